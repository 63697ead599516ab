//! The collector of deleted sandboxes' durable stops (issue 14): every delete collects what the
//! sandbox's durable stop stored, the same way (`service::sandboxes::collect_durable`). A
//! user's `DELETE` (and the compat kill) collect at once; the deletes made elsewhere — the
//! reconciler's auto-delete and expiry, `berth admin delete-org` (a process without the object
//! store) — and a collection that failed are found here, every [`COLLECT_EVERY`], by every API
//! process with an object store. Two processes never collect one sandbox twice: the row's
//! durable snapshot is taken under its lock (`berth_store::sandboxes::take_durable`).

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::service::sandboxes::collect_deleted;

/// How often the collector looks for deleted sandboxes whose durable stop is still stored.
pub const COLLECT_EVERY: Duration = Duration::from_secs(2);

/// Sandboxes collected per look (a full batch looks again at once).
const BATCH: i64 = 64;

/// Runs the collector until `shutdown` fires.
pub async fn run(db: PgPool, objects: berth_storage::Objects, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(COLLECT_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = every.tick() => {}
        }
        loop {
            match collect_deleted(&db, &objects, BATCH).await {
                Ok(n) if n as i64 == BATCH && !shutdown.is_cancelled() => continue,
                Ok(_) => break,
                Err(error) => {
                    warn!(%error, "collecting deleted sandboxes' durable stops failed; retrying");
                    break;
                }
            }
        }
    }
}
