//! The transactional outbox relay: publishes committed commands ([`relay`]) and committed
//! events ([`event_relay`]) to JetStream, through one loop and one publish pipeline.
//!
//! # Guarantees
//! - At least once: a row is marked published only after JetStream acked it; a crash between
//!   the ack and the mark re-publishes it, and JetStream drops the duplicate by `Nats-Msg-Id`
//!   (= the row's id) within its duplicate window.
//! - Several relays may run: rows are claimed with `FOR UPDATE SKIP LOCKED`.
//! - Woken after the commit that wrote the rows, never by a `NOTIFY` inside it (Postgres
//!   serializes the commits of notifying transactions; migration 0025): in process by
//!   [`wake`] (the API's use cases call it after committing), and over core NATS by
//!   `{p}.outbox.wake` (the reconciler publishes it after writing events or commands). A lost
//!   wake costs at most [`POLL_INTERVAL`].
//!
//! One round: claim a batch, publish it pipelined (one shared pipeline: every publish sent,
//! then every ack awaited), mark what was acked, repeat up to [`ROUND_BATCHES`] batches;
//! commands first, then events. While either outbox has more, the next round starts at once, so
//! a backlog of events never holds commands back for more than one bounded round (the 1,000-host
//! sim once stalled every create for minutes behind 67,000 unpublished events).

pub mod event_relay;
pub mod relay;

use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_nats::HeaderMap;
use berth_schemas::Subjects;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument, Span};

/// The polling fallback when no notification arrives.
pub const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// Wait after a failed batch before trying again.
pub const RETRY_DELAY: Duration = Duration::from_millis(500);
/// Batches each outbox (commands, events) publishes per round before the other has its turn.
pub const ROUND_BATCHES: usize = 4;

/// Connections of the relay's own pool ([`own_pool`]): one for its batch transaction, one for
/// its backlog gauges.
pub const POOL_SIZE: u32 = 2;

/// A pool of [`POOL_SIZE`] connections for the relay, with `api`'s connect options, opened
/// lazily. The relay never waits behind the API's requests for a connection: on the API's pool
/// it did, and under 250 creates/s in the 1,000-host sim it published about 180 commands/s
/// while every connection of that pool was held by a create (the outbox grew without bound).
pub fn own_pool(api: &PgPool) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .connect_lazy_with((*api.connect_options()).clone())
}

/// What one bounded drain did: how many rows it published, and whether it stopped at its
/// batch bound with rows left (the relay then starts its next round at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Drained {
    /// Rows acked by JetStream and marked published.
    pub published: usize,
    /// The drain stopped at its bound, not because the outbox was empty.
    pub more: bool,
}

/// This process's relays follow it; [`wake`] bumps it.
static LOCAL_WAKE: std::sync::LazyLock<tokio::sync::watch::Sender<u64>> =
    std::sync::LazyLock::new(|| tokio::sync::watch::channel(0).0);

/// Wakes this process's relays: call after committing a transaction that wrote commands or
/// events. Cheap; extra wakes cost an empty round.
pub fn wake() {
    LOCAL_WAKE.send_modify(|n| *n = n.wrapping_add(1));
}

/// For a process that commits use cases but runs no relay (`berth proxy`, whose preview wakes
/// start sandboxes): forwards each [`wake`] of this process to every relay as
/// `{p}.outbox.wake` until `shutdown` fires.
pub async fn forward_wakes(
    nats: async_nats::Client,
    subjects: Subjects,
    shutdown: CancellationToken,
) {
    let mut local = LOCAL_WAKE.subscribe();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = local.changed() => {}
        }
        if let Err(error) = nats.publish(subjects.outbox_wake(), Bytes::new()).await {
            debug!(%error, "outbox wake not forwarded");
        }
    }
}

/// Runs the relay until `shutdown` fires: commands, then events, each round. Errors are logged
/// and retried; the relay only returns on shutdown.
pub async fn run(
    db: PgPool,
    nats: async_nats::Client,
    subjects: Subjects,
    max_concurrent_starts: i64,
    shutdown: CancellationToken,
) {
    let js = jetstream::new(nats.clone());
    while let Err(error) = berth_schemas::streams::ensure_streams(&js, &subjects).await {
        warn!(%error, "relay: cannot ensure streams yet");
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(RETRY_DELAY) => {}
        }
    }
    let mut local = LOCAL_WAKE.subscribe();
    let mut remote = nats.subscribe(subjects.outbox_wake()).await.ok();
    info!("outbox relay running");
    loop {
        let commands =
            relay::drain(&db, &js, &subjects, max_concurrent_starts, ROUND_BATCHES).await;
        let delay = settle("outbox", commands);
        if let Err(error) = relay::record_backlog(&db).await {
            debug!(%error, "outbox gauges not updated");
        }
        // Events after commands, with the same ack-then-mark guarantee.
        let delay = delay.min(event_relay::round(&db, &js, &subjects).await);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = local.changed() => {}
            woken = next_wake(&mut remote) => {
                if !woken {
                    // The subscription ended (the client closed): subscribe again; the poll
                    // covers the gap.
                    remote = nats.subscribe(subjects.outbox_wake()).await.ok();
                }
            }
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// Logs how a drain of `what` went and says how long to wait before the next round: nothing
/// when it stopped at its bound with rows left, [`POLL_INTERVAL`] after it emptied the outbox,
/// [`RETRY_DELAY`] after a failure.
fn settle<E: std::fmt::Display>(what: &str, drained: Result<Drained, E>) -> Duration {
    match drained {
        Ok(drained) => {
            if drained.published > 0 {
                debug!(published = drained.published, what, "drained");
            }
            if drained.more {
                Duration::ZERO
            } else {
                POLL_INTERVAL
            }
        }
        Err(error) => {
            warn!(%error, what, "relay batch failed; retrying");
            RETRY_DELAY
        }
    }
}

/// Waits for the next `{p}.outbox.wake` and takes every other one already queued (one round
/// answers them all). False when the subscription ended; pending forever without one.
async fn next_wake(remote: &mut Option<async_nats::Subscriber>) -> bool {
    let Some(sub) = remote else {
        return std::future::pending().await;
    };
    if sub.next().await.is_none() {
        return false;
    }
    while let Some(Some(_)) = sub.next().now_or_never() {}
    true
}

/// One message of a batch: `key` says which row it came from.
pub(crate) struct Outgoing<K> {
    /// Names the row the message came from (returned when acked or failed).
    pub key: K,
    /// The JetStream subject.
    pub subject: String,
    /// Carries `Nats-Msg-Id` = the row's id, and whatever else the kind needs.
    pub headers: HeaderMap,
    /// The message body.
    pub payload: Bytes,
    /// The span the publish runs in.
    pub span: Span,
}

/// The `Nats-Msg-Id` headers of the row `id`: JetStream drops a re-publish within its duplicate
/// window by it.
pub(crate) fn msg_id_headers(id: impl std::fmt::Display) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, id.to_string().as_str());
    headers
}

/// Publishes `batch` in a pipeline (stops sending at the first failed send), then awaits the
/// acks, and records the batch's duration in the histogram `duration_metric`. Returns the keys
/// acked, in the order given, and the first failure (its key and why).
pub(crate) async fn publish_all<K>(
    js: &jetstream::Context,
    batch: Vec<Outgoing<K>>,
    duration_metric: &'static str,
) -> (Vec<K>, Option<(K, String)>) {
    let started = Instant::now();
    let mut pending = Vec::with_capacity(batch.len());
    let mut failure = None;
    for message in batch {
        match js
            .publish_with_headers(message.subject, message.headers, message.payload)
            .instrument(message.span)
            .await
        {
            Ok(ack) => pending.push((message.key, ack)),
            Err(e) => {
                failure = Some((message.key, e.to_string()));
                break;
            }
        }
    }
    let mut acked = Vec::with_capacity(pending.len());
    for (key, ack) in pending {
        match ack.await {
            Ok(_) => acked.push(key),
            Err(e) => {
                failure.get_or_insert((key, e.to_string()));
            }
        }
    }
    metrics::histogram!(duration_metric).record(started.elapsed().as_secs_f64());
    (acked, failure)
}
