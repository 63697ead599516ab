//! The command consumer: a durable JetStream pull consumer per host on `{p}.cmd.<host_id>`.
//!
//! # Guarantees
//! - Commands of one sandbox are applied in delivery order, one at a time; different
//!   sandboxes proceed concurrently. (Each command's task first awaits the previous task of
//!   the same sandbox.)
//! - A command is acked only after its result was published to `{p}.result.<host_id>` and
//!   JetStream acknowledged that publish.
//! - The trace continues: the apply span records the command's `traceparent` (its trace id
//!   and parent id; [`TraceParent::for_command`] when the header is missing or invalid), and
//!   the result carries a `traceparent` of the same trace whose parent id is the apply span's
//!   own id, so the reconciler's span becomes its child. If the publish fails the command is nak'd; the
//!   redelivery republishes the stored result (see `fence`).
//! - A message that does not decode is terminated (acked without redelivery) and logged.
//! - Long work extends the ack deadline with progress acks, so JetStream does not redeliver a
//!   command that is still being worked on.
//! - A stop's background upload that a previous run of this hostd did not finish is started
//!   again, first in its sandbox's chain ([`StopRef::pending_in`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind};
use async_nats::HeaderMap;
use berth_schemas::trace::{TraceParent, TRACEPARENT};
use berth_schemas::wire::{self, Command, CommandResult, ResultOutcome};
use berth_schemas::{CommandId, CommandKind, SandboxId, Subjects};
use futures::StreamExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::apply::archive::{StopRef, StopReport};
use crate::apply::{self, Applied, ApplyTrace};
use crate::error::HostdError;
use crate::host::Host;

/// How long JetStream waits for an ack before redelivering a command.
pub const ACK_WAIT: Duration = Duration::from_secs(15);

/// How often a command still being worked on extends its ack deadline.
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

/// How long a nak'd command (delete that must be retried, result not published) waits.
pub const RETRY_DELAY: Duration = Duration::from_secs(5);

/// Pause before resubscribing after the message stream broke.
const RESUBSCRIBE_DELAY: Duration = Duration::from_secs(1);

/// How long shutdown waits for commands in progress.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Consumes commands until `shutdown`, then waits (up to [`SHUTDOWN_GRACE`]) for those in
/// progress. Un-acked commands are redelivered to the next run.
///
/// Errors: [`HostdError::Nats`] when the command stream does not exist.
pub async fn consume(
    host: Arc<Host>,
    js: jetstream::Context,
    subjects: Subjects,
    shutdown: CancellationToken,
) -> Result<(), HostdError> {
    let stream = js
        .get_stream(subjects.cmd_stream())
        .await
        .map_err(HostdError::nats("look up the command stream"))?;
    let name = subjects.host_consumer(host.host_id);
    let config = pull::Config {
        durable_name: Some(name.clone()),
        filter_subject: subjects.cmd(host.host_id),
        ack_policy: AckPolicy::Explicit,
        ack_wait: ACK_WAIT,
        deliver_policy: DeliverPolicy::All,
        ..Default::default()
    };
    let result_subject = subjects.result(host.host_id);
    let mut chains: HashMap<SandboxId, JoinHandle<()>> = HashMap::new();
    resume_uploads(&host, &js, &result_subject, &mut chains);

    // A previous run of this host may have died holding commands it never acked. Recreating
    // the durable consumer redelivers them now instead of after their ack wait: the stream is a
    // work queue, so everything still in it is unacked, and applying is idempotent (command id
    // and generation fence). One hostd owns a host id, so nothing else consumes here.
    match stream.delete_consumer(&name).await {
        Ok(_) => tracing::debug!(consumer = %name, "recreating the host consumer"),
        Err(e) => tracing::debug!(error = %e, "no previous host consumer to recreate"),
    }
    'resubscribe: while !shutdown.is_cancelled() {
        let messages = async {
            let consumer: PullConsumer = stream
                .get_or_create_consumer(&name, config.clone())
                .await
                .map_err(HostdError::nats("create the host consumer"))?;
            berth_schemas::streams::pull_messages(&consumer)
                .await
                .map_err(HostdError::nats("pull commands"))
        };
        let mut messages = match messages.await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e.report(), "command subscription failed; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => break 'resubscribe,
                    _ = tokio::time::sleep(RESUBSCRIBE_DELAY) => continue 'resubscribe,
                }
            }
        };
        tracing::info!(consumer = %name, "consuming commands");
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break 'resubscribe,
                next = messages.next() => match next {
                    Some(Ok(message)) => {
                        dispatch(&host, &js, &result_subject, &mut chains, message);
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "command stream error; resubscribing");
                        // The old stream goes before the pause: alive, it would pull again
                        // when the client reconnects, and a command delivered to it would
                        // wait its ack wait for redelivery.
                        drop(messages);
                        tokio::time::sleep(RESUBSCRIBE_DELAY).await;
                        continue 'resubscribe;
                    }
                    None => continue 'resubscribe,
                },
            }
        }
    }

    // `chains` holds the last task of each sandbox, which awaits the ones before it.
    let in_progress: Vec<JoinHandle<()>> =
        chains.into_values().filter(|h| !h.is_finished()).collect();
    tracing::info!(in_progress = in_progress.len(), "command consumer stopping");
    let drain = futures::future::join_all(in_progress);
    if tokio::time::timeout(SHUTDOWN_GRACE, drain).await.is_err() {
        tracing::warn!(grace = ?SHUTDOWN_GRACE, "commands still in progress at shutdown");
    }
    Ok(())
}

/// Decodes a message and chains its handling behind the sandbox's previous command.
fn dispatch(
    host: &Arc<Host>,
    js: &jetstream::Context,
    result_subject: &str,
    chains: &mut HashMap<SandboxId, JoinHandle<()>>,
    message: jetstream::Message,
) {
    let command = match wire::decode::<Command>(&message.payload) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(subject = %message.subject, error = %e, "undecodable command; terminating it");
            tokio::spawn(async move {
                if let Err(e) = message.ack_with(AckKind::Term).await {
                    tracing::warn!(error = %e, "term of an undecodable command failed");
                }
            });
            return;
        }
    };
    chains.retain(|_, h| !h.is_finished());
    // A background stop upload of this sandbox gives way to its next command.
    host.uploads.cancel(command.sandbox_id);
    let previous = chains.remove(&command.sandbox_id);
    let span = tracing::info_span!(
        "command",
        host_id = %host.host_id,
        sandbox_id = %command.sandbox_id,
        command_id = %command.id,
        kind = %command.kind,
    );
    let (host, js, subject) = (host.clone(), js.clone(), result_subject.to_owned());
    let sandbox_id = command.sandbox_id;
    let task = async move {
        if let Some(previous) = previous {
            // A panicked predecessor is logged by the runtime; order is all that matters here.
            let _ = previous.await;
        }
        handle(&host, &js, &subject, message, command).await;
    };
    chains.insert(sandbox_id, tokio::spawn(task.instrument(span)));
}

/// The trace context a command message carries: its `traceparent` header, or
/// [`TraceParent::for_command`] when the header is missing or invalid.
pub fn incoming_trace(headers: Option<&HeaderMap>, command: CommandId) -> TraceParent {
    headers
        .and_then(|h| h.get(TRACEPARENT))
        .and_then(|value| TraceParent::parse(value.as_str()))
        .unwrap_or_else(|| TraceParent::for_command(command, [0; 8]))
}

/// Applies one command, publishes its result, then acks (or naks).
async fn handle(
    host: &Arc<Host>,
    js: &jetstream::Context,
    result_subject: &str,
    message: jetstream::Message,
    command: Command,
) {
    let trace = ApplyTrace::child_of(incoming_trace(message.headers.as_ref(), command.id));
    let work = apply::apply(host, &command, &trace);
    tokio::pin!(work);
    let start = tokio::time::Instant::now() + PROGRESS_INTERVAL;
    let mut progress = tokio::time::interval_at(start, PROGRESS_INTERVAL);
    let applied = loop {
        tokio::select! {
            applied = &mut work => break applied,
            _ = progress.tick() => {
                if let Err(e) = message.ack_with(AckKind::Progress).await {
                    tracing::debug!(error = %e, "progress ack failed");
                }
            }
        }
    };
    let stopped = matches!(&applied, Applied::Respond { result, .. }
        if command.kind == CommandKind::Stop
            && matches!(result.outcome, ResultOutcome::Succeeded { .. } | ResultOutcome::StoppedOnDisk { .. }));
    let settle = match applied {
        Applied::Respond { result, .. } => {
            match publish_result(js, result_subject, &result, &trace.outgoing()).await {
                Ok(()) => AckKind::Ack,
                Err(e) => {
                    tracing::warn!(error = %e.report(), "result not published; command will be redelivered");
                    AckKind::Nak(Some(RETRY_DELAY))
                }
            }
        }
        Applied::Retry { .. } => AckKind::Nak(Some(RETRY_DELAY)),
    };
    if let Err(e) = message.ack_with(settle).await {
        // Not acked: JetStream redelivers after the ack wait and the fence replays the result.
        tracing::warn!(error = %e, "settling the command message failed");
    }
    if stopped {
        // Issue 14: make the stop durable in the background (still in the sandbox's chain, so
        // its next command finds the disk as the upload left it; that command cancels it).
        let cancel = host.uploads.arm(command.sandbox_id);
        let stop = StopRef::of(&command);
        make_durable(host, js, result_subject, stop, cancel, &trace.outgoing()).await;
    }
}

/// Uploads `stop`'s snapshot (unless `cancel` fires first) and publishes its durability
/// report, a second result of the stop.
async fn make_durable(
    host: &Arc<Host>,
    js: &jetstream::Context,
    result_subject: &str,
    stop: StopRef,
    cancel: CancellationToken,
    trace: &TraceParent,
) {
    let upload = apply::archive::durable_after_stop(host, stop, cancel);
    match crate::fault::scope(CommandKind::Stop, upload).await {
        None => {}
        Some(StopReport::Now(report)) => publish_report(js, result_subject, &report, trace).await,
        Some(StopReport::Later(upload)) => {
            // Off the chain: the sandbox's next command goes on meanwhile.
            let (js, subject, trace) = (js.clone(), result_subject.to_owned(), *trace);
            tokio::spawn(
                async move {
                    if let Ok(Some(report)) = upload.await {
                        publish_report(&js, &subject, &report, &trace).await;
                    }
                }
                .in_current_span(),
            );
        }
    }
}

async fn publish_report(
    js: &jetstream::Context,
    subject: &str,
    report: &CommandResult,
    trace: &TraceParent,
) {
    if let Err(e) = publish_result(js, subject, report, trace).await {
        tracing::warn!(error = %e.report(), "stop durability report not published");
    }
}

/// Starts again, each first in its sandbox's chain, the background uploads a previous run of
/// this hostd did not finish: every stopped sandbox whose stop is not durable yet
/// ([`StopRef::pending_in`]). Its stop was acked before the upload began, so nothing would
/// redeliver it, and without a durable stop a start elsewhere is refused (issue 14). The report
/// names the stop's command and generation as usual: the reconciler ignores it if the sandbox
/// moved on meanwhile.
fn resume_uploads(
    host: &Arc<Host>,
    js: &jetstream::Context,
    result_subject: &str,
    chains: &mut HashMap<SandboxId, JoinHandle<()>>,
) {
    for record in host.snapshot() {
        let Some(stop) = StopRef::pending_in(&record) else {
            continue;
        };
        tracing::info!(sandbox_id = %stop.sandbox_id, generation = %stop.generation,
            "resuming the upload of a stop that is not durable");
        let cancel = host.uploads.arm(stop.sandbox_id);
        let trace = TraceParent::for_command(stop.command_id, [0; 8]);
        let (host, js, subject) = (host.clone(), js.clone(), result_subject.to_owned());
        let span = tracing::info_span!("resumed_upload", host_id = %host.host_id,
            sandbox_id = %stop.sandbox_id, command_id = %stop.command_id);
        let task = async move { make_durable(&host, &js, &subject, stop, cancel, &trace).await };
        chains.insert(stop.sandbox_id, tokio::spawn(task.instrument(span)));
    }
}

/// Publishes a result through JetStream, with `trace` as its `traceparent` header, and waits
/// for the stream's acknowledgement.
///
/// Errors: [`HostdError::Nats`].
pub async fn publish_result(
    js: &jetstream::Context,
    subject: &str,
    result: &CommandResult,
    trace: &TraceParent,
) -> Result<(), HostdError> {
    let mut headers = HeaderMap::new();
    headers.insert(TRACEPARENT, trace.to_header().as_str());
    js.publish_with_headers(subject.to_owned(), headers, wire::encode(result).into())
        .await
        .map_err(HostdError::nats("publish a result"))?
        .await
        .map_err(HostdError::nats("confirm a result"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commands_traceparent_header_is_its_trace() {
        let id = CommandId::new();
        let sent = TraceParent::for_command(id, [7; 8]);
        let mut headers = HeaderMap::new();
        headers.insert(TRACEPARENT, sent.to_header().as_str());
        assert_eq!(incoming_trace(Some(&headers), id), sent);
    }

    #[test]
    fn without_a_valid_header_the_trace_is_the_commands_id() {
        let id = CommandId::new();
        let mut garbage = HeaderMap::new();
        garbage.insert(TRACEPARENT, "not a traceparent");
        for headers in [None, Some(&garbage)] {
            let trace = incoming_trace(headers, id);
            assert_eq!(trace.trace_id, *id.as_uuid().as_bytes());
            assert_ne!(trace.parent_id, [0; 8]);
        }
    }

    #[test]
    fn a_result_continues_the_trace_with_the_apply_span_as_parent() {
        let parent = TraceParent::for_command(CommandId::new(), [7; 8]);
        let apply = ApplyTrace::child_of(parent);
        let out = apply.outgoing();
        assert_eq!(out.trace_id, parent.trace_id);
        assert_eq!(out.parent_id, apply.span_id);
        assert_ne!(out.parent_id, [0; 8]);
        assert_ne!(ApplyTrace::child_of(parent).span_id, apply.span_id);
    }
}
