//! Deferred failovers, in process (the real reconciler pass, store and API router on the test's
//! Postgres; host results synthesized, no hostd): a stranded sandbox whose backup no host has
//! room for, or whose backup is not ready, is left `running` by each pass until its host has
//! been silent past the lost and failover delays plus `failover_retry_for`, then fails
//! `host_lost` saying why, releasing its capacity on the lost host once; and more deferred
//! sandboxes than a pass's batch never keep the others on the lost host from failing over.
//!
//! Time is not waited for: the test moves the lost host's last heartbeat back (database clock)
//! past each threshold, minutes apart.

use std::time::Duration;

use berth_reconciler::pass::{self, Action, PassConfig, PassReport};
use berth_schemas::wire::Resources;
use berth_schemas::{CommandKind, HostId, SandboxId};
use berth_store::leases::Lease;
use sqlx::PgPool;

use crate::support::inproc::{
    heartbeat, lease, lifecycle_only_health, reserved, row, succeeded, Plane,
};

/// Passes with minutes-long delays: lost after 60 s of silence, failed over 60 s later, a
/// deferred failover given up 600 s after that (a silence of 720 s).
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

/// Due for failover, not yet overdue.
const DUE: f64 = 180.0;
/// Past the bound on deferred failovers.
const OVERDUE: f64 = 800.0;

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

/// One pass as the lease holder, with the other host (of `capacity`) heard from just before it
/// (placement only picks fresh hosts).
async fn pass_once(
    plane: &Plane,
    lease: &Lease,
    config: &PassConfig,
    other: HostId,
    capacity: Resources,
) -> PassReport {
    heartbeat(&plane.db, other, capacity).await;
    let report = pass::run_pass(&plane.db, config, lease).await.unwrap();
    assert!(!report.all_hosts_silent && !report.deposed, "{report:?}");
    report
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
    let plane = Plane::start(db.clone()).await;
    let lease = lease(&db).await;
    let config = minutes(500);
    // Needs more memory than the other host has (memory is never overcommitted); its backup is
    // ready.
    let big = running(&plane, 1, 4096, true).await;
    // Fits on the other host, but its backup is not ready (a failed upload it still names).
    let unready = running(&plane, 1, 256, true).await;
    sqlx::query(
        "UPDATE snapshots SET state = 'failed', reason = 'upload failed (test)'
          WHERE id = (SELECT last_backup_id FROM sandboxes WHERE id = $1)",
    )
    .bind(unready)
    .execute(&db)
    .await
    .unwrap();
    let other = HostId::new();
    let small_host = Resources {
        vcpus: 4,
        memory_mib: 2048,
    };
    let held = reserved(&db, plane.host).await;
    assert_eq!(held, (2, 4352));

    // Due for failover, within the bound: both deferred, still `running` on the lost host,
    // holding their capacity there.
    lost_since(&db, plane.host, DUE).await;
    for _ in 0..2 {
        let report = pass_once(&plane, &lease, &config, other, small_host).await;
        assert_eq!(report.count(Action::HostLostFailover), 0, "{report:?}");
        assert_eq!(report.count(Action::FailoverRestored), 0, "{report:?}");
        for id in [big, unready] {
            assert_eq!(row(&db, id).await.state, "running", "deferred, not failed");
        }
        assert_eq!(reserved(&db, plane.host).await, held, "released nothing");
        assert_eq!(reserved(&db, other).await, (0, 0), "reserved nothing");
        assert_no_drift(&db).await;
    }

    // Past the bound: both fail `host_lost`, each saying why, and release what they held.
    lost_since(&db, plane.host, OVERDUE).await;
    let report = pass_once(&plane, &lease, &config, other, small_host).await;
    assert_eq!(report.count(Action::HostLostFailover), 2, "{report:?}");
    let (state, reason) = state_reason(&db, big).await;
    assert_eq!(state, "failed-start");
    assert!(
        reason.starts_with("host_lost") && reason.contains("no host had room for its backup"),
        "{reason}"
    );
    let (state, reason) = state_reason(&db, unready).await;
    assert_eq!(state, "failed-start");
    assert!(
        reason.contains("its backup was being deleted or not ready"),
        "{reason}"
    );
    for id in [big, unready] {
        assert_eq!(last_reason(&db, id).await, "host_lost");
        assert!(!row(&db, id).await.holds_capacity);
    }
    assert_eq!(reserved(&db, plane.host).await, (0, 0));
    assert_eq!(reserved(&db, other).await, (0, 0));
    assert_no_drift(&db).await;

    // Released once: a further pass changes nothing.
    let report = pass_once(&plane, &lease, &config, other, small_host).await;
    assert_eq!(report.count(Action::HostLostFailover), 0, "{report:?}");
    assert_eq!(reserved(&db, plane.host).await, (0, 0));
    assert_no_drift(&db).await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn more_deferred_failovers_than_a_batch_do_not_keep_the_rest_of_a_lost_host_from_failing_over(
    db: PgPool,
) {
    let plane = Plane::start(db.clone()).await;
    let lease = lease(&db).await;
    // Two sandboxes acted on per pass; three deferred ones come first (ids are time-ordered).
    let config = minutes(2);
    let mut big = Vec::new();
    for _ in 0..3 {
        big.push(running(&plane, 1, 4096, true).await);
    }
    let small = running(&plane, 1, 256, true).await;
    let bare = running(&plane, 1, 256, false).await;
    let other = HostId::new();
    let small_host = Resources {
        vcpus: 4,
        memory_mib: 2048,
    };

    lost_since(&db, plane.host, DUE).await;
    let report = pass_once(&plane, &lease, &config, other, small_host).await;
    assert_eq!(report.count(Action::FailoverRestored), 1, "{report:?}");
    assert_eq!(report.count(Action::HostLostFailover), 1, "{report:?}");
    let restored = row(&db, small).await;
    assert_eq!(restored.state, "restoring", "the one that fits failed over");
    assert_eq!(reserved(&db, other).await, (1, 256));
    assert_eq!(state_reason(&db, bare).await.0, "failed-start");
    assert_eq!(last_reason(&db, bare).await, "host_lost");
    for id in &big {
        assert_eq!(row(&db, *id).await.state, "running", "deferred");
    }
    assert_eq!(reserved(&db, plane.host).await, (3, 12_288));
    assert_no_drift(&db).await;

    // Past the bound the deferred ones fail, a batch (two) per pass.
    lost_since(&db, plane.host, OVERDUE).await;
    let report = pass_once(&plane, &lease, &config, other, small_host).await;
    assert_eq!(report.count(Action::HostLostFailover), 2, "{report:?}");
    let report = pass_once(&plane, &lease, &config, other, small_host).await;
    assert_eq!(report.count(Action::HostLostFailover), 1, "{report:?}");
    for id in &big {
        let (state, reason) = state_reason(&db, *id).await;
        assert_eq!(state, "failed-start");
        assert!(reason.contains("no host had room"), "{reason}");
    }
    assert_eq!(reserved(&db, plane.host).await, (0, 0));
    assert_eq!(
        reserved(&db, other).await,
        (1, 256),
        "the restore keeps its own"
    );
    assert_no_drift(&db).await;
}
