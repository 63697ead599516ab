//! What the store-wide sweep of the object store's orphans (issue 14, run by the API's
//! collector) asks the database: which listed manifests and chunks nothing names, the claim of
//! a manifest's removal (`manifest_removals`, migration 0040) and the one-sweep-at-a-time lock.
//! Chunks go through [`crate::chunks`]'s queue, claim and finish like a snapshot delete's
//! ([`crate::chunks::queue_swept`]).
//!
//! # Guarantees
//! - A manifest is claimed only while nothing names it: no snapshot row, no sandbox's
//!   `durable_snapshot` or `seed_snapshot`, no superseded stop awaiting collection, no open
//!   command's `snapshot_id` (an archive, migrate, unarchive, restore or clone being fetched).
//!   The claim and [`manifest_removed`] (which a host's durability report checks before it is
//!   recorded) take the same per-snapshot advisory transaction lock: whichever commits second
//!   sees the other, so a report the sweep overtook is never recorded durable, and a manifest a
//!   report named first is never claimed.
//! - A claimed manifest stays claimed ([`manifest_removed`] stays true) until its removal
//!   finished more than [`crate::chunks::REMOVAL_RETENTION`] ago, and a day's margin more
//!   ([`prune_removed`], [`crate::chunks::PRUNE_AFTER`]): a report that comes later still finds
//!   it, or is refused as requested too long ago.
//!
//! # Assumptions
//! A report names only a snapshot its host stored under a fresh id (never a snapshot row's id),
//! and every other name of a manifest is written from an existing name (a superseded stop from
//! a row's durable stop, a command from a row or a snapshot), so a durable write is the only
//! way a manifest nothing named becomes named.

use berth_schemas::ids::SnapshotId;
use sqlx::PgConnection;

use crate::op::{timed, Op};
use crate::StoreError;

/// The advisory session lock one sweep holds on its own connection (ASCII "BERTHSWP"): a
/// second process's sweep skips its turn while it is held.
pub const SWEEP_LOCK: i64 = 0x4245_5254_4853_5750;

/// The per-snapshot advisory transaction lock of [`claim_manifest`] and [`manifest_removed`].
const LOCK_MANIFEST: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended('manifest:' || $1::text, 0))";

/// The condition "nothing names manifest `$1`" (see the module's guarantees).
const UNNAMED: &str = "NOT EXISTS (SELECT 1 FROM snapshots s WHERE s.id = $1)
     AND NOT EXISTS (SELECT 1 FROM sandboxes x WHERE x.durable_snapshot = $1)
     AND NOT EXISTS (SELECT 1 FROM sandboxes x WHERE x.seed_snapshot = $1)
     AND NOT EXISTS (SELECT 1 FROM durable_superseded d WHERE d.snapshot_id = $1)
     AND NOT EXISTS (SELECT 1 FROM commands m
                      WHERE m.snapshot_id = $1 AND m.completed_at IS NULL)";

/// `SELECT candidate.v FROM unnest($1::{array}) AS candidate(v) WHERE {condition}`: of the
/// candidates bound as `$1` (an `array` of them, e.g. `uuid[]`), those for which `condition`,
/// written about one candidate as `$1` ([`UNNAMED`], [`crate::chunks::UNREFERENCED`]), holds.
/// The sweep's looks and the claims that check again under their locks read the same
/// condition. (The alias `candidate` is one no condition uses for its own tables.)
fn candidates_where(array: &str, condition: &str) -> String {
    format!(
        "SELECT candidate.v FROM unnest($1::{array}) AS candidate(v) WHERE {}",
        condition.replace("$1", "candidate.v")
    )
}

/// Takes the sweep's session lock on `conn` if no other session holds it; whether it did.
/// Use a connection of its own and close it after (its end releases the lock, also when the
/// sweep is cut short).
pub async fn try_lock(conn: &mut PgConnection) -> Result<bool, StoreError> {
    timed(
        Op::ObjectSweep,
        sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(SWEEP_LOCK)
            .fetch_one(conn),
    )
    .await
}

/// Of the listed manifests `candidates`, those nothing names now (see the module's
/// guarantees). A look only: [`claim_manifest`] checks again under the lock.
pub async fn unnamed_manifests(
    conn: &mut PgConnection,
    candidates: &[SnapshotId],
) -> Result<Vec<SnapshotId>, StoreError> {
    timed(
        Op::ObjectSweep,
        sqlx::query_scalar(&candidates_where("uuid[]", UNNAMED))
            .bind(candidates)
            .fetch_all(conn),
    )
    .await
}

/// Of the kept manifests `ids`, those whose every chunk the database already references (a
/// ready snapshot's `snapshot_chunks`, a sandbox's durable stop's `durable_chunks`, a
/// superseded stop's `superseded_chunks`): the sweep need not read them to know their chunks.
pub async fn referenced_in_rows(
    conn: &mut PgConnection,
    ids: &[SnapshotId],
) -> Result<Vec<SnapshotId>, StoreError> {
    timed(
        Op::ObjectSweep,
        sqlx::query_scalar(
            "SELECT c.id FROM unnest($1::uuid[]) AS c(id)
              WHERE EXISTS (SELECT 1 FROM snapshots s WHERE s.id = c.id AND s.state = 'ready')
                 OR EXISTS (SELECT 1 FROM sandboxes x
                             WHERE x.durable_snapshot = c.id AND x.durable_at IS NOT NULL)
                 OR EXISTS (SELECT 1 FROM durable_superseded d WHERE d.snapshot_id = c.id)",
        )
        .bind(ids)
        .fetch_all(conn),
    )
    .await
}

/// Claims the manifest of `snapshot` for removal if nothing names it, in the caller's
/// transaction, under the per-snapshot lock; whether it is claimed (also when a sweep claimed
/// it before: its object was stored again, or a remover stopped before removing it). Commit
/// before removing the object, then [`finish_manifest`].
pub async fn claim_manifest(
    conn: &mut PgConnection,
    snapshot: SnapshotId,
) -> Result<bool, StoreError> {
    timed(
        Op::ObjectSweep,
        sqlx::query(LOCK_MANIFEST)
            .bind(snapshot)
            .execute(&mut *conn),
    )
    .await?;
    let claimed = timed(
        Op::ObjectSweep,
        sqlx::query(&format!(
            "INSERT INTO manifest_removals (snapshot_id) SELECT $1 WHERE {UNNAMED}
             ON CONFLICT (snapshot_id) DO UPDATE
                SET removing_at = clock_timestamp(), removed_at = NULL"
        ))
        .bind(snapshot)
        .execute(conn),
    )
    .await?;
    Ok(claimed.rows_affected() > 0)
}

/// Stamps the claimed manifest of `snapshot` as removed from the object store.
pub async fn finish_manifest(
    conn: &mut PgConnection,
    snapshot: SnapshotId,
) -> Result<(), StoreError> {
    timed(
        Op::ObjectSweep,
        sqlx::query(
            "UPDATE manifest_removals SET removed_at = clock_timestamp()
              WHERE snapshot_id = $1 AND removed_at IS NULL",
        )
        .bind(snapshot)
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// Whether the sweep claimed `snapshot`'s manifest for removal (it may be gone from the store),
/// under the per-snapshot lock held until the caller's transaction ends: call it in the
/// transaction that would record the snapshot durable, and record nothing when true. Call it
/// before that transaction's [`crate::chunks::check_for_ready`]: a removal's record pruned
/// ([`prune_removed`]) before this look is covered by that check's age refusal only when its
/// clock is read after.
pub async fn manifest_removed(
    conn: &mut PgConnection,
    snapshot: SnapshotId,
) -> Result<bool, StoreError> {
    timed(
        Op::ObjectSweep,
        sqlx::query(LOCK_MANIFEST)
            .bind(snapshot)
            .execute(&mut *conn),
    )
    .await?;
    timed(
        Op::ObjectSweep,
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM manifest_removals WHERE snapshot_id = $1)",
        )
        .bind(snapshot)
        .fetch_one(conn),
    )
    .await
}

/// Of the listed chunks `candidates`, those no row references (`snapshot_chunks`,
/// `durable_chunks`, `superseded_chunks`). A look only: [`crate::chunks::claim`] checks the
/// same condition again.
pub async fn unreferenced_chunks(
    conn: &mut PgConnection,
    candidates: &[String],
) -> Result<Vec<String>, StoreError> {
    timed(
        Op::ObjectSweep,
        sqlx::query_scalar(&candidates_where("text[]", crate::chunks::UNREFERENCED))
            .bind(candidates)
            .fetch_all(conn),
    )
    .await
}

/// Deletes up to `limit` manifest removals that finished (`removed_at`: the object is gone)
/// more than [`crate::chunks::PRUNE_AFTER`] ago ([`crate::chunks::REMOVAL_RETENTION`] and a
/// day's margin for the database's clock stepping), on the database's clock; how many. A
/// claim not finished stays (a later look claims it again and removes the object).
///
/// Why such a row is no longer needed: it is read only by [`manifest_removed`], for a
/// durability report naming its snapshot, and by a claim of it again (which inserts a fresh
/// row as well). A report names a snapshot its host stored under a fresh id after its command
/// was inserted; the sweep listed that manifest before claiming it, so the command was
/// inserted before the claim, before the removal finished, hence more than the retention
/// before now. The report's transaction, having read no row here, then refuses it in
/// [`crate::chunks::check_for_ready`], whose clock is read after this look: a report is never
/// recorded durable for a manifest this deleted the record of.
pub async fn prune_removed(conn: &mut PgConnection, limit: i64) -> Result<u64, StoreError> {
    let pruned = timed(
        Op::ObjectSweep,
        sqlx::query(
            "DELETE FROM manifest_removals
              WHERE snapshot_id IN (SELECT snapshot_id FROM manifest_removals
                                     WHERE removed_at < clock_timestamp()
                                                        - make_interval(secs => $1)
                                     LIMIT $2)
                AND removed_at < clock_timestamp() - make_interval(secs => $1)",
        )
        .bind(crate::chunks::PRUNE_AFTER.as_secs_f64())
        .bind(limit)
        .execute(conn),
    )
    .await?;
    Ok(pruned.rows_affected())
}
