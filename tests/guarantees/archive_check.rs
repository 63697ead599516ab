//! Issue 14, rule 1 ("never lose the last copy"): a stored stop is judged against the insert of
//! the command that stored it (the archive, or the stop whose second result reports its
//! upload), a time no settings change moves. A chunk removal that finished after that command
//! was requested may have taken a chunk the host's upload skipped; such a copy is not recorded
//! durable (an archive's fails and the sandbox stays `stopped` with its disk), even when the row
//! changed after the removal (its `updated_at`, the reference before); a copy whose manifest the
//! object store sweep claimed first is refused too, each saying why, and so is a copy or a
//! snapshot reported longer than `chunks::REMOVAL_RETENTION` after its request (the sweep
//! forgets older finished removals, so it cannot be checked). Results are synthesized
//! (no hostd), through `berth_reconciler::results` on the real Postgres.

use berth_reconciler::results::{
    ARCHIVE_LOST_CHUNKS, ARCHIVE_MANIFEST_SWEPT, ARCHIVE_TOO_OLD, SNAPSHOT_TOO_OLD,
};
use berth_schemas::ids::{SandboxId, SnapshotId};
use berth_schemas::wire::{ResultOutcome, SnapshotStored, StopDurable};
use berth_schemas::CommandKind;
use sqlx::PgPool;

use crate::support::inproc::{self, OutboxCommand, Plane};

/// A running sandbox stopped (its stop's first result applied, `stopped`), then, after the
/// stop command's insert, a chunk removal of a chunk its upload skipped claimed and finished
/// (1 and 2 seconds on), then a settings change that moves the row's `updated_at` past it (3
/// seconds on: `store::sandboxes::update_settings` writes `updated_at = now()`, allowed while
/// `stopped` and `archiving`). With `archive`, the archive is requested before the removal.
/// The sandbox, its stop command, the command whose copy is reported, and the copy's report.
async fn removal_then_settings_change(
    plane: &Plane,
    archive: bool,
) -> (SandboxId, OutboxCommand, OutboxCommand, StopDurable) {
    let (id, stop) = plane.stopped().await;
    let reporting = if archive {
        plane.request(id, "archive").await;
        let command = plane.latest(id).await;
        assert_eq!(command.kind, CommandKind::Archive);
        assert_eq!(inproc::row(&plane.db, id).await.state, "archiving");
        command
    } else {
        stop.clone()
    };
    let skipped = "5".repeat(64);
    sqlx::query(
        "INSERT INTO chunk_removals (sha256, removing_at, removed_at)
         VALUES ($1, now() + interval '1 second', now() + interval '2 seconds')",
    )
    .bind(&skipped)
    .execute(&plane.db)
    .await
    .unwrap();
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
    (id, stop, reporting, copy)
}

/// The row's `state_reason` (an archive refused says why there and in its event).
async fn state_reason(plane: &Plane, id: SandboxId) -> Option<String> {
    sqlx::query_scalar("SELECT state_reason FROM sandboxes WHERE id = $1")
        .bind(id.as_uuid())
        .fetch_one(&plane.db)
        .await
        .unwrap()
}

/// The archive refused, `stopped` with its disk (no delete frees it), for `reason`.
async fn archive_refused(plane: &Plane, id: SandboxId, reason: &str) {
    let row = inproc::row(&plane.db, id).await;
    assert_eq!(row.state, "stopped", "a refused copy is never `archived`");
    assert_eq!(
        durable_at(plane, id).await,
        None,
        "the refused copy is not recorded durable"
    );
    let frees = inproc::commands_of(&plane.db, id)
        .await
        .into_iter()
        .filter(|c| c.kind == CommandKind::Delete)
        .count();
    assert_eq!(frees, 0, "the host keeps the disk: no delete frees it");
    assert_eq!(state_reason(plane, id).await.as_deref(), Some(reason));
}

async fn durable_at(plane: &Plane, id: SandboxId) -> Option<chrono::DateTime<chrono::Utc>> {
    sqlx::query_scalar("SELECT durable_at FROM sandboxes WHERE id = $1")
        .bind(id.as_uuid())
        .fetch_one(&plane.db)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_archive_whose_chunk_was_removed_after_it_was_requested_fails_though_the_row_changed_since(
    db: PgPool,
) {
    let plane = Plane::start(db).await;
    let (id, _, archive, copy) = removal_then_settings_change(&plane, true).await;
    plane.deliver(&archive, ResultOutcome::Durable(copy)).await;
    archive_refused(&plane, id, ARCHIVE_LOST_CHUNKS).await;
}

/// An archive's report that comes after the object store sweep claimed its manifest (the
/// report came after the sweep's grace period) is refused under the sweep's lock, and says so,
/// not that a snapshot delete took its chunks.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_archive_whose_manifest_was_swept_before_its_report_fails_saying_so(db: PgPool) {
    let plane = Plane::start(db).await;
    let (id, _, archive, copy) = removal_then_settings_change(&plane, true).await;
    let mut tx = plane.db.begin().await.unwrap();
    assert!(
        berth_store::sweep::claim_manifest(&mut tx, copy.snapshot_id)
            .await
            .unwrap(),
        "nothing names it before its report"
    );
    tx.commit().await.unwrap();
    plane.deliver(&archive, ResultOutcome::Durable(copy)).await;
    archive_refused(&plane, id, ARCHIVE_MANIFEST_SWEPT).await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_stop_whose_skipped_chunk_was_removed_after_the_stop_was_requested_is_not_durable_though_the_row_changed_since(
    db: PgPool,
) {
    let plane = Plane::start(db).await;
    let (id, stop, reporting, copy) = removal_then_settings_change(&plane, false).await;
    assert_eq!(
        reporting, stop,
        "the stop's second result reports its upload"
    );
    let snapshot = copy.snapshot_id;
    plane.deliver(&stop, ResultOutcome::Durable(copy)).await;

    let row = inproc::row(&plane.db, id).await;
    assert_eq!(row.state, "stopped");
    assert_eq!(
        durable_at(&plane, id).await,
        None,
        "a stop that may miss a chunk is never recorded durable"
    );
    assert_eq!(
        handed_to_collector(&plane, snapshot).await,
        1,
        "what its upload stored goes to the collector"
    );
}

/// A stopped sandbox, and the command whose copy is then reported (its archive with
/// `archive`, else the stop whose second result reports its upload), its insert moved back by
/// `ago` seconds on the database's clock.
async fn stopped_then_requested_ago(
    plane: &Plane,
    archive: bool,
    ago: f64,
) -> (SandboxId, OutboxCommand) {
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
    let reporting = if archive {
        plane.request(id, "archive").await;
        plane.latest(id).await
    } else {
        stop
    };
    sqlx::query(
        "UPDATE commands SET created_at = created_at - make_interval(secs => $2) WHERE id = $1",
    )
    .bind(reporting.id.as_uuid())
    .bind(ago)
    .execute(&plane.db)
    .await
    .unwrap();
    (id, reporting)
}

/// A copy of one chunk that no removal ever touched.
fn untouched_copy() -> StopDurable {
    StopDurable {
        snapshot_id: SnapshotId::new(),
        memory: false,
        stored_bytes: 1,
        chunks: vec![("6".repeat(64), 1)],
    }
}

/// The retention, plus `hours` (negative: short of it), in seconds.
fn retention_plus_hours(hours: f64) -> f64 {
    berth_store::chunks::REMOVAL_RETENTION.as_secs_f64() + hours * 3600.0
}

/// The sweep forgets removals that finished longer ago than `chunks::REMOVAL_RETENTION`, so an
/// archive reported longer than that after it was requested cannot be checked and fails saying
/// so (the sandbox keeps its disk); one reported inside it is recorded as ever.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_archive_reported_past_the_removal_retention_fails_saying_so_and_a_younger_one_archives(
    db: PgPool,
) {
    let plane = Plane::start(db).await;
    let (old, archive) = stopped_then_requested_ago(&plane, true, retention_plus_hours(1.0)).await;
    plane
        .deliver(&archive, ResultOutcome::Durable(untouched_copy()))
        .await;
    archive_refused(&plane, old, ARCHIVE_TOO_OLD).await;

    let (young, archive) =
        stopped_then_requested_ago(&plane, true, retention_plus_hours(-1.0)).await;
    plane
        .deliver(&archive, ResultOutcome::Durable(untouched_copy()))
        .await;
    assert_eq!(inproc::row(&plane.db, young).await.state, "archived");
    assert!(durable_at(&plane, young).await.is_some());
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_stop_reported_past_the_removal_retention_is_not_durable_and_a_younger_one_is(
    db: PgPool,
) {
    let plane = Plane::start(db).await;
    let (old, stop) = stopped_then_requested_ago(&plane, false, retention_plus_hours(1.0)).await;
    let copy = untouched_copy();
    let snapshot = copy.snapshot_id;
    plane.deliver(&stop, ResultOutcome::Durable(copy)).await;
    assert_eq!(inproc::row(&plane.db, old).await.state, "stopped");
    assert_eq!(durable_at(&plane, old).await, None);
    assert_eq!(
        handed_to_collector(&plane, snapshot).await,
        1,
        "what its upload stored goes to the collector"
    );

    let (young, stop) = stopped_then_requested_ago(&plane, false, retention_plus_hours(-1.0)).await;
    plane
        .deliver(&stop, ResultOutcome::Durable(untouched_copy()))
        .await;
    assert!(durable_at(&plane, young).await.is_some());
}

/// A snapshot's upload reported longer than `chunks::REMOVAL_RETENTION` after its row was
/// inserted fails saying so: the removals that finished meanwhile may be forgotten.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_snapshot_reported_past_the_removal_retention_fails_saying_so(db: PgPool) {
    let plane = Plane::start(db).await;
    let id = plane.create().await;
    let create = plane.latest(id).await;
    plane
        .deliver(&create, inproc::succeeded(CommandKind::Create))
        .await;
    let reply = plane
        .api
        .call(
            &plane.org.key,
            axum::http::Method::POST,
            &format!("/v1/sandboxes/{id}/snapshot"),
            None,
            None,
        )
        .await;
    assert_eq!(reply.status, 202, "{}", reply.body);
    let snapshot = uuid::Uuid::parse_str(reply.body["id"].as_str().unwrap()).unwrap();
    sqlx::query(
        "UPDATE snapshots SET created_at = created_at - make_interval(secs => $2) WHERE id = $1",
    )
    .bind(snapshot)
    .bind(retention_plus_hours(1.0))
    .execute(&plane.db)
    .await
    .unwrap();
    let command = plane.latest(id).await;
    assert_eq!(command.kind, CommandKind::Snapshot);
    plane
        .deliver(
            &command,
            ResultOutcome::Snapshotted(SnapshotStored {
                memory: false,
                logical_bytes: 1,
                stored_bytes: 1,
                new_bytes: 1,
                paused_ms: 1,
                chunks: vec![("7".repeat(64), 1)],
            }),
        )
        .await;
    let (state, reason): (String, Option<String>) =
        sqlx::query_as("SELECT state, reason FROM snapshots WHERE id = $1")
            .bind(snapshot)
            .fetch_one(&plane.db)
            .await
            .unwrap();
    assert_eq!(state, "failed");
    assert_eq!(reason.as_deref(), Some(SNAPSHOT_TOO_OLD));
}

/// How many times the stored copy `snapshot` was handed to the collector (`durable_superseded`).
async fn handed_to_collector(plane: &Plane, snapshot: SnapshotId) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM durable_superseded WHERE snapshot_id = $1")
        .bind(snapshot.as_uuid())
        .fetch_one(&plane.db)
        .await
        .unwrap()
}
