//! The event half of the outbox relay: publishes committed `events` rows as CloudEvents on
//! `{p}.events.sandbox.<org>.<sandbox>` (stream `{P}_EVENTS`), and the `webhook.disabled`
//! event a disabled webhook's row carries on `{p}.events.webhook.<org>.<webhook>`. Runs in the
//! relay loop ([`super::run`]) after the commands.
//!
//! # Guarantees
//! - At least once, exactly as for commands: a row is marked published only after JetStream
//!   acked it; a crash in between re-publishes it with the same `Nats-Msg-Id` (= event id),
//!   which JetStream drops within its duplicate window. Consumers deduplicate by the
//!   CloudEvent `id` beyond it.
//! - Publish order: marking takes the advisory transaction lock [`EVENTS_SEQ_LOCK`] and
//!   stamps `seq` from `events_seq` under it, so seq values commit in increasing order (the
//!   property [`crate::service::events`] readers rely on). The lock is held only for the `UPDATE` and
//!   the commit, never across a publish.
//! - Several relays may run: rows are claimed with `FOR UPDATE SKIP LOCKED`.

use std::time::Duration;

use async_nats::jetstream;
use async_nats::HeaderMap;
use berth_schemas::cloudevents::{self, CloudEvent, WebhookDisabledData};
use berth_schemas::{EventId, Subjects, WebhookId};
use sqlx::{PgPool, Row};
use tracing::{debug, Span};

use super::{msg_id_headers, Outgoing};
use crate::service::events::{EventRecord, EVENT_COLUMNS};

/// Events claimed per batch.
pub const BATCH_SIZE: i64 = 256;
/// The `pg_advisory_xact_lock` key under which `events.seq` is assigned (ASCII "BERTHSEQ").
pub const EVENTS_SEQ_LOCK: i64 = 0x4245_5254_4853_4551;

/// Errors of one event batch.
#[derive(Debug, thiserror::Error)]
pub enum EventRelayError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("publish of event {event_id}: {message}")]
    Publish { event_id: EventId, message: String },
}

/// Publishes everything unpublished (sandbox events, then webhook-disabled events) and updates
/// the backlog gauges. Returns how many were published; errors are for the caller to log and
/// retry (nothing is lost: unmarked rows are published again).
pub async fn drain(
    db: &PgPool,
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<usize, EventRelayError> {
    let mut total = drain_sandbox_events(db, js, subjects).await?;
    total += drain_webhook_events(db, js, subjects).await?;
    if let Err(error) = record_backlog(db).await {
        debug!(%error, "event outbox gauges not updated");
    }
    Ok(total)
}

fn headers(id: EventId) -> HeaderMap {
    let mut headers = msg_id_headers(id);
    headers.insert("Content-Type", cloudevents::CONTENT_TYPE);
    headers
}

/// Publishes `(id, subject, body)` through the relay's pipeline ([`super::publish_all`]).
/// Returns the ids acked, in the order given, and the first failure.
async fn publish_all(
    js: &jetstream::Context,
    batch: Vec<(EventId, String, String)>,
) -> (Vec<EventId>, Option<EventRelayError>) {
    let batch = batch
        .into_iter()
        .map(|(id, subject, body)| Outgoing {
            key: id,
            subject,
            headers: headers(id),
            payload: body.into(),
            span: Span::none(),
        })
        .collect();
    let (acked, failure) =
        super::publish_all(js, batch, "berth_event_publish_duration_seconds").await;
    let failure = failure.map(|(event_id, message)| EventRelayError::Publish { event_id, message });
    (acked, failure)
}

async fn drain_sandbox_events(
    db: &PgPool,
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<usize, EventRelayError> {
    let mut total = 0;
    loop {
        let mut tx = db.begin().await?;
        let rows = sqlx::query(&format!(
            "SELECT {EVENT_COLUMNS} FROM events
              WHERE published_at IS NULL
              ORDER BY at, id
              LIMIT $1
              FOR UPDATE SKIP LOCKED"
        ))
        .bind(BATCH_SIZE)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            return Ok(total);
        }
        let batch = rows
            .iter()
            .map(|row| {
                let ev = EventRecord::from_row(row)?.event;
                let subject = subjects.sandbox_events(ev.data.org_id, ev.data.sandbox_id);
                Ok((ev.id, subject, ev.to_json()))
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        let (acked, failure) = publish_all(js, batch).await;
        if !acked.is_empty() {
            // Serialize seq assignment with every other relay until this commit (see the
            // module's guarantees). Only this UPDATE and the commit run under the lock.
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(EVENTS_SEQ_LOCK)
                .execute(&mut *tx)
                .await?;
            let count = i64::try_from(acked.len()).expect("a batch fits in i64");
            let first: i64 = sqlx::query_scalar("SELECT nextval('events_seq')")
                .fetch_one(&mut *tx)
                .await?;
            if count > 1 {
                sqlx::query("SELECT setval('events_seq', $1)")
                    .bind(first + count - 1)
                    .execute(&mut *tx)
                    .await?;
            }
            let seqs: Vec<i64> = (first..first + count).collect();
            let ids: Vec<uuid::Uuid> = acked.iter().map(EventId::as_uuid).collect();
            sqlx::query(
                "UPDATE events e SET published_at = now(), seq = u.seq
                   FROM unnest($1::uuid[], $2::int8[]) AS u(id, seq)
                  WHERE e.id = u.id",
            )
            .bind(&ids)
            .bind(&seqs)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        metrics::counter!("berth_events_published_total", "kind" => "sandbox")
            .increment(acked.len() as u64);
        total += acked.len();
        if let Some(error) = failure {
            return Err(error);
        }
    }
}

async fn drain_webhook_events(
    db: &PgPool,
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<usize, EventRelayError> {
    let mut tx = db.begin().await?;
    let rows = sqlx::query(
        "SELECT id, org_id, url, consecutive_failures, disabled_reason, disabled_at,
                disabled_event_id
           FROM webhooks
          WHERE disabled_event_id IS NOT NULL AND disabled_published_at IS NULL
          ORDER BY disabled_at
          LIMIT $1
          FOR UPDATE SKIP LOCKED",
    )
    .bind(BATCH_SIZE)
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        return Ok(0);
    }
    let mut batch = Vec::with_capacity(rows.len());
    let mut webhook_of = Vec::with_capacity(rows.len());
    for row in &rows {
        let webhook: WebhookId = row.try_get("id")?;
        let event_id: EventId = row.try_get("disabled_event_id")?;
        let data = WebhookDisabledData {
            webhook_id: webhook,
            org_id: row.try_get("org_id")?,
            url: row.try_get("url")?,
            consecutive_failures: row.try_get("consecutive_failures")?,
            reason: row
                .try_get::<Option<String>, _>("disabled_reason")?
                .unwrap_or_default(),
        };
        let subject = subjects.webhook_events(data.org_id, webhook);
        let event = CloudEvent::webhook_disabled(event_id, row.try_get("disabled_at")?, data);
        batch.push((event_id, subject, event.to_json()));
        webhook_of.push((event_id, webhook));
    }
    let (acked, failure) = publish_all(js, batch).await;
    let done: Vec<uuid::Uuid> = webhook_of
        .iter()
        .filter(|(e, _)| acked.contains(e))
        .map(|(_, w)| w.as_uuid())
        .collect();
    sqlx::query("UPDATE webhooks SET disabled_published_at = now() WHERE id = ANY($1)")
        .bind(&done)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    metrics::counter!("berth_events_published_total", "kind" => "webhook")
        .increment(done.len() as u64);
    match failure {
        Some(error) => Err(error),
        None => Ok(done.len()),
    }
}

/// Sets `berth_event_outbox_pending` and `berth_event_outbox_oldest_age_seconds`.
async fn record_backlog(db: &PgPool) -> Result<(), sqlx::Error> {
    let row = sqlx::query(
        "SELECT count(*) AS pending,
                COALESCE(EXTRACT(EPOCH FROM now() - min(at)), 0)::float8 AS oldest
           FROM events WHERE published_at IS NULL",
    )
    .fetch_one(db)
    .await?;
    metrics::gauge!("berth_event_outbox_pending").set(row.get::<i64, _>("pending") as f64);
    metrics::gauge!("berth_event_outbox_oldest_age_seconds").set(row.get::<f64, _>("oldest"));
    Ok(())
}

/// One relay round for events, for the relay loop: drains, logs a failure, and says how long
/// to wait before the next round ([`super::POLL_INTERVAL`] after success,
/// [`super::RETRY_DELAY`] after a failure).
pub async fn round(db: &PgPool, js: &jetstream::Context, subjects: &Subjects) -> Duration {
    super::settle("event outbox", drain(db, js, subjects).await)
}
