//! Snapshot rows against a real Postgres (a fresh database per test): a snapshot settles once,
//! another org never sees it, an org's usage counts shared content once, and a delete hands back
//! exactly the chunks no other snapshot references.

mod common;

use berth_schemas::ids::SnapshotId;
use berth_schemas::state::snapshot::SnapshotState;
use berth_schemas::{OrgId, SandboxId};
use berth_store::orgs;
use berth_store::snapshots::{self, Settled};
use sqlx::PgPool;

async fn org(db: &PgPool) -> OrgId {
    orgs::create(db, &format!("org-{}", OrgId::new()))
        .await
        .unwrap()
        .unwrap()
}

async fn creating(
    db: &PgPool,
    org: OrgId,
    sandbox: SandboxId,
    parent: Option<SnapshotId>,
) -> SnapshotId {
    common::creating_snapshot(db, org, sandbox, parent, 0.0)
        .await
        .0
}

fn settled(chunks: &[(String, i64)]) -> Settled<'_> {
    Settled {
        holds: "disk",
        logical_bytes: 1000,
        stored_bytes: chunks.iter().map(|c| c.1).sum(),
        new_bytes: 10,
        paused_ms: 7,
        chunks,
    }
}

fn chunk(c: char, n: i64) -> (String, i64) {
    (c.to_string().repeat(64), n)
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_snapshot_settles_once_and_a_delete_returns_only_unshared_chunks(db: PgPool) {
    let (o, sandbox) = (org(&db).await, SandboxId::new());
    let first = creating(&db, o, sandbox, None).await;
    let second = creating(&db, o, sandbox, Some(first)).await;
    let (a, b, c) = (chunk('a', 100), chunk('b', 200), chunk('c', 400));
    let mut conn = db.acquire().await.unwrap();
    assert!(
        snapshots::write_ready(&mut conn, first, &settled(&[a.clone(), b.clone()]))
            .await
            .unwrap()
    );
    assert!(
        !snapshots::write_ready(&mut conn, first, &settled(std::slice::from_ref(&c)))
            .await
            .unwrap(),
        "settles once"
    );
    assert!(
        !snapshots::write_failed(&mut conn, first, "late")
            .await
            .unwrap(),
        "a ready one never fails"
    );
    assert!(
        snapshots::write_ready(&mut conn, second, &settled(&[b.clone(), c.clone()]))
            .await
            .unwrap()
    );
    assert_eq!(
        snapshots::org_usage(&mut conn, o).await.unwrap(),
        (2, 700),
        "b counted once"
    );

    let row = snapshots::get(&db, o, first).await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.paused_ms, row.holds.as_deref()),
        (SnapshotState::Ready, Some(7), Some("disk"))
    );
    assert!(
        snapshots::get(&db, org(&db).await, first)
            .await
            .unwrap()
            .is_none(),
        "another org sees nothing"
    );
    assert_eq!(
        snapshots::list_for_sandbox(&db, o, sandbox)
            .await
            .unwrap()
            .len(),
        2
    );

    let mut tx = db.begin().await.unwrap();
    snapshots::lock(&mut tx, first).await.unwrap().unwrap();
    assert_eq!(
        snapshots::delete(&mut tx, first).await.unwrap(),
        vec![a.clone()],
        "b is still the second's"
    );
    tx.commit().await.unwrap();
    let second_row = snapshots::get(&db, o, second).await.unwrap().unwrap();
    assert_eq!(
        second_row.parent_id, None,
        "the parent link goes with the parent"
    );
    let mut tx = db.begin().await.unwrap();
    let mut gone = snapshots::delete(&mut tx, second).await.unwrap();
    gone.sort();
    assert_eq!(gone, vec![b, c]);
    tx.commit().await.unwrap();
    assert_eq!(snapshots::org_usage(&mut conn, o).await.unwrap(), (0, 0));
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn only_creating_snapshots_time_out_and_a_failed_one_keeps_its_reason(db: PgPool) {
    let o = org(&db).await;
    let stuck = creating(&db, o, SandboxId::new(), None).await;
    let done = creating(&db, o, SandboxId::new(), None).await;
    let mut conn = db.acquire().await.unwrap();
    assert!(
        snapshots::write_ready(&mut conn, done, &settled(&[chunk('d', 1)]))
            .await
            .unwrap()
    );
    let mut tx = db.begin().await.unwrap();
    let due = snapshots::lock_timed_out(&mut tx, -1.0, 10).await.unwrap();
    assert_eq!(due.iter().map(|r| r.id).collect::<Vec<_>>(), vec![stuck]);
    assert!(snapshots::write_failed(&mut tx, stuck, "timed out")
        .await
        .unwrap());
    tx.commit().await.unwrap();
    let row = snapshots::get(&db, o, stuck).await.unwrap().unwrap();
    assert_eq!(
        (row.state, row.reason.as_deref()),
        (SnapshotState::Failed, Some("timed out"))
    );
    assert!(
        !snapshots::write_ready(&mut conn, stuck, &settled(&[]))
            .await
            .unwrap(),
        "a failed one is not revived"
    );

    let name = format!("quota-{}", OrgId::new());
    let q = orgs::create(&db, &name).await.unwrap().unwrap();
    let limits = orgs::SnapshotQuota {
        max_snapshots: Some(3),
        max_snapshot_bytes: Some(1 << 20),
    };
    assert!(orgs::set_snapshot_quota(&db, &name, limits).await.unwrap());
    let mut tx = db.begin().await.unwrap();
    assert_eq!(orgs::lock_snapshot_quota(&mut tx, q).await.unwrap(), limits);
}
