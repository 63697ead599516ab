//! The sweep of orphaned chunks (issue 14 rule 3, "stored content garbage-collected"): chunks
//! an upload stored before it was cut short of its manifest (hostd killed, the object store
//! down, a cancelled stop upload) are referenced by nothing, and no delete ever queues them.
//! The sweep lists the chunk objects, keeps those last written more than [`SweepConfig::grace`]
//! ago that nothing references, and hands them to the chunk removal protocol
//! (`berth_store::chunks`): queued ([`chunks::queue_unreferenced`]), then each claimed and
//! removed by the same remover a snapshot delete uses ([`remove_chunks`]). So a snapshot that
//! settles `ready` at the same moment naming one of them is still safe: it takes the queued
//! chunk back, or fails when a claimed removal may have taken it.
//!
//! The grace is the only protection of an upload still in progress (its chunks are referenced
//! only once it settles): [`DEFAULT_SWEEP_GRACE`] is a day, 48 times the longest a snapshot,
//! archive or unarchive may take before the reconciler times it out (30 minutes,
//! `DEFAULT_SNAPSHOT_TIMEOUT` / `DEFAULT_ARCHIVE_TIMEOUT`), and room for a stop's background
//! upload that a hostd restart began again. An upload that reuses an older orphan (it skips a
//! chunk the store holds) is not protected by the grace but by the claim: if the sweep removed
//! that chunk under it, the snapshot fails rather than becoming ready without it.
//!
//! A chunk a stored manifest names is never swept, even when no row references it: each round
//! first lists the manifests, and reads those of snapshots no row settles
//! ([`chunks::unsettled_manifests`]: a stop whose durability report has not arrived, a snapshot
//! still `creating` or failed after its manifest) — usually none or a few, each read once and
//! remembered (a manifest never changes). hostd takes a stored manifest as proof that its
//! chunks are stored (an archive reuses the stop snapshot it recorded), so a manifest must never
//! outlive its chunks. Such a manifest, and the chunks it pins, stay until something collects
//! it; the sweep never deletes a manifest.
//!
//! Bounded work: the chunk keys spread over 256 shards (`chunks/<hh>/`,
//! [`berth_storage::CHUNK_SHARDS`]); a round lists whole shards from where the last one stopped,
//! in pages of [`PAGE`] keys (one query each), until it listed [`SweepConfig::max_listed`] keys
//! or removed [`SweepConfig::max_removed`] chunks, and covers every shard at most once. The
//! manifest listing that comes first is not bounded: every round lists them all (one S3 list
//! request per 1000 snapshots and stops stored), as the pins must be current.
//!
//! One sweeper at a time: a round runs only under the `chunk_sweep` lease
//! (`berth_store::leases`), so of several API processes one sweeps. Two sweeping at once (a
//! lease expired mid-round) would be harmless: the queue leaves a removal in flight alone and
//! only one claim of a chunk succeeds.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use berth_schemas::ids::SnapshotId;

use berth_store::{chunks, leases};
use futures::StreamExt;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use uuid::Uuid;

use super::snapshots::remove_chunks;

/// Default [`SweepConfig::every`]: a round every 5 minutes.
pub const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(5 * 60);
/// Default [`SweepConfig::grace`]: a day (see the module doc).
pub const DEFAULT_SWEEP_GRACE: Duration = Duration::from_secs(24 * 3600);
/// Default [`SweepConfig::max_listed`]: 100 000 keys a round (100 S3 list requests).
pub const DEFAULT_SWEEP_MAX_LISTED: usize = 100_000;
/// Default [`SweepConfig::max_removed`]: 1000 chunks a round.
pub const DEFAULT_SWEEP_MAX_REMOVED: usize = 1000;
/// Keys looked up in the database at once.
pub const PAGE: usize = 1000;
/// The lease a sweeping process holds (`leases.name`).
pub const SWEEP_LEASE: &str = "chunk_sweep";

/// When and how much the sweep works.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepConfig {
    /// How often a round runs.
    pub every: Duration,
    /// A chunk last written less than this long ago is never swept.
    pub grace: Duration,
    /// A round stops after the shard in which it listed this many keys.
    pub max_listed: usize,
    /// A round stops once it removed this many chunks (it lists that shard again next time).
    pub max_removed: usize,
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            every: DEFAULT_SWEEP_EVERY,
            grace: DEFAULT_SWEEP_GRACE,
            max_listed: DEFAULT_SWEEP_MAX_LISTED,
            max_removed: DEFAULT_SWEEP_MAX_REMOVED,
        }
    }
}

/// What one round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepRound {
    /// Chunk keys listed.
    pub listed: usize,
    /// Of them, last written longer ago than the grace.
    pub old: usize,
    /// Chunks removed from the store (queued and claimed by this round).
    pub removed: usize,
    /// Chunks kept because a stored manifest no row settles names them.
    pub pinned: usize,
    /// Shards listed to the end.
    pub shards: u16,
}

/// The sweep's position between rounds: the next shard to list. One per process; a process
/// taking the lease over starts at shard 0.
#[derive(Debug, Default)]
pub struct Sweeper {
    next_shard: u16,
    /// The chunks each unsettled manifest names, as read (a manifest never changes).
    manifests: HashMap<SnapshotId, Vec<String>>,
    /// Ends a round between pages (never between a claim and its removal).
    stop: CancellationToken,
}

impl Sweeper {
    /// A sweeper whose rounds end early, between pages, once `stop` fires.
    pub fn stopping_on(stop: CancellationToken) -> Sweeper {
        Sweeper {
            stop,
            ..Sweeper::default()
        }
    }

    /// One round (see the module doc), whatever the lease: the caller holds it. Counts the
    /// chunks removed in `berth_orphan_chunks_removed_total`.
    ///
    /// Errors: the first database or store failure, as text; what it queued and did not
    /// remove stays queued, and the next round lists the shard again.
    pub async fn round(
        &mut self,
        db: &PgPool,
        objects: &berth_storage::Objects,
        config: &SweepConfig,
    ) -> Result<SweepRound, String> {
        let cutoff = SystemTime::now()
            .checked_sub(config.grace)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let mut round = SweepRound::default();
        let outcome = match self.pins(db, objects).await {
            Ok(pins) => {
                self.shards(db, objects, config, cutoff, &pins, &mut round)
                    .await
            }
            Err(error) => Err(error),
        };
        if round.removed > 0 {
            metrics::counter!("berth_orphan_chunks_removed_total").increment(round.removed as u64);
            info!(
                removed = round.removed,
                listed = round.listed,
                "chunks no snapshot or stop references removed from the object store"
            );
        }
        outcome.map(|()| round)
    }

    /// The chunks named by the stored manifests of snapshots no row settles.
    async fn pins(
        &mut self,
        db: &PgPool,
        objects: &berth_storage::Objects,
    ) -> Result<HashSet<String>, String> {
        let mut listing = objects.list_manifests().chunks(PAGE);
        let mut read = HashMap::new();
        while let Some(page) = listing.next().await {
            let ids = page
                .into_iter()
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?;
            let unsettled = {
                let mut conn = db.acquire().await.map_err(|e| e.to_string())?;
                chunks::unsettled_manifests(&mut conn, &ids)
                    .await
                    .map_err(|e| e.to_string())?
            };
            for id in unsettled {
                if let Some(hashes) = self.manifests.remove(&id) {
                    read.insert(id, hashes);
                    continue;
                }
                match berth_storage::fetch_manifest(objects, id).await {
                    Ok(manifest) => {
                        let hashes = manifest.distinct_chunks().into_iter().map(|(h, _)| h);
                        read.insert(id, hashes.collect());
                    }
                    // Collected since the listing: it pins nothing any more.
                    Err(berth_storage::StorageError::NotFound(_)) => {}
                    // Damaged: hostd refuses it too (it reads it the same way), so it proves
                    // nothing stored and pins nothing.
                    Err(error @ berth_storage::StorageError::BadManifest { .. }) => {
                        warn!(%error, snapshot_id = %id, "a stored manifest does not read back; it pins no chunk");
                    }
                    Err(error) => return Err(format!("manifest of snapshot {id}: {error}")),
                }
            }
        }
        self.manifests = read;
        Ok(self.manifests.values().flatten().cloned().collect())
    }

    async fn shards(
        &mut self,
        db: &PgPool,
        objects: &berth_storage::Objects,
        config: &SweepConfig,
        cutoff: SystemTime,
        pins: &HashSet<String>,
        round: &mut SweepRound,
    ) -> Result<(), String> {
        while round.shards < berth_storage::CHUNK_SHARDS
            && round.listed < config.max_listed
            && round.removed < config.max_removed
        {
            let shard = self.next_shard as u8;
            let mut listing = objects.list_chunk_shard(shard).chunks(PAGE);
            while let Some(page) = listing.next().await {
                if self.stop.is_cancelled() {
                    return Ok(());
                }
                let page = page
                    .into_iter()
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| e.to_string())?;
                round.listed += page.len();
                let mut old: Vec<String> = page
                    .into_iter()
                    .filter(|c| c.last_modified < cutoff)
                    .map(|c| c.sha256)
                    .collect();
                round.old += old.len();
                let before = old.len();
                old.retain(|h| !pins.contains(h));
                round.pinned += before - old.len();
                let room = config.max_removed.saturating_sub(round.removed);
                if old.is_empty() || room == 0 {
                    continue;
                }
                let queued = {
                    let mut conn = db.acquire().await.map_err(|e| e.to_string())?;
                    chunks::queue_unreferenced(
                        &mut conn,
                        &old,
                        i64::try_from(room).unwrap_or(i64::MAX),
                    )
                    .await
                    .map_err(|e| e.to_string())?
                };
                round.removed += remove_chunks(db, objects, &queued).await?;
                if round.removed >= config.max_removed {
                    // Stopped inside the shard: the next round lists it again.
                    return Ok(());
                }
            }
            round.shards += 1;
            self.next_shard = (self.next_shard + 1) % berth_storage::CHUNK_SHARDS;
        }
        Ok(())
    }
}

/// Runs a round every [`SweepConfig::every`] while this process holds the [`SWEEP_LEASE`]
/// (taken or renewed before each round, for twice the period), until `shutdown` fires.
pub async fn run(
    db: PgPool,
    objects: berth_storage::Objects,
    config: SweepConfig,
    shutdown: CancellationToken,
) {
    metrics::describe_counter!(
        "berth_orphan_chunks_removed_total",
        "Chunks the sweep removed from the object store: stored by an upload cut before its \
         manifest, referenced by nothing, older than the grace."
    );
    let holder = Uuid::now_v7();
    let mut sweeper = Sweeper::stopping_on(shutdown.clone());
    let mut held = false;
    let mut every = tokio::time::interval(config.every);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = every.tick() => {}
        }
        match leases::acquire(&db, SWEEP_LEASE, holder, config.every * 2).await {
            Ok(Some(_)) => {}
            Ok(None) => {
                held = false;
                continue;
            }
            Err(error) => {
                warn!(%error, "taking the chunk sweep lease failed; retrying");
                continue;
            }
        }
        if !held {
            // Taken over (or first held): start from the first shard.
            sweeper = Sweeper::stopping_on(shutdown.clone());
            held = true;
        }
        if let Err(error) = sweeper.round(&db, &objects, &config).await {
            warn!(%error, "sweeping orphaned chunks failed; retrying next round");
        }
    }
}
