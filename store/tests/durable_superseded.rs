//! Superseded durable stop snapshots (issue 14, migration 0034), against a real Postgres: a
//! start, a newer durable stop and a delete each record the stop snapshot they supersede in
//! their own transaction, its chunks stay referenced until it is collected, and it is collected
//! only once no upload of the next stop and no boot may still need it, with exactly the chunks
//! nothing else references.

use berth_schemas::ids::SnapshotId;
use berth_schemas::{Capacity, CommandKind, SandboxState};
use berth_store::sandboxes;
use berth_store::{chunks, SandboxRow};
use sqlx::PgPool;

mod common;
use common::{host, placed, transition};

fn hash(c: char) -> String {
    c.to_string().repeat(64)
}

async fn lock(db: &PgPool, row: &SandboxRow) -> SandboxRow {
    let mut conn = db.acquire().await.unwrap();
    sandboxes::lock(&mut conn, row.id, None)
        .await
        .unwrap()
        .unwrap()
}

/// Writes `to` (a user's transition) and returns the row after it.
async fn go(db: &PgPool, row: &SandboxRow, to: SandboxState, delete: bool) -> SandboxRow {
    let (kind, capacity) = match to {
        SandboxState::Starting => (CommandKind::Start, Capacity::Reserve),
        _ => (CommandKind::Stop, Capacity::Release),
    };
    let mut t = transition(to, kind, capacity);
    t.delete = delete;
    let mut tx = db.begin().await.unwrap();
    let row = sandboxes::lock(&mut tx, row.id, None)
        .await
        .unwrap()
        .unwrap();
    let written = sandboxes::write_transition(&mut tx, &row, &t)
        .await
        .unwrap()
        .row;
    tx.commit().await.unwrap();
    written
}

/// Records a durable stop `snapshot` referencing `hashes` for the stopped `row`.
async fn durable(db: &PgPool, row: &SandboxRow, snapshot: SnapshotId, hashes: &[String]) {
    let chunks: Vec<(String, i64)> = hashes.iter().map(|h| (h.clone(), 10)).collect();
    let mut tx = db.begin().await.unwrap();
    assert!(
        sandboxes::write_durable(&mut tx, row.id, row.generation, snapshot, &chunks)
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();
}

/// What the collector would take now (committed), its orphans sorted.
async fn take(db: &PgPool, row: &SandboxRow) -> Option<(SnapshotId, Vec<String>)> {
    let mut tx = db.begin().await.unwrap();
    let taken = sandboxes::take_superseded(&mut tx, Some(row.id))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    taken.map(|t| {
        let mut orphans = t.orphans;
        orphans.sort();
        (t.snapshot, orphans)
    })
}

async fn claimable(db: &PgPool, h: &str) -> bool {
    let mut conn = db.acquire().await.unwrap();
    chunks::queue(&mut conn, &[h.to_owned()]).await.unwrap();
    chunks::claim(&mut conn, h).await.unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn each_superseded_stop_is_collected_once_nothing_needs_it_with_only_its_own_chunks(
    db: PgPool,
) {
    let host = host(&db).await;
    let row = placed(&db, host).await;
    let (x, y, z) = (hash('a'), hash('b'), hash('c'));
    let stopped = go(&db, &row, SandboxState::Stopped, false).await;
    let a = SnapshotId::new();
    durable(&db, &stopped, a, &[x.clone(), y.clone()]).await;

    // A start supersedes A in its own transaction; its chunks stay referenced.
    let started = go(&db, &stopped, SandboxState::Starting, false).await;
    assert_eq!((started.durable_at, started.durable_snapshot), (None, None));
    let mut conn = db.acquire().await.unwrap();
    assert_eq!(
        sandboxes::superseded_count(&mut conn, row.id)
            .await
            .unwrap(),
        1
    );
    drop(conn);
    // Stopped again, the next stop's upload (a full capture skipping what the store holds) may
    // count on A's chunks: A waits, and no removal takes them.
    let stopped = go(&db, &started, SandboxState::Stopped, false).await;
    assert_eq!(
        take(&db, &stopped).await,
        None,
        "held while the stop is not durable"
    );
    assert!(
        !claimable(&db, &x).await,
        "a superseded snapshot's chunk is referenced"
    );
    // Once the next stop B (sharing y) is durable, A goes with only x.
    let b = SnapshotId::new();
    durable(&db, &stopped, b, &[y.clone(), z.clone()]).await;
    assert_eq!(take(&db, &stopped).await, Some((a, vec![x.clone()])));
    assert_eq!(take(&db, &stopped).await, None, "collected once");
    assert!(claimable(&db, &x).await);

    // A newer durable stop at the same generation (an archive's upload) supersedes B.
    let c = SnapshotId::new();
    durable(&db, &stopped, c, std::slice::from_ref(&z)).await;
    assert_eq!(lock(&db, &row).await.durable_snapshot, Some(c));
    assert_eq!(take(&db, &stopped).await, Some((b, vec![y.clone()])));

    // A delete during a migration supersedes C; held while the delete is in flight (the new
    // host may still be fetching it), collected once the sandbox is deleted.
    sqlx::query("UPDATE sandboxes SET state = 'migrating' WHERE id = $1")
        .bind(row.id)
        .execute(&db)
        .await
        .unwrap();
    let deleting = go(&db, &stopped, SandboxState::Stopping, true).await;
    assert_eq!(deleting.durable_snapshot, None);
    assert_eq!(
        take(&db, &deleting).await,
        None,
        "held while the delete is in flight"
    );
    sqlx::query("UPDATE sandboxes SET state = 'deleted' WHERE id = $1")
        .bind(row.id)
        .execute(&db)
        .await
        .unwrap();
    assert_eq!(take(&db, &deleting).await, Some((c, vec![z.clone()])));
    let mut conn = db.acquire().await.unwrap();
    assert_eq!(
        sandboxes::superseded_count(&mut conn, row.id)
            .await
            .unwrap(),
        0
    );
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_chunk_another_sandbox_or_a_snapshot_references_is_never_an_orphan(db: PgPool) {
    let host = host(&db).await;
    let one = go(&db, &placed(&db, host).await, SandboxState::Stopped, false).await;
    let two = go(&db, &placed(&db, host).await, SandboxState::Stopped, false).await;
    let shared = hash('d');
    let own = hash('e');
    let a = SnapshotId::new();
    durable(&db, &one, a, &[shared.clone(), own.clone()]).await;
    durable(&db, &two, SnapshotId::new(), std::slice::from_ref(&shared)).await;
    // Deleted elsewhere (an org's delete writes the row itself): the collector's look moves
    // its durable stop to the superseded ones.
    sqlx::query("UPDATE sandboxes SET state = 'stopping', deleted_at = now() WHERE id = $1")
        .bind(one.id)
        .execute(&db)
        .await
        .unwrap();
    let mut conn = db.acquire().await.unwrap();
    assert_eq!(
        sandboxes::deleted_with_durable(&mut conn, 10)
            .await
            .unwrap(),
        [one.id]
    );
    assert_eq!(
        sandboxes::take_durable(&mut conn, one.id).await.unwrap(),
        Some(a)
    );
    assert_eq!(
        sandboxes::take_durable(&mut conn, two.id).await.unwrap(),
        None,
        "not deleted"
    );
    drop(conn);
    assert_eq!(
        take(&db, &one).await,
        None,
        "a boot may fetch it until the delete is answered"
    );
    sqlx::query("UPDATE sandboxes SET state = 'deleted' WHERE id = $1")
        .bind(one.id)
        .execute(&db)
        .await
        .unwrap();
    assert_eq!(take(&db, &one).await, Some((a, vec![own])));
    // A user's delete of a stopped sandbox (no boot, and its stop never becomes durable now):
    // collected at once, with the chunk nothing references any more.
    let two = lock(&db, &two).await;
    let deleting = go(&db, &two, SandboxState::Stopping, true).await;
    assert_eq!(take(&db, &deleting).await.map(|t| t.1), Some(vec![shared]));
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_delete_during_archiving_holds_the_stored_stop_until_the_sandbox_is_deleted(db: PgPool) {
    // The host's archive reads the stop's manifest to decide whether to upload again: one
    // collected under it would be stored again, as a copy no row names.
    let host = host(&db).await;
    let row = placed(&db, host).await;
    let stopped = go(&db, &row, SandboxState::Stopped, false).await;
    let a = SnapshotId::new();
    durable(&db, &stopped, a, &[hash('a')]).await;
    sqlx::query("UPDATE sandboxes SET state = 'archiving' WHERE id = $1")
        .bind(row.id)
        .execute(&db)
        .await
        .unwrap();
    let deleting = go(&db, &stopped, SandboxState::Stopping, true).await;
    assert_eq!(deleting.durable_snapshot, None);
    assert_eq!(
        take(&db, &deleting).await,
        None,
        "held while the archive may still read it"
    );
    sqlx::query("UPDATE sandboxes SET state = 'deleted' WHERE id = $1")
        .bind(row.id)
        .execute(&db)
        .await
        .unwrap();
    assert_eq!(take(&db, &deleting).await, Some((a, vec![hash('a')])));
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_late_stop_snapshot_no_row_names_is_collected_but_never_one_a_row_names(db: PgPool) {
    let host = host(&db).await;
    let row = placed(&db, host).await;
    let stopped = go(&db, &row, SandboxState::Stopped, false).await;
    let (named, late) = (SnapshotId::new(), SnapshotId::new());
    durable(&db, &stopped, named, &[hash('a')]).await;
    let unnamed = |snapshot: SnapshotId, chunks: Vec<String>| {
        let db = db.clone();
        async move {
            let mut tx = db.begin().await.unwrap();
            let recorded = sandboxes::supersede_unnamed(&mut tx, row.id, snapshot, &chunks)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            recorded
        }
    };
    // A report for the snapshot a row names is never handed to the collector.
    assert!(!unnamed(named, vec![hash('a')]).await);
    // A late one is, once, and is collected with its own chunks.
    assert!(unnamed(late, vec![hash('a'), hash('b')]).await);
    assert!(!unnamed(late, vec![hash('b')]).await, "recorded once");
    assert!(
        !claimable(&db, &hash('b')).await,
        "its chunks stay referenced"
    );
    assert_eq!(take(&db, &stopped).await, Some((late, vec![hash('b')])));

    // One the row names again (a host reused a stop whose report came late for its archive)
    // waits while it is named.
    let reused = SnapshotId::new();
    assert!(unnamed(reused, vec![hash('c')]).await);
    durable(&db, &stopped, reused, &[hash('c')]).await;
    assert_eq!(take(&db, &stopped).await, Some((named, vec![hash('a')])));
    assert_eq!(take(&db, &stopped).await, None, "named again: kept");
    go(&db, &stopped, SandboxState::Starting, false).await;
    assert_eq!(take(&db, &stopped).await, Some((reused, vec![hash('c')])));
}
