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
use berth_schemas::{CommandId, HostId, SandboxId, Subjects};
use sqlx::{PgPool, Row};
use tracing::info_span;

use super::{msg_id_headers, publish_all, Outgoing};

pub use super::{POLL_INTERVAL, RETRY_DELAY};

/// Commands claimed per batch.
pub const BATCH_SIZE: i64 = 128;
/// At most this many creates and starts in flight per host; more wait in the outbox.
pub const DEFAULT_MAX_CONCURRENT_STARTS: i64 = 8;
/// Errors of one relay batch.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("publish of command {command_id}: {message}")]
    Publish {
        command_id: CommandId,
        message: String,
    },
}

/// Publishes every unpublished command, oldest first, in batches; returns how many were
/// published. Publishes of a batch are pipelined, then their acks awaited.
pub async fn drain(
    db: &PgPool,
    js: &jetstream::Context,
    subjects: &Subjects,
    max_concurrent_starts: i64,
) -> Result<usize, RelayError> {
    let mut total = 0;
    loop {
        let mut tx = db.begin().await?;
        // Creates and starts beyond a host's cap of in-flight boots wait in the outbox (queued,
        // not refused). Other kinds pass; the generation fence keeps a stop or delete that
        // overtakes a queued start correct (the host refuses the older start).
        let eligible: Vec<uuid::Uuid> = sqlx::query_scalar(
            "WITH in_flight AS (
                 SELECT host_id, count(*) AS n FROM commands
                  WHERE published_at IS NOT NULL AND completed_at IS NULL
                    AND kind IN ('sandbox.create', 'sandbox.start')
                  GROUP BY host_id),
             queued AS (
                 SELECT id, host_id, kind, created_at,
                        row_number() OVER (PARTITION BY host_id,
                            kind IN ('sandbox.create', 'sandbox.start') ORDER BY created_at) AS rn
                   FROM commands WHERE published_at IS NULL)
             SELECT q.id FROM queued q LEFT JOIN in_flight f ON f.host_id = q.host_id
              WHERE q.kind NOT IN ('sandbox.create', 'sandbox.start')
                 OR q.rn + COALESCE(f.n, 0) <= $2
              ORDER BY q.created_at
              LIMIT $1",
        )
        .bind(BATCH_SIZE)
        .bind(max_concurrent_starts)
        .fetch_all(&mut *tx)
        .await?;
        let rows = sqlx::query(
            "SELECT id, sandbox_id, host_id, kind, payload FROM commands
              WHERE id = ANY($1) AND published_at IS NULL
              ORDER BY created_at
              FOR UPDATE SKIP LOCKED",
        )
        .bind(&eligible)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            return Ok(total);
        }
        let batch = rows
            .iter()
            .map(|row| {
                let id: CommandId = row.get("id");
                let host: HostId = row.get("host_id");
                let kind: String = row.get("kind");
                let payload: Vec<u8> = row.get("payload");
                let mut headers = msg_id_headers(id);
                // Trace context for hostd and the reconciler: the trace id is the command id.
                let trace = TraceParent::for_command(id, rand::random());
                headers.insert(TRACEPARENT, trace.to_header().as_str());
                let sandbox: SandboxId = row.get("sandbox_id");
                let span = info_span!("command.publish", command_id = %id, sandbox_id = %sandbox,
                    host_id = %host, kind = %kind, trace_id = %trace.trace_id_hex());
                Outgoing {
                    key: (id, kind),
                    subject: subjects.cmd(host),
                    headers,
                    payload: payload.into(),
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
            published.push(id.as_uuid());
        }
        sqlx::query("UPDATE commands SET published_at = now() WHERE id = ANY($1)")
            .bind(&published)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "UPDATE commands SET publish_attempts = publish_attempts + 1
              WHERE published_at IS NULL AND id = ANY($1)",
        )
        .bind(
            rows.iter()
                .map(|r| r.get::<uuid::Uuid, _>("id"))
                .collect::<Vec<_>>(),
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        total += published.len();
        if let Some(error) = failure {
            return Err(error);
        }
    }
}

/// Sets `berth_outbox_pending` and `berth_outbox_oldest_age_seconds`.
pub(crate) async fn record_backlog(db: &PgPool) -> Result<(), sqlx::Error> {
    let row = sqlx::query(
        "SELECT count(*) AS pending,
                COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8 AS oldest
           FROM commands WHERE published_at IS NULL",
    )
    .fetch_one(db)
    .await?;
    metrics::gauge!("berth_outbox_pending").set(row.get::<i64, _>("pending") as f64);
    metrics::gauge!("berth_outbox_oldest_age_seconds").set(row.get::<f64, _>("oldest"));
    Ok(())
}
