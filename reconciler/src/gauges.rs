//! Fleet gauges and command latency, for Prometheus. Labels are bounded: sandbox and host
//! states, command kinds, outcomes, and host ids (hosts are few and long-lived); never
//! sandbox ids.
//!
//! - `berth_sandboxes{state}`: sandbox rows by state (every written state, zeros included).
//! - `berth_orgs`: orgs.
//! - `berth_hosts{state}`: hosts by state (`ready`, `draining`, `cordoned`, `lost`).
//! - `berth_host_heartbeat_age_seconds{host}`: seconds since each host's last heartbeat, on
//!   the database clock.
//! - `berth_hosts_by_condition{condition}`: hosts by health (`healthy`, `degraded`,
//!   `probing`: see [`crate::health`]).
//! - `berth_command_latency_seconds{kind,outcome}`: from a command's commit in the outbox to
//!   the apply of its result (create→running, stop→stopped, start→running,
//!   delete→deleted), observed once per command, when its result moves the row.
//!
//! Every reconciler replica computes the fleet gauges (cheap counts every
//! [`DEFAULT_INTERVAL`]); they read the same rows, so dashboards take `max` across replicas.

use std::time::Duration;

use berth_schemas::wire::{CommandResult, ResultOutcome};
use berth_schemas::{HostCondition, HostState, SandboxState};
use berth_store::{host_health, hosts, orgs, sandboxes, StoreError};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::debug;

/// How often the fleet gauges are recomputed.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(15);

/// Recomputes the fleet gauges every `interval` until `shutdown` fires.
pub async fn run(db: PgPool, interval: Duration, shutdown: CancellationToken) {
    describe_metrics();
    loop {
        if let Err(error) = record_fleet(&db).await {
            debug!(%error, "fleet gauges not updated");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

fn describe_metrics() {
    metrics::describe_gauge!("berth_sandboxes", "Sandbox rows by state.");
    metrics::describe_gauge!("berth_orgs", "Orgs.");
    metrics::describe_gauge!("berth_hosts", "Hosts by state.");
    metrics::describe_gauge!(
        "berth_host_heartbeat_age_seconds",
        metrics::Unit::Seconds,
        "Seconds since each host's last heartbeat (database clock)."
    );
    metrics::describe_histogram!(
        "berth_command_latency_seconds",
        metrics::Unit::Seconds,
        "From a command's commit to the apply of its result, by kind and outcome."
    );
}

/// Sets `berth_sandboxes`, `berth_orgs`, `berth_hosts` and `berth_host_heartbeat_age_seconds`
/// from the current rows.
pub async fn record_fleet(db: &PgPool) -> Result<(), StoreError> {
    let by_state = sandboxes::count_by_state(db).await?;
    for state in SandboxState::ALL.into_iter().filter(|s| s.is_written()) {
        let n = by_state
            .iter()
            .find(|(s, _)| *s == state)
            .map_or(0, |(_, n)| *n);
        metrics::gauge!("berth_sandboxes", "state" => state.as_str()).set(n as f64);
    }
    metrics::gauge!("berth_orgs").set(orgs::count(db).await? as f64);
    let fleet = hosts::states_and_ages(db).await?;
    for state in HostState::ALL {
        let n = fleet.iter().filter(|(_, s, _)| *s == state).count();
        metrics::gauge!("berth_hosts", "state" => state.as_str()).set(n as f64);
    }
    for (host, _, age) in &fleet {
        metrics::gauge!("berth_host_heartbeat_age_seconds", "host" => host.to_string()).set(*age);
    }
    record_conditions(db).await
}

/// `berth_hosts_by_condition{condition}`: hosts `healthy`, `degraded` and `probing` (their
/// health from their boots' outcomes; lost hosts included, as their rows say).
async fn record_conditions(db: &PgPool) -> Result<(), StoreError> {
    let health = host_health::conditions(db, None).await?;
    for condition in HostCondition::ALL {
        let n = health.iter().filter(|h| h.condition == condition).count();
        metrics::gauge!("berth_hosts_by_condition", "condition" => condition.as_str())
            .set(n as f64);
    }
    Ok(())
}

/// Observes `berth_command_latency_seconds{kind,outcome}` for the command `result` answers:
/// `seconds` from its outbox commit to its completion, both on the database's clock (the apply
/// that completed it returns them, [`berth_store::commands::Completion`]). Call once, after the
/// result moved the row.
pub fn observe_command_latency(result: &CommandResult, seconds: f64) {
    let outcome = match result.outcome {
        ResultOutcome::Succeeded { .. }
        | ResultOutcome::StoppedOnDisk { .. }
        | ResultOutcome::Snapshotted(_)
        | ResultOutcome::Durable(_) => "succeeded",
        ResultOutcome::Failed { .. } | ResultOutcome::Rejected { .. } => "failed",
        ResultOutcome::RefusedStale { .. } => return,
    };
    metrics::histogram!("berth_command_latency_seconds",
        "kind" => result.kind.as_str(), "outcome" => outcome)
    .record(seconds.max(0.0));
}
