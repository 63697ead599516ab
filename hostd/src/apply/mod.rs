//! Applying commands, one use case per file: the fence, then the command's work, then the
//! record. [`up`] makes a sandbox run (create and start), [`stop`] stops it, [`delete`]
//! removes it, [`snapshot`] stores it in the object store while it runs, [`resume`] rebuilds
//! it (restore) or builds a new one (clone) from a stored snapshot, [`archive`] stores a stopped
//! one whole (its disk freed by the delete the control plane sends once `archived`), [`migrate`] takes in a sandbox moved from another host (after
//! dropping a stale copy of its own); what a real host and a sim host do differently is the host's
//! [`Backend`](crate::host::Backend).
//!
//! # Guarantees
//! - At most once (DESIGN.md guarantee 2): see `fence`. The result is written to the record
//!   before it is published, so a redelivery republishes it instead of redoing the work.
//! - Bring-up converges: every step checks what exists (record, address, netns, veth, mount,
//!   container), so a create redelivered after a crash finishes the sandbox without
//!   duplicating anything. On failure a cleanup stack undoes this attempt's work, newest first;
//!   a failed *create* removes everything and leaves a tombstone.
//! - Delete is idempotent and converges: it removes whatever exists by derived names; a failure
//!   is not reported but retried ([`Applied::Retry`]).
//!
//! # Assumptions
//! Commands of one sandbox are applied one at a time (`nats::commands` chains them).

pub mod archive;
pub mod delete;
pub mod migrate;
pub mod resume;
pub mod settle;
pub mod snapshot;
pub mod stop;
pub mod up;

use std::sync::Arc;
use std::time::Instant;

use berth_schemas::trace::TraceParent;
use berth_schemas::wire::{Command, CommandResult, ResultOutcome, SandboxSpec};

use crate::DEFAULT_RUNTIME;
use berth_schemas::CommandKind;
use tracing::Instrument;

use crate::error::HostdError;
use crate::fault::Step;
use crate::fence::{self, Fence};
use crate::host::Host;
use crate::metrics::{self, CommandOutcome};
use crate::record::{SandboxRecord, StoredResult};

/// What to do with a command message after [`apply`].
#[derive(Debug)]
pub enum Applied {
    /// Publish this result, then ack the message.
    Respond {
        /// The result to publish.
        result: CommandResult,
        /// How the command ended, for metrics.
        outcome: CommandOutcome,
    },
    /// Publish nothing; nak the message so it is redelivered later (delete must converge, and a
    /// record that could not be written must not be acked).
    Retry {
        /// Why.
        error: HostdError,
    },
}

/// The trace context of one apply: the command's trace (from its `traceparent` header) and
/// this apply's own span id, which the result's `traceparent` names as its parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApplyTrace {
    /// What the command message carried, or [`TraceParent::for_command`] without a header.
    pub parent: TraceParent,
    /// This apply's span id (random per apply, never zero).
    pub span_id: [u8; 8],
}

impl ApplyTrace {
    /// A new span, child of `parent`.
    pub fn child_of(parent: TraceParent) -> Self {
        let mut span_id = [0u8; 8];
        span_id.copy_from_slice(&uuid::Uuid::new_v4().as_bytes()[..8]);
        if span_id == [0; 8] {
            span_id = 1u64.to_be_bytes();
        }
        Self { parent, span_id }
    }

    /// The `traceparent` of what this apply publishes: the same trace, this span as parent.
    pub fn outgoing(&self) -> TraceParent {
        TraceParent {
            parent_id: self.span_id,
            ..self.parent
        }
    }
}

/// The span of one step of a command's work (`step` = its name: `template`, `network`,
/// `disk`, `overlay`, `boot` or `restore`, `agent`; `drain`, `checkpoint`, `unmount`, `release`;
/// `destroy`, `tear_down`, `remove_dir`), a child of
/// the `apply` span: with `BERTH_LOG_SPANS=true` each logs its duration as it closes, which is how
/// a create's or delete's time splits into its steps (issue 16 lever 2).
pub fn step(name: &'static str) -> tracing::Span {
    tracing::info_span!("step", step = name)
}

/// Applies one command (fence, work, record) and says what to publish. The `apply` span
/// records the command's `trace_id`, its `parent_id` and this apply's `span_id`.
pub async fn apply(host: &Arc<Host>, cmd: &Command, trace: &ApplyTrace) -> Applied {
    let span = tracing::info_span!(
        "apply",
        host_id = %host.host_id,
        sandbox_id = %cmd.sandbox_id,
        command_id = %cmd.id,
        kind = %cmd.kind,
        generation = %cmd.generation,
        trace_id = %trace.parent.trace_id_hex(),
        parent_id = %hex::encode(trace.parent.parent_id),
        span_id = %hex::encode(trace.span_id),
    );
    let started = Instant::now();
    let mut applied = crate::fault::scope(cmd.kind, apply_inner(host, cmd))
        .instrument(span)
        .await;
    if let Applied::Respond { result, .. } = &mut applied {
        result.apply_ms = u32::try_from(started.elapsed().as_millis()).unwrap_or(u32::MAX);
    }
    let runtime = cmd
        .spec
        .as_ref()
        .map_or(DEFAULT_RUNTIME, |spec| runtime_name(host, spec));
    metrics::runtime_operation(runtime, operation(cmd.kind), started.elapsed());
    match &applied {
        Applied::Respond { outcome, .. } => metrics::command(cmd.kind, *outcome),
        Applied::Retry { .. } => metrics::command(cmd.kind, CommandOutcome::Retried),
    }
    applied
}

async fn apply_inner(host: &Arc<Host>, cmd: &Command) -> Applied {
    let _busy = host.warm.busy();
    // A command naming a warm pool sandbox owns it from here (a create hands it over, see
    // `up`): the pool neither offers nor removes it any more.
    if host.warm.claim(cmd.sandbox_id).await {
        tracing::info!("the sandbox is a warm pool sandbox; taken out of the pool");
        // Only a create (or start) hands it over; under any other command it is an ordinary
        // sandbox from now on, in the inventory for the control plane to judge.
        if !matches!(cmd.kind, CommandKind::Create | CommandKind::Start) {
            if let Some(mut record) = host.live(cmd.sandbox_id) {
                record.warm = false;
                if let Err(error) = host.put(&record) {
                    return Applied::Retry { error };
                }
            }
        }
    }
    if cmd.kind == CommandKind::Create {
        if let Some(spec) = &cmd.spec {
            host.warm.learn(spec);
        }
    }
    let record = match host.live(cmd.sandbox_id) {
        Some(r) => Some(r),
        None => match host.store.load(cmd.sandbox_id) {
            Ok(r) => r,
            Err(error) => return Applied::Retry { error },
        },
    };
    match fence::check(record.as_ref(), cmd) {
        Fence::Replay(stored) => {
            tracing::info!("command already applied; replaying its result");
            return Applied::Respond {
                result: stored.to_wire(host.host_id, cmd.sandbox_id, host.heartbeat_seq.current()),
                outcome: CommandOutcome::Replayed,
            };
        }
        Fence::RefuseStale { applied } => {
            tracing::info!(%applied, "refusing a stale command");
            return Applied::Respond {
                result: CommandResult {
                    command_id: cmd.id,
                    sandbox_id: cmd.sandbox_id,
                    host_id: host.host_id,
                    generation: cmd.generation,
                    kind: cmd.kind,
                    outcome: ResultOutcome::RefusedStale { applied },
                    heartbeat_seq: host.heartbeat_seq.current(),
                    apply_ms: 0,
                },
                outcome: CommandOutcome::RefusedStale,
            };
        }
        Fence::Apply => {}
    }
    crate::fault::crash_point(Step::Fenced);
    if let Err(source) = crate::fault::fail_point(Step::Fenced) {
        let error = HostdError::Io {
            context: "fault injection".into(),
            source,
        };
        tracing::warn!(error = %error.report(), "command failed; will retry");
        return Applied::Retry { error };
    }
    let live = record.clone().filter(|r| !r.is_tombstone());
    // A stop or delete closes the sandbox's agent gate until its record is written: new agent
    // calls are refused, and one its teardown cuts reports the sandbox going away (409 at the
    // API), not an agent fault.
    let _closed = matches!(cmd.kind, CommandKind::Stop | CommandKind::Delete)
        .then(|| host.gates.close_while(cmd.sandbox_id));
    // A sandbox a hostd before the two-phase free archived on its own: its tombstone remembers
    // where its disk went, and a start that still comes here unarchives it from there instead
    // of booting a fresh template. A hostd now never frees an archived disk but by the
    // control plane's delete, whose tombstone names no stop snapshot (`changes_the_disk`).
    let archived_here = record
        .as_ref()
        .filter(|r| r.is_tombstone() && r.phase == crate::record::Phase::Deleted)
        .and_then(|r| r.durable.clone());
    let (after, outcome) = match cmd.kind {
        CommandKind::Start if archived_here.is_some() => {
            let durable = archived_here.clone().unwrap_or_else(|| unreachable!());
            tracing::info!(snapshot_id = %durable.snapshot_id, "a start of a sandbox archived here: unarchiving it");
            let from_store = Command {
                snapshot: Some(berth_schemas::wire::SnapshotOrder {
                    snapshot_id: durable.snapshot_id,
                    parent: None,
                    disk_only: false,
                }),
                kind: CommandKind::Unarchive,
                ..cmd.clone()
            };
            resume::resume(host, &from_store, None).await
        }
        CommandKind::Create | CommandKind::Start => up::up(host, cmd, live).await,
        CommandKind::Stop => stop::stop(host, live).await,
        CommandKind::Snapshot => snapshot::snapshot(host, cmd, live).await,
        CommandKind::Restore | CommandKind::Clone => resume::resume(host, cmd, live).await,
        // An unarchive is a clone of its stop snapshot under the sandbox's own id, and so is a
        // migration; neither boots a copy this host kept of an earlier stay (an archived
        // sandbox's disk whose freeing delete has not come yet, a stale stop).
        CommandKind::Unarchive | CommandKind::Migrate => {
            match migrate::forget_stale_copy(host, cmd, live).await {
                Ok(live) => resume::resume(host, cmd, live).await,
                Err(error) => {
                    tracing::warn!(error = %error.report(), "stale copy not removed; will retry");
                    return Applied::Retry { error };
                }
            }
        }
        CommandKind::Archive => archive::archive(host, cmd, live).await,
        CommandKind::Delete => match delete::delete(host, cmd, record).await {
            Ok(done) => done,
            Err(error) => {
                tracing::warn!(error = %error.report(), "delete failed; will retry");
                return Applied::Retry { error };
            }
        },
    };
    let stored = StoredResult {
        command_id: cmd.id,
        generation: cmd.generation,
        kind: cmd.kind,
        outcome,
    };
    if let Some(mut record) = after {
        if changes_the_disk(cmd.kind) {
            record.durable = None;
            record.durable_by = None;
        }
        record.remember(stored.clone());
        let persisted = if record.is_tombstone() {
            host.store
                .bury(&record)
                .map(|()| host.forget(cmd.sandbox_id))
        } else {
            host.put(&record)
        };
        if let Err(error) = persisted {
            tracing::error!(error = %error.report(), "record not written; will retry");
            return Applied::Retry { error };
        }
    }
    crate::fault::crash_point(Step::Recorded);
    let outcome = match stored.outcome {
        ResultOutcome::Succeeded { .. }
        | ResultOutcome::StoppedOnDisk { .. }
        | ResultOutcome::Snapshotted(_)
        | ResultOutcome::Durable(_) => CommandOutcome::Succeeded,
        ResultOutcome::Failed { .. } | ResultOutcome::Rejected { .. } => CommandOutcome::Failed,
        ResultOutcome::RefusedStale { .. } => CommandOutcome::RefusedStale,
    };
    Applied::Respond {
        result: stored.to_wire(host.host_id, cmd.sandbox_id, host.heartbeat_seq.current()),
        outcome,
    }
}

/// A new record for `cmd`'s sandbox, in the runtime its spec names; `None` when the command
/// carries no spec (a destroy of a container whose row was purged).
fn new_record(host: &Host, cmd: &Command) -> Option<SandboxRecord> {
    let spec = cmd.spec.clone()?;
    let runtime = runtime_name(host, &spec);
    Some(SandboxRecord::new(
        cmd.sandbox_id,
        spec,
        runtime,
        cmd.generation,
    ))
}

/// The runtime a sandbox runs in: the driver this host hands out for the runtime its spec
/// names (the template's, from Postgres; on a sim host, `sim`), or that name when this host
/// lacks it (the bring-up then fails with `UnsupportedRuntime`).
pub(crate) fn runtime_name(host: &Host, spec: &SandboxSpec) -> &'static str {
    let wanted = spec.runtime.as_str();
    host.runtimes
        .get(wanted)
        .map_or(wanted, |driver| driver.name())
}

/// The metrics `operation` label of a whole command.
fn operation(kind: CommandKind) -> &'static str {
    match kind {
        CommandKind::Create => "create",
        CommandKind::Start => "start",
        CommandKind::Stop => "stop",
        CommandKind::Delete => "delete",
        CommandKind::Snapshot => "snapshot",
        CommandKind::Restore => "restore",
        CommandKind::Clone => "clone",
        CommandKind::Archive => "archive",
        CommandKind::Unarchive => "unarchive",
        CommandKind::Migrate => "migrate",
    }
}

/// Whether a command of `kind` changes (or replaces) the sandbox's disk, so its last durable
/// stop snapshot no longer describes it.
fn changes_the_disk(kind: CommandKind) -> bool {
    matches!(
        kind,
        CommandKind::Create
            | CommandKind::Start
            | CommandKind::Restore
            | CommandKind::Clone
            | CommandKind::Unarchive
            | CommandKind::Migrate
            | CommandKind::Delete
    )
}
