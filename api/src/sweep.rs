//! The store-wide sweep of the object store's orphans (issue 14), run by the API's collector
//! ([`crate::collector`]) every [`SweepConfig::every`]. What it collects, nothing else does:
//! the chunks of an upload cut before its manifest (a hostd killed at `stop:uploading` or
//! `archive:uploading` whose sandbox moved on before it came back, a store failure), a manifest
//! whose report was lost for good or that a redelivered archive replaced (it found its first
//! copy no longer whole and uploaded again), and a chunk removal whose remover died between its
//! claim and its finish.
//!
//! One look ([`sweep_once`]):
//! 1. lists every manifest and chunk with its last-modified time; only objects older than
//!    [`SweepConfig::grace`] are considered (an upload in flight has its report to come);
//! 2. removes each manifest nothing names (`berth_store::sweep::unnamed_manifests`: no snapshot
//!    row, no sandbox's durable stop or seed, no superseded stop awaiting collection, no open
//!    command), each claimed first (`manifest_removals`, committed before the object goes);
//! 3. reads the manifests it keeps whose chunks the rows do not already reference (a young
//!    stop's whose report is on its way, a failed or `creating` snapshot's), and removes each
//!    chunk that none of them and no row references, through the `chunk_removals` queue,
//!    claim and finish of a snapshot delete (`service::snapshots::remove_chunks`);
//! 4. takes over the chunk removals claimed more than [`chunks::STALE_CLAIM`] ago and
//!    never finished, and removes their objects again;
//! 5. forgets the removals, of chunks and of manifests, that finished more than
//!    [`chunks::PRUNE_AFTER`] ago on the database's clock ([`chunks::REMOVAL_RETENTION`], 7
//!    days, and a day's margin against the clock stepping back)
//!    (`berth_store::chunks::prune_finished`, `berth_store::sweep::prune_removed`); a claimed,
//!    unfinished one is never forgotten.
//!
//! # Why it never loses the last copy (DESIGN.md guarantee 9)
//! - A chunk's age says nothing of who counts on it: an upload skips a chunk the store holds,
//!   however old, and the snapshot or stop it belongs to names nothing until its report is
//!   applied. The safety is the `chunk_removals` protocol, not the grace period: the sweep
//!   commits its claim before it removes the object, and a snapshot settling `ready` or a stop
//!   or archive recorded durable checks its chunks against the claims in its transaction
//!   (`berth_store::chunks::check_for_ready`, against a time before its upload's first look:
//!   the snapshot row's, the stop's or the archive's command insert). A removal that finished
//!   after that time fails the snapshot, or leaves the stop not durable (the next archive
//!   uploads again; an archive's disk stays on its host). One that finished before it was seen
//!   missing by the upload, which stored the chunk again. A claim and a check in flight are
//!   ordered by one advisory lock ([`chunks::CLAIM_LOCK`], exclusive for a claim, shared for a
//!   check): a claim judges references only after every check that passed committed its own.
//! - A finished removal is remembered for [`chunks::REMOVAL_RETENTION`] (and a day's margin,
//!   [`chunks::PRUNE_AFTER`], so a database clock stepping back up to a day breaks nothing)
//!   only, so the check
//!   refuses, in the same transaction and on the database's clock, every snapshot and report
//!   whose start time is older than that (the snapshot fails saying so; the stop is not
//!   recorded durable, an archive's disk stays on its host). A removal it would have needed
//!   finished after that start time, hence more than the retention ago, and is either still
//!   there or the check is refused: its clock is read after its rows are locked, so a row
//!   forgotten before the check looked is forgotten at a time the check's clock has passed.
//!   A manifest's removal is forgotten on the same terms: a report naming it belongs to a
//!   command inserted before the sweep listed the manifest, so older still than its removal.
//! - A manifest's claim and a durability report's check take one per-snapshot lock
//!   (`berth_store::sweep::claim_manifest`, `manifest_removed`): a report that comes after the
//!   sweep removed its manifest is not recorded durable, and a manifest a report named first is
//!   kept (until the retention: see above). Snapshot rows name theirs before the upload
//!   begins.
//! - A stale claim is taken over only after [`chunks::STALE_CLAIM`], and every remover (a
//!   snapshot delete's, the collector's, the sweep's, a takeover's) deletes only within its
//!   `chunks::delete_budget`: not at all once half that age has passed since its claim, and
//!   under a timeout of a quarter of it, so a stalled remover's delete never lands after a
//!   takeover finished and an upload stored the chunk again; a claimed row already fails every
//!   check that could come to count on the chunk. (A request the store already received when
//!   its timeout cut it is beyond any client's reach; the margin is the other quarter.)
//! - Several API processes: each look holds a Postgres advisory session lock on a connection
//!   of its own (`berth_store::sweep::try_lock`; a second process skips its turn), and every
//!   removal is claimed in the database anyway, so two sweeps never race on one object.
//!
//! Clocks: an object's last-modified time is the store's clock (an S3 server's, a local file's
//! mtime), compared with this process's; the grace period (hours) dwarfs their skew.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use berth_schemas::ids::SnapshotId;
use berth_storage::{Objects, StorageError};
use berth_store::{chunks, sweep, StoreError};
use sqlx::{Connection, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often each API process tries a sweep (one of them runs it at a time).
pub const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(15 * 60);
/// How old an object must be before the sweep considers it: far longer than any upload takes
/// from its first chunk to its report being applied.
pub const DEFAULT_SWEEP_GRACE: Duration = Duration::from_secs(6 * 60 * 60);
/// Stale claims taken over per look.
const STALE_BATCH: i64 = 1_000;
/// Finished removals forgotten per statement (a look repeats it until fewer are left).
const PRUNE_BATCH: i64 = 10_000;
/// Names per database look.
const LOOK_BATCH: usize = 5_000;
/// The counter of what the sweep removed, by `kind`: `manifest`, `chunk`, `stale_claim` (a
/// chunk whose removal's remover had died).
pub const REMOVED_METRIC: &str = "berth_object_sweep_removed_total";

/// When and what the sweep removes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepConfig {
    /// How often a look is tried ([`DEFAULT_SWEEP_EVERY`]).
    pub every: Duration,
    /// Objects written more recently are never considered ([`DEFAULT_SWEEP_GRACE`]).
    pub grace: Duration,
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            every: DEFAULT_SWEEP_EVERY,
            grace: DEFAULT_SWEEP_GRACE,
        }
    }
}

/// What one look removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Manifests nothing named.
    pub manifests: u64,
    /// Chunks nothing referenced.
    pub chunks: u64,
    /// Chunks whose stale removal claim was taken over and finished.
    pub stale_claims: u64,
    /// Finished removals (of chunks and of manifests) forgotten past [`chunks::PRUNE_AFTER`].
    pub forgotten: u64,
}

/// Errors of a look; nothing is half-removed that the next look does not finish.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// A query failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The sweep's own connection or transaction failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The object store failed (listing, reading a kept manifest, removing).
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// A chunk removal failed part way (database or store, as text).
    #[error("chunk removal: {0}")]
    ChunkRemoval(String),
}

/// Runs a look every `config.every` until `shutdown` fires.
pub async fn run(db: PgPool, objects: Objects, config: SweepConfig, shutdown: CancellationToken) {
    metrics::describe_counter!(
        REMOVED_METRIC,
        "Objects the store-wide sweep removed from the object store, by kind (manifest, chunk, stale_claim)"
    );
    // A zero period would panic; `berth api` refuses one.
    let mut every = tokio::time::interval(config.every.max(Duration::from_millis(1)));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = every.tick() => {}
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            swept = sweep_once(&db, &objects, &config) => match swept {
                Ok(Some(report)) if report != SweepReport::default() => {
                    info!(manifests = report.manifests, chunks = report.chunks,
                        stale_claims = report.stale_claims, forgotten = report.forgotten,
                        "object store swept");
                }
                Ok(_) => {}
                Err(error) => warn!(%error, "sweeping the object store failed; retrying"),
            },
        }
    }
}

/// One look (see the module doc); `None` when another process is sweeping.
///
/// Errors: [`SweepError`]; what was claimed and not removed is finished by a later look.
pub async fn sweep_once(
    db: &PgPool,
    objects: &Objects,
    config: &SweepConfig,
) -> Result<Option<SweepReport>, SweepError> {
    // A connection of its own holds the lock; closing it (or dropping it) releases it.
    let mut lock = db.acquire().await?.detach();
    if !sweep::try_lock(&mut lock).await? {
        return Ok(None);
    }
    let swept = sweep_locked(db, objects, config).await;
    let _ = lock.close().await;
    swept.map(Some)
}

async fn sweep_locked(
    db: &PgPool,
    objects: &Objects,
    config: &SweepConfig,
) -> Result<SweepReport, SweepError> {
    let cutoff = SystemTime::now()
        .checked_sub(config.grace)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let mut report = SweepReport::default();
    let manifests = objects.list_manifests().await?;
    let old: Vec<SnapshotId> = manifests
        .iter()
        .filter(|l| l.last_modified < cutoff)
        .map(|l| l.name)
        .collect();
    let mut removed: HashSet<SnapshotId> = HashSet::new();
    for batch in old.chunks(LOOK_BATCH) {
        let unnamed = {
            let mut conn = db.acquire().await?;
            sweep::unnamed_manifests(&mut conn, batch).await?
        };
        for id in unnamed {
            if remove_manifest(db, objects, id).await? {
                removed.insert(id);
                report.manifests += 1;
                metrics::counter!(REMOVED_METRIC, "kind" => "manifest").increment(1);
            }
        }
    }
    let kept: Vec<SnapshotId> = manifests
        .iter()
        .map(|l| l.name)
        .filter(|id| !removed.contains(id))
        .collect();
    let named = kept_chunks(db, objects, &kept).await?;

    // Before the listing: a removal finished after this may have deleted a chunk the listing
    // still showed, and must not be queued afresh (`chunks::queue_swept`).
    let listed_at = {
        let mut conn = db.acquire().await?;
        chunks::clock(&mut conn).await?
    };
    let listed = objects.list_chunks().await?;
    let old: Vec<String> = listed
        .into_iter()
        .filter(|l| l.last_modified < cutoff && !named.contains(&l.name))
        .map(|l| l.name)
        .collect();
    for batch in old.chunks(LOOK_BATCH) {
        let orphans = {
            let mut tx = db.begin().await?;
            let orphans = sweep::unreferenced_chunks(&mut tx, batch).await?;
            chunks::queue_swept(&mut tx, &orphans, listed_at).await?;
            tx.commit().await?;
            orphans
        };
        let n = crate::service::snapshots::remove_chunks(db, objects, &orphans)
            .await
            .map_err(SweepError::ChunkRemoval)?;
        report.chunks += n as u64;
        metrics::counter!(REMOVED_METRIC, "kind" => "chunk").increment(n as u64);
    }

    report.stale_claims = retry_stale_claims(db, objects).await?;
    report.forgotten = forget_finished(db).await?;
    Ok(report)
}

/// Deletes the chunk and manifest removals that finished more than [`chunks::PRUNE_AFTER`]
/// ago, a batch per statement; how many (see the module doc for
/// why no check needs them any more).
async fn forget_finished(db: &PgPool) -> Result<u64, SweepError> {
    let mut conn = db.acquire().await?;
    let mut n = 0;
    loop {
        let chunks = chunks::prune_finished(&mut conn, PRUNE_BATCH).await?;
        let manifests = sweep::prune_removed(&mut conn, PRUNE_BATCH).await?;
        n += chunks + manifests;
        if chunks < PRUNE_BATCH as u64 && manifests < PRUNE_BATCH as u64 {
            return Ok(n);
        }
    }
}

/// Claims (committed), removes and finishes the manifest of `id`; whether it was claimed.
async fn remove_manifest(
    db: &PgPool,
    objects: &Objects,
    id: SnapshotId,
) -> Result<bool, SweepError> {
    let mut tx = db.begin().await?;
    if !sweep::claim_manifest(&mut tx, id).await? {
        return Ok(false);
    }
    tx.commit().await?;
    objects.delete(&Objects::manifest_key(id)).await?;
    let mut conn = db.acquire().await?;
    sweep::finish_manifest(&mut conn, id).await?;
    info!(snapshot_id = %id, "an orphaned manifest removed from the object store");
    Ok(true)
}

/// The chunks the kept manifests `kept` reference that the rows may not: those of the kept
/// manifests whose chunks are not all in the database's references, read from the store. A
/// manifest gone meanwhile references nothing; a damaged one can never be restored (every read
/// checks it), so it keeps nothing either.
async fn kept_chunks(
    db: &PgPool,
    objects: &Objects,
    kept: &[SnapshotId],
) -> Result<HashSet<String>, SweepError> {
    let mut named = HashSet::new();
    for batch in kept.chunks(LOOK_BATCH) {
        let in_rows: HashSet<SnapshotId> = {
            let mut conn = db.acquire().await?;
            sweep::referenced_in_rows(&mut conn, batch).await?
        }
        .into_iter()
        .collect();
        for &id in batch.iter().filter(|id| !in_rows.contains(id)) {
            match berth_storage::fetch_manifest(objects, id).await {
                Ok(manifest) => {
                    named.extend(manifest.distinct_chunks().into_iter().map(|(h, _)| h))
                }
                Err(StorageError::NotFound(_)) => {}
                Err(error @ StorageError::BadManifest { .. }) => {
                    warn!(%error, snapshot_id = %id, "a kept manifest cannot be read; it keeps no chunk");
                }
                Err(error) => return Err(error.into()),
            }
        }
    }
    Ok(named)
}

/// Takes over the chunk removals claimed more than [`chunks::STALE_CLAIM`] ago and never
/// finished, removes their objects again (within the takeover's own delete budget) and
/// finishes them; how many.
async fn retry_stale_claims(db: &PgPool, objects: &Objects) -> Result<u64, SweepError> {
    let hashes = {
        let mut conn = db.acquire().await?;
        chunks::stale_claims(&mut conn, STALE_BATCH).await?
    };
    let mut n = 0;
    for hash in hashes {
        let mut conn = db.acquire().await?;
        let claimed = std::time::Instant::now();
        let Some(token) = chunks::reclaim_at(&mut conn, &hash).await? else {
            continue;
        };
        if !crate::service::snapshots::remove_claimed(&mut conn, objects, &hash, (claimed, token))
            .await
            .map_err(SweepError::ChunkRemoval)?
        {
            continue;
        }
        info!(sha256 = %hash, "a stale chunk removal retried");
        metrics::counter!(REMOVED_METRIC, "kind" => "stale_claim").increment(1);
        n += 1;
    }
    Ok(n)
}
