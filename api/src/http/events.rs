//! Event routes: `GET /v1/sandboxes/{id}/events` (one sandbox's events, a JSON list) and
//! `GET /v1/events`: an org's lifecycle events as Server-Sent Events — the backlog, then live.
//!
//! Each message is `id: <event id>` and `data: <CloudEvent JSON>` (no `event:` field, so a
//! browser `EventSource` delivers every message to `onmessage`). A client that reconnects with
//! `Last-Event-ID: <the last id it saw>` (browsers send it themselves) resumes right after that
//! event.
//!
//! # Guarantees
//! - No gap and no repeat across a reconnect: the stream follows the publish order `seq`,
//!   whose values commit in increasing order (see [`crate::service::events`]), and resumes strictly
//!   after the `Last-Event-ID`'s position.
//! - Only published events are streamed (the same ones consumers of `{P}_EVENTS` see), so an
//!   event appears here shortly after the relay published it.
//! - The stream ends when the server shuts down; the client reconnects with `Last-Event-ID`.
//!
//! # Errors
//! 400 `invalid_request` naming the parameter for an unknown query parameter (a misspelt
//! filter would otherwise stream every event of the org); for a malformed `sandbox_id`, an
//! unknown `type`, or a
//! `Last-Event-ID` that names no published event of the caller's org (e.g. purged with its
//! sandbox's tombstone): reconnect without it to start from the oldest retained event.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::{Extension, Json};
use berth_schemas::cloudevents::normalize_type;
use berth_schemas::EventId;
use futures::Stream;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::extract::{KnownParams, NoParams, StrictQuery};
use super::sandboxes::parse_id;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::model;
use crate::service::events::{self as events, EventFilter, StreamStart};
use crate::AppState;

/// How often an open stream looks for newly published events.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Events read per query.
pub const DEFAULT_BATCH: i64 = 256;
/// A comment line this often keeps proxies from closing an idle stream.
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(15);
/// Events buffered per stream before the reader waits for the client.
const BUFFER: usize = 64;
/// The header a reconnecting client sends.
pub const LAST_EVENT_ID: &str = "last-event-id";

/// Timing of the SSE stream.
#[derive(Debug, Clone)]
pub struct EventStreamConfig {
    /// How often an open stream looks for newly published events.
    pub poll_interval: Duration,
    /// The most events read per look.
    pub batch: i64,
}

impl Default for EventStreamConfig {
    fn default() -> Self {
        Self {
            poll_interval: DEFAULT_POLL_INTERVAL,
            batch: DEFAULT_BATCH,
        }
    }
}

/// Cancelled when the server shuts down; long-lived streams end on it (axum's graceful
/// shutdown waits for open connections). Installed by [`crate::serve`].
#[derive(Debug, Clone)]
pub struct StreamShutdown(pub CancellationToken);

/// Query of `GET /v1/events`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Only this sandbox's events.
    pub sandbox_id: Option<String>,
    /// Comma-separated event types (`dev.berth.sandbox.running` or `sandbox.running`).
    #[serde(rename = "type")]
    #[param(rename = "type")]
    pub kind: Option<String>,
    /// Resume after this event id (for clients that cannot set `Last-Event-ID`).
    pub last_event_id: Option<String>,
}

impl KnownParams for EventsQuery {
    const NAMES: &'static [&'static str] = &["sandbox_id", "type", "last_event_id"];
}

/// Parses the `type` list.
///
/// Errors: 400 naming `type` for an event type Berth does not emit.
pub fn parse_types(raw: Option<&str>) -> Result<Vec<String>, ApiError> {
    raw.unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            normalize_type(t)
                .ok_or_else(|| ApiError::invalid("type", format!("unknown event type {t:?}")))
        })
        .collect()
}

/// `GET /v1/sandboxes/{id}/events`: the sandbox's state changes, oldest first.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/events", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = [model::Event]), (status = 404, description = "`not_found`")),
    security(("bearer" = [])))]
pub async fn events(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
) -> Result<Json<Vec<model::Event>>, ApiError> {
    Ok(Json(
        events::of_sandbox(&app.db, caller.org_id, parse_id(&id)?).await?,
    ))
}

/// `GET /v1/events`
#[utoipa::path(get, path = "/v1/events", tag = "crate::event_stream", params(EventsQuery,
        ("Last-Event-ID" = Option<String>, Header, description = "Resume after this event id")),
    responses(
        (status = 200, description = "`text/event-stream`: `id:` the event id, `data:` the CloudEvent JSON; the backlog, then live", content_type = "text/event-stream"),
        (status = 400, description = "`invalid_request`: bad `sandbox_id`, unknown `type`, or an unknown `Last-Event-ID`"),
        (status = 404, description = "`not_found`: `sandbox_id` names no sandbox of the caller's org"),
    ), security(("bearer" = [])))]
pub async fn stream(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    shutdown: Option<Extension<StreamShutdown>>,
    StrictQuery(query): StrictQuery<EventsQuery>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let permit = app
        .guards
        .concurrency(caller.org_id, crate::limits::Concurrent::Streams)?;
    let filter = EventFilter {
        sandbox_id: query
            .sandbox_id
            .as_deref()
            .map(|s| {
                s.parse()
                    .map_err(|_| ApiError::invalid("sandbox_id", "sandbox_id is not a UUID"))
            })
            .transpose()?,
        types: parse_types(query.kind.as_deref())?,
    };
    let last = headers
        .get(LAST_EVENT_ID)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or(query.last_event_id)
        .filter(|s| !s.trim().is_empty());
    let last_id = last
        .as_deref()
        .map(|raw| raw.trim().parse::<EventId>().ok());
    let start = match events::stream_start(&app.db, caller.org_id, &filter, last_id).await? {
        StreamStart::After(seq) => seq,
        StreamStart::UnknownLastEvent => {
            let raw = last.unwrap_or_default();
            return Err(ApiError::invalid(
                "Last-Event-ID",
                format!("no published event {raw:?} in this org; reconnect without it"),
            ));
        }
    };
    let (tx, rx) = mpsc::channel(BUFFER);
    let stop = shutdown.map(|Extension(s)| s.0).unwrap_or_default();
    tokio::spawn(follow(app, caller, filter, start, tx, stop, permit));
    let events = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|event| (Ok(event), rx))
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::new().interval(KEEP_ALIVE_INTERVAL)))
}

/// Registers `berth_sse_streams` (at zero) and the event relay's metrics with their help text.
pub fn describe_metrics() {
    metrics::describe_gauge!("berth_sse_streams", "Open `GET /v1/events` streams.");
    metrics::gauge!("berth_sse_streams").increment(0.0);
    metrics::describe_counter!(
        "berth_events_published_total",
        "Events published to the event stream, by kind (sandbox, webhook)."
    );
    metrics::describe_histogram!(
        "berth_event_publish_duration_seconds",
        metrics::Unit::Seconds,
        "Duration of publishing one batch of events and awaiting the acks."
    );
    metrics::describe_gauge!(
        "berth_event_outbox_pending",
        "Events committed but not yet published."
    );
    metrics::describe_gauge!(
        "berth_event_outbox_oldest_age_seconds",
        metrics::Unit::Seconds,
        "Age of the oldest unpublished event."
    );
}

/// Counts open streams in `berth_sse_streams` while alive.
struct OpenStream;

impl OpenStream {
    fn new() -> Self {
        metrics::gauge!("berth_sse_streams").increment(1.0);
        OpenStream
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        metrics::gauge!("berth_sse_streams").decrement(1.0);
    }
}

/// Feeds `tx` with the caller's events after `cursor`, until the client goes away or the
/// server shuts down.
async fn follow(
    app: AppState,
    caller: Caller,
    filter: EventFilter,
    mut cursor: i64,
    tx: mpsc::Sender<Event>,
    stop: CancellationToken,
    _permit: crate::limits::ConcurrencyPermit,
) {
    let _open = OpenStream::new();
    let config = app.config.events.clone();
    loop {
        let batch =
            events::published_after_on(&app.db, caller.org_id, cursor, &filter, config.batch).await;
        let full = match batch {
            Ok(records) => {
                let full = records.len() as i64 >= config.batch;
                for record in records {
                    let Some(seq) = record.seq else { continue };
                    let event = Event::default()
                        .id(record.event.id.to_string())
                        .data(record.event.to_json());
                    tokio::select! {
                        sent = tx.send(event) => if sent.is_err() { return },
                        _ = stop.cancelled() => return,
                    }
                    cursor = seq;
                }
                full
            }
            Err(error) => {
                warn!(%error, org_id = %caller.org_id, "event stream read failed; retrying");
                false
            }
        };
        if full {
            continue;
        }
        tokio::select! {
            _ = tx.closed() => {
                debug!(org_id = %caller.org_id, "event stream client went away");
                return;
            }
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(config.poll_interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_lists_are_split_normalized_and_checked() {
        assert_eq!(
            parse_types(Some("sandbox.running, dev.berth.sandbox.stopped")).unwrap(),
            ["dev.berth.sandbox.running", "dev.berth.sandbox.stopped"]
        );
        assert!(parse_types(None).unwrap().is_empty());
        assert!(parse_types(Some("sandbox.exploded")).is_err());
    }
}
