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
//! - Publish order: [`berth_store::events::mark_published`] stamps `seq` under an advisory
//!   transaction lock held only for that `UPDATE` and the commit, never across a publish, so
//!   seq values commit in increasing order (the property [`crate::service::events`] readers
//!   rely on).
//! - Several relays may run: rows are claimed with `FOR UPDATE SKIP LOCKED`.

use std::time::Duration;

use async_nats::jetstream;
use async_nats::HeaderMap;
use berth_schemas::cloudevents::{self, CloudEvent};
use berth_schemas::{EventId, Subjects, WebhookId};
use berth_store::{events, StoreError};
use sqlx::PgPool;

use crate::webhooks::store;
use tracing::{debug, Span};

use super::{msg_id_headers, Drained, Outgoing};

/// Events claimed per batch.
pub const BATCH_SIZE: i64 = 256;

/// Errors of one event batch.
#[derive(Debug, thiserror::Error)]
pub enum EventRelayError {
    /// A query on a table only the API owns (the webhooks' disabled events) failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The event outbox's rows could not be claimed or marked.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// JetStream did not take (or ack) the event; it stays unpublished and is retried.
    #[error("publish of event {event_id}: {message}")]
    Publish {
        /// The first event that failed.
        event_id: EventId,
        /// Why, as NATS said it.
        message: String,
    },
}

/// Publishes unpublished sandbox events in batches of [`BATCH_SIZE`], at most `max_batches`
/// of them, then one batch of webhook-disabled events, and updates the backlog gauges. Returns
/// how many were published and whether sandbox events are left past the bound
/// ([`Drained::more`]); errors are for the caller to log and retry (nothing is lost: unmarked
/// rows are published again).
pub async fn drain(
    db: &PgPool,
    js: &jetstream::Context,
    subjects: &Subjects,
    max_batches: usize,
) -> Result<Drained, EventRelayError> {
    let mut drained = drain_sandbox_events(db, js, subjects, max_batches).await?;
    drained.published += drain_webhook_events(db, js, subjects).await?;
    if let Err(error) = record_backlog(db).await {
        debug!(%error, "event outbox gauges not updated");
    }
    Ok(drained)
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
    max_batches: usize,
) -> Result<Drained, EventRelayError> {
    let mut total = 0;
    for _ in 0..max_batches {
        let mut tx = db.begin().await.map_err(StoreError::from)?;
        let rows = events::claim_unpublished(&mut tx, BATCH_SIZE).await?;
        if rows.is_empty() {
            return Ok(Drained {
                published: total,
                more: false,
            });
        }
        let batch = rows
            .into_iter()
            .map(|row| {
                let ev = row.event;
                let subject = subjects.sandbox_events(ev.data.org_id, ev.data.sandbox_id);
                (ev.id, subject, ev.to_json())
            })
            .collect();
        let (acked, failure) = publish_all(js, batch).await;
        // Stamps `seq` under the store's advisory lock, held until this commit.
        events::mark_published(&mut tx, &acked).await?;
        tx.commit().await.map_err(StoreError::from)?;
        metrics::counter!("berth_events_published_total", "kind" => "sandbox")
            .increment(acked.len() as u64);
        total += acked.len();
        if let Some(error) = failure {
            return Err(error);
        }
    }
    Ok(Drained {
        published: total,
        more: true,
    })
}

async fn drain_webhook_events(
    db: &PgPool,
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<usize, EventRelayError> {
    let mut tx = db.begin().await?;
    let disabled = store::claim_unpublished_disabled(&mut tx, BATCH_SIZE).await?;
    if disabled.is_empty() {
        return Ok(0);
    }
    let mut batch = Vec::with_capacity(disabled.len());
    let mut webhook_of = Vec::with_capacity(disabled.len());
    for (event_id, at, data) in disabled {
        let webhook = data.webhook_id;
        let subject = subjects.webhook_events(data.org_id, webhook);
        let event = CloudEvent::webhook_disabled(event_id, at, data);
        batch.push((event_id, subject, event.to_json()));
        webhook_of.push((event_id, webhook));
    }
    let (acked, failure) = publish_all(js, batch).await;
    let done: Vec<WebhookId> = webhook_of
        .iter()
        .filter(|(e, _)| acked.contains(e))
        .map(|(_, w)| *w)
        .collect();
    store::mark_disabled_published(&mut tx, &done).await?;
    tx.commit().await?;
    metrics::counter!("berth_events_published_total", "kind" => "webhook")
        .increment(done.len() as u64);
    match failure {
        Some(error) => Err(error),
        None => Ok(done.len()),
    }
}

/// Sets `berth_event_outbox_pending` and `berth_event_outbox_oldest_age_seconds`.
async fn record_backlog(db: &PgPool) -> Result<(), StoreError> {
    let (pending, oldest) = events::backlog(db).await?;
    metrics::gauge!("berth_event_outbox_pending").set(pending as f64);
    metrics::gauge!("berth_event_outbox_oldest_age_seconds").set(oldest);
    Ok(())
}

/// One relay round for events, for the relay loop: drains at most [`super::ROUND_BATCHES`]
/// batches, logs a failure, and says how long
/// to wait before the next round ([`super::POLL_INTERVAL`] after success,
/// [`super::RETRY_DELAY`] after a failure).
pub async fn round(db: &PgPool, js: &jetstream::Context, subjects: &Subjects) -> Duration {
    super::settle(
        "event outbox",
        drain(db, js, subjects, super::ROUND_BATCHES).await,
    )
}
