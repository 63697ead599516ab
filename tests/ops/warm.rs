//! Warm pools (issue 16 lever 1), the control plane's part: the slots a host's heartbeat lists
//! (through the scheduler's real batch apply) are taken by creates of their shape through the
//! real API router — the sandbox gets the slot's id and its command goes to the slot's host —
//! and placement prefers the host holding one. The host's hand-over is hostd's (its own tests).

use berth_schemas::wire::{Heartbeat, Resources, Runtime, RuntimeInfo, WarmSlot};
use berth_schemas::{HostId, SandboxId};
use sqlx::PgPool;

use crate::support::inproc::{self, now_ms, Plane, HOST_CAPACITY};

/// The create body of the warm slots' shape.
const WARM_SHAPE: &str = r#"{"template":"base","vcpus":1,"memory_mib":256,"disk_mib":1024}"#;

/// A slot of [`WARM_SHAPE`] under a new id.
fn slot() -> WarmSlot {
    WarmSlot {
        sandbox_id: SandboxId::new(),
        template: "base".into(),
        runtime: Runtime::Runc,
        resources: Resources {
            vcpus: 1,
            memory_mib: 256,
        },
        disk_mib: 1024,
        image: None,
    }
}

/// Applies `host`'s heartbeat `seq` (of `capacity`) listing `warm`, through the scheduler's
/// batch apply.
async fn report(db: &PgPool, host: HostId, seq: u64, capacity: Resources, warm: Vec<WarmSlot>) {
    let hb = Heartbeat {
        host_id: host,
        name: format!("test-{host}"),
        seq,
        capacity,
        used: Resources::default(),
        runtimes: vec![RuntimeInfo {
            name: "runc".into(),
            memory_snapshot: false,
        }],
        inventory: Vec::new(),
        forwarder: None,
        sent_at_ms: now_ms(),
        warm,
    };
    let applied = berth_scheduler::heartbeat::apply_batch(db, &[hb])
        .await
        .unwrap();
    assert_eq!(applied.len(), 1, "the heartbeat is the host's newest");
}

/// The host the sandbox's create command went to.
async fn create_host(plane: &Plane, id: SandboxId) -> HostId {
    let commands = inproc::commands_of(&plane.db, id).await;
    assert_eq!(commands.len(), 1, "one create command");
    assert_eq!(commands[0].command.sandbox_id, id);
    commands[0].host_id
}

async fn slots_of(db: &PgPool, host: HostId) -> Vec<SandboxId> {
    berth_store::warm::of_host(db, host)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.sandbox_id)
        .collect()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_create_of_a_warm_slots_shape_takes_its_id_and_other_shapes_leave_it(db: PgPool) {
    let plane = Plane::start(db).await;
    let warm = slot();
    report(&plane.db, plane.host, 2, HOST_CAPACITY, vec![warm.clone()]).await;
    assert_eq!(slots_of(&plane.db, plane.host).await, vec![warm.sandbox_id]);

    // Other resources, another disk size, another template: new ids, the slot stays.
    for other in [
        r#"{"template":"base","vcpus":2,"memory_mib":256,"disk_mib":1024}"#,
        r#"{"template":"base","vcpus":1,"memory_mib":512,"disk_mib":1024}"#,
        r#"{"template":"base","vcpus":1,"memory_mib":256,"disk_mib":2048}"#,
        r#"{"template":"python","vcpus":1,"memory_mib":256,"disk_mib":1024}"#,
    ] {
        let id = plane.api.create(&plane.org.key, other).await;
        assert_ne!(id, warm.sandbox_id, "{other}");
        assert_eq!(slots_of(&plane.db, plane.host).await, vec![warm.sandbox_id]);
    }

    // The shape: the slot's id, its command to the slot's host, the slot gone.
    let id = plane.api.create(&plane.org.key, WARM_SHAPE).await;
    assert_eq!(id, warm.sandbox_id);
    assert_eq!(create_host(&plane, id).await, plane.host);
    assert_eq!(inproc::row(&plane.db, id).await.state, "provisioning");
    assert!(slots_of(&plane.db, plane.host).await.is_empty());

    // No slot left: a new id, as before warm pools.
    let next = plane.api.create(&plane.org.key, WARM_SHAPE).await;
    assert_ne!(next, warm.sandbox_id);

    // The host's heartbeat sent before it saw the create still lists the slot: it does not
    // come back, and the next create of the shape gets a new id again.
    report(&plane.db, plane.host, 3, HOST_CAPACITY, vec![warm.clone()]).await;
    assert!(slots_of(&plane.db, plane.host).await.is_empty());
    let again = plane.api.create(&plane.org.key, WARM_SHAPE).await;
    assert_ne!(again, warm.sandbox_id);
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_create_prefers_the_host_holding_a_warm_slot_over_an_emptier_one(db: PgPool) {
    let plane = Plane::start(db).await;
    // Four times the plane's host, and as empty: spread alone picks it.
    let big = HostId::new();
    let big_capacity = Resources {
        vcpus: HOST_CAPACITY.vcpus * 4,
        memory_mib: HOST_CAPACITY.memory_mib * 4,
    };
    report(&plane.db, big, 1, big_capacity, Vec::new()).await;
    let cold = plane.api.create(&plane.org.key, WARM_SHAPE).await;
    assert_eq!(
        create_host(&plane, cold).await,
        big,
        "spread, no slot anywhere"
    );

    let warm = slot();
    report(&plane.db, plane.host, 2, HOST_CAPACITY, vec![warm.clone()]).await;
    let id = plane.api.create(&plane.org.key, WARM_SHAPE).await;
    assert_eq!(id, warm.sandbox_id);
    assert_eq!(create_host(&plane, id).await, plane.host);

    // A create of another shape still spreads.
    let other = plane
        .api
        .create(
            &plane.org.key,
            r#"{"template":"base","vcpus":1,"memory_mib":512,"disk_mib":1024}"#,
        )
        .await;
    assert_eq!(create_host(&plane, other).await, big);
}

/// The slots the store holds of the stack's one host, once it holds one other than `not`.
async fn stored_slot(stack: &crate::support::stack::Stack, not: &[SandboxId]) -> SandboxId {
    let host = stack.hosts[0].host_id;
    let deadline = tokio::time::Instant::now() + crate::support::env::SETTLE_TIMEOUT;
    loop {
        let slots = berth_store::warm::of_host(&stack.db, host).await.unwrap();
        if let Some(slot) = slots.iter().find(|s| !not.contains(&s.sandbox_id)) {
            return slot.sandbox_id;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the host never offered a warm sandbox: {slots:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// End to end on a real hostd with `--warm-pool base=1`: the first create shows the pool its
/// shape; the next create of that shape through the API gets the warm sandbox's id, runs,
/// execs, and is deleted without leftovers; the pool refills under a new id.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_create_through_the_api_runs_in_the_hosts_warm_sandbox(db: PgPool) {
    let mut stack = crate::support::stack::Stack::start(db, 0).await;
    stack
        .add_host_with_args((None, None), &["--warm-pool".into(), "base=1".into()])
        .await;
    let first = stack.create().await;
    stack.wait_state(&first, "running").await;
    let warm = stored_slot(&stack, &[]).await;

    let taken = stack.create().await;
    assert_eq!(
        taken,
        warm.to_string(),
        "the create did not take the warm slot"
    );
    stack.wait_state(&taken, "running").await;
    let (status, out) = stack.exec(&taken, &["echo", "warm"]).await;
    assert_eq!(
        (status, out["stdout"].as_str()),
        (200, Some("warm\n")),
        "{out}"
    );
    let refill = stored_slot(&stack, &[warm]).await;
    assert_ne!(refill, warm);

    for id in [&first, &taken] {
        assert_eq!(stack.delete(id).await.0, 202);
        stack.wait_state(id, "deleted").await;
        stack.nothing_left(id).await;
    }
    stack.teardown().await;
}
