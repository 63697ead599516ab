//! Deferred failovers, in process (the real reconciler pass, store and API router on the test's
//! Postgres; host results synthesized, no hostd): a stranded sandbox whose backup no host has
//! room for, whose hosts with room are stale or degraded, or whose backup is not ready, is left
//! `running` by each pass until `failover_retry_for` after the first pass that deferred it,
//! then fails `host_lost` saying which, releasing its capacity on the lost host once; the bound
//! counts from that first deferral, not from the host's silence, and a deferral from an earlier
//! silence or another host counts for nothing; and more deferred sandboxes than a pass's batch
//! never keep the others on the lost host from failing over.
//!
//! Time is not waited for: the test moves the lost host's last heartbeat and the recorded
//! deferrals back (database clock) past each threshold, minutes apart.

use std::time::Duration;

use berth_reconciler::pass::{self, Action, PassConfig, PassReport};
use berth_schemas::wire::Resources;
use berth_schemas::{CommandKind, HostId, SandboxId};
use berth_store::leases::Lease;
use sqlx::PgPool;

use crate::support::inproc::{
    heartbeat, lease, lifecycle_only_health, reserved, row, succeeded, Plane, HOST_CAPACITY,
};

/// Passes with minutes-long delays: lost after 60 s of silence, failed over 60 s later, a
/// deferred failover given up 600 s after its first deferral.
fn minutes(batch: i64) -> PassConfig {
    PassConfig {
        host_lost_after: Duration::from_secs(60),
        failover_after: Duration::from_secs(60),
        failover_retry_for: Duration::from_secs(600),
        batch,
        health: lifecycle_only_health(),
        // The test's heartbeats carry no inventory; never judge a guest by it.
        inventory_grace: Duration::from_secs(365 * 24 * 3600),
        ..PassConfig::default()
    }
}

/// Due for failover.
const DUE: f64 = 180.0;
/// Within the bound on deferred failovers (600 s), counted from the first deferral.
const WITHIN: f64 = 540.0;
/// Past that bound, once added to [`WITHIN`].
const PAST: f64 = 120.0;

/// A `running` sandbox of `vcpus` and `memory_mib` on the plane's host; with `backup`, it names
/// a `ready` backup of its own as its newest (`last_backup_id`).
async fn running(plane: &Plane, vcpus: u32, memory_mib: u32, backup: bool) -> SandboxId {
    let body = format!(r#"{{"vcpus":{vcpus},"memory_mib":{memory_mib}}}"#);
    let id = plane.api.create(&plane.org.key, &body).await;
    let create = plane.latest(id).await;
    assert_eq!(create.kind, CommandKind::Create);
    plane.deliver(&create, succeeded(CommandKind::Create)).await;
    assert_eq!(row(&plane.db, id).await.state, "running");
    if backup {
        let backup_id = uuid::Uuid::now_v7();
        sqlx::query(
            "INSERT INTO snapshots (id, org_id, sandbox_id, host_id, state, holds, template,
                                    runtime, vcpus, memory_mib, disk_mib, stored_bytes,
                                    command_id, kind, ready_at)
             SELECT $2, org_id, id, host_id, 'ready', 'disk', template, runtime, vcpus,
                    memory_mib, disk_mib, 0, gen_random_uuid(), 'backup', now()
               FROM sandboxes WHERE id = $1",
        )
        .bind(id)
        .bind(backup_id)
        .execute(&plane.db)
        .await
        .unwrap();
        sqlx::query(
            "UPDATE sandboxes SET last_backup_id = $2, last_backup_at = now() WHERE id = $1",
        )
        .bind(id)
        .bind(backup_id)
        .execute(&plane.db)
        .await
        .unwrap();
    }
    id
}

/// Marks `host` `lost`, its last heartbeat `silent` seconds ago (database clock).
async fn lost_since(db: &PgPool, host: HostId, silent: f64) {
    sqlx::query(
        "UPDATE hosts SET state = 'lost', last_seen = now() - make_interval(secs => $2)
          WHERE id = $1",
    )
    .bind(host)
    .bind(silent)
    .execute(db)
    .await
    .unwrap();
}

/// `secs` seconds pass for `host` (lost): its last heartbeat and every failover deferral recorded
/// on its sandboxes move back by that much (database clock).
async fn time_passes(db: &PgPool, host: HostId, secs: f64) {
    sqlx::query("UPDATE hosts SET last_seen = last_seen - make_interval(secs => $2) WHERE id = $1")
        .bind(host)
        .bind(secs)
        .execute(db)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE sandboxes SET failover_deferred_at = failover_deferred_at - make_interval(secs => $2)
          WHERE host_id = $1 AND failover_deferred_at IS NOT NULL",
    )
    .bind(host)
    .bind(secs)
    .execute(db)
    .await
    .unwrap();
}

/// A plane with its host, the pass's lease and config, and another host of [`SMALL_HOST`]
/// capacity that is heard from before each pass (placement only picks fresh hosts).
struct Fixture {
    plane: Plane,
    lease: Lease,
    config: PassConfig,
    other: HostId,
}

/// The other host's capacity: room for a small sandbox's backup, not for a 4 GiB one.
const SMALL_HOST: Resources = Resources {
    vcpus: 4,
    memory_mib: 2048,
};

impl Fixture {
    async fn start(db: &PgPool, batch: i64) -> Self {
        Self {
            plane: Plane::start(db.clone()).await,
            lease: lease(db).await,
            config: minutes(batch),
            other: HostId::new(),
        }
    }

    /// One pass as the lease holder, with the other host heard from just before it.
    async fn pass(&self) -> PassReport {
        self.pass_with(self.other, SMALL_HOST).await
    }

    /// One pass, with `other` (of `capacity`) heard from just before it.
    async fn pass_with(&self, other: HostId, capacity: Resources) -> PassReport {
        heartbeat(&self.plane.db, other, capacity).await;
        let report = pass::run_pass(&self.plane.db, &self.config, &self.lease)
            .await
            .unwrap();
        assert!(!report.all_hosts_silent && !report.deposed, "{report:?}");
        report
    }

    /// One pass that defers: no failover restored or given up, and each of `ids` still
    /// `running` on the lost host.
    async fn pass_deferring(&self, ids: &[SandboxId]) -> PassReport {
        deferring(&self.plane.db, self.pass().await, ids).await
    }
}

/// Asserts `report` deferred every failover it met: none restored or given up, each of `ids`
/// still `running` on the lost host.
async fn deferring(db: &PgPool, report: PassReport, ids: &[SandboxId]) -> PassReport {
    assert_eq!(report.count(Action::HostLostFailover), 0, "{report:?}");
    assert_eq!(report.count(Action::FailoverRestored), 0, "{report:?}");
    for id in ids {
        assert_eq!(row(db, *id).await.state, "running", "deferred, not failed");
    }
    report
}

/// Asserts `id`'s failover was given up (`failed-start`, its last event `host_lost`, its
/// capacity released) and returns the sandbox's `state_reason`.
async fn given_up(db: &PgPool, id: SandboxId) -> String {
    let (state, reason) = state_reason(db, id).await;
    assert_eq!(state, "failed-start", "{reason}");
    assert_eq!(last_reason(db, id).await, "host_lost");
    assert!(!row(db, id).await.holds_capacity);
    reason
}

async fn state_reason(db: &PgPool, id: SandboxId) -> (String, String) {
    sqlx::query_as("SELECT state, COALESCE(state_reason, '') FROM sandboxes WHERE id = $1")
        .bind(id)
        .fetch_one(db)
        .await
        .unwrap()
}

/// The `reason` of the sandbox's newest event.
async fn last_reason(db: &PgPool, id: SandboxId) -> String {
    sqlx::query_scalar(
        "SELECT reason FROM events WHERE sandbox_id = $1 ORDER BY at DESC, id DESC LIMIT 1",
    )
    .bind(id)
    .fetch_one(db)
    .await
    .unwrap()
}

async fn assert_no_drift(db: &PgPool) {
    assert_eq!(
        pass::capacity_drift(db).await.unwrap(),
        (0, 0),
        "guarantee 4"
    );
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_failover_deferred_for_want_of_room_or_of_a_ready_backup_fails_host_lost_after_its_bound_and_not_before(
    db: PgPool,
) {
    let fx = Fixture::start(&db, 500).await;
    let plane = &fx.plane;
    // Needs more memory than the other host has (memory is never overcommitted); its backup is
    // ready.
    let big = running(plane, 1, 4096, true).await;
    // Fits on the other host, but its backup is not ready (a failed upload it still names).
    let unready = running(plane, 1, 256, true).await;
    sqlx::query(
        "UPDATE snapshots SET state = 'failed', reason = 'upload failed (test)'
          WHERE id = (SELECT last_backup_id FROM sandboxes WHERE id = $1)",
    )
    .bind(unready)
    .execute(&db)
    .await
    .unwrap();
    let held = reserved(&db, plane.host).await;
    assert_eq!(held, (2, 4352));

    // Due for failover, and until the bound after the first deferral: both deferred, still
    // `running` on the lost host, holding their capacity there.
    lost_since(&db, plane.host, DUE).await;
    for wait in [0.0, 0.0, WITHIN] {
        time_passes(&db, plane.host, wait).await;
        fx.pass_deferring(&[big, unready]).await;
        assert_eq!(reserved(&db, plane.host).await, held, "released nothing");
        assert_eq!(reserved(&db, fx.other).await, (0, 0), "reserved nothing");
        assert_no_drift(&db).await;
    }

    // Past the bound: both fail `host_lost`, each saying why, and release what they held.
    time_passes(&db, plane.host, PAST).await;
    let report = fx.pass().await;
    assert_eq!(report.count(Action::HostLostFailover), 2, "{report:?}");
    let reason = given_up(&db, big).await;
    assert!(
        reason.starts_with("host_lost") && reason.contains("no host had room for its backup"),
        "{reason}"
    );
    let reason = given_up(&db, unready).await;
    assert!(
        reason.contains("its backup was being deleted or not ready"),
        "{reason}"
    );
    assert_eq!(reserved(&db, plane.host).await, (0, 0));
    assert_eq!(reserved(&db, fx.other).await, (0, 0));
    assert_no_drift(&db).await;

    // Released once: a further pass changes nothing.
    let report = fx.pass().await;
    assert_eq!(report.count(Action::HostLostFailover), 0, "{report:?}");
    assert_eq!(reserved(&db, plane.host).await, (0, 0));
    assert_no_drift(&db).await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn more_deferred_failovers_than_a_batch_do_not_keep_the_rest_of_a_lost_host_from_failing_over(
    db: PgPool,
) {
    // Two sandboxes acted on per pass; three deferred ones come first (ids are time-ordered).
    let fx = Fixture::start(&db, 2).await;
    let plane = &fx.plane;
    let mut big = Vec::new();
    for _ in 0..3 {
        big.push(running(plane, 1, 4096, true).await);
    }
    let small = running(plane, 1, 256, true).await;
    let bare = running(plane, 1, 256, false).await;

    lost_since(&db, plane.host, DUE).await;
    let report = fx.pass().await;
    assert_eq!(report.count(Action::FailoverRestored), 1, "{report:?}");
    assert_eq!(report.count(Action::HostLostFailover), 1, "{report:?}");
    let restored = row(&db, small).await;
    assert_eq!(restored.state, "restoring", "the one that fits failed over");
    assert_eq!(reserved(&db, fx.other).await, (1, 256));
    assert_eq!(state_reason(&db, bare).await.0, "failed-start");
    assert_eq!(last_reason(&db, bare).await, "host_lost");
    for id in &big {
        assert_eq!(row(&db, *id).await.state, "running", "deferred");
    }
    assert_eq!(reserved(&db, plane.host).await, (3, 12_288));
    assert_no_drift(&db).await;

    // Past the bound the deferred ones fail, a batch (two) per pass.
    time_passes(&db, plane.host, WITHIN + PAST).await;
    let report = fx.pass().await;
    assert_eq!(report.count(Action::HostLostFailover), 2, "{report:?}");
    let report = fx.pass().await;
    assert_eq!(report.count(Action::HostLostFailover), 1, "{report:?}");
    for id in &big {
        let reason = given_up(&db, *id).await;
        assert!(reason.contains("no host had room"), "{reason}");
    }
    assert_eq!(reserved(&db, plane.host).await, (0, 0));
    assert_eq!(
        reserved(&db, fx.other).await,
        (1, 256),
        "the restore keeps its own"
    );
    assert_no_drift(&db).await;
}

/// The sandbox's recorded first deferral: `(seconds ago, on its own host)`, if any.
async fn deferral(db: &PgPool, id: SandboxId) -> Option<(f64, bool)> {
    sqlx::query_as(
        "SELECT EXTRACT(EPOCH FROM now() - failover_deferred_at)::float8,
                failover_deferred_on = host_id
           FROM sandboxes WHERE id = $1 AND failover_deferred_at IS NOT NULL",
    )
    .bind(id)
    .fetch_optional(db)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_failover_first_deferred_long_after_it_was_due_is_still_retried_for_its_whole_bound(
    db: PgPool,
) {
    let fx = Fixture::start(&db, 500).await;
    let plane = &fx.plane;
    let big = running(plane, 1, 4096, true).await;

    // No pass ran while the host was silent for an hour (the reconciler was down): its failover
    // has been due for far longer than the bound when a pass first reaches it. It is deferred,
    // not given up at once.
    lost_since(&db, plane.host, 3600.0).await;
    for wait in [0.0, 0.0, WITHIN] {
        time_passes(&db, plane.host, wait).await;
        fx.pass_deferring(&[big]).await;
        let (ago, on_its_host) = deferral(&db, big).await.expect("first deferral recorded");
        assert!(on_its_host);
        assert!(
            (wait..wait + 60.0).contains(&ago),
            "the first deferral stays the one counted from: {ago}"
        );
    }

    // The bound after that first deferral: given up, saying why.
    time_passes(&db, plane.host, PAST).await;
    let report = fx.pass().await;
    assert_eq!(report.count(Action::HostLostFailover), 1, "{report:?}");
    let reason = given_up(&db, big).await;
    assert!(
        reason.contains("600s its failover was retried for")
            && reason.contains("no host had room for its backup"),
        "{reason}"
    );
    assert_eq!(reserved(&db, plane.host).await, (0, 0));
    assert_no_drift(&db).await;
}

/// Records a first deferral of `id`'s failover 700 s ago (past the bound), on `on` (or on the
/// host recorded already).
async fn overdue_deferral(db: &PgPool, id: SandboxId, on: Option<HostId>) {
    sqlx::query(
        "UPDATE sandboxes
            SET failover_deferred_at = now() - interval '700 seconds',
                failover_deferred_on = COALESCE($2, failover_deferred_on)
          WHERE id = $1",
    )
    .bind(id)
    .bind(on)
    .execute(db)
    .await
    .unwrap();
}

/// Makes `host`'s last heartbeat older than placement's freshness window (15 s), though not old
/// enough (60 s) to be lost.
async fn stale_again(db: &PgPool, host: HostId) {
    sqlx::query("UPDATE hosts SET last_seen = now() - interval '30 seconds' WHERE id = $1")
        .bind(host)
        .execute(db)
        .await
        .unwrap();
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_deferral_from_an_earlier_silence_or_on_another_host_counts_for_nothing(db: PgPool) {
    let fx = Fixture::start(&db, 500).await;
    let plane = &fx.plane;
    let big = running(plane, 1, 4096, true).await;
    // Deferred while lost; then the host comes back: the sandbox runs on there.
    lost_since(&db, plane.host, DUE).await;
    fx.pass().await;
    assert!(deferral(&db, big).await.is_some());
    heartbeat(&db, plane.host, HOST_CAPACITY).await;
    fx.pass().await;
    assert_eq!(row(&db, big).await.state, "running");

    // Lost again: the deferral recorded in its earlier silence (older than the bound, but from
    // before its last heartbeat) is not counted; the first deferral of this silence replaces it.
    overdue_deferral(&db, big, None).await;
    lost_since(&db, plane.host, DUE).await;
    fx.pass_deferring(&[big]).await;
    let (ago, on_its_host) = deferral(&db, big).await.unwrap();
    assert!(ago < 60.0 && on_its_host, "replaced: {ago}");

    // A deferral recorded on another host (the sandbox has moved since) is not counted either,
    // though newer than this host's last heartbeat.
    lost_since(&db, plane.host, 3600.0).await;
    overdue_deferral(&db, big, Some(HostId::new())).await;
    fx.pass_deferring(&[big]).await;
    let (ago, on_its_host) = deferral(&db, big).await.unwrap();
    assert!(ago < 60.0 && on_its_host, "replaced: {ago}");

    // One of this silence, on its host, past the bound is.
    time_passes(&db, plane.host, WITHIN + PAST).await;
    let report = fx.pass().await;
    assert_eq!(report.count(Action::HostLostFailover), 1, "{report:?}");
    given_up(&db, big).await;
    assert_no_drift(&db).await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_failover_deferred_because_the_hosts_with_room_are_stale_or_degraded_says_so_not_no_room(
    db: PgPool,
) {
    let fx = Fixture::start(&db, 500).await;
    let plane = &fx.plane;
    // Fits on either other host, with a ready backup.
    let small = running(plane, 1, 256, true).await;
    let roomy = Resources {
        vcpus: 4,
        memory_mib: 2048,
    };
    // One host with room, heard from each pass, but degraded and not due its probe for an hour.
    let degraded = HostId::new();
    heartbeat(&db, degraded, roomy).await;
    sqlx::query(
        "UPDATE hosts SET health = 'degraded', probe_at = now() + interval '1 hour' WHERE id = $1",
    )
    .bind(degraded)
    .execute(&db)
    .await
    .unwrap();
    // One host with room whose last heartbeat is stale (made so before each pass).
    let stale = HostId::new();
    heartbeat(&db, stale, roomy).await;
    lost_since(&db, plane.host, DUE).await;
    for _ in 0..2 {
        stale_again(&db, stale).await;
        deferring(&db, fx.pass_with(degraded, roomy).await, &[small]).await;
        assert_eq!(reserved(&db, degraded).await, (0, 0));
        assert_eq!(reserved(&db, stale).await, (0, 0));
    }

    time_passes(&db, plane.host, WITHIN + PAST).await;
    stale_again(&db, stale).await;
    let report = fx.pass_with(degraded, roomy).await;
    assert_eq!(report.count(Action::HostLostFailover), 1, "{report:?}");
    let reason = given_up(&db, small).await;
    assert!(
        reason.ends_with(
            "the hosts with room for its backup could not be used: 1 with a stale heartbeat, \
             1 degraded and not due a probe"
        ),
        "{reason}"
    );
    assert!(!reason.contains("no host had room"), "{reason}");
    assert_eq!(reserved(&db, plane.host).await, (0, 0));
    assert_no_drift(&db).await;
}
