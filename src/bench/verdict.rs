//! What the scale bench counts against the reconciler (issue 12 item 1): the passes that run
//! while the fleet is loaded, the guests they failed although they were alive (false failures:
//! the sim runtime witnesses every guest's life, [`berth_hostd::runtime::sim::life`]), and the
//! containers they compensated as orphans.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use berth_reconciler::pass::{run_pass, Action, PassConfig, PassReport};
use berth_schemas::state::GuestFailure;
use berth_store::leases::Lease;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// The reconciler's periodic pass, run by the bench while it loads the fleet, every
/// [`PassConfig::interval`] as the leader would.
pub struct PassLoop {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl PassLoop {
    /// Starts passing under `lease`; every report is appended to `reports`.
    pub fn start(
        db: PgPool,
        config: PassConfig,
        lease: Lease,
        reports: Arc<Mutex<Vec<PassReport>>>,
    ) -> Self {
        let stop = CancellationToken::new();
        let halt = stop.clone();
        let task = tokio::spawn(async move {
            loop {
                let lease = renew(&db, lease).await?;
                let report = run_pass(&db, &config, &lease).await?;
                reports
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(report);
                tokio::select! {
                    _ = halt.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(config.interval) => {}
                }
            }
        });
        Self { stop, task }
    }

    /// Stops after the pass in progress (if any) ends.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        self.task.await?
    }
}

/// How long the bench's reconciler lease lasts between renewals (each pass renews it).
pub const LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(600);

/// Renews the bench's reconciler `lease` for [`LEASE_TTL`] (its term stays).
///
/// Errors: the database's, or the lease was taken by someone else.
pub async fn renew(db: &PgPool, lease: Lease) -> anyhow::Result<Lease> {
    use anyhow::Context;
    berth_store::leases::acquire(db, lease.name, lease.holder, LEASE_TTL)
        .await?
        .context("reconciler lease taken by someone else")
}

/// What every pass of the run did, summed.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Passes run.
    pub passes: usize,
    /// Guests the passes failed (`guest_unhealthy`).
    pub guest_failures: u64,
    /// Of those, guests that were alive when they were failed.
    pub false_failures: u64,
    /// Creates and starts the passes timed out (`command_timeout` of a boot).
    pub boot_timeouts: u64,
    /// Of those, sandboxes whose sim guest was alive when the pass failed them: the host had
    /// answered, and its result waited in the control plane's queues.
    pub false_timeouts: u64,
    /// Containers stopped as orphans (`orphan_stopped`).
    pub orphans_stopped: u64,
    /// Containers destroyed as orphans (`orphan_destroyed`).
    pub orphans_destroyed: u64,
    /// The most hosts one pass found with evidence too old to judge.
    pub most_stale_hosts: u64,
    /// The most guest failures one pass's circuit breaker held back.
    pub most_held: u64,
}

/// Sums `reports` and asks the sim runtime which failed guests were alive.
pub async fn verdict(db: &PgPool, reports: &[PassReport]) -> anyhow::Result<Verdict> {
    let sum = |a: Action| reports.iter().map(|r| r.count(a)).sum::<u64>();
    let messages = [
        GuestFailure::Unhealthy.message(),
        GuestFailure::Missing.message(),
    ];
    let alive = |failed: &[(berth_schemas::SandboxId, chrono::DateTime<chrono::Utc>)]| {
        failed
            .iter()
            .filter(|(id, at)| {
                berth_hostd::runtime::sim::life(&id.to_string())
                    .is_some_and(|life| life.alive_at(SystemTime::from(*at)))
            })
            .count() as u64
    };
    // Every guest failure's event: the sandbox and when the pass wrote it.
    let failed = berth_store::events::guest_failures(db, &messages[..]).await?;
    // Every boot the pass timed out (the reconciler's messages: `timeout: host never answered
    // <kind>`, or never delivered while the relay lagged).
    let timeout_messages: Vec<String> = [
        berth_schemas::CommandKind::Create,
        berth_schemas::CommandKind::Start,
    ]
    .iter()
    .flat_map(|kind| {
        [
            format!("timeout: host never answered {kind}"),
            format!("timeout: {kind} was never delivered to its host (control-plane backlog)"),
        ]
    })
    .collect();
    let timeout_messages: Vec<&str> = timeout_messages.iter().map(String::as_str).collect();
    let timed_out = berth_store::events::guest_failures(db, &timeout_messages).await?;
    Ok(Verdict {
        passes: reports.len(),
        guest_failures: sum(Action::GuestUnhealthy),
        false_failures: alive(&failed),
        boot_timeouts: timed_out.len() as u64,
        false_timeouts: alive(&timed_out),
        orphans_stopped: sum(Action::OrphanStopped),
        orphans_destroyed: sum(Action::OrphanDestroyed),
        most_stale_hosts: reports.iter().map(|r| r.stale_hosts).max().unwrap_or(0),
        most_held: reports.iter().map(|r| r.breaker_held).max().unwrap_or(0),
    })
}
