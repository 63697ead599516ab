//! Host health from boot outcomes, and the one retry of a create its host failed (issue 12
//! item 2). The result consumer ([`crate::results`]) and the pass's command timeouts feed
//! each create's and start's outcome to the host's health machine
//! ([`berth_schemas::host_state::HostHealth::on`], written by [`berth_store::host_health`]);
//! placement avoids a `degraded` host until its probe.
//!
//! Whose fault a failure is: the host says so in its result — `Rejected` for what no host
//! could run (an unknown template or runtime, a command without its spec: the request's
//! fault), `Failed` for the rest (the runtime failed or hung, the network, the disk or the
//! agent: the host's fault). Only the host's failures count against it and only they are
//! retried elsewhere ([`berth_schemas::state::retries_elsewhere`]). A create that timed out
//! is not retried: the host may still be running it, and a second host would make two.
//!
//! # Errors
//! Store errors roll back the caller's transaction (the result is redelivered).

use std::time::Duration;

use berth_scheduler::placement::{self, Placement};
use berth_schemas::host_state::{HealthEvent, HealthPolicy};
use berth_schemas::wire::{CommandResult, ResultOutcome};
use berth_schemas::{CommandKind, HostCondition, HostId};
use berth_store::host_health::{self, Recorded};
use berth_store::hosts::Overcommit;
use berth_store::{sandboxes, SandboxRow, StoreError};
use sqlx::PgConnection;
use tracing::{info, warn};

/// How host health is judged and where a failed create may be retried.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HealthConfig {
    /// When bad boots degrade a host and how its probes back off.
    pub policy: HealthPolicy,
    /// A retry goes only to a host heard from within this window (the API's placement
    /// window, `--heartbeat-freshness`).
    pub heartbeat_freshness: Duration,
    /// How far a retry's placement reserves beyond a host's physical capacity (the API's).
    pub overcommit: Overcommit,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            policy: HealthPolicy::default(),
            heartbeat_freshness: berth_scheduler::DEFAULT_HEARTBEAT_FRESHNESS,
            overcommit: Overcommit::default(),
        }
    }
}

/// Whether `kind` boots a sandbox (its outcome bears on the host's health).
pub fn is_boot(kind: CommandKind) -> bool {
    matches!(kind, CommandKind::Create | CommandKind::Start)
}

/// Feeds a boot's result to its host's health, in the caller's transaction: a success
/// (slow or not, by the time the host spent applying it, [`CommandResult::apply_ms`]: never
/// the time it spent in the control plane's queues), or a failure that was the
/// host's. A `Rejected` result (the request's fault) and every non-boot command change
/// nothing. Call once per result that moved its row (never for duplicates).
pub async fn record_result(
    conn: &mut PgConnection,
    result: &CommandResult,
    policy: &HealthPolicy,
) -> Result<(), StoreError> {
    if !is_boot(result.kind) {
        return Ok(());
    }
    let (event, reason) = match &result.outcome {
        ResultOutcome::Succeeded { .. } | ResultOutcome::StoppedOnDisk { .. } => {
            // The host's own time for the boot: a control plane that lags (a backlog in the
            // relay, NATS or this consumer) must not make every host look slow.
            let took = f64::from(result.apply_ms) / 1000.0;
            let event = HealthEvent::of_boot(Duration::from_millis(result.apply_ms.into()), policy);
            let reason = (event == HealthEvent::Slow).then(|| {
                format!(
                    "{} took {took:.1} s (slow past {:?})",
                    result.kind, policy.slow_boot
                )
            });
            (event, reason)
        }
        ResultOutcome::Failed { reason } => (
            HealthEvent::Failed,
            Some(format!("{} failed: {reason}", result.kind)),
        ),
        ResultOutcome::Rejected { .. }
        | ResultOutcome::RefusedStale { .. }
        | ResultOutcome::Snapshotted(_)
        | ResultOutcome::Durable(_) => return Ok(()),
    };
    record(conn, result.host_id, event, policy, reason.as_deref()).await
}

/// Feeds a boot the host never answered ([`HealthEvent::TimedOut`]) to its health.
pub async fn record_timeout(
    conn: &mut PgConnection,
    host: HostId,
    kind: CommandKind,
    policy: &HealthPolicy,
) -> Result<(), StoreError> {
    if !is_boot(kind) {
        return Ok(());
    }
    let reason = format!("{kind} never answered");
    record(conn, host, HealthEvent::TimedOut, policy, Some(&reason)).await
}

async fn record(
    conn: &mut PgConnection,
    host: HostId,
    event: HealthEvent,
    policy: &HealthPolicy,
    reason: Option<&str>,
) -> Result<(), StoreError> {
    metrics::counter!("berth_host_boot_outcomes_total", "outcome" => event.as_str()).increment(1);
    let Some(Recorded { before, change }) =
        host_health::record(conn, host, event, policy, reason).await?
    else {
        return Ok(());
    };
    let (from, to) = (before.condition, change.health.condition);
    if from != to {
        metrics::counter!("berth_host_condition_changes_total", "to" => to.as_str()).increment(1);
        match to {
            HostCondition::Degraded => {
                warn!(host_id = %host, %from, failures = change.health.failures,
                probe_in = ?change.probe_in, reason = reason.unwrap_or(""),
                "host degraded: placement avoids it until its probe")
            }
            HostCondition::Healthy => info!(host_id = %host, %from, "host healthy again"),
            HostCondition::Probing => {}
        }
    }
    Ok(())
}

/// Sends the failed create of the locked `row` to another host, if one fits now: placement
/// (never the failed host) reserves there, and the store moves the row
/// ([`sandboxes::move_create`]). `None` when no other host can take it (the caller fails the
/// sandbox as usual). The caller has checked [`berth_schemas::state::retries_elsewhere`].
pub async fn retry_elsewhere(
    conn: &mut PgConnection,
    row: &SandboxRow,
    failed_host: HostId,
    reason: &str,
    config: &HealthConfig,
) -> Result<Option<HostId>, StoreError> {
    let placed = placement::place(
        &mut *conn,
        row.resources,
        config.heartbeat_freshness,
        config.overcommit,
        Some(failed_host),
    )
    .await?;
    let Placement::Placed { host, .. } = placed else {
        metrics::counter!("berth_create_retries_total", "result" => "no_host").increment(1);
        info!(sandbox_id = %row.id, host_id = %failed_host, ?placed,
            "create failed by its host; no other host can take it");
        return Ok(None);
    };
    let message = format!("host {failed_host} failed the create ({reason}); retried on {host}");
    sandboxes::move_create(&mut *conn, row, host, &message).await?;
    metrics::counter!("berth_create_retries_total", "result" => "moved").increment(1);
    warn!(sandbox_id = %row.id, from = %failed_host, to = %host, %reason,
        "create failed by its host; retried on another host");
    Ok(Some(host))
}
