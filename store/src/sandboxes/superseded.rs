//! Superseded durable stop snapshots (issue 14, migration 0034). A row names only its newest
//! durable stop; the one a start (or a migrate or unarchive that ran), a newer durable stop or
//! a delete supersedes is recorded by [`supersede`] in the same transaction, its chunk
//! references moved along, and collected by the API's collector: [`take_superseded`] picks one
//! whose sandbox is past any upload or boot that may still need its content, and returns its
//! manifest with the chunks nothing else references (for the caller to queue for removal,
//! `crate::chunks::queue`, and remove from the store).
//!
//! Why the hold: a stop's upload is a full capture that skips every chunk the store holds
//! already, mostly the previous stop's. While the sandbox is `stopping`, or `stopped` (or
//! `archiving`) and not durable yet, that upload may be counting on them (a deleted sandbox's
//! never becomes durable). A delete during `migrating` or `unarchiving` may still have the new
//! host fetching the stop, and one during `archiving` the host's archive reading its manifest
//! (missing, it would upload the disk again as a copy no row names): that one waits until the
//! sandbox is `deleted`. The claim of
//! `chunk_removals` and `crate::chunks::check_for_ready` (at the durable write) cover the rest.

use berth_schemas::ids::SnapshotId;
use berth_schemas::{Generation, SandboxId};
use sqlx::PgConnection;

use crate::op::{timed, Op};
use crate::StoreError;

/// Moves sandbox `id`'s durable stop snapshot (if it names one other than `keep`) to the
/// superseded ones awaiting collection, with its chunk references, and clears `durable_at` and
/// `durable_snapshot`, in the caller's transaction; the snapshot moved. Fenced on `generation`
/// when given (nothing moves at another generation). `until_deleted`: a boot may still be
/// fetching it (a delete during `migrating` or `unarchiving`), so it waits until the sandbox is
/// `deleted`. Lock the row first.
pub async fn supersede(
    conn: &mut PgConnection,
    id: SandboxId,
    generation: Option<Generation>,
    keep: Option<SnapshotId>,
    until_deleted: bool,
) -> Result<Option<SnapshotId>, StoreError> {
    let cleared: Option<SnapshotId> = timed(
        Op::SandboxDurable,
        sqlx::query_scalar(
            "WITH old AS (SELECT id, durable_snapshot FROM sandboxes
                           WHERE id = $1 AND durable_snapshot IS NOT NULL
                             AND durable_snapshot IS DISTINCT FROM $3
                             AND ($2::int8 IS NULL OR generation = $2)
                           FOR UPDATE)
             UPDATE sandboxes s SET durable_at = NULL, durable_snapshot = NULL
               FROM old WHERE s.id = old.id
             RETURNING old.durable_snapshot",
        )
        .bind(id)
        .bind(generation)
        .bind(keep)
        .fetch_optional(&mut *conn),
    )
    .await?;
    let Some(snapshot) = cleared else {
        return Ok(None);
    };
    record(conn, id, snapshot, until_deleted).await?;
    Ok(Some(snapshot))
}

/// Records `snapshot`, sandbox `id`'s durable stop until now, as superseded, moving the
/// sandbox's chunk references (`durable_chunks`) to it, in the caller's transaction.
pub(super) async fn record(
    conn: &mut PgConnection,
    id: SandboxId,
    snapshot: SnapshotId,
    until_deleted: bool,
) -> Result<(), StoreError> {
    timed(
        Op::SandboxDurable,
        sqlx::query(
            "INSERT INTO durable_superseded (snapshot_id, sandbox_id, until_deleted)
             VALUES ($1, $2, $3) ON CONFLICT (snapshot_id) DO NOTHING",
        )
        .bind(snapshot)
        .bind(id)
        .bind(until_deleted)
        .execute(&mut *conn),
    )
    .await?;
    timed(
        Op::SandboxDurable,
        sqlx::query(
            "WITH mine AS (DELETE FROM durable_chunks WHERE sandbox_id = $1 RETURNING sha256)
             INSERT INTO superseded_chunks (snapshot_id, sha256)
             SELECT $2, sha256 FROM mine ON CONFLICT DO NOTHING",
        )
        .bind(id)
        .bind(snapshot)
        .execute(&mut *conn),
    )
    .await?;
    Ok(())
}

/// Records `snapshot`, a stop snapshot of sandbox `id` that its host stored but that no row
/// names (its durability report came after the sandbox moved on: a start cancelled the stop's
/// upload, which finished anyway, or a delete), as superseded with its chunk references
/// `chunks`, so the collector removes it like any other; whether it was recorded. Nothing is
/// recorded twice, nor for a snapshot any sandbox names as its durable stop or a snapshot row
/// has (a report is a host's word: it never gets another sandbox's content collected; that
/// look uses the partial index `sandboxes_durable_snapshot`, migration 0038). Lock the row
/// first.
pub async fn supersede_unnamed(
    conn: &mut PgConnection,
    id: SandboxId,
    snapshot: SnapshotId,
    chunks: &[String],
) -> Result<bool, StoreError> {
    let inserted = timed(
        Op::SandboxDurable,
        sqlx::query(
            "INSERT INTO durable_superseded (snapshot_id, sandbox_id)
             SELECT $1, $2
              WHERE NOT EXISTS (SELECT 1 FROM sandboxes WHERE durable_snapshot = $1)
                AND NOT EXISTS (SELECT 1 FROM snapshots WHERE id = $1)
             ON CONFLICT (snapshot_id) DO NOTHING",
        )
        .bind(snapshot)
        .bind(id)
        .execute(&mut *conn),
    )
    .await?;
    if inserted.rows_affected() == 0 {
        return Ok(false);
    }
    timed(
        Op::SandboxDurable,
        sqlx::query(
            "INSERT INTO superseded_chunks (snapshot_id, sha256)
             SELECT $1, unnest($2::text[]) ON CONFLICT DO NOTHING",
        )
        .bind(snapshot)
        .bind(chunks)
        .execute(conn),
    )
    .await?;
    Ok(true)
}

/// A superseded durable stop snapshot [`take_superseded`] took for collection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superseded {
    /// Its manifest.
    pub snapshot: SnapshotId,
    /// The sandbox whose stop it was.
    pub sandbox: SandboxId,
    /// Its chunks that no snapshot, durable stop or other superseded snapshot references.
    pub orphans: Vec<String>,
}

/// Takes, in the caller's transaction, the oldest superseded stop snapshot (of `sandbox` when
/// given) that may be collected now: its sandbox (if its row is still there) is being deleted
/// (and, when a boot may still fetch it, `deleted`), or is neither `stopping` nor
/// `stopped`/`archiving` without a durable stop (the next stop's upload), and that its row does
/// not name as its durable stop again (an archive of a host older than wire version 17 could
/// report a stop whose report came late as its copy); rows another collector holds are skipped.
/// Forgets it and its chunk references; commit only once its manifest is removed from the
/// store (a rollback leaves it for the next look).
pub async fn take_superseded(
    conn: &mut PgConnection,
    sandbox: Option<SandboxId>,
) -> Result<Option<Superseded>, StoreError> {
    let taken: Option<(SnapshotId, SandboxId)> = timed(
        Op::SandboxDurable,
        sqlx::query_as(
            "SELECT x.snapshot_id, x.sandbox_id FROM durable_superseded x
               LEFT JOIN sandboxes s ON s.id = x.sandbox_id
              WHERE ($1::uuid IS NULL OR x.sandbox_id = $1)
                AND x.snapshot_id IS DISTINCT FROM s.durable_snapshot
                AND (s.id IS NULL
                     OR (s.deleted_at IS NOT NULL AND (NOT x.until_deleted OR s.state = 'deleted'))
                     OR (s.deleted_at IS NULL
                         AND NOT (s.state = 'stopping'
                                  OR (s.state IN ('stopped', 'archiving')
                                      AND s.durable_at IS NULL))))
              ORDER BY x.superseded_at LIMIT 1
              FOR UPDATE OF x SKIP LOCKED",
        )
        .bind(sandbox)
        .fetch_optional(&mut *conn),
    )
    .await?;
    let Some((snapshot, sandbox)) = taken else {
        return Ok(None);
    };
    let orphans: Vec<String> = timed(
        Op::SandboxDurable,
        sqlx::query_scalar(
            "WITH mine AS (DELETE FROM superseded_chunks WHERE snapshot_id = $1 RETURNING sha256)
             SELECT m.sha256 FROM mine m
              WHERE NOT EXISTS (SELECT 1 FROM snapshot_chunks c WHERE c.sha256 = m.sha256)
                AND NOT EXISTS (SELECT 1 FROM durable_chunks d WHERE d.sha256 = m.sha256)
                AND NOT EXISTS (SELECT 1 FROM superseded_chunks o
                                 WHERE o.sha256 = m.sha256 AND o.snapshot_id <> $1)",
        )
        .bind(snapshot)
        .fetch_all(&mut *conn),
    )
    .await?;
    timed(
        Op::SandboxDurable,
        sqlx::query("DELETE FROM durable_superseded WHERE snapshot_id = $1")
            .bind(snapshot)
            .execute(&mut *conn),
    )
    .await?;
    Ok(Some(Superseded {
        snapshot,
        sandbox,
        orphans,
    }))
}

/// How many superseded stop snapshots of `sandbox` await collection (tests, diagnostics).
pub async fn superseded_count(
    conn: &mut PgConnection,
    sandbox: SandboxId,
) -> Result<i64, StoreError> {
    timed(
        Op::SandboxDurable,
        sqlx::query_scalar("SELECT count(*) FROM durable_superseded WHERE sandbox_id = $1")
            .bind(sandbox)
            .fetch_one(conn),
    )
    .await
}
