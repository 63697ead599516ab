//! Warm slots against a real Postgres (a fresh database per test, `#[sqlx::test]`): a host's
//! rows are the slots of its newest applied heartbeat, a slot whose id names a sandbox never
//! comes back and is never claimed, a stale slot is not claimed, and two transactions never
//! claim one slot.

use std::time::Duration;

use berth_schemas::wire::{Heartbeat, Resources, Runtime, RuntimeInfo, WarmSlot};
use berth_schemas::{HostId, SandboxId};
use berth_store::warm::{self, Reported, Shape};
use sqlx::PgPool;

mod common;
use common::{host, placed_as, HOST_CAPACITY, SIZE};

/// The placement freshness of these tests.
const FRESH: Duration = Duration::from_secs(15);

/// A slot of [`shape`] under a new id.
fn slot() -> WarmSlot {
    WarmSlot {
        sandbox_id: SandboxId::new(),
        template: "base".into(),
        runtime: Runtime::Runc,
        resources: SIZE,
        disk_mib: 256,
        image: None,
    }
}

/// What a create of the base template at [`SIZE`] with 256 MiB of disk asks.
fn shape() -> Shape<'static> {
    Shape {
        template: "base",
        runtime: Runtime::Runc,
        resources: SIZE,
        disk_mib: 256,
        image: None,
    }
}

/// Applies `host`'s heartbeat `seq` listing `slots` as the heartbeat consumer does: the
/// upsert, then the applied heartbeats' slots, in one transaction. Whether it was applied.
async fn report(db: &PgPool, host: HostId, seq: u64, slots: Vec<WarmSlot>) -> bool {
    let hb = Heartbeat {
        host_id: host,
        name: "store-test".into(),
        seq,
        capacity: HOST_CAPACITY,
        used: Resources::default(),
        runtimes: vec![RuntimeInfo {
            name: "runc".into(),
            memory_snapshot: false,
        }],
        inventory: vec![],
        forwarder: None,
        sent_at_ms: 0,
        warm: slots.clone(),
    };
    let mut tx = db.begin().await.unwrap();
    let applied = berth_store::heartbeats::upsert(&mut *tx, std::slice::from_ref(&hb))
        .await
        .unwrap();
    let reported: Vec<Reported<'_>> = applied
        .iter()
        .map(|_| Reported {
            host,
            seq,
            slots: &slots,
        })
        .collect();
    warm::replace(&mut tx, &reported).await.unwrap();
    tx.commit().await.unwrap();
    !applied.is_empty()
}

fn ids(slots: &[WarmSlot]) -> Vec<SandboxId> {
    let mut ids: Vec<SandboxId> = slots.iter().map(|s| s.sandbox_id).collect();
    ids.sort();
    ids
}

async fn stored(db: &PgPool, host: HostId) -> Vec<SandboxId> {
    ids(&warm::of_host(db, host).await.unwrap())
}

async fn claim(db: &PgPool, host: HostId, shape: &Shape<'_>) -> Option<SandboxId> {
    let mut tx = db.begin().await.unwrap();
    let claimed = warm::claim(&mut tx, host, shape, FRESH).await.unwrap();
    tx.commit().await.unwrap();
    claimed
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_newest_heartbeats_slots_replace_the_hosts_rows_and_an_older_one_changes_nothing(
    db: PgPool,
) {
    let host = host(&db).await;
    let (a, b, c) = (slot(), slot(), slot());
    assert!(report(&db, host, 2, vec![a.clone(), b.clone()]).await);
    assert_eq!(
        warm::of_host(&db, host).await.unwrap(),
        {
            let mut both = vec![a.clone(), b.clone()];
            both.sort_by_key(|s| s.sandbox_id);
            both
        },
        "every field is stored as reported"
    );
    assert!(report(&db, host, 3, vec![b.clone(), c.clone()]).await);
    assert_eq!(stored(&db, host).await, ids(&[b.clone(), c.clone()]));
    // Sent before seq 3, arriving after it: nothing changes.
    assert!(!report(&db, host, 2, vec![a.clone()]).await);
    assert_eq!(stored(&db, host).await, ids(&[b.clone(), c.clone()]));
    // Nor when given to the replacement alone: it checks the seq against the host's row.
    let mut tx = db.begin().await.unwrap();
    let late = [a.clone()];
    warm::replace(
        &mut tx,
        &[Reported {
            host,
            seq: 2,
            slots: &late,
        }],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(stored(&db, host).await, ids(&[b.clone(), c.clone()]));
    // A heartbeat listing none empties the host's rows.
    assert!(report(&db, host, 4, vec![]).await);
    assert!(stored(&db, host).await.is_empty());
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_claim_takes_a_slot_of_its_exact_shape_once(db: PgPool) {
    let host = host(&db).await;
    let other_host = common::host(&db).await;
    let imaged = WarmSlot {
        image: Some("registry.example/app@sha256:00".into()),
        ..slot()
    };
    let plain = slot();
    assert!(report(&db, host, 2, vec![plain.clone(), imaged.clone()]).await);
    let misses = [
        Shape {
            template: "python",
            ..shape()
        },
        Shape {
            runtime: Runtime::Runsc,
            ..shape()
        },
        Shape {
            resources: Resources { vcpus: 2, ..SIZE },
            ..shape()
        },
        Shape {
            resources: Resources {
                memory_mib: 1024,
                ..SIZE
            },
            ..shape()
        },
        Shape {
            disk_mib: 512,
            ..shape()
        },
        Shape {
            image: Some("registry.example/app@sha256:11"),
            ..shape()
        },
    ];
    for miss in &misses {
        assert_eq!(claim(&db, host, miss).await, None, "{miss:?}");
    }
    assert_eq!(
        claim(&db, other_host, &shape()).await,
        None,
        "another host's"
    );
    assert_eq!(stored(&db, host).await.len(), 2, "a miss takes nothing");

    assert_eq!(claim(&db, host, &shape()).await, Some(plain.sandbox_id));
    assert_eq!(claim(&db, host, &shape()).await, None, "taken once");
    let with_image = Shape {
        image: Some("registry.example/app@sha256:00"),
        ..shape()
    };
    assert_eq!(claim(&db, host, &with_image).await, Some(imaged.sandbox_id));
    assert!(stored(&db, host).await.is_empty());
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_slot_whose_id_names_a_sandbox_is_never_stored_again_and_never_claimed(db: PgPool) {
    let host = host(&db).await;
    let taken = slot();
    assert!(report(&db, host, 2, vec![taken.clone()]).await);
    // A create takes it: the slot's row goes, a sandbox of its id comes.
    let mut tx = db.begin().await.unwrap();
    assert_eq!(
        warm::claim(&mut tx, host, &shape(), FRESH).await.unwrap(),
        Some(taken.sandbox_id)
    );
    tx.commit().await.unwrap();
    placed_as(&db, host, Some(taken.sandbox_id)).await;
    // A heartbeat the host sent before it saw the create arrives late, newer than the stored
    // one: the slot does not come back.
    assert!(report(&db, host, 3, vec![taken.clone()]).await);
    assert!(stored(&db, host).await.is_empty());

    // A row that names a sandbox anyway (a heartbeat that raced the create's commit) is
    // never claimed, and the host's next heartbeat removes it.
    let raced = slot();
    assert!(report(&db, host, 4, vec![raced.clone()]).await);
    placed_as(&db, host, Some(raced.sandbox_id)).await;
    assert_eq!(claim(&db, host, &shape()).await, None);
    let mut tx = db.begin().await.unwrap();
    assert!(warm::hosts_with_slot(&mut tx, &shape(), FRESH)
        .await
        .unwrap()
        .is_empty());
    drop(tx);
    assert_eq!(stored(&db, host).await, vec![raced.sandbox_id]);
    assert!(report(&db, host, 5, vec![raced.clone()]).await);
    assert!(stored(&db, host).await.is_empty());
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_slot_reported_before_the_freshness_window_is_not_claimed(db: PgPool) {
    let host = host(&db).await;
    let old = slot();
    assert!(report(&db, host, 2, vec![old.clone()]).await);
    sqlx::query("UPDATE warm_slots SET reported_at = now() - interval '1 minute'")
        .execute(&db)
        .await
        .unwrap();
    let mut tx = db.begin().await.unwrap();
    assert!(warm::hosts_with_slot(&mut tx, &shape(), FRESH)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        warm::claim(&mut tx, host, &shape(), FRESH).await.unwrap(),
        None
    );
    // Within a longer window it is.
    let hour = Duration::from_secs(3600);
    assert_eq!(
        warm::hosts_with_slot(&mut tx, &shape(), hour)
            .await
            .unwrap(),
        vec![host]
    );
    assert_eq!(
        warm::claim(&mut tx, host, &shape(), hour).await.unwrap(),
        Some(old.sandbox_id)
    );
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn two_transactions_never_claim_the_same_slot(db: PgPool) {
    let host = host(&db).await;
    let (a, b) = (slot(), slot());
    assert!(report(&db, host, 2, vec![a.clone(), b.clone()]).await);
    let mut first = db.begin().await.unwrap();
    let mut second = db.begin().await.unwrap();
    let one = warm::claim(&mut first, host, &shape(), FRESH)
        .await
        .unwrap()
        .unwrap();
    let two = warm::claim(&mut second, host, &shape(), FRESH)
        .await
        .unwrap()
        .unwrap();
    assert_ne!(one, two, "the second skips the slot the first holds");
    // No third slot: a third transaction finds none while both are open, and none after.
    let mut third = db.begin().await.unwrap();
    assert_eq!(
        warm::claim(&mut third, host, &shape(), FRESH)
            .await
            .unwrap(),
        None
    );
    first.commit().await.unwrap();
    second.commit().await.unwrap();
    assert_eq!(
        warm::claim(&mut third, host, &shape(), FRESH)
            .await
            .unwrap(),
        None
    );
    third.rollback().await.unwrap();
    // A claim rolled back leaves the slot for the next.
    assert!(report(&db, host, 3, vec![a.clone()]).await);
    let mut rolled = db.begin().await.unwrap();
    assert_eq!(
        warm::claim(&mut rolled, host, &shape(), FRESH)
            .await
            .unwrap(),
        Some(a.sandbox_id)
    );
    // Rolled back and waited for: a dropped transaction's rollback runs later, on its
    // connection's way back to the pool, and until then its lock makes the next claim skip
    // the slot (`SKIP LOCKED`): that raced under load in CI.
    rolled.rollback().await.unwrap();
    assert_eq!(claim(&db, host, &shape()).await, Some(a.sandbox_id));
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_host_speaks_only_for_its_own_slots_and_an_id_listed_twice_is_nobodys(db: PgPool) {
    let (one, two) = (host(&db).await, host(&db).await);
    let mine = slot();
    assert!(report(&db, one, 2, vec![mine.clone()]).await);
    // Another host lists the same id: the row stays the first host's.
    assert!(report(&db, two, 2, vec![mine.clone()]).await);
    assert_eq!(stored(&db, one).await, vec![mine.sandbox_id]);
    assert!(stored(&db, two).await.is_empty());

    // Listed twice in one batch (here by one host): stored for neither listing.
    let twice = slot();
    let other = slot();
    assert!(
        report(
            &db,
            two,
            3,
            vec![twice.clone(), other.clone(), twice.clone()]
        )
        .await
    );
    assert_eq!(stored(&db, two).await, vec![other.sandbox_id]);

    let mut tx = db.begin().await.unwrap();
    let mut holding = warm::hosts_with_slot(&mut tx, &shape(), FRESH)
        .await
        .unwrap();
    holding.sort();
    let mut both = vec![one, two];
    both.sort();
    assert_eq!(holding, both);
}
