//! Issue 14, rule 1 ("never lose the last copy"): an archive's copy is judged against the
//! archive command's insert, a time no settings change moves. A chunk removal that finished
//! after the archive was requested may have taken a chunk the host's upload skipped; such a
//! copy is refused and the sandbox stays `stopped` with its disk, even when the row changed
//! after the removal (its `updated_at`, the reference before). Results are synthesized (no
//! hostd), through `berth_reconciler::results` on the real Postgres.

use berth_schemas::ids::SnapshotId;
use berth_schemas::wire::{ResultOutcome, StopDurable};
use berth_schemas::CommandKind;
use sqlx::PgPool;

use crate::support::inproc::{self, Plane};

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_archive_whose_chunk_was_removed_after_it_was_requested_fails_though_the_row_changed_since(
    db: PgPool,
) {
    let plane = Plane::start(db).await;
    let id = plane.create().await;
    let create = plane.latest(id).await;
    plane
        .deliver(&create, inproc::succeeded(CommandKind::Create))
        .await;
    plane.request(id, "stop").await;
    let stop = plane.latest(id).await;
    plane
        .deliver(&stop, inproc::succeeded(CommandKind::Stop))
        .await;
    plane.request(id, "archive").await;
    let archive = plane.latest(id).await;
    assert_eq!(archive.kind, CommandKind::Archive);
    assert_eq!(inproc::row(&plane.db, id).await.state, "archiving");

    // After the archive's insert, a snapshot delete's removal of a chunk the host's upload
    // skipped (it was in the store when the host looked) claims it and finishes...
    let skipped = "5".repeat(64);
    sqlx::query(
        "INSERT INTO chunk_removals (sha256, removing_at, removed_at)
         VALUES ($1, now() + interval '1 second', now() + interval '2 seconds')",
    )
    .bind(&skipped)
    .execute(&plane.db)
    .await
    .unwrap();
    // ...and then the user changes a setting, which moves the row's `updated_at` past it
    // (`store::sandboxes::update_settings` writes `updated_at = now()`, allowed while
    // `archiving`).
    sqlx::query("UPDATE sandboxes SET updated_at = now() + interval '3 seconds' WHERE id = $1")
        .bind(id.as_uuid())
        .execute(&plane.db)
        .await
        .unwrap();

    let copy = StopDurable {
        snapshot_id: SnapshotId::new(),
        memory: false,
        stored_bytes: 1,
        chunks: vec![(skipped, 1)],
    };
    plane.deliver(&archive, ResultOutcome::Durable(copy)).await;

    let row = inproc::row(&plane.db, id).await;
    assert_eq!(
        row.state, "stopped",
        "a copy missing a chunk is never `archived`"
    );
    let durable: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT durable_at FROM sandboxes WHERE id = $1")
            .bind(id.as_uuid())
            .fetch_one(&plane.db)
            .await
            .unwrap();
    assert_eq!(durable, None, "the refused copy is not recorded durable");
    let frees = inproc::commands_of(&plane.db, id)
        .await
        .into_iter()
        .filter(|c| c.kind == CommandKind::Delete)
        .count();
    assert_eq!(frees, 0, "the host keeps the disk: no delete frees it");
}
