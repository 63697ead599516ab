//! Berth's scheduler: placement and the heartbeat consumer that keeps `hosts` current.
//!
//! - [`placement`]: a pure scoring function ([`placement::rank`]), and [`placement::place`],
//!   which reserves capacity on the best host through the store inside the caller's
//!   transaction (so placement commits with the sandbox row, its command and its event:
//!   guarantee 1).
//! - [`heartbeat`]: consumes `{p}.hb.*` and has the store upsert host rows on the database
//!   clock.
//!
//! No SQL here: the queries are [`berth_store::hosts`]' and [`berth_store::warm`]'.
//!
//! # Guarantees
//! - A reservation never takes a host past its capacity: the store's `UPDATE` re-checks
//!   headroom under the row lock, so concurrent placements on one host serialize.
//! - Only hosts that admit new sandboxes (`ready`) whose last heartbeat is younger than the
//!   freshness window are chosen.

pub mod heartbeat;
pub mod placement;

use std::time::Duration;

use berth_schemas::Subjects;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// How recent a host's last heartbeat must be for placement to choose it.
pub const DEFAULT_HEARTBEAT_FRESHNESS: Duration = Duration::from_secs(15);

/// Errors of the scheduler.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    /// A store operation failed; its [`berth_store::op::Op`] names which.
    #[error(transparent)]
    Store(#[from] berth_store::StoreError),
    /// The heartbeat subscription could not be made (NATS down or refusing).
    #[error("nats subscribe to {subject}: {source}")]
    Subscribe {
        /// The subject subscribed to (`{p}.hb.*`).
        subject: String,
        /// The client's error.
        source: async_nats::SubscribeError,
    },
}

/// What the scheduler process needs.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// The NATS subject names under the deployment's prefix (heartbeats come on `{p}.hb.*`).
    pub subjects: Subjects,
}

/// Runs the heartbeat consumer until `shutdown` fires.
///
/// Errors: [`SchedulerError::Subscribe`] when the subscription cannot be made; database
/// errors on single heartbeats are logged and the next heartbeat retries.
pub async fn run(
    config: SchedulerConfig,
    db: PgPool,
    nats: async_nats::Client,
    shutdown: CancellationToken,
) -> Result<(), SchedulerError> {
    heartbeat::consume(&config.subjects, &db, &nats, shutdown).await
}
