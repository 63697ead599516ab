//! The command half of the outbox relay ([`super`]): publishes committed commands to
//! `{p}.cmd.<host>` on JetStream.
//!
//! # Guarantees
//! - At least once, with `Nats-Msg-Id` = command id (see [`super`]).
//! - Each command message carries a W3C `traceparent` header whose trace id is the command id
//!   ([`berth_schemas::trace`]), published inside a `command.publish` span.
//! - At most [`DEFAULT_MAX_CONCURRENT_STARTS`] creates and starts are in flight per host;
//!   more wait in the outbox (queued, not refused).

use async_nats::jetstream;
use berth_schemas::trace::{TraceParent, TRACEPARENT};
use berth_schemas::{CommandId, Subjects};
use berth_store::{commands, StoreError};
use sqlx::PgPool;
use tracing::info_span;

use super::{msg_id_headers, publish_all, Drained, Outgoing};

pub use super::{POLL_INTERVAL, RETRY_DELAY};

/// Commands claimed per batch.
pub const BATCH_SIZE: i64 = 128;
/// At most this many creates and starts in flight per host; more wait in the outbox.
pub const DEFAULT_MAX_CONCURRENT_STARTS: i64 = 8;
/// Errors of one relay batch.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The outbox's rows could not be claimed or marked.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// JetStream did not take (or ack) the command; it stays unpublished and is retried.
    #[error("publish of command {command_id}: {message}")]
    Publish {
        /// The first command that failed.
        command_id: CommandId,
        /// Why, as NATS said it.
        message: String,
    },
}

/// Publishes unpublished commands, oldest first, in batches of [`BATCH_SIZE`], at most
/// `max_batches` of them; returns how many were published and whether it stopped at that
/// bound ([`Drained::more`]). Publishes of a batch are pipelined, then their acks awaited.
pub async fn drain(
    db: &PgPool,
    js: &jetstream::Context,
    subjects: &Subjects,
    max_concurrent_starts: i64,
    max_batches: usize,
) -> Result<Drained, RelayError> {
    let mut total = 0;
    for _ in 0..max_batches {
        let mut tx = db.begin().await.map_err(StoreError::from)?;
        let rows = commands::claim_publishable(&mut tx, BATCH_SIZE, max_concurrent_starts).await?;
        if rows.is_empty() {
            return Ok(Drained {
                published: total,
                more: false,
            });
        }
        let claimed: Vec<CommandId> = rows.iter().map(|r| r.id).collect();
        let batch = rows
            .into_iter()
            .map(|row| {
                let mut headers = msg_id_headers(row.id);
                // Trace context for hostd and the reconciler: the trace id is the command id,
                // the parent id this publish span's.
                let trace = TraceParent::for_command(row.id, rand::random());
                headers.insert(TRACEPARENT, trace.to_header().as_str());
                let span = info_span!("command.publish", command_id = %row.id,
                    sandbox_id = %row.sandbox_id, host_id = %row.host_id, kind = %row.kind,
                    trace_id = %trace.trace_id_hex(), span_id = %trace.parent_id_hex());
                Outgoing {
                    key: (row.id, row.kind),
                    subject: subjects.cmd(row.host_id),
                    headers,
                    payload: row.payload.into(),
                    span,
                }
            })
            .collect();
        let (acked, failure) =
            publish_all(js, batch, "berth_outbox_publish_duration_seconds").await;
        let failure = failure.map(|((command_id, _), message)| RelayError::Publish {
            command_id,
            message,
        });
        let mut published = Vec::with_capacity(acked.len());
        for (id, kind) in acked {
            metrics::counter!("berth_commands_published_total", "kind" => kind).increment(1);
            published.push(id);
        }
        commands::mark_published(&mut tx, &published, &claimed).await?;
        tx.commit().await.map_err(StoreError::from)?;
        total += published.len();
        if let Some(error) = failure {
            return Err(error);
        }
    }
    Ok(Drained {
        published: total,
        more: true,
    })
}

/// Sets `berth_outbox_pending` and `berth_outbox_oldest_age_seconds`.
pub(crate) async fn record_backlog(db: &PgPool) -> Result<(), StoreError> {
    let (pending, oldest) = commands::backlog(db).await?;
    metrics::gauge!("berth_outbox_pending").set(pending as f64);
    metrics::gauge!("berth_outbox_oldest_age_seconds").set(oldest);
    Ok(())
}
