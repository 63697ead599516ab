//! The outbox relay: publishes committed commands to `{p}.cmd.<host>` on JetStream, then
//! committed events (see [`crate::event_relay`]).
//!
//! # Guarantees
//! - At least once: a command is marked `published_at` only after JetStream acked it; a crash
//!   between the ack and the mark re-publishes it, and JetStream drops the duplicate by
//!   `Nats-Msg-Id` (= command id) within its duplicate window.
//! - Several relays may run: rows are claimed with `FOR UPDATE SKIP LOCKED`.
//! - Each command message carries a W3C `traceparent` header whose trace id is the command id
//!   ([`berth_schemas::trace`]), published inside a `command.publish` span.
//! - Woken by `LISTEN berth_outbox` (a trigger notifies on insert), with a polling fallback of
//!   [`POLL_INTERVAL`] in case a notification is lost while the listener reconnects.

use std::time::Duration;

use async_nats::jetstream;
use async_nats::HeaderMap;
use berth_schemas::db::OUTBOX_CHANNEL;
use berth_schemas::trace::{TraceParent, TRACEPARENT};
use berth_schemas::{CommandId, HostId, SandboxId, Subjects};
use sqlx::postgres::PgListener;
use sqlx::{PgPool, Row};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn, Instrument};

/// The polling fallback when no notification arrives.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// Commands claimed per batch.
pub const BATCH_SIZE: i64 = 128;
/// At most this many creates and starts in flight per host; more wait in the outbox.
pub const DEFAULT_MAX_CONCURRENT_STARTS: i64 = 8;
/// Wait after a failed batch before trying again.
pub const RETRY_DELAY: Duration = Duration::from_millis(500);

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

/// Runs the relay until `shutdown` fires. Errors are logged and retried; the relay only
/// returns on shutdown.
pub async fn run(
    db: PgPool,
    nats: async_nats::Client,
    subjects: Subjects,
    max_concurrent_starts: i64,
    shutdown: CancellationToken,
) {
    let js = jetstream::new(nats);
    while let Err(error) = berth_schemas::streams::ensure_streams(&js, &subjects).await {
        warn!(%error, "relay: cannot ensure streams yet");
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(RETRY_DELAY) => {}
        }
    }
    let mut listener = loop {
        match listen(&db).await {
            Ok(l) => break l,
            Err(error) => {
                warn!(%error, "relay: cannot LISTEN yet");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(RETRY_DELAY) => {}
                }
            }
        }
    };
    info!("outbox relay running");
    loop {
        let delay = match drain(&db, &js, &subjects, max_concurrent_starts).await {
            Ok(n) => {
                if n > 0 {
                    debug!(published = n, "outbox drained");
                }
                POLL_INTERVAL
            }
            Err(error) => {
                warn!(%error, "relay batch failed; retrying");
                RETRY_DELAY
            }
        };
        if let Err(error) = record_backlog(&db).await {
            debug!(%error, "outbox gauges not updated");
        }
        // Events after commands, with the same ack-then-mark guarantee.
        let delay = delay
            .min(crate::event_relay::round(&db, &js, &subjects, POLL_INTERVAL, RETRY_DELAY).await);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            n = listener.recv() => {
                if let Err(error) = n {
                    warn!(%error, "relay: notification listener failed; it reconnects");
                    tokio::time::sleep(RETRY_DELAY).await;
                }
            }
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

async fn listen(db: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(db).await?;
    listener.listen(OUTBOX_CHANNEL).await?;
    Ok(listener)
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
        let started = std::time::Instant::now();
        let mut pending = Vec::with_capacity(rows.len());
        let mut failure = None;
        for row in &rows {
            let id: CommandId = row.get("id");
            let host: HostId = row.get("host_id");
            let kind: String = row.get("kind");
            let payload: Vec<u8> = row.get("payload");
            let mut headers = HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id.to_string().as_str());
            // Trace context for hostd and the reconciler: the trace id is the command id.
            let trace = TraceParent::for_command(id, rand::random());
            headers.insert(TRACEPARENT, trace.to_header().as_str());
            let sandbox: SandboxId = row.get("sandbox_id");
            let span = info_span!("command.publish", command_id = %id, sandbox_id = %sandbox,
                host_id = %host, kind = %kind, trace_id = %trace.trace_id_hex());
            match js
                .publish_with_headers(subjects.cmd(host), headers, payload.into())
                .instrument(span)
                .await
            {
                Ok(ack) => pending.push((id, kind, ack)),
                Err(e) => {
                    failure = Some(RelayError::Publish {
                        command_id: id,
                        message: e.to_string(),
                    });
                    break;
                }
            }
        }
        let mut published = Vec::with_capacity(pending.len());
        for (id, kind, ack) in pending {
            match ack.await {
                Ok(_) => {
                    metrics::counter!("berth_commands_published_total", "kind" => kind)
                        .increment(1);
                    published.push(id.as_uuid());
                }
                Err(e) => {
                    failure.get_or_insert(RelayError::Publish {
                        command_id: id,
                        message: e.to_string(),
                    });
                }
            }
        }
        metrics::histogram!("berth_outbox_publish_duration_seconds")
            .record(started.elapsed().as_secs_f64());
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
async fn record_backlog(db: &PgPool) -> Result<(), sqlx::Error> {
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
