//! Berth's reconciler: applies host results to sandbox rows behind the generation fence.
//!
//! - [`results`]: the durable result consumer and the fenced, idempotent apply.
//!
//! # Guarantees
//! - A result changes a row only when its generation equals the row's current generation and
//!   the state machine ([`berth_schemas::state::on_result`]) leads from the row's state; a
//!   redelivered result finds the row already moved and changes nothing.
//! - A late result cannot bring a deleted sandbox back (guarantee 3): a deleting row only
//!   accepts its delete's result.
//! - Capacity is released in the same transaction as the state change, exactly once (the
//!   row's `holds_capacity` flag flips with it).

pub mod results;

use berth_schemas::Subjects;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// Errors of the reconciler.
#[derive(Debug, thiserror::Error)]
pub enum ReconcilerError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("jetstream setup: {0}")]
    JetStream(String),
}

/// What the reconciler process needs.
#[derive(Debug, Clone)]
pub struct ReconcilerConfig {
    pub subjects: Subjects,
}

/// Runs the result consumer until `shutdown` fires.
///
/// Errors: [`ReconcilerError::JetStream`] when the stream or consumer cannot be set up.
pub async fn run(
    config: ReconcilerConfig,
    db: PgPool,
    nats: async_nats::Client,
    shutdown: CancellationToken,
) -> Result<(), ReconcilerError> {
    results::consume(&config.subjects, &db, nats, shutdown).await
}
