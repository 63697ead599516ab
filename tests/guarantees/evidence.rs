//! Issue 12 item 1: the reconciler judges a sandbox only on evidence — an inventory taken after
//! the sandbox's last change and after its host applied its last command, from a host whose
//! evidence is not too old — and a circuit breaker holds mass failures until they persist or an
//! operator releases them. On the router and the real pass, with heartbeats and results
//! written as the scheduler and the result consumer write them; the end-to-end test with a
//! real hostd and a backlogged heartbeat consumer is `lag.rs`.

use std::time::Duration;

use berth_reconciler::pass::{run_pass, Action, GuestBreaker, PassConfig, PassReport};
use berth_schemas::wire::{GuestStatus, Heartbeat, InventoryItem, Resources, RuntimeInfo};
use berth_schemas::{CommandKind, Generation, HostId, SandboxId};
use berth_store::leases::Lease;
use sqlx::PgPool;

use crate::support::env::eventually;
use crate::support::inproc::{self, now_ms, Plane, HOST_CAPACITY};

/// Long enough that no heartbeat of a test is too old, unless the test says otherwise.
const HOUR: Duration = Duration::from_secs(3600);

/// The pass of these tests: no grace (the send times decide), evidence good for an hour, the
/// breaker off unless a test sets it.
fn config() -> PassConfig {
    PassConfig {
        inventory_grace: Duration::ZERO,
        evidence_max_age: HOUR,
        breaker: GuestBreaker {
            host_share: 1.0,
            fleet_share: 1.0,
            ..GuestBreaker::default()
        },
        ..PassConfig::default()
    }
}

/// Writes `host`'s heartbeat `seq`, taken at `sent_at_ms`, listing `running` as running,
/// through the scheduler's batch apply. Returns whether it was applied (the newest wins).
async fn report(
    db: &PgPool,
    host: HostId,
    seq: u64,
    sent_at_ms: u64,
    running: &[SandboxId],
) -> bool {
    let items = running
        .iter()
        .map(|id| InventoryItem {
            sandbox_id: *id,
            generation: Generation(1),
            status: GuestStatus::Running,
        })
        .collect();
    report_items(db, host, seq, sent_at_ms, items).await
}

/// [`report`] with the inventory's items as given.
async fn report_items(
    db: &PgPool,
    host: HostId,
    seq: u64,
    sent_at_ms: u64,
    inventory: Vec<InventoryItem>,
) -> bool {
    let hb = Heartbeat {
        host_id: host,
        name: format!("test-{host}"),
        seq,
        capacity: HOST_CAPACITY,
        used: Resources::default(),
        runtimes: vec![RuntimeInfo {
            name: "runc".into(),
            memory_snapshot: false,
        }],
        inventory,
        forwarder: None,
        sent_at_ms,
        warm: Vec::new(),
    };
    !berth_scheduler::heartbeat::apply_batch(db, &[hb])
        .await
        .unwrap()
        .is_empty()
}

/// A sandbox the host reported running, its create's result carrying `heartbeat_seq`. Returns
/// after a few milliseconds, so a send time taken next is after the row's change.
async fn running(plane: &Plane, heartbeat_seq: u64) -> SandboxId {
    let id = plane.create().await;
    let create = plane.latest(id).await;
    let result = berth_schemas::wire::CommandResult {
        heartbeat_seq,
        ..inproc::result_for(&create, inproc::succeeded(CommandKind::Create))
    };
    berth_reconciler::results::apply(&plane.db, &result)
        .await
        .unwrap();
    assert_eq!(inproc::row(&plane.db, id).await.state, "running");
    tokio::time::sleep(Duration::from_millis(20)).await;
    id
}

async fn pass(db: &PgPool, config: &PassConfig, lease: &Lease) -> PassReport {
    let report = run_pass(db, config, lease).await.unwrap();
    assert!(!report.deposed);
    report
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_inventory_taken_before_the_sandbox_ran_is_not_evidence_even_when_it_arrives_late(
    db: PgPool,
) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let before = now_ms();
    let id = running(&plane, 10).await;
    // A backlogged consumer applies, now, a heartbeat the host took before the sandbox ran:
    // its seq is newer than the result's, but its send time is older than the row's change.
    assert!(report(&plane.db, plane.host, 11, before, &[]).await);
    let r = pass(&plane.db, &config(), &lease).await;
    assert_eq!(r.count(Action::GuestUnhealthy), 0);
    assert_eq!(inproc::row(&plane.db, id).await.state, "running");

    // The same empty inventory taken after the change is evidence: the guest is missing.
    assert!(report(&plane.db, plane.host, 12, now_ms(), &[]).await);
    let r = pass(&plane.db, &config(), &lease).await;
    assert_eq!(r.count(Action::GuestUnhealthy), 1);
    let row = inproc::row(&plane.db, id).await;
    assert_eq!(row.state, "failed-start");
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_inventory_from_before_the_host_applied_the_command_is_not_evidence(db: PgPool) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    // The host applied the create when its newest heartbeat was seq 50: heartbeat 50 (sent
    // before the apply, arriving after the result) does not list the sandbox yet.
    let id = running(&plane, 50).await;
    assert!(report(&plane.db, plane.host, 50, now_ms(), &[]).await);
    let r = pass(&plane.db, &config(), &lease).await;
    assert_eq!(r.count(Action::GuestUnhealthy), 0);
    assert_eq!(inproc::row(&plane.db, id).await.state, "running");
    // Heartbeat 51 came after the apply; listing the guest, it keeps it running...
    assert!(report(&plane.db, plane.host, 51, now_ms(), &[id]).await);
    assert_eq!(
        pass(&plane.db, &config(), &lease)
            .await
            .count(Action::GuestUnhealthy),
        0
    );
    // ... and without it, the guest is gone.
    assert!(report(&plane.db, plane.host, 52, now_ms(), &[]).await);
    assert_eq!(
        pass(&plane.db, &config(), &lease)
            .await
            .count(Action::GuestUnhealthy),
        1
    );
    assert_eq!(inproc::row(&plane.db, id).await.state, "failed-start");
}

/// A boot its host applied (the host's inventory shows the sandbox at the command's generation)
/// is not timed out while its result waits in the control plane's queues, and its result then
/// makes it run; a boot the host never applied times out as before.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_boot_its_host_applied_is_not_timed_out_while_its_result_is_queued(db: PgPool) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let applied = plane.create().await;
    let unanswered = plane.create().await;
    // The host booted the first (generation 1, its create's) and says so in its inventory;
    // the result is still queued. It never saw the second.
    assert!(report(&plane.db, plane.host, 1, now_ms(), &[applied]).await);
    inproc::relay_all(&plane.db).await;
    let eager = PassConfig {
        create_timeout: Duration::ZERO,
        ..config()
    };
    let r = pass(&plane.db, &eager, &lease).await;
    assert_eq!(r.count(Action::CommandTimeout), 1, "{r:?}");
    assert_eq!(inproc::row(&plane.db, applied).await.state, "provisioning");
    let failed = inproc::row(&plane.db, unanswered).await;
    assert_eq!(failed.state, "failed-start");
    // Later passes leave it alone too, and the queued result makes it run.
    let r = pass(&plane.db, &eager, &lease).await;
    assert_eq!(r.count(Action::CommandTimeout), 0, "{r:?}");
    let create = plane.latest(applied).await;
    berth_reconciler::results::apply(
        &plane.db,
        &inproc::result_for(&create, inproc::succeeded(CommandKind::Create)),
    )
    .await
    .unwrap();
    assert_eq!(inproc::row(&plane.db, applied).await.state, "running");
}

/// The host's health and its count of bad boots in a row.
async fn health(db: &PgPool, host: HostId) -> (String, i32) {
    sqlx::query_as("SELECT health, health_failures FROM hosts WHERE id = $1")
        .bind(host.0)
        .fetch_one(db)
        .await
        .unwrap()
}

/// A boot is slow by the time its host spent on it (`apply_ms`), never by the time its
/// command and result waited in the control plane: ten boots whose commands are ten minutes
/// old but took the host 50 ms each leave it healthy; three that took it 90 s degrade it.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_boot_is_slow_by_its_hosts_own_time_not_by_the_control_planes_lag(db: PgPool) {
    let plane = Plane::start(db).await;
    let boot = |apply_ms: u32| {
        let plane = &plane;
        async move {
            let id = plane.create().await;
            let create = plane.latest(id).await;
            // The command and its result waited ten minutes in the queues.
            sqlx::query(
                "UPDATE commands SET created_at = now() - interval '10 minutes',
                        published_at = now() - interval '10 minutes' WHERE id = $1",
            )
            .bind(create.id.0)
            .execute(&plane.db)
            .await
            .unwrap();
            let result = berth_schemas::wire::CommandResult {
                apply_ms,
                ..inproc::result_for(&create, inproc::succeeded(CommandKind::Create))
            };
            berth_reconciler::results::apply(&plane.db, &result)
                .await
                .unwrap();
            assert_eq!(inproc::row(&plane.db, id).await.state, "running");
        }
    };
    for _ in 0..10 {
        boot(50).await;
    }
    assert_eq!(
        health(&plane.db, plane.host).await,
        ("healthy".to_owned(), 0)
    );
    for _ in 0..3 {
        boot(90_000).await;
    }
    assert_eq!(health(&plane.db, plane.host).await.0, "degraded");
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_host_whose_evidence_is_too_old_is_left_alone_and_named(db: PgPool) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let id = running(&plane, 1).await;
    // The inventory misses the running sandbox and lists a container no row knows (purged).
    let stray = SandboxId::new();
    assert!(report(&plane.db, plane.host, 2, now_ms(), &[stray]).await);
    let strict = PassConfig {
        evidence_max_age: Duration::from_millis(500),
        ..config()
    };
    let db = plane.db.clone();
    let host = plane.host;
    eventually("the host's evidence is older than the max age", || {
        let db = db.clone();
        async move {
            let mut conn = db.acquire().await.unwrap();
            berth_store::heartbeats::stale_evidence(&mut conn, Duration::from_millis(500))
                .await
                .unwrap()
                .iter()
                .any(|(h, age)| *h == host && *age >= 0.5)
        }
    })
    .await;
    let r = pass(&plane.db, &strict, &lease).await;
    assert_eq!(r.stale_hosts, 1);
    assert_eq!(r.count(Action::GuestUnhealthy), 0);
    assert_eq!(r.count(Action::OrphanDestroyed), 0);
    assert_eq!(inproc::row(&plane.db, id).await.state, "running");

    // Fresh evidence: the guest is failed and the stray destroyed.
    assert!(report(&plane.db, plane.host, 3, now_ms(), &[stray]).await);
    let r = pass(&plane.db, &config(), &lease).await;
    assert_eq!(r.stale_hosts, 0);
    assert_eq!(r.count(Action::GuestUnhealthy), 1);
    assert_eq!(r.count(Action::OrphanDestroyed), 1);
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_orphan_is_judged_only_on_an_inventory_taken_after_its_stop_was_applied(db: PgPool) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let id = running(&plane, 1).await;
    assert!(report(&plane.db, plane.host, 2, now_ms(), &[id]).await);
    plane.request(id, "stop").await;
    let stop = plane.latest(id).await;
    let result = berth_schemas::wire::CommandResult {
        heartbeat_seq: 3,
        ..inproc::result_for(&stop, inproc::succeeded(CommandKind::Stop))
    };
    berth_reconciler::results::apply(&plane.db, &result)
        .await
        .unwrap();
    assert_eq!(inproc::row(&plane.db, id).await.state, "stopped");
    tokio::time::sleep(Duration::from_millis(20)).await;
    // Heartbeat 3 was taken before the host applied the stop: still running there.
    assert!(report(&plane.db, plane.host, 3, now_ms(), &[id]).await);
    let r = pass(&plane.db, &config(), &lease).await;
    assert_eq!(r.count(Action::OrphanStopped), 0);
    // Heartbeat 4, after the stop, still shows it running: a real orphan.
    assert!(report(&plane.db, plane.host, 4, now_ms(), &[id]).await);
    let r = pass(&plane.db, &config(), &lease).await;
    assert_eq!(r.count(Action::OrphanStopped), 1);
}

/// An inventory is judged when its heartbeat is ingested (`store::findings`, issue 16), against
/// the rows as they are then. A row written by a transaction that began before the inventory
/// was taken and committed after that judgement is judged on the host's next heartbeat: the
/// pass never acts on what the ingest did not see, and the next inventory (seconds later) is
/// judged against the committed row. (The pass that expanded every inventory acted one
/// heartbeat earlier here.)
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_row_committed_after_its_hosts_inventory_was_judged_is_judged_on_the_next_heartbeat(
    db: PgPool,
) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let id = running(&plane, 1).await;
    assert!(report(&plane.db, plane.host, 2, now_ms(), &[id]).await);
    // A long transaction stops the row (its `updated_at` is the transaction's start)...
    let mut slow = plane.db.begin().await.unwrap();
    sqlx::query(
        "UPDATE sandboxes SET state = 'stopped', holds_capacity = false, updated_at = now()
          WHERE id = $1",
    )
    .bind(id.0)
    .execute(&mut *slow)
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    // ... while the host's inventory, taken after it began, is ingested: the row still runs.
    assert!(report(&plane.db, plane.host, 3, now_ms(), &[id]).await);
    slow.commit().await.unwrap();
    let r = pass(&plane.db, &config(), &lease).await;
    assert_eq!(r.count(Action::OrphanStopped), 0, "{r:?}");
    // The next heartbeat still lists it running: judged against the stopped row, stopped.
    assert!(report(&plane.db, plane.host, 4, now_ms(), &[id]).await);
    let r = pass(&plane.db, &config(), &lease).await;
    assert_eq!(r.count(Action::OrphanStopped), 1, "{r:?}");
    let stop = plane.latest(id).await;
    assert_eq!(
        (stop.kind, stop.host_id),
        (CommandKind::Stop, plane.host),
        "{stop:?}"
    );
}

/// A host that lists one container twice (at two generations) is still ingested, and the
/// container no row accounts for is destroyed once, at the newer generation (the host's fence
/// lets that through).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_container_listed_twice_is_ingested_and_compensated_once_at_its_newest_generation(
    db: PgPool,
) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let stray = SandboxId::new();
    let item = |generation: i64| InventoryItem {
        sandbox_id: stray,
        generation: Generation(generation),
        status: GuestStatus::Running,
    };
    assert!(report_items(&plane.db, plane.host, 1, now_ms(), vec![item(2), item(5)]).await);
    let r = pass(&plane.db, &config(), &lease).await;
    assert_eq!(r.count(Action::OrphanDestroyed), 1, "{r:?}");
    let commands = inproc::commands_of(&plane.db, stray).await;
    let sent: Vec<_> = commands.iter().map(|c| (c.kind, c.generation)).collect();
    assert_eq!(sent, [(CommandKind::Delete, Generation(5))]);
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_older_heartbeat_never_replaces_a_newer_one(db: PgPool) {
    let plane = Plane::start(db).await;
    let (a, b) = (SandboxId::new(), SandboxId::new());
    let seq_and_inventory = |db: PgPool, host: HostId| async move {
        sqlx::query_as::<_, (i64, serde_json::Value)>(
            "SELECT heartbeat_seq, inventory FROM hosts WHERE id = $1",
        )
        .bind(host)
        .fetch_one(&db)
        .await
        .unwrap()
    };
    assert!(report(&plane.db, plane.host, 5, now_ms(), &[a]).await);
    // A late heartbeat 4 changes nothing.
    assert!(!report(&plane.db, plane.host, 4, now_ms(), &[]).await);
    let (seq, inventory) = seq_and_inventory(plane.db.clone(), plane.host).await;
    assert_eq!(seq, 5);
    assert!(inventory.to_string().contains(&a.to_string()));
    // Of one batch, the greatest seq wins whatever the order.
    let hb = |seq: u64, id: SandboxId| Heartbeat {
        host_id: plane.host,
        name: "batch".into(),
        seq,
        capacity: HOST_CAPACITY,
        used: Resources::default(),
        runtimes: vec![],
        inventory: vec![InventoryItem {
            sandbox_id: id,
            generation: Generation(1),
            status: GuestStatus::Running,
        }],
        forwarder: None,
        sent_at_ms: now_ms(),
        warm: Vec::new(),
    };
    let applied = berth_scheduler::heartbeat::apply_batch(&plane.db, &[hb(7, b), hb(6, a)])
        .await
        .unwrap();
    assert_eq!(applied.len(), 1);
    assert!(applied[0].lag_seconds >= 0.0);
    let (seq, inventory) = seq_and_inventory(plane.db.clone(), plane.host).await;
    assert_eq!(seq, 7);
    assert!(inventory.to_string().contains(&b.to_string()));
    assert!(!inventory.to_string().contains(&a.to_string()));
}

/// The breaker of these tests: a host trips when more than half of its running sandboxes,
/// and at least 5, would fail; the fleet's never does.
fn breaking() -> PassConfig {
    PassConfig {
        breaker: GuestBreaker {
            host_share: 0.5,
            fleet_share: 1.0,
            min_failures: 5,
            persist_passes: 3,
        },
        ..config()
    }
}

async fn six_running(plane: &Plane) -> Vec<SandboxId> {
    let mut ids = Vec::new();
    for _ in 0..6 {
        ids.push(running(plane, 1).await);
    }
    ids
}

async fn states(db: &PgPool, ids: &[SandboxId]) -> Vec<String> {
    let mut out = Vec::new();
    for id in ids {
        out.push(inproc::row(db, *id).await.state);
    }
    out
}

async fn host_events(db: &PgPool, host: HostId) -> Vec<String> {
    sqlx::query_scalar("SELECT type FROM host_events WHERE host_id = $1 ORDER BY id")
        .bind(host)
        .fetch_all(db)
        .await
        .unwrap()
}

fn trips_counted(scope: &str) -> f64 {
    berth_api::metrics::handle()
        .render()
        .lines()
        .find(|l| {
            l.starts_with("berth_reconciler_breaker_trips_total{")
                && l.contains(&format!("scope=\"{scope}\""))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_breaker_holds_a_mass_failure_and_acts_once_the_evidence_persisted(db: PgPool) {
    let _ = berth_api::metrics::handle();
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let ids = six_running(&plane).await;
    let config = breaking();
    // Every guest of the host vanished at once: 6 of 6 would fail.
    assert!(report(&plane.db, plane.host, 2, now_ms(), &[]).await);
    let r = pass(&plane.db, &config, &lease).await;
    assert_eq!(r.count(Action::GuestUnhealthy), 0);
    assert_eq!(r.breaker_held, 6);
    assert!(trips_counted("host") >= 1.0, "the trip is counted");
    assert_eq!(
        host_events(&plane.db, plane.host).await,
        ["host.breaker_tripped"]
    );
    let listed = berth::breaker_admin::list(&plane.db).await.unwrap();
    assert!(
        listed.contains(&format!("host {}", plane.host)) && listed.contains("holding"),
        "{listed}"
    );

    // Another pass on the same heartbeat does not count towards persistence.
    let r = pass(&plane.db, &config, &lease).await;
    assert_eq!((r.count(Action::GuestUnhealthy), r.breaker_held), (0, 6));
    // The second heartbeat showing the same: held still (2 of 3 passes).
    assert!(report(&plane.db, plane.host, 3, now_ms(), &[]).await);
    let r = pass(&plane.db, &config, &lease).await;
    assert_eq!((r.count(Action::GuestUnhealthy), r.breaker_held), (0, 6));
    assert!(states(&plane.db, &ids).await.iter().all(|s| s == "running"));
    // The third: the evidence persisted; the pass acts.
    assert!(report(&plane.db, plane.host, 4, now_ms(), &[]).await);
    let r = pass(&plane.db, &config, &lease).await;
    assert_eq!((r.count(Action::GuestUnhealthy), r.breaker_held), (6, 0));
    assert!(states(&plane.db, &ids)
        .await
        .iter()
        .all(|s| s == "failed-start"));
    // Nothing left to fail: the trip clears.
    pass(&plane.db, &config, &lease).await;
    assert_eq!(
        host_events(&plane.db, plane.host).await,
        [
            "host.breaker_tripped",
            "host.breaker_released",
            "host.breaker_cleared"
        ]
    );
    assert!(berth_store::breakers::trips(&plane.db)
        .await
        .unwrap()
        .is_empty());
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_operators_release_lets_the_next_pass_act_and_needs_a_trip(db: PgPool) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    // No trip yet: nothing to release (a release never pre-approves a future trip).
    assert!(berth::breaker_admin::release(&plane.db, Some(plane.host))
        .await
        .is_err());
    assert!(berth::breaker_admin::release(&plane.db, None)
        .await
        .is_err());
    let ids = six_running(&plane).await;
    let config = breaking();
    assert!(report(&plane.db, plane.host, 2, now_ms(), &[]).await);
    let r = pass(&plane.db, &config, &lease).await;
    assert_eq!((r.count(Action::GuestUnhealthy), r.breaker_held), (0, 6));

    berth::breaker_admin::release(&plane.db, Some(plane.host))
        .await
        .unwrap();
    let listed = berth::breaker_admin::list(&plane.db).await.unwrap();
    assert!(listed.contains("released by operator"), "{listed}");
    // The same heartbeat, the next pass: the operator's word is enough.
    let r = pass(&plane.db, &config, &lease).await;
    assert_eq!((r.count(Action::GuestUnhealthy), r.breaker_held), (6, 0));
    assert!(states(&plane.db, &ids)
        .await
        .iter()
        .all(|s| s == "failed-start"));
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_fleet_over_its_share_holds_every_host_until_released(db: PgPool) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let ids = six_running(&plane).await;
    // A second host with many healthy sandboxes would keep the host share low; the fleet
    // share is what trips here.
    let config = PassConfig {
        breaker: GuestBreaker {
            host_share: 1.0,
            fleet_share: 0.5,
            min_failures: 5,
            persist_passes: 10,
        },
        ..config()
    };
    assert!(report(&plane.db, plane.host, 2, now_ms(), &[]).await);
    let r = pass(&plane.db, &config, &lease).await;
    assert_eq!((r.count(Action::GuestUnhealthy), r.breaker_held), (0, 6));
    let fleet_events: Vec<String> =
        sqlx::query_scalar("SELECT type FROM host_events WHERE host_id IS NULL")
            .fetch_all(&plane.db)
            .await
            .unwrap();
    assert_eq!(fleet_events, ["host.breaker_tripped"]);
    berth::breaker_admin::release(&plane.db, None)
        .await
        .unwrap();
    let r = pass(&plane.db, &config, &lease).await;
    assert_eq!((r.count(Action::GuestUnhealthy), r.breaker_held), (6, 0));
    assert!(states(&plane.db, &ids)
        .await
        .iter()
        .all(|s| s == "failed-start"));
}

/// A create still in the outbox never times out while its host is healthy (the control plane's
/// own backlog must not fail healthy work); once the host is not healthy (its earlier boots
/// hang and hold its cap) it times out as never delivered, without charging the host again.
/// One the host had and never answered counts against it.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_command_still_in_the_outbox_times_out_only_behind_an_unhealthy_host(db: PgPool) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let stuck = plane.create().await;
    let delivered = plane.create().await;
    let command = plane.latest(delivered).await;
    sqlx::query("UPDATE commands SET published_at = now() WHERE id = $1")
        .bind(command.id.0)
        .execute(&plane.db)
        .await
        .unwrap();
    let eager = PassConfig {
        create_timeout: Duration::ZERO,
        ..config()
    };
    let r = pass(&plane.db, &eager, &lease).await;
    assert_eq!(r.count(Action::CommandTimeout), 1, "{r:?}");
    assert_eq!(inproc::row(&plane.db, stuck).await.state, "provisioning");
    let reason = |id: SandboxId| {
        let db = plane.db.clone();
        async move {
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT message FROM events WHERE sandbox_id = $1 AND to_state = 'failed-start'",
            )
            .bind(id.0)
            .fetch_one(&db)
            .await
            .unwrap()
            .unwrap_or_default()
        }
    };
    assert!(reason(delivered).await.contains("host never answered"));
    assert_eq!(
        health(&plane.db, plane.host).await,
        ("healthy".to_owned(), 1)
    );

    // The host is degraded now: the create it never had times out, and charges nothing more.
    sqlx::query("UPDATE hosts SET health = 'degraded' WHERE id = $1")
        .bind(plane.host.0)
        .execute(&plane.db)
        .await
        .unwrap();
    let r = pass(&plane.db, &eager, &lease).await;
    assert_eq!(r.count(Action::CommandTimeout), 1, "{r:?}");
    assert!(
        reason(stuck).await.contains("never delivered"),
        "{}",
        reason(stuck).await
    );
    assert_eq!(
        health(&plane.db, plane.host).await,
        ("degraded".to_owned(), 1)
    );
}
