//! JetStream stream definitions, shared so every component creates them identically
//! (whichever starts first creates; the rest find them).
//!
//! - `{P}_CMD` on `{p}.cmd.>`: commands, work-queue retention (a command is removed once its
//!   host acks it), deduplicated by `Nats-Msg-Id` = command id within [`DUPLICATE_WINDOW`].
//! - `{P}_RESULT` on `{p}.result.>`: results, work-queue retention, acked by the reconciler.
//! - `{P}_EVENTS` on `{p}.events.>`: lifecycle events as CloudEvents JSON, limits retention
//!   (kept for [`EVENTS_MAX_AGE`] whoever reads them), so any consumer can replay from any
//!   point; deduplicated by `Nats-Msg-Id` = event id within [`DUPLICATE_WINDOW`].
//!
//! Each is created with [`Subjects::stream_replicas`] copies (1 by default; 3 on a
//! three-node cluster, `--stream-replicas`), and its consumers inherit that count.

use std::time::Duration;

use async_nats::jetstream::consumer::StreamError;
use async_nats::jetstream::consumer::{pull, PullConsumer};
use async_nats::jetstream::{self, stream};

use crate::subjects::Subjects;

/// How long JetStream remembers a `Nats-Msg-Id` to drop a re-publish of the same command.
/// The relay re-publishes only commands it could not mark published, within seconds.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// How long the event stream keeps an event (limits retention): consumers can replay this far
/// back. The `events` table stays the durable record; this bounds the stream's disk.
pub const EVENTS_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

/// How often a consumer's leader sends an idle heartbeat on a pull request that has nothing
/// to deliver. Two missed ones (10 s) tell the client its pull is lost: the leader's node was
/// killed, and nothing will arrive on that request. async-nats' own default (15 s, and no new
/// pull before the old request's expiry + 5 s) stalled a consumer 30–35 s after the node of
/// its leader was killed (`tests/topology/faults.rs`).
pub const PULL_IDLE_HEARTBEAT: Duration = Duration::from_secs(5);

/// How long one pull request stays open on the server before the client sends the next. It
/// bounds the stall when leadership moved but the request stayed behind on a live node: that
/// node keeps heartbeating the request and delivers nothing (nats-server 2.9 does not release
/// waiting pulls when its consumer leader steps down; seen as a host that got no command for
/// 30 s after the meta leader's kill, with the default 30 s). Each consumer sends one pull per
/// period when idle.
pub const PULL_EXPIRES: Duration = Duration::from_secs(15);

/// The message stream of a durable pull consumer as every Berth consumer opens it: batches of
/// up to 200, [`PULL_IDLE_HEARTBEAT`], [`PULL_EXPIRES`]. Its consumer resubscribes on any
/// error or end of the stream (a missed heartbeat, `409 Consumer Deleted`, which nats-server
/// 2.9 also sends to waiting pulls when a node merely stops the consumer, no responders).
///
/// Errors: [`StreamError`] when the pull subscription cannot be made.
pub async fn pull_messages(consumer: &PullConsumer) -> Result<pull::Stream, StreamError> {
    consumer
        .stream()
        .max_messages_per_batch(200)
        .heartbeat(PULL_IDLE_HEARTBEAT)
        .expires(PULL_EXPIRES)
        .messages()
        .await
}

/// The event stream's definition.
pub fn events_stream_config(subjects: &Subjects) -> stream::Config {
    stream::Config {
        name: subjects.events_stream(),
        subjects: vec![subjects.events_all()],
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        max_age: EVENTS_MAX_AGE,
        duplicate_window: DUPLICATE_WINDOW,
        num_replicas: subjects.stream_replicas(),
        ..Default::default()
    }
}

/// Creates the command, result and event streams if they do not exist.
///
/// Errors: the JetStream error when a stream cannot be created or looked up.
pub async fn ensure_streams(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<(), async_nats::jetstream::context::CreateStreamError> {
    for (name, subject) in [
        (subjects.cmd_stream(), subjects.cmd_all()),
        (subjects.result_stream(), subjects.result_all()),
    ] {
        js.get_or_create_stream(stream::Config {
            name,
            subjects: vec![subject],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            duplicate_window: DUPLICATE_WINDOW,
            num_replicas: subjects.stream_replicas(),
            ..Default::default()
        })
        .await?;
    }
    js.get_or_create_stream(events_stream_config(subjects))
        .await?;
    Ok(())
}

/// Deletes every stream of `subjects` (tests clean up with this).
pub async fn delete_streams(js: &jetstream::Context, subjects: &Subjects) {
    let _ = js.delete_stream(subjects.cmd_stream()).await;
    let _ = js.delete_stream(subjects.result_stream()).await;
    let _ = js.delete_stream(subjects.events_stream()).await;
}
