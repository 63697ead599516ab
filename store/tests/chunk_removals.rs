//! The delete-vs-upload race on shared chunks (issue 13 item 8), against a real Postgres: a
//! chunk a snapshot delete orphans while another snapshot is being uploaded is either taken back
//! by that snapshot (and never removed) or, once a remover claimed it, makes that snapshot fail;
//! never both "removed" and "ready".

use berth_schemas::ids::SnapshotId;
use berth_schemas::{CommandId, HostId, OrgId, SandboxId};
use berth_store::snapshots::{self, NewSnapshot, Settled};
use berth_store::{chunks, orgs};
use sqlx::PgPool;

async fn creating(db: &PgPool, org: OrgId) -> (SnapshotId, chrono::DateTime<chrono::Utc>) {
    let id = SnapshotId::new();
    let mut tx = db.begin().await.unwrap();
    snapshots::create(
        &mut tx,
        &NewSnapshot {
            id,
            org_id: org,
            sandbox_id: SandboxId::new(),
            host_id: HostId::new(),
            parent_id: None,
            template: "base",
            runtime: "runc",
            vcpus: 1,
            memory_mib: 256,
            disk_mib: 1024,
            command_id: CommandId::new(),
            expires_at: None,
            kind: snapshots::KIND_SNAPSHOT,
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let row = snapshots::get(db, org, id).await.unwrap().unwrap();
    (id, row.created_at)
}

fn hash(c: char) -> String {
    c.to_string().repeat(64)
}

async fn ready(db: &PgPool, id: SnapshotId, hashes: &[String]) {
    let chunks: Vec<(String, i64)> = hashes.iter().map(|h| (h.clone(), 10)).collect();
    let mut conn = db.acquire().await.unwrap();
    assert!(snapshots::write_ready(
        &mut conn,
        id,
        &Settled {
            holds: "disk",
            logical_bytes: 10,
            stored_bytes: 10,
            new_bytes: 10,
            paused_ms: 1,
            chunks: &chunks,
        },
    )
    .await
    .unwrap());
}

/// Deletes snapshot `id` the way the API does: row and references, orphans queued, one
/// transaction. Returns the orphans.
async fn delete(db: &PgPool, id: SnapshotId) -> Vec<String> {
    let mut tx = db.begin().await.unwrap();
    snapshots::lock(&mut tx, id).await.unwrap().unwrap();
    let orphans: Vec<String> = snapshots::delete(&mut tx, id)
        .await
        .unwrap()
        .into_iter()
        .map(|(h, _)| h)
        .collect();
    chunks::queue(&mut tx, &orphans).await.unwrap();
    tx.commit().await.unwrap();
    orphans
}

async fn queued(db: &PgPool, h: &str) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM chunk_removals WHERE sha256 = $1)")
        .bind(h)
        .fetch_one(db)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_chunk_claimed_for_removal_under_an_upload_fails_that_snapshot(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let x = hash('a');
    let (old, _) = creating(&db, org).await;
    ready(&db, old, std::slice::from_ref(&x)).await;
    // Another snapshot is requested and uploads; its upload finds `x` stored and skips it.
    let (uploading, requested_at) = creating(&db, org).await;
    assert_eq!(delete(&db, old).await, std::slice::from_ref(&x));
    let mut conn = db.acquire().await.unwrap();
    assert!(
        chunks::claim(&mut conn, &x).await.unwrap(),
        "no reference yet"
    );
    // (the remover deletes the object here)
    chunks::finish(&mut conn, &x).await.unwrap();
    let mut tx = db.begin().await.unwrap();
    let lost = chunks::check_for_ready(&mut tx, uploading, requested_at, std::slice::from_ref(&x))
        .await
        .unwrap();
    assert_eq!(
        lost,
        std::slice::from_ref(&x),
        "the snapshot must fail, not become ready"
    );
    tx.commit().await.unwrap();

    // A claim whose removal is still under way counts the same.
    let y = hash('b');
    let (old, _) = creating(&db, org).await;
    ready(&db, old, std::slice::from_ref(&y)).await;
    let (uploading, requested_at) = creating(&db, org).await;
    delete(&db, old).await;
    assert!(chunks::claim(&mut conn, &y).await.unwrap());
    let lost =
        chunks::check_for_ready(&mut conn, uploading, requested_at, std::slice::from_ref(&y))
            .await
            .unwrap();
    assert_eq!(lost, [y]);
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_settling_snapshot_takes_a_queued_chunk_back_and_the_remover_then_leaves_it(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let x = hash('c');
    let (old, _) = creating(&db, org).await;
    ready(&db, old, std::slice::from_ref(&x)).await;
    let (uploading, requested_at) = creating(&db, org).await;
    assert_eq!(delete(&db, old).await, std::slice::from_ref(&x));
    assert!(queued(&db, &x).await);

    // The snapshot settles first, in one transaction: check, then ready.
    let mut tx = db.begin().await.unwrap();
    let lost = chunks::check_for_ready(&mut tx, uploading, requested_at, std::slice::from_ref(&x))
        .await
        .unwrap();
    assert!(lost.is_empty());
    // A remover racing the settle waits on the row lock and then finds the reference.
    let racer = {
        let db = db.clone();
        let x = x.clone();
        tokio::spawn(async move {
            let mut conn = db.acquire().await.unwrap();
            chunks::claim(&mut conn, &x).await.unwrap()
        })
    };
    snapshots::write_ready(
        &mut tx,
        uploading,
        &Settled {
            holds: "disk",
            logical_bytes: 10,
            stored_bytes: 10,
            new_bytes: 10,
            paused_ms: 1,
            chunks: &[(x.clone(), 10)],
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(!racer.await.unwrap(), "a referenced chunk is never claimed");
    let mut conn = db.acquire().await.unwrap();
    assert!(!chunks::claim(&mut conn, &x).await.unwrap());
    assert!(!queued(&db, &x).await, "taken back");

    // Deleting the last snapshot that references it orphans it again, and then it goes.
    assert_eq!(delete(&db, uploading).await, std::slice::from_ref(&x));
    assert!(chunks::claim(&mut conn, &x).await.unwrap());
    chunks::finish(&mut conn, &x).await.unwrap();
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_removal_finished_before_a_snapshot_was_requested_does_not_fail_it(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let x = hash('d');
    let (old, _) = creating(&db, org).await;
    ready(&db, old, std::slice::from_ref(&x)).await;
    delete(&db, old).await;
    let mut conn = db.acquire().await.unwrap();
    assert!(chunks::claim(&mut conn, &x).await.unwrap());
    chunks::finish(&mut conn, &x).await.unwrap();
    // Requested after the object was gone: its upload found it missing and stored it again.
    let (later, requested_at) = creating(&db, org).await;
    let lost = chunks::check_for_ready(&mut conn, later, requested_at, std::slice::from_ref(&x))
        .await
        .unwrap();
    assert!(lost.is_empty());
    assert!(!queued(&db, &x).await, "referenced again: no longer queued");
}
