//! The result consumer: one durable JetStream consumer (`reconciler`) on `{p}.result.>`; each
//! result is applied in one transaction and acked after the commit.
//!
//! Results of different sandboxes are applied concurrently (at most [`APPLY_CONCURRENCY`] at
//! once); those of one sandbox one at a time, in delivery order (each waits for the previous
//! one of its sandbox). The row lock and the generation fence in [`apply`] keep concurrent
//! applies correct; the order keeps them from ending as `Stale` needlessly.
//!
//! # Errors
//! A database error naks the message with [`RETRY_DELAY`], so it is applied later; an
//! undecodable message is terminated (it can never apply).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, AckKind};
use berth_schemas::state::{on_result, retries_elsewhere, Outcome, Reason, ResultDecision};
use berth_schemas::trace::{TraceParent, TRACEPARENT};
use berth_schemas::wire::{self, Command, CommandResult, ResultOutcome, StopFallback, StopMode};
use berth_schemas::{CommandId, CommandKind, SandboxId, SandboxState, Subjects};
use berth_store::commands::{self, CommandOutcome, Completion, Issued};
use berth_store::sandboxes::{self, ResultWrite};
use berth_store::{SandboxRow, StoreError};
use futures::StreamExt;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, instrument, warn, Instrument, Span};

use crate::health::{self, HealthConfig};
use crate::ReconcilerError;

/// How long a result whose apply failed waits before redelivery.
pub const RETRY_DELAY: Duration = Duration::from_secs(1);
/// How long JetStream waits for an ack before redelivering a result.
pub const ACK_WAIT: Duration = Duration::from_secs(30);
/// Results applied at once by default (each holds one database connection for its
/// transaction; `--result-concurrency`). One at a time capped the control plane at about 200
/// results/s (`berth bench --runtime sim`); at 200 sim hosts, 24 at once sustained 263
/// lifecycle commands/s where 8 sustained 199 (`tests/bench/RESULTS.md`, 2026-12-06).
pub const APPLY_CONCURRENCY: usize = 24;

/// Makes the streams (if missing) and the reconciler's durable consumer, and opens its message
/// stream.
///
/// Errors: [`ReconcilerError::JetStream`] with the client's error.
async fn subscribe(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<consumer::pull::Stream, ReconcilerError> {
    berth_schemas::streams::ensure_streams(js, subjects)
        .await
        .map_err(|e| ReconcilerError::JetStream(e.to_string()))?;
    let stream = js
        .get_stream(subjects.result_stream())
        .await
        .map_err(|e| ReconcilerError::JetStream(e.to_string()))?;
    let consumer = stream
        .get_or_create_consumer(
            &subjects.reconciler_consumer(),
            consumer::pull::Config {
                durable_name: Some(subjects.reconciler_consumer()),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: ACK_WAIT,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| ReconcilerError::JetStream(e.to_string()))?;
    berth_schemas::streams::pull_messages(&consumer)
        .await
        .map_err(|e| ReconcilerError::JetStream(e.to_string()))
}

/// [`subscribe`] until it succeeds (every [`RETRY_DELAY`]): a JetStream cluster still electing
/// its leaders (all of it just started, or a node was lost) times requests out for a while.
/// `None` once `shutdown` fires.
async fn subscribed(
    js: &jetstream::Context,
    subjects: &Subjects,
    shutdown: &CancellationToken,
) -> Option<consumer::pull::Stream> {
    loop {
        match subscribe(js, subjects).await {
            Ok(messages) => return Some(messages),
            Err(error) => {
                warn!(%error, "result consumer: JetStream not ready yet; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    _ = tokio::time::sleep(RETRY_DELAY) => {}
                }
            }
        }
    }
}

/// Consumes results until `shutdown` fires, judging hosts' health and retrying failed
/// creates as `health` says, applying at most `concurrency` at once (at least one; each holds
/// one of `db`'s connections while it applies).
pub async fn consume(
    subjects: &Subjects,
    db: &PgPool,
    nats: async_nats::Client,
    health: HealthConfig,
    concurrency: usize,
    shutdown: CancellationToken,
) -> Result<(), ReconcilerError> {
    let js = jetstream::new(nats.clone());
    let Some(mut messages) = subscribed(&js, subjects, &shutdown).await else {
        return Ok(());
    };
    metrics::describe_counter!(
        "berth_result_resubscribes_total",
        "Times the result consumer lost its pull (consumer leader killed or moved, consumer \
         stopped by a JetStream node) and subscribed again"
    );
    metrics::counter!("berth_result_resubscribes_total").increment(0);
    metrics::describe_counter!(
        "berth_results_rejected_total",
        "Host results not believed (forged or misrouted), by reason; none of them was applied"
    );
    for why in Rejection::ALL {
        metrics::counter!("berth_results_rejected_total", "reason" => why.label()).increment(0);
    }
    let wake = OutboxWake {
        nats: nats.clone(),
        subject: subjects.outbox_wake(),
    };
    let limit = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
    let mut chains: HashMap<SandboxId, tokio::task::JoinHandle<()>> = HashMap::new();
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break,
            msg = messages.next() => match msg {
                Some(Ok(msg)) => msg,
                // The pull is lost or ended: its consumer's leader was killed or moved (missed
                // idle heartbeats), or a node stopped the consumer (`409 Consumer Deleted`,
                // after which the stream ends). Only a new pull gets results again; the
                // process must not end, nor wait for the old request to expire.
                lost => {
                    let error = lost.and_then(Result::err).map(|e| e.to_string());
                    let error = error.as_deref().unwrap_or("the message stream ended");
                    warn!(error, "result pull lost; resubscribing");
                    metrics::counter!("berth_result_resubscribes_total").increment(1);
                    // The old stream goes now, not when the new one replaces it: alive, it
                    // sends a pull of its own when the client reconnects, and a result
                    // delivered to it before it is dropped is never applied nor acked (it
                    // waits ACK_WAIT for redelivery; seen after a NATS restart).
                    drop(messages);
                    // A pause, so a stream that fails at once does not spin.
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(RETRY_DELAY) => {}
                    }
                    match subscribed(&js, subjects, &shutdown).await {
                        Some(m) => messages = m,
                        None => break,
                    }
                    continue;
                }
            },
        };
        let result: CommandResult = match wire::decode(&msg.payload) {
            Ok(r) => r,
            Err(error) => {
                warn!(%error, "terminating undecodable result");
                let _ = msg.ack_with(AckKind::Term).await;
                continue;
            }
        };
        if subjects.host_of_result(&msg.subject) != Some(result.host_id) {
            // Only the host itself may publish on its result subject (NATS permissions); a
            // payload naming another host is forged or misrouted.
            reject(&result, Rejection::SubjectMismatch, &msg.subject);
            let _ = msg.ack_with(AckKind::Term).await;
            continue;
        }
        chains.retain(|_, h| !h.is_finished());
        let previous = chains.remove(&result.sandbox_id);
        let permit = limit
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (db, sandbox_id, wake) = (db.clone(), result.sandbox_id, wake.clone());
        let span = apply_span(msg.headers.as_ref(), &result);
        chains.insert(
            sandbox_id,
            tokio::spawn(
                async move {
                    if let Some(previous) = previous {
                        // A panicked predecessor is logged by the runtime; only order matters.
                        let _ = previous.await;
                    }
                    handle(&db, msg, result, &health, &wake).await;
                    drop(permit);
                }
                .instrument(span),
            ),
        );
    }
    // Let the applies in progress finish (each acks its message); the rest is redelivered.
    futures::future::join_all(chains.into_values()).await;
    Ok(())
}

/// The span a result is applied in: a child of the hostd span that published it, when the
/// result carries a `traceparent` header (hostd writes one whose trace id is the command id),
/// otherwise a span in the command's trace with no known parent. Records `trace_id`,
/// `parent_id` (the hostd span, or empty) and its own `span_id`.
pub fn apply_span(headers: Option<&async_nats::HeaderMap>, result: &CommandResult) -> Span {
    let (trace, parent) = trace_context(headers, result.command_id);
    info_span!("result.apply", command_id = %result.command_id,
        trace_id = %trace.trace_id_hex(), parent_id = %parent, span_id = %trace.parent_id_hex())
}

/// The context of a result's apply span: (its own context, whose parent id is the new span's
/// id; the hex id of the span it continues, or empty when the result carried no valid
/// `traceparent`).
pub fn trace_context(
    headers: Option<&async_nats::HeaderMap>,
    command: CommandId,
) -> (TraceParent, String) {
    let received = headers
        .and_then(|h| h.get(TRACEPARENT))
        .and_then(|v| TraceParent::parse(v.as_str()));
    match received {
        // Only a context of this command's own trace is continued.
        Some(tp) if tp.trace_id == *command.as_uuid().as_bytes() => {
            (tp.child(rand::random()), tp.parent_id_hex())
        }
        _ => (
            TraceParent::for_command(command, rand::random()),
            String::new(),
        ),
    }
}

/// Wakes the API processes' relays after a commit wrote what they publish (core NATS
/// `{p}.outbox.wake`; the relays poll as well, so a lost wake only delays).
#[derive(Clone)]
pub struct OutboxWake {
    /// The control plane's connection.
    pub nats: async_nats::Client,
    /// `{p}.outbox.wake`.
    pub subject: String,
}

impl OutboxWake {
    /// Publishes the wake; a failure is logged (the relays' poll covers it).
    pub async fn wake(&self) {
        if let Err(error) = self
            .nats
            .publish(self.subject.clone(), Vec::new().into())
            .await
        {
            debug!(%error, "outbox wake not published");
        }
    }
}

/// Whether applying a result of `kind` as `applied` gave the relays something: an event or a
/// command was written, or a boot finished (a start held back for its host's cap may go).
fn wakes_relay(kind: CommandKind, applied: Applied) -> bool {
    let wrote = !matches!(
        applied,
        Applied::Stale | Applied::Duplicate | Applied::Unknown | Applied::Rejected(_)
    );
    wrote || matches!(kind, CommandKind::Create | CommandKind::Start)
}

/// Why an archive failed when the control plane's chunk check refused its stop snapshot (a
/// chunk its upload skipped as stored was claimed by a concurrent chunk removal): the user
/// reads it as the event's message and `state_reason`.
pub const ARCHIVE_LOST_CHUNKS: &str = "archive's upload lost chunks to a concurrent snapshot \
     delete; the sandbox keeps its disk; archive again";

/// Why an archive failed when its manifest was removed by the object store sweep before its
/// report was applied (the report came after the sweep's grace period; the copy may be gone).
pub const ARCHIVE_MANIFEST_SWEPT: &str = "archive's stored copy was removed from the object \
     store as an orphan before its report was applied; the sandbox keeps its disk; archive again";

/// Why an archive failed when its stored copy could not be judged: its command's row is gone,
/// so no time is known to be before its upload's look at the store.
pub const ARCHIVE_NO_COMMAND: &str = "archive's command is no longer known, so its stored copy \
     cannot be checked; the sandbox keeps its disk; archive again";

/// Why an archive failed when the sandbox's row no longer took its copy (its generation or
/// state moved on in the same transaction).
pub const ARCHIVE_NOT_RECORDED: &str = "archive's stored copy could not be recorded: the \
     sandbox moved on; the sandbox keeps its disk; archive again";

/// Why an archive failed when its report came more than `chunks::REMOVAL_RETENTION` (7 days)
/// after its command was inserted: the chunk removals that finished since may be forgotten,
/// so its copy cannot be checked.
pub const ARCHIVE_TOO_OLD: &str = "archive's stored copy was reported more than 7 days after \
     the archive was requested, too late to be checked; the sandbox keeps its disk; archive again";

/// Why a snapshot failed when its upload's report came more than `chunks::REMOVAL_RETENTION`
/// (7 days) after its row was inserted: its chunks can no longer be checked against the
/// removals that finished since.
pub const SNAPSHOT_TOO_OLD: &str = "its upload was reported more than 7 days after it was \
     requested, too late to be checked against chunk removals; take the snapshot again";

/// The reason an archive fails for a copy [`crate::durable::record`] refused.
fn archive_refusal(refused: crate::durable::Refused) -> &'static str {
    use crate::durable::Refused;
    match refused {
        Refused::LostChunks => ARCHIVE_LOST_CHUNKS,
        Refused::ManifestSwept => ARCHIVE_MANIFEST_SWEPT,
        Refused::NoCommand => ARCHIVE_NO_COMMAND,
        Refused::NotWritten => ARCHIVE_NOT_RECORDED,
        Refused::TooOld => ARCHIVE_TOO_OLD,
    }
}

/// Applies one result, then acks it (or naks it for a retry when the database failed).
async fn handle(
    db: &PgPool,
    msg: jetstream::Message,
    result: CommandResult,
    health: &HealthConfig,
    wake: &OutboxWake,
) {
    let started = Instant::now();
    let applied = apply_timed(db, &result, health).await;
    let (applied, latency) = match applied {
        Ok((applied, latency)) => (Ok(applied), latency),
        Err(error) => (Err(error), None),
    };
    if let Ok(applied) = &applied {
        if wakes_relay(result.kind, *applied) {
            wake.wake().await;
        }
    }
    match applied {
        Ok(Applied::Rejected(why)) => {
            reject(&result, why, &msg.subject);
            let _ = msg.ack_with(AckKind::Term).await;
        }
        Ok(applied) => {
            metrics::histogram!("berth_result_apply_duration_seconds")
                .record(started.elapsed().as_secs_f64());
            metrics::counter!("berth_results_total", "kind" => result.kind.as_str(), "applied" => applied.label())
                .increment(1);
            if let (Applied::Transitioned { .. }, Some(seconds)) = (applied, latency) {
                crate::gauges::observe_command_latency(&result, seconds);
            }
            if let Err(error) = msg.ack().await {
                warn!(%error, "result ack failed; it will be redelivered and ignored");
            }
        }
        Err(error) => {
            warn!(%error, command_id = %result.command_id, "result apply failed; retrying");
            let _ = msg.ack_with(AckKind::Nak(Some(RETRY_DELAY))).await;
        }
    }
}

/// Counts and logs a result that is not believed; it is never applied.
fn reject(result: &CommandResult, why: Rejection, subject: &str) {
    metrics::counter!("berth_results_rejected_total", "reason" => why.label()).increment(1);
    if why == Rejection::NotPlacement {
        // The normal end of a cleanup on a host the sandbox no longer lives on.
        info!(%subject, command_id = %result.command_id, sandbox_id = %result.sandbox_id,
            host_id = %result.host_id, kind = %result.kind, "result of a host off the placement: not applied");
        return;
    }
    warn!(reason = why.label(), %subject, command_id = %result.command_id,
        sandbox_id = %result.sandbox_id, host_id = %result.host_id, kind = %result.kind,
        generation = %result.generation, "result rejected");
}

/// Why a result was not believed (`berth_results_rejected_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// The payload's host is not the host of the subject it arrived on.
    SubjectMismatch,
    /// No such command in the outbox: never issued (or purged with its sandbox).
    UnknownCommand,
    /// The command was issued to another host.
    WrongHost,
    /// The command was issued for another sandbox, generation or kind than the result says.
    Mismatch,
    /// The command was the reporting host's, but the sandbox is placed on another host (a
    /// compensation or orphan cleanup there): the command completes, the row is not touched.
    NotPlacement,
}

impl Rejection {
    /// Every reason.
    pub const ALL: [Rejection; 5] = [
        Rejection::SubjectMismatch,
        Rejection::UnknownCommand,
        Rejection::WrongHost,
        Rejection::Mismatch,
        Rejection::NotPlacement,
    ];

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Rejection::SubjectMismatch => "subject_mismatch",
            Rejection::UnknownCommand => "unknown_command",
            Rejection::WrongHost => "wrong_host",
            Rejection::Mismatch => "mismatch",
            Rejection::NotPlacement => "not_placement",
        }
    }
}

/// What [`apply`] did with a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The row moved to `to`.
    Transitioned {
        /// The state written.
        to: SandboxState,
    },
    /// The row's generation has moved on (or the host refused the command as stale).
    Stale,
    /// The generation matched but the row is not where this result leads from (a duplicate).
    Duplicate,
    /// No such sandbox (purged).
    Unknown,
    /// A success that contradicted the row's terminal state: a compensating command was queued.
    Compensated,
    /// A create its host failed (the host's fault) was sent to another host; the row stays
    /// `provisioning` there.
    Retried {
        /// The host the create now goes to.
        to: berth_schemas::HostId,
    },
    /// The result does not match the command the outbox issued, or comes from a host the
    /// sandbox is not placed on: nothing of it was applied.
    Rejected(Rejection),
    /// A snapshot's row settled in this state (its sandbox row is unchanged).
    Snapshot(berth_schemas::state::snapshot::SnapshotState),
    /// A stop snapshot was recorded durable (`durable_at`); the state is unchanged.
    Durable,
}

impl Applied {
    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Applied::Transitioned { .. } => "transitioned",
            Applied::Stale => "stale",
            Applied::Duplicate => "duplicate",
            Applied::Unknown => "unknown",
            Applied::Compensated => "compensated",
            Applied::Retried { .. } => "retried",
            Applied::Rejected(_) => "rejected",
            Applied::Snapshot(_) => "snapshot",
            Applied::Durable => "durable",
        }
    }
}

/// Applies one result in one transaction: believe it only if the outbox issued its command to
/// its host for its sandbox, generation and kind, and the sandbox is placed on that host
/// ([`Applied::Rejected`] otherwise, with nothing written but, for a command of that host's
/// that no longer concerns the placement, its completion); fence on generation, decide with the state machine
/// ([`on_result`]), and have the store write the decision (state, capacity, event), a
/// compensation, or nothing; the command is marked completed either way. Idempotent: applying
/// the same result again returns [`Applied::Duplicate`] and writes nothing. A transaction that
/// Postgres aborts (deadlock, serialization) is run again. Host health and retries follow the
/// default [`HealthConfig`]; see [`apply_with`].
pub async fn apply(db: &PgPool, result: &CommandResult) -> Result<Applied, StoreError> {
    apply_with(db, result, &HealthConfig::default()).await
}

/// [`apply`], judging host health and retrying failed creates as `health` says: a boot's
/// result that moves its row also counts for (or against) its host ([`health::record_result`]),
/// and a create its host failed by its own fault goes to another host once
/// ([`retries_elsewhere`], [`Applied::Retried`]) instead of failing, when one can take it.
#[instrument(skip_all, fields(sandbox_id = %result.sandbox_id, host_id = %result.host_id,
    command_id = %result.command_id, kind = %result.kind, generation = %result.generation))]
pub async fn apply_with(
    db: &PgPool,
    result: &CommandResult,
    health: &HealthConfig,
) -> Result<Applied, StoreError> {
    Ok(apply_timed(db, result, health).await?.0)
}

/// [`apply_with`], with the seconds from the command's insert to its completion when this
/// apply completed it (for `berth_command_latency_seconds`).
async fn apply_timed(
    db: &PgPool,
    result: &CommandResult,
    health: &HealthConfig,
) -> Result<(Applied, Option<f64>), StoreError> {
    berth_store::retry_transaction(|| apply_once(db, result, health)).await
}

async fn apply_once(
    db: &PgPool,
    result: &CommandResult,
    health: &HealthConfig,
) -> Result<(Applied, Option<f64>), StoreError> {
    let mut tx = db.begin().await?;
    let completed = match &result.outcome {
        ResultOutcome::Succeeded { .. }
        | ResultOutcome::StoppedOnDisk { .. }
        | ResultOutcome::Snapshotted(_)
        | ResultOutcome::Durable(_) => CommandOutcome::Succeeded,
        ResultOutcome::Failed { .. } | ResultOutcome::Rejected { .. } => CommandOutcome::Failed,
        ResultOutcome::RefusedStale { .. } => CommandOutcome::RefusedStale,
    };
    let expected = Issued {
        sandbox_id: result.sandbox_id,
        host_id: result.host_id,
        generation: result.generation,
        kind: result.kind,
    };
    let completion = commands::complete_issued(
        &mut tx,
        result.command_id,
        expected,
        completed,
        result.heartbeat_seq,
    )
    .await?;
    match completion {
        Completion::NotAsIssued(None) => Ok((Applied::Rejected(Rejection::UnknownCommand), None)),
        Completion::NotAsIssued(Some(issued)) if issued.host_id != result.host_id => {
            Ok((Applied::Rejected(Rejection::WrongHost), None))
        }
        Completion::NotAsIssued(Some(_)) => Ok((Applied::Rejected(Rejection::Mismatch), None)),
        Completion::Completed { latency } => {
            Ok((apply_issued(tx, result, health).await?, Some(latency)))
        }
        Completion::AlreadyCompleted => Ok((apply_issued(tx, result, health).await?, None)),
    }
}

/// The rest of [`apply_once`], for a result whose command was issued as it says (and is
/// completed now in `tx`): the row is fenced, decided and written, and `tx` committed.
async fn apply_issued(
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    result: &CommandResult,
    health: &HealthConfig,
) -> Result<Applied, StoreError> {
    if result.kind == CommandKind::Snapshot {
        // A snapshot settles its own row; the sandbox's state and generation do not move.
        let applied = crate::snapshots::apply(&mut tx, result).await?;
        tx.commit().await?;
        return Ok(applied);
    }
    if let (CommandKind::Stop, ResultOutcome::Durable(durable)) = (result.kind, &result.outcome) {
        // A stop's second result: its snapshot is stored; the state does not move.
        let applied = crate::durable::apply_stop(&mut tx, result, durable).await?;
        tx.commit().await?;
        return Ok(applied);
    }
    let Some(row) = sandboxes::lock(&mut tx, result.sandbox_id, None).await? else {
        tx.commit().await?;
        return Ok(Applied::Unknown);
    };
    if row.host_id != Some(result.host_id) {
        if let ResultOutcome::Durable(durable) = &result.outcome {
            // A late archive from a host the sandbox has left: what it stored no row names.
            crate::durable::forget(&mut tx, &row, durable).await?;
        }
        tx.commit().await?;
        return Ok(Applied::Rejected(Rejection::NotPlacement));
    }
    let (mut outcome, address, last_stop, mut message) = match &result.outcome {
        ResultOutcome::Succeeded { address, last_stop } => {
            (Outcome::Succeeded, address.as_deref(), *last_stop, None)
        }
        // A memory stop that kept the disk only: a stop like any other, its reason kept below.
        ResultOutcome::StoppedOnDisk { .. } => {
            (Outcome::Succeeded, None, Some(StopMode::Disk), None)
        }
        // An archive's success: its stop snapshot is stored whole, its disk still on its host
        // until the delete queued with `archived` frees it (below).
        ResultOutcome::Durable(_) => (Outcome::Succeeded, None, None, None),
        ResultOutcome::Failed { reason } | ResultOutcome::Rejected { reason } => {
            (Outcome::Failed, None, None, Some(reason.as_str()))
        }
        ResultOutcome::Snapshotted(_) => {
            warn!("a snapshot's outcome for a command of another kind; ignored");
            tx.commit().await?;
            return Ok(Applied::Duplicate);
        }
        ResultOutcome::RefusedStale { applied } => {
            info!(applied = %applied, "host refused a stale command");
            tx.commit().await?;
            return Ok(Applied::Stale);
        }
    };
    if result.generation != row.generation {
        debug!(row_generation = %row.generation, "stale result ignored");
        if let ResultOutcome::Durable(durable) = &result.outcome {
            // A late archive (timed out, or its sandbox moved on): what it stored no row names.
            crate::durable::forget(&mut tx, &row, durable).await?;
        }
        tx.commit().await?;
        return Ok(Applied::Stale);
    }
    let mut decision = on_result(row.state, row.deleting(), result.kind, outcome);
    // Whether `archived` is written: its host's copy is then freed.
    let mut archived = false;
    if let ResultOutcome::Durable(durable) = &result.outcome {
        match decision {
            // `archived` only with its durable stop snapshot recorded (guarantee 9). The host
            // kept the disk: a copy the chunk check refuses fails the archive, and the sandbox
            // stays `stopped` there with its disk (issue 14, rule 1).
            ResultDecision::Apply { .. } => {
                // Checked against the archive command's insert: the host looked at the store
                // after it, and no settings change moves it (the row's `updated_at` does).
                match crate::durable::record(
                    &mut tx,
                    &row,
                    row.generation,
                    durable,
                    result.command_id,
                )
                .await?
                {
                    Ok(()) => archived = true,
                    Err(refused) => {
                        crate::durable::forget(&mut tx, &row, durable).await?;
                        outcome = Outcome::Failed;
                        message = Some(archive_refusal(refused));
                        decision = on_result(row.state, row.deleting(), result.kind, outcome);
                    }
                }
            }
            // A duplicate, or an archive whose sandbox is being deleted: named by no row (a
            // duplicate's is, and is kept), it goes to the collector.
            ResultDecision::Compensate(_) | ResultDecision::Ignore => {
                crate::durable::forget(&mut tx, &row, durable).await?;
            }
        }
    }
    if let ResultDecision::Apply { .. } = decision {
        // The first time this boot's result moves the row: it counts for its host's health.
        health::record_result(&mut tx, result, &health.policy).await?;
    }
    if let (ResultDecision::Apply { .. }, Some(fault), Some(message)) =
        (decision, result.outcome.fault(), message)
    {
        let tried = commands::creates_issued(&mut tx, row.id).await?;
        if retries_elsewhere(row.state, row.deleting(), result.kind, fault, tried) {
            if let Some(to) =
                health::retry_elsewhere(&mut tx, &row, result.host_id, message, health).await?
            {
                tx.commit().await?;
                return Ok(Applied::Retried { to });
            }
        }
    }
    let applied = match decision {
        ResultDecision::Apply { to, capacity } => {
            if to == SandboxState::Running {
                // A migration landed: the old host's copy is stale from now on (issue 14).
                if let Some(cleanup) = sandboxes::leave_old_host(&mut tx, &row).await? {
                    info!(cleanup_id = %cleanup, "migrated; the old host's copy is deleted");
                }
            }
            let reason = match outcome {
                Outcome::Failed => Reason::RuntimeError,
                Outcome::Succeeded => Reason::HostReport,
            };
            sandboxes::write_result(
                &mut tx,
                &row,
                &ResultWrite {
                    to,
                    capacity,
                    reason,
                    command_id: result.command_id,
                    address,
                    last_stop,
                    stop_fallback: stop_fallback(&result.outcome),
                    message,
                },
            )
            .await?;
            if archived {
                // Two-phase free: the host's disk goes only now, by the control plane's word.
                let free = sandboxes::free_archived_copy(&mut tx, &row, result.host_id).await?;
                info!(delete_id = %free, "archived; the host's copy is freed");
            }
            info!(from = %row.state, to = %to, "result applied");
            Applied::Transitioned { to }
        }
        // Once per generation: a redelivered late success finds its compensation queued.
        ResultDecision::Compensate(kind)
            if !commands::exists(&mut tx, row.id, row.generation, kind).await? =>
        {
            compensate(&mut tx, result, &row, kind).await?;
            Applied::Compensated
        }
        ResultDecision::Compensate(_) | ResultDecision::Ignore => Applied::Duplicate,
    };
    tx.commit().await?;
    Ok(applied)
}

/// Why a stop kept the disk only, when the host said so ([`ResultOutcome::StoppedOnDisk`]).
fn stop_fallback(outcome: &ResultOutcome) -> Option<&StopFallback> {
    match outcome {
        ResultOutcome::StoppedOnDisk { fallback } => Some(fallback),
        _ => None,
    }
}

/// Queues `kind` for the sandbox on the host that reported, at the row's generation (never
/// older than what the host applied, so the host's fence lets it through). The row is not
/// changed.
async fn compensate(
    conn: &mut PgConnection,
    result: &CommandResult,
    row: &SandboxRow,
    kind: CommandKind,
) -> Result<(), StoreError> {
    let command = Command {
        snapshot: None,
        id: CommandId::new(),
        sandbox_id: row.id,
        generation: row.generation,
        kind,
        spec: Some(row.spec()),
    };
    commands::insert(conn, result.host_id, &command).await?;
    metrics::counter!("berth_compensations_total", "kind" => kind.as_str()).increment(1);
    warn!(compensation = %kind, compensation_id = %command.id, "late success contradicts the row; compensating");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_continues_the_trace_of_its_command_from_the_hostd_span() {
        let command = CommandId::new();
        let hostd = TraceParent::for_command(command, [0x11; 8]);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(TRACEPARENT, hostd.to_header().as_str());
        let (own, parent) = trace_context(Some(&headers), command);
        assert_eq!(own.trace_id, hostd.trace_id);
        assert_eq!(parent, "1111111111111111");
        assert_ne!(
            own.parent_id, hostd.parent_id,
            "the apply span has its own id"
        );
    }

    #[test]
    fn the_too_old_reasons_name_the_removal_retention() {
        assert_eq!(
            berth_store::chunks::REMOVAL_RETENTION,
            std::time::Duration::from_secs(7 * 24 * 60 * 60),
            "ARCHIVE_TOO_OLD and SNAPSHOT_TOO_OLD say 7 days"
        );
        assert!(ARCHIVE_TOO_OLD.contains("7 days") && SNAPSHOT_TOO_OLD.contains("7 days"));
    }

    #[test]
    fn a_missing_or_foreign_traceparent_starts_from_the_command_id() {
        let command = CommandId::new();
        let (own, parent) = trace_context(None, command);
        assert_eq!(own.trace_id, *command.as_uuid().as_bytes());
        assert!(parent.is_empty());
        let mut headers = async_nats::HeaderMap::new();
        let other = TraceParent::for_command(CommandId::new(), [0x22; 8]);
        headers.insert(TRACEPARENT, other.to_header().as_str());
        let (own, parent) = trace_context(Some(&headers), command);
        assert_eq!(own.trace_id, *command.as_uuid().as_bytes());
        assert!(parent.is_empty());
    }
}
