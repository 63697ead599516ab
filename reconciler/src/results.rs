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
use berth_schemas::db::{insert_command, insert_event, NewEvent};
use berth_schemas::state::{on_result, Outcome, Reason, ResultDecision};
use berth_schemas::wire::{self, Command, CommandResult, Resources, ResultOutcome, SandboxSpec};
use berth_schemas::{
    CommandId, CommandKind, Generation, HostId, OrgId, SandboxId, SandboxState, Subjects,
};
use futures::StreamExt;
use sqlx::{PgPool, Row};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, instrument, warn};

use crate::ReconcilerError;

/// How long a result whose apply failed waits before redelivery.
pub const RETRY_DELAY: Duration = Duration::from_secs(1);
/// How long JetStream waits for an ack before redelivering a result.
pub const ACK_WAIT: Duration = Duration::from_secs(30);
/// Results applied at once (each holds one database connection for its transaction). One at a
/// time capped the control plane at about 200 results/s (`berth bench --runtime sim`).
pub const APPLY_CONCURRENCY: usize = 8;

/// Consumes results until `shutdown` fires.
pub async fn consume(
    subjects: &Subjects,
    db: &PgPool,
    nats: async_nats::Client,
    shutdown: CancellationToken,
) -> Result<(), ReconcilerError> {
    let js = jetstream::new(nats);
    berth_schemas::streams::ensure_streams(&js, subjects)
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
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| ReconcilerError::JetStream(e.to_string()))?;
    let limit = Arc::new(tokio::sync::Semaphore::new(APPLY_CONCURRENCY));
    let mut chains: HashMap<SandboxId, tokio::task::JoinHandle<()>> = HashMap::new();
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break,
            msg = messages.next() => match msg {
                Some(Ok(msg)) => msg,
                Some(Err(error)) => {
                    warn!(%error, "result stream error; continuing");
                    continue;
                }
                None => break,
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
        chains.retain(|_, h| !h.is_finished());
        let previous = chains.remove(&result.sandbox_id);
        let permit = limit
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (db, sandbox_id) = (db.clone(), result.sandbox_id);
        chains.insert(
            sandbox_id,
            tokio::spawn(async move {
                if let Some(previous) = previous {
                    // A panicked predecessor is logged by the runtime; only order matters here.
                    let _ = previous.await;
                }
                handle(&db, msg, result).await;
                drop(permit);
            }),
        );
    }
    // Let the applies in progress finish (each acks its message); the rest is redelivered.
    futures::future::join_all(chains.into_values()).await;
    Ok(())
}

/// Applies one result, then acks it (or naks it for a retry when the database failed).
async fn handle(db: &PgPool, msg: jetstream::Message, result: CommandResult) {
    let started = Instant::now();
    match apply(db, &result).await {
        Ok(applied) => {
            metrics::histogram!("berth_result_apply_duration_seconds")
                .record(started.elapsed().as_secs_f64());
            metrics::counter!("berth_results_total", "kind" => result.kind.as_str(), "applied" => applied.label())
                .increment(1);
            if let Applied::Transitioned { .. } = applied {
                crate::gauges::observe_command_latency(db, &result).await;
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

/// What [`apply`] did with a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The row moved to `to`.
    Transitioned { to: SandboxState },
    /// The row's generation has moved on (or the host refused the command as stale).
    Stale,
    /// The generation matched but the row is not where this result leads from (a duplicate).
    Duplicate,
    /// No such sandbox (purged).
    Unknown,
    /// A success that contradicted the row's terminal state: a compensating command was queued.
    Compensated,
}

/// The command that undoes a host's success the row does not want, if any: a create that
/// succeeded after its sandbox became `failed-start` is destroyed; a start is stopped (the
/// sandbox's disk stays, so it can be started again).
pub fn compensation_for(
    state: SandboxState,
    kind: CommandKind,
    outcome: Outcome,
) -> Option<CommandKind> {
    match (state, kind, outcome) {
        (SandboxState::FailedStart, CommandKind::Create, Outcome::Succeeded) => {
            Some(CommandKind::Delete)
        }
        (SandboxState::FailedStart, CommandKind::Start, Outcome::Succeeded) => {
            Some(CommandKind::Stop)
        }
        _ => None,
    }
}

/// Queues `kind` for the sandbox on the host that reported, at the row's generation (never
/// older than what the host applied, so the host's fence lets it through). The row is not
/// changed.
async fn compensate(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    result: &CommandResult,
    row: &sqlx::postgres::PgRow,
    generation: Generation,
    kind: CommandKind,
) -> Result<(), sqlx::Error> {
    let command = Command {
        id: CommandId::new(),
        sandbox_id: result.sandbox_id,
        generation,
        kind,
        spec: SandboxSpec {
            org_id: row.get("org_id"),
            template: row.get("template"),
            resources: Resources {
                vcpus: u32::try_from(row.get::<i32, _>("vcpus")).unwrap_or(0),
                memory_mib: u32::try_from(row.get::<i32, _>("memory_mib")).unwrap_or(0),
            },
        },
    };
    insert_command(tx, result.host_id, &command).await?;
    metrics::counter!("berth_compensations_total", "kind" => kind.as_str()).increment(1);
    warn!(compensation = %kind, compensation_id = %command.id, "late success contradicts the row; compensating");
    Ok(())
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
        }
    }
}

/// Applies one result in one transaction: fence on generation, decide with the state machine,
/// write the state, release capacity when the sandbox stops holding it, write the event, and
/// mark the command completed. Idempotent: applying the same result again returns
/// [`Applied::Duplicate`] and writes nothing.
#[instrument(skip_all, fields(sandbox_id = %result.sandbox_id, host_id = %result.host_id,
    command_id = %result.command_id, kind = %result.kind, generation = %result.generation))]
pub async fn apply(db: &PgPool, result: &CommandResult) -> Result<Applied, sqlx::Error> {
    let mut tx = db.begin().await?;
    let outcome_label = match &result.outcome {
        ResultOutcome::Succeeded { .. } => "succeeded",
        ResultOutcome::Failed { .. } => "failed",
        ResultOutcome::RefusedStale { .. } => "refused_stale",
    };
    sqlx::query(
        "UPDATE commands SET completed_at = now(), outcome = $2
          WHERE id = $1 AND completed_at IS NULL",
    )
    .bind(result.command_id)
    .bind(outcome_label)
    .execute(&mut *tx)
    .await?;
    if matches!(result.kind, CommandKind::Create | CommandKind::Start) {
        // A boot finished: the relay may publish a start it held back for this host's cap.
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(berth_schemas::db::OUTBOX_CHANNEL)
            .execute(&mut *tx)
            .await?;
    }

    let Some(row) = sqlx::query(
        "SELECT org_id, template, state, generation, deleted_at IS NOT NULL AS deleting,
                host_id, holds_capacity, vcpus, memory_mib
           FROM sandboxes WHERE id = $1 FOR UPDATE",
    )
    .bind(result.sandbox_id)
    .fetch_optional(&mut *tx)
    .await?
    else {
        tx.commit().await?;
        return Ok(Applied::Unknown);
    };
    let generation: Generation = row.get("generation");
    let state: SandboxState = row
        .get::<String, _>("state")
        .parse()
        .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    let deleting: bool = row.get("deleting");

    let (outcome, address, last_stop, reason_text) = match &result.outcome {
        ResultOutcome::Succeeded { address, last_stop } => {
            (Outcome::Succeeded, address.clone(), *last_stop, None)
        }
        ResultOutcome::Failed { reason } => (Outcome::Failed, None, None, Some(reason.clone())),
        ResultOutcome::RefusedStale { applied } => {
            info!(applied = %applied, "host refused a stale command");
            tx.commit().await?;
            return Ok(Applied::Stale);
        }
    };
    if result.generation != generation {
        debug!(row_generation = %generation, "stale result ignored");
        tx.commit().await?;
        return Ok(Applied::Stale);
    }
    let ResultDecision::Apply {
        to,
        releases_capacity,
    } = on_result(state, deleting, result.kind, outcome)
    else {
        // The first terminal result for a generation wins. A success that contradicts it
        // (the row already failed this boot) is undone on the host, never applied.
        if let Some(kind) = compensation_for(state, result.kind, outcome) {
            // Once per generation: a redelivered late success finds its compensation queued.
            let queued: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM commands
                                 WHERE sandbox_id = $1 AND generation = $2 AND kind = $3)",
            )
            .bind(result.sandbox_id)
            .bind(generation)
            .bind(kind.as_str())
            .fetch_one(&mut *tx)
            .await?;
            if !queued {
                compensate(&mut tx, result, &row, generation, kind).await?;
                tx.commit().await?;
                return Ok(Applied::Compensated);
            }
        }
        tx.commit().await?;
        return Ok(Applied::Duplicate);
    };

    let holds_capacity: bool = row.get("holds_capacity");
    let release = releases_capacity && holds_capacity;
    // Fenced write: the row lock is held, and the WHERE restates the fence.
    sqlx::query(
        "UPDATE sandboxes
            SET state = $3,
                state_reason = $4,
                address = CASE WHEN $3 = 'running' THEN $5 ELSE NULL END,
                last_stop = COALESCE($6, last_stop),
                holds_capacity = holds_capacity AND NOT $7,
                updated_at = now()
          WHERE id = $1 AND generation = $2",
    )
    .bind(result.sandbox_id)
    .bind(generation)
    .bind(to.as_str())
    .bind(reason_text.as_deref())
    .bind(address.as_deref())
    .bind(last_stop.map(|m| m.as_str()))
    .bind(release)
    .execute(&mut *tx)
    .await?;
    if release {
        let host: Option<HostId> = row.get("host_id");
        if let Some(host) = host {
            let held = Resources {
                vcpus: u32::try_from(row.get::<i32, _>("vcpus")).unwrap_or(0),
                memory_mib: u32::try_from(row.get::<i32, _>("memory_mib")).unwrap_or(0),
            };
            berth_scheduler::placement::release(&mut tx, host, held).await?;
        }
    }
    let org_id: OrgId = row.get("org_id");
    let reason = if outcome == Outcome::Failed {
        Reason::RuntimeError
    } else {
        Reason::HostReport
    };
    insert_event(
        &mut tx,
        &NewEvent {
            sandbox_id: result.sandbox_id,
            org_id,
            from: Some(state),
            to,
            reason,
            generation,
            command_id: Some(result.command_id),
            message: reason_text.as_deref(),
        },
    )
    .await?;
    tx.commit().await?;
    info!(from = %state, to = %to, "result applied");
    Ok(Applied::Transitioned { to })
}
