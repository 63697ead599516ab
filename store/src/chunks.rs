//! The removal of stored chunks no snapshot references (`chunk_removals`, migration 0020),
//! safe against a snapshot being uploaded at the same time that reuses them.
//!
//! The race: a snapshot delete finds chunk `X` referenced by no other ready snapshot and removes
//! it from the object store, while another snapshot's upload (still `creating`, so it holds no
//! references yet) skipped `X` because the store held it, or reused it from its parent. That
//! snapshot would become `ready` naming a chunk that is gone.
//!
//! The protocol:
//! 1. [`queue`]: the delete queues its orphaned chunks in its own transaction.
//! 2. [`claim`]: a remover claims a queued chunk only while no snapshot references it (nor a
//!    durable stop snapshot, `durable_chunks`, nor a superseded one awaiting collection,
//!    `superseded_chunks`), and
//!    commits before it removes the object; [`finish`] stamps when the object is gone.
//! 3. [`check_for_ready`]: a snapshot settling `ready` locks the rows of its chunks, in its
//!    transaction. A queued, unclaimed row is taken back (the chunk is referenced again, and a
//!    later claim finds that reference). A claimed row whose removal had not finished before
//!    the snapshot was requested means the chunk may be gone although its upload saw it:
//!    that snapshot must fail. A removal finished before the request is harmless: the upload
//!    looked after it and stored the chunk again.
//! 4. [`prune_finished`]: a finished row is remembered for [`REMOVAL_RETENTION`] (7 days) and
//!    a day more ([`PRUNE_AFTER`]), and [`check_for_ready`] refuses a snapshot or durable stop
//!    requested longer ago than the retention, so the rows it would need are always there.
//!
//! # How a claim and a settling snapshot are ordered
//! A settle's references (`snapshot_chunks`, `durable_chunks`) are inserted in its transaction
//! and invisible to every other one until it commits, and a settle may find no removal row to
//! lock at all: the chunk was still referenced by an older snapshot when it checked, and a
//! delete of that snapshot queued it after. Row locks alone then order nothing: the claim's
//! reference check would not see the uncommitted reference, claim, and the object would go
//! under a snapshot about to commit `ready`. So the two take one advisory transaction lock,
//! [`CLAIM_LOCK`]:
//! - [`check_for_ready`] takes it SHARED before it looks, and its transaction (which writes the
//!   references) holds it to commit. Settles never wait for each other.
//! - [`claim_at`] takes it EXCLUSIVELY, in a transaction of its own (a savepoint if the caller
//!   is in one), before its reference check, and holds it to commit (the claim's commit).
//!
//! Whichever takes the lock second waits for the other's commit, and then looks with a fresh
//! statement, hence (READ COMMITTED) a fresh snapshot that sees what the first committed:
//! - the settle first: the claim's check runs after the settle committed, sees its references
//!   and does not claim (it drops the queued row instead: the chunk is referenced);
//! - the claim first: the settle's check runs after the claim committed, finds the claimed row
//!   and fails (or, finished before its request, harmlessly takes it back).
//!
//! [`reclaim_at`] needs no lock: it judges no reference, it takes over a row claimed and
//! unfinished since a claim that was so ordered, and every check since has found it claimed.
//!
//! The store-wide sweep of orphans (`crate::sweep`, issue 14) removes chunks nothing names
//! through the same three steps ([`queue_swept`], then [`claim`], [`finish`]): a chunk it lists
//! may be one an upload in flight skipped because the store held it (its last-modified time is
//! then old and says nothing), and only a claimed row tells that upload's check it may be gone.
//! A claim whose remover died before [`finish`] is taken over ([`stale_claims`], [`reclaim`])
//! and the object removed again: a claimed row already fails every snapshot or durable stop
//! that references the chunk and was requested before it finishes, so nothing can have come to
//! count on it meanwhile. The remover it took over is fenced by time: every remover deletes only
//! within its [`delete_budget`] of its claim, which ends well before [`STALE_CLAIM`], so its
//! delete can never land after the takeover finished and an upload stored the chunk again.

use std::time::{Duration, Instant};

use berth_schemas::ids::SnapshotId;
use chrono::{DateTime, Utc};
use sqlx::{Connection, PgConnection};

use crate::op::{timed, Op};
use crate::StoreError;

/// The condition "no row references chunk `$1`": no snapshot's `snapshot_chunks`, no durable
/// stop's `durable_chunks`, no superseded stop's `superseded_chunks` awaiting collection. What
/// [`claim`] requires, and what the sweep's look asks first (`crate::sweep::unreferenced_chunks`).
pub(crate) const UNREFERENCED: &str =
    "NOT EXISTS (SELECT 1 FROM snapshot_chunks c WHERE c.sha256 = $1)
     AND NOT EXISTS (SELECT 1 FROM durable_chunks d WHERE d.sha256 = $1)
     AND NOT EXISTS (SELECT 1 FROM superseded_chunks x WHERE x.sha256 = $1)";

/// The advisory lock key ordering [`claim_at`] (exclusive) against [`check_for_ready`]
/// (shared), ASCII "BERTHCHK" (see the module doc). Distinct from the other constant keys,
/// `crate::sweep::SWEEP_LOCK` ("BERTHSWP") and `crate::events::EVENTS_SEQ_LOCK` ("BERTHSEQ");
/// the hashed keys (per-snapshot manifest locks, idempotency keys) are 64-bit hashes.
pub const CLAIM_LOCK: i64 = 0x4245_5254_4843_484B;

/// How long a finished removal is remembered, on the database's clock: [`prune_finished`]
/// deletes a `chunk_removals` row that finished longer ago (and `crate::sweep::prune_removed`
/// a `manifest_removals` row; both with a day's margin, [`PRUNE_AFTER`]), and
/// [`check_for_ready`] refuses every snapshot or durable stop requested longer ago, so no
/// check ever needs a row that is gone. A report that takes longer
/// than this from its request (a snapshot row's insert, a stop's or an archive's command
/// insert) to being applied is refused: its snapshot fails, its stop is not recorded durable
/// (the next archive uploads again). One constant, not a setting: the API prunes and the
/// reconciler checks, and the two must never disagree.
pub const REMOVAL_RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// How long after it finished a removal row is actually deleted ([`prune_finished`],
/// `crate::sweep::prune_removed`): [`REMOVAL_RETENTION`] plus one day. The check refuses at the
/// retention, the prune deletes only a day later, so the argument "a pruned row finished more
/// than the retention before the check's clock" survives a database clock that steps ahead
/// (the prune then runs early, on the fast clock) and back (the check then reads a clock behind
/// the prune's): a step of up to a day can no longer let a report pass whose row was pruned.
pub const PRUNE_AFTER: Duration = Duration::from_secs(REMOVAL_RETENTION.as_secs() + 24 * 60 * 60);

/// Queues `hashes` (chunks a delete just orphaned) for removal, in the caller's transaction.
/// A row already there is left as it is:
/// - queued: it stays queued (a remover claims it once nothing references it);
/// - claimed and not finished: its remover (or a takeover, [`reclaim`]) is removing the object;
///   reset to queued, a settling snapshot would take it back while the object goes;
/// - finished: the object was removed at `removed_at`. A snapshot or durable stop requested
///   before then that skipped the chunk must still see that ([`check_for_ready`]); reset, it
///   would take the row back and name a chunk that is gone. (Once [`prune_finished`] deleted
///   it, past [`REMOVAL_RETENTION`], every such request is refused as too old, and a fresh
///   queued row is inserted.) (A reference can meet a finished
///   row without that check: a late stop report's chunks go to the collector as a superseded
///   stop, `crate::sandboxes::supersede_unnamed`.) If the chunk was stored again since, the
///   store-wide sweep finds it listed and queues it afresh ([`queue_swept`]).
pub async fn queue(conn: &mut PgConnection, hashes: &[String]) -> Result<(), StoreError> {
    timed(
        Op::ChunkRemoval,
        sqlx::query(
            "INSERT INTO chunk_removals (sha256) SELECT unnest($1::text[])
             ON CONFLICT (sha256) DO NOTHING",
        )
        .bind(hashes)
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// The database's clock now (`clock_timestamp()`): the sweep reads it before it lists the
/// chunks, for [`queue_swept`].
pub async fn clock(conn: &mut PgConnection) -> Result<DateTime<Utc>, StoreError> {
    timed(
        Op::ChunkRemoval,
        sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(conn),
    )
    .await
}

/// Queues `hashes` (chunks the sweep found stored and named by nothing, in a listing begun at
/// `listed_at` on the database's clock, [`clock`]) for removal, in the caller's transaction,
/// without disturbing a claim in progress:
/// - a row already queued stays as it is;
/// - a claimed row whose removal has not finished stays claimed (its remover, or [`reclaim`],
///   finishes it; reset, a settling snapshot would take it back while the object is being
///   removed);
/// - a removal finished before `listed_at` is queued afresh: its object was deleted before the
///   listing began and the listing still showed it, so it was stored again since;
/// - a removal finished at or after `listed_at` stays finished: the listing may have seen the
///   object before that removal deleted it, and a snapshot that skipped the chunk must still
///   find the removal when it settles.
pub async fn queue_swept(
    conn: &mut PgConnection,
    hashes: &[String],
    listed_at: DateTime<Utc>,
) -> Result<(), StoreError> {
    timed(
        Op::ChunkRemoval,
        sqlx::query(
            "INSERT INTO chunk_removals (sha256) SELECT unnest($1::text[])
             ON CONFLICT (sha256) DO UPDATE
                SET queued_at = clock_timestamp(), removing_at = NULL, removed_at = NULL
              WHERE chunk_removals.removed_at < $2",
        )
        .bind(hashes)
        .bind(listed_at)
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// How long a chunk removal may stay claimed and unfinished before the store-wide sweep takes
/// it over ([`stale_claims`], [`reclaim`]). Every remover reads it too ([`delete_budget`]): one
/// age for both sides, so a remover never deletes after a takeover could have finished and an
/// upload stored the chunk again.
pub const STALE_CLAIM: Duration = Duration::from_secs(60 * 60);

/// How long a remover that claimed (or took over) a chunk's removal at `claimed` may still
/// spend deleting its object: `None` once more than half of [`STALE_CLAIM`] has passed (delete
/// nothing and leave the row claimed: a takeover finishes it), else a quarter of it, the
/// timeout to put on the delete. Note `claimed` before the claim's statement goes out, so the
/// database's `removing_at` is never earlier. A delete so bounded lands within three quarters
/// of [`STALE_CLAIM`] of the claim, before any takeover of it can claim again.
pub fn delete_budget(claimed: Instant) -> Option<Duration> {
    budget_after(claimed.elapsed())
}

/// [`delete_budget`] for a claim noted `elapsed` ago.
fn budget_after(elapsed: Duration) -> Option<Duration> {
    (elapsed <= STALE_CLAIM / 2).then_some(STALE_CLAIM / 4)
}

/// Up to `limit` chunks whose removal was claimed more than [`STALE_CLAIM`] ago and never
/// finished (the remover died, or its store failed, or it stalled past its
/// [`delete_budget`]), oldest first.
pub async fn stale_claims(conn: &mut PgConnection, limit: i64) -> Result<Vec<String>, StoreError> {
    timed(
        Op::ChunkRemoval,
        sqlx::query_scalar(
            "SELECT sha256 FROM chunk_removals
              WHERE removing_at < clock_timestamp() - make_interval(secs => $1)
                AND removed_at IS NULL
              ORDER BY removing_at LIMIT $2",
        )
        .bind(STALE_CLAIM.as_secs_f64())
        .bind(limit)
        .fetch_all(conn),
    )
    .await
}

/// Takes over the stale claim of `hash` (claimed more than [`STALE_CLAIM`] ago, not
/// finished); whether this caller holds it now (one of several retriers does). Commit, remove
/// the object again within its [`delete_budget`], then [`finish`]. The remover whose claim it
/// takes over deletes nothing any more (its budget ran out at half of [`STALE_CLAIM`]), so the
/// two never remove it at once, the second after an upload stored it again.
pub async fn reclaim(conn: &mut PgConnection, hash: &str) -> Result<bool, StoreError> {
    Ok(reclaim_at(conn, hash).await?.is_some())
}

/// [`reclaim`], returning the claim's time (`removing_at`), the token [`still_claimed`] and
/// [`finish_claimed`] check; `None` when this caller does not hold it.
pub async fn reclaim_at(
    conn: &mut PgConnection,
    hash: &str,
) -> Result<Option<DateTime<Utc>>, StoreError> {
    timed(
        Op::ChunkRemoval,
        sqlx::query_scalar(
            "UPDATE chunk_removals SET removing_at = clock_timestamp()
              WHERE sha256 = $1 AND removed_at IS NULL
                AND removing_at < clock_timestamp() - make_interval(secs => $2)
             RETURNING removing_at",
        )
        .bind(hash)
        .bind(STALE_CLAIM.as_secs_f64())
        .fetch_optional(conn),
    )
    .await
}

/// Claims the queued chunk `hash` for removal, if no snapshot references it and nobody claimed
/// it; whether it was claimed. Commits the claim itself (a savepoint only, if the caller is in
/// a transaction: then commit before deleting the object).
pub async fn claim(conn: &mut PgConnection, hash: &str) -> Result<bool, StoreError> {
    Ok(claim_at(conn, hash).await?.is_some())
}

/// [`claim`], returning the claim's time (`removing_at`), the token [`still_claimed`] and
/// [`finish_claimed`] check; `None` when not claimed.
///
/// Runs in a transaction of its own that first takes [`CLAIM_LOCK`] exclusively, so its
/// reference check waits for every settling snapshot or durable stop that already passed its
/// [`check_for_ready`] to commit, and sees their references (the module doc).
pub async fn claim_at(
    conn: &mut PgConnection,
    hash: &str,
) -> Result<Option<DateTime<Utc>>, StoreError> {
    let mut tx = timed(Op::ChunkRemoval, conn.begin()).await?;
    timed(
        Op::ChunkRemoval,
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(CLAIM_LOCK)
            .execute(&mut *tx),
    )
    .await?;
    // A new statement after the lock: a new snapshot, which sees every settle that held the
    // lock committed.
    let claimed: Option<DateTime<Utc>> = timed(
        Op::ChunkRemoval,
        sqlx::query_scalar(&format!(
            "UPDATE chunk_removals SET removing_at = clock_timestamp()
              WHERE sha256 = $1 AND removing_at IS NULL AND {UNREFERENCED}
             RETURNING removing_at"
        ))
        .bind(hash)
        .fetch_optional(&mut *tx),
    )
    .await?;
    if claimed.is_none() {
        // Referenced again (or claimed by another remover): a referenced chunk's row goes.
        timed(
            Op::ChunkRemoval,
            sqlx::query(&format!(
                "DELETE FROM chunk_removals
                  WHERE sha256 = $1 AND removing_at IS NULL AND NOT ({UNREFERENCED})"
            ))
            .bind(hash)
            .execute(&mut *tx),
        )
        .await?;
    }
    timed(Op::ChunkRemoval, tx.commit()).await?;
    Ok(claimed)
}

/// Whether this remover's claim of `hash`, made at `claimed_at` ([`claim_at`], [`reclaim_at`]),
/// is still the row's, unfinished, and younger than half of [`STALE_CLAIM`] on the database's
/// clock: checked right before the object's delete, so a remover that stalled (a paused
/// process or VM, whose monotonic clock may not have run) or whose claim a takeover replaced
/// deletes nothing.
pub async fn still_claimed(
    conn: &mut PgConnection,
    hash: &str,
    claimed_at: DateTime<Utc>,
) -> Result<bool, StoreError> {
    timed(
        Op::ChunkRemoval,
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM chunk_removals
                             WHERE sha256 = $1 AND removing_at = $2 AND removed_at IS NULL
                               AND clock_timestamp() - removing_at
                                   < make_interval(secs => $3))",
        )
        .bind(hash)
        .bind(claimed_at)
        .bind((STALE_CLAIM / 2).as_secs_f64())
        .fetch_one(conn),
    )
    .await
}

/// [`finish`] fenced by the claim's token: stamps the removal finished only while the row is
/// still this remover's claim made at `claimed_at` (a takeover's newer claim is left for the
/// takeover to finish, so a stalled remover's late finish cannot date a removal before an
/// upload that its successor's delete will then race). Whether it stamped.
pub async fn finish_claimed(
    conn: &mut PgConnection,
    hash: &str,
    claimed_at: DateTime<Utc>,
) -> Result<bool, StoreError> {
    let done = timed(
        Op::ChunkRemoval,
        sqlx::query(
            "UPDATE chunk_removals SET removed_at = clock_timestamp()
              WHERE sha256 = $1 AND removing_at = $2 AND removed_at IS NULL",
        )
        .bind(hash)
        .bind(claimed_at)
        .execute(conn),
    )
    .await?;
    Ok(done.rows_affected() > 0)
}

/// Stamps the claimed chunk `hash` as removed from the object store, whoever claimed it
/// (unfenced: a remover that can be taken over finishes with [`finish_claimed`]).
pub async fn finish(conn: &mut PgConnection, hash: &str) -> Result<(), StoreError> {
    timed(
        Op::ChunkRemoval,
        sqlx::query(
            "UPDATE chunk_removals SET removed_at = clock_timestamp()
              WHERE sha256 = $1 AND removing_at IS NOT NULL AND removed_at IS NULL",
        )
        .bind(hash)
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// A `chunk_removals` row: the chunk's sha256, when a remover claimed it, when it finished.
type RemovalRow = (String, Option<DateTime<Utc>>, Option<DateTime<Utc>>);

/// What [`check_for_ready`] found for a snapshot or durable stop about to settle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadyCheck {
    /// No removal can have taken a chunk from under its upload; the queued removals of its
    /// chunks were taken back. It may settle.
    Clear,
    /// These chunks' removals were claimed and had not finished before it was requested: they
    /// may be gone although its upload saw them. It must not settle.
    Lost(Vec<String>),
    /// It was requested more than [`REMOVAL_RETENTION`] ago (the database's clock): a removal
    /// that finished since may have been pruned, so nothing can say its chunks are there. It
    /// must not settle.
    TooOld,
}

/// For snapshot `snapshot`, requested at `requested_at` (the database's clock), about to
/// settle `ready` referencing `hashes`: locks their removal rows, then refuses it if it was
/// requested more than [`REMOVAL_RETENTION`] ago ([`ReadyCheck::TooOld`]), else returns the
/// chunks a removal may have taken from under its upload (claimed, and not finished before
/// `requested_at`: [`ReadyCheck::Lost`]), else takes back those not claimed
/// ([`ReadyCheck::Clear`]). Call in the transaction that writes it, and settle only on
/// [`ReadyCheck::Clear`].
///
/// The age is read after the rows are locked, on `clock_timestamp()`: a row [`prune_finished`]
/// deleted before this look saw it was deleted at a time the clock has passed, and it finished
/// more than [`REMOVAL_RETENTION`] before that, so a request it could have failed is too old
/// here too.
pub async fn check_for_ready(
    conn: &mut PgConnection,
    snapshot: SnapshotId,
    requested_at: DateTime<Utc>,
    hashes: &[String],
) -> Result<ReadyCheck, StoreError> {
    // Held to the caller's commit, with the references it writes: a claim waits for that
    // commit before it judges references, or this check waits for the claim's (module doc).
    timed(
        Op::ChunkRemoval,
        sqlx::query("SELECT pg_advisory_xact_lock_shared($1)")
            .bind(CLAIM_LOCK)
            .execute(&mut *conn),
    )
    .await?;
    let rows: Vec<RemovalRow> = timed(
        Op::ChunkRemoval,
        sqlx::query_as(
            "SELECT sha256, removing_at, removed_at FROM chunk_removals
              WHERE sha256 = ANY($1) ORDER BY sha256 FOR UPDATE",
        )
        .bind(hashes)
        .fetch_all(&mut *conn),
    )
    .await?;
    // `clock_timestamp()`, read now, after the rows are locked; `now()` (the transaction's
    // start) would be unsafe: a transaction begun long before could see a pruned row's absence
    // and judge its age by a clock from before the prune.
    let too_old: bool = timed(
        Op::ChunkRemoval,
        sqlx::query_scalar("SELECT $1 < clock_timestamp() - make_interval(secs => $2)")
            .bind(requested_at)
            .bind(REMOVAL_RETENTION.as_secs_f64())
            .fetch_one(&mut *conn),
    )
    .await?;
    if too_old {
        tracing::warn!(snapshot_id = %snapshot, %requested_at, "a settling snapshot was requested longer ago than chunk removals are remembered");
        return Ok(ReadyCheck::TooOld);
    }
    let lost: Vec<String> = rows
        .iter()
        .filter(|(_, claimed, removed)| {
            claimed.is_some() && removed.is_none_or(|at| at >= requested_at)
        })
        .map(|(h, _, _)| h.clone())
        .collect();
    if !lost.is_empty() {
        tracing::warn!(snapshot_id = %snapshot, lost = lost.len(), "a settling snapshot references chunks a delete removed under its upload");
        return Ok(ReadyCheck::Lost(lost));
    }
    let taken_back: Vec<&str> = rows.iter().map(|(h, _, _)| h.as_str()).collect();
    timed(
        Op::ChunkRemoval,
        sqlx::query("DELETE FROM chunk_removals WHERE sha256 = ANY($1)")
            .bind(&taken_back)
            .execute(conn),
    )
    .await?;
    Ok(ReadyCheck::Clear)
}

/// Deletes up to `limit` removals that finished more than [`PRUNE_AFTER`] ago (the
/// database's clock: [`REMOVAL_RETENTION`] and a day's margin); how many. Never an unfinished
/// one: a claimed row is what fails the checks of the snapshots and stops that might count on
/// its chunk, and what a takeover finds ([`stale_claims`]); a row [`queue_swept`] or a settling
/// snapshot changes meanwhile is judged again on its new version.
///
/// Why a finished row past that age is no longer needed: [`check_for_ready`] consults a
/// finished row only for a snapshot or stop requested before it finished, hence more than
/// [`REMOVAL_RETENTION`] before now, and refuses every such request without looking. A
/// delete's [`queue`] of the chunk later inserts a fresh queued row, which is what a row reset
/// by [`queue_swept`] would be.
pub async fn prune_finished(conn: &mut PgConnection, limit: i64) -> Result<u64, StoreError> {
    let pruned = timed(
        Op::ChunkRemoval,
        sqlx::query(
            "DELETE FROM chunk_removals
              WHERE sha256 IN (SELECT sha256 FROM chunk_removals
                                WHERE removed_at < clock_timestamp() - make_interval(secs => $1)
                                LIMIT $2)
                AND removed_at < clock_timestamp() - make_interval(secs => $1)",
        )
        .bind(PRUNE_AFTER.as_secs_f64())
        .bind(limit)
        .execute(conn),
    )
    .await?;
    Ok(pruned.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remover_past_half_the_stale_claim_age_deletes_nothing() {
        assert_eq!(budget_after(Duration::ZERO), Some(STALE_CLAIM / 4));
        assert_eq!(budget_after(STALE_CLAIM / 2), Some(STALE_CLAIM / 4));
        assert_eq!(
            budget_after(STALE_CLAIM / 2 + Duration::from_millis(1)),
            None
        );
        assert_eq!(budget_after(STALE_CLAIM), None);
        // Its delete, bounded by the budget, lands before a takeover can claim again.
        assert!(STALE_CLAIM / 2 + STALE_CLAIM / 4 < STALE_CLAIM);
        let long_ago = Instant::now().checked_sub(STALE_CLAIM).unwrap();
        assert_eq!(delete_budget(long_ago), None);
        assert_eq!(delete_budget(Instant::now()), Some(STALE_CLAIM / 4));
    }

    #[test]
    fn the_claim_lock_is_no_other_constant_advisory_key() {
        assert_ne!(CLAIM_LOCK, crate::sweep::SWEEP_LOCK);
        assert_ne!(CLAIM_LOCK, crate::events::EVENTS_SEQ_LOCK);
        assert_eq!(CLAIM_LOCK.to_be_bytes(), *b"BERTHCHK");
    }
}
