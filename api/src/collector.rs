//! The collector of durable stop snapshots (issue 14). A row names only its newest durable
//! stop; a start (or a migrate or unarchive that ran), a newer durable stop and a delete
//! supersede it, recorded in the same transaction (`berth_store::sandboxes::supersede`). Every
//! [`COLLECT_EVERY`], every API process with an object store collects the superseded ones that
//! nothing may need any more (no upload of the next stop and no boot in flight), the same way
//! (`service::sandboxes::collect_durable`): the manifest, then the chunks nothing else
//! references. It also supersedes the durable stop of sandboxes deleted elsewhere — the
//! reconciler's auto-delete and expiry, `berth admin delete-org` (a process without the object
//! store) — and retries a collection that failed. Two processes never collect one snapshot
//! twice: its row is taken under a lock (`berth_store::sandboxes::take_superseded`).
//!
//! Each look also deletes the backups past their org's retention (`backups_kept`,
//! [`prune_backups`]), content first as a user's snapshot delete does.
//!
//! Beside it, every [`SweepConfig::every`], the store-wide sweep of what nothing names
//! ([`crate::sweep`]): chunks of uploads cut before their manifest, manifests whose report was
//! lost, removals whose remover died.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::service::sandboxes::collect_deleted;
use crate::service::snapshots::prune_backups;
use crate::sweep::SweepConfig;

/// How often the collector looks for durable stop snapshots to collect.
pub const COLLECT_EVERY: Duration = Duration::from_secs(2);

/// Snapshots collected per look (a full batch looks again at once).
const BATCH: i64 = 64;

/// Runs the collector, and the sweep as `sweep` says, until `shutdown` fires.
pub async fn run(
    db: PgPool,
    objects: berth_storage::Objects,
    sweep: SweepConfig,
    shutdown: CancellationToken,
) {
    let sweeper = tokio::spawn(crate::sweep::run(
        db.clone(),
        objects.clone(),
        sweep,
        shutdown.clone(),
    ));
    let mut every = tokio::time::interval(COLLECT_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = every.tick() => {}
        }
        if let Err(error) = prune_backups(&db, &objects, BATCH).await {
            warn!(%error, "pruning backups past their retention failed; retrying");
        }
        loop {
            match collect_deleted(&db, &objects, BATCH).await {
                Ok(n) if n as i64 == BATCH && !shutdown.is_cancelled() => continue,
                Ok(_) => break,
                Err(error) => {
                    warn!(%error, "collecting durable stop snapshots failed; retrying");
                    break;
                }
            }
        }
    }
    let _ = sweeper.await;
}
