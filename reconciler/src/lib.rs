//! Berth's reconciler: applies host results behind the generation fence, and — as the elected
//! leader — runs a periodic pass that converges everything results alone cannot.
//!
//! - [`results`]: the durable result consumer and the fenced, idempotent apply (every
//!   replica consumes; the JetStream consumer is shared, so each result is applied once).
//! - [`pass`]: the leader's pass (leader election: [`berth_store::leases`]).
//! - [`gauges`]: fleet gauges and end-to-end command latency for Prometheus.
//! - [`health`]: hosts' health from their boots' outcomes, and the one retry elsewhere of a
//!   create its host failed.
//! - [`watermark`]: the time before which every published result is applied; the pass's
//!   command timeouts count to it, so the control plane's own backlog never times a command out.
//!
//! # Guarantees
//! - A result changes a row only when its generation equals the row's current generation and
//!   the state machine ([`berth_schemas::state::on_result`]) leads from the row's state; a
//!   redelivered result finds the row already moved and changes nothing.
//! - A late result cannot bring a deleted sandbox back (guarantee 3): a deleting row only
//!   accepts its delete's result; a success that contradicts a terminal state is compensated.
//! - Capacity is released in the same transaction as the state change, exactly once: the
//!   state machine decides it and the store applies it with the state write.
//! - Only the lease holder's pass can commit (see [`berth_store::leases`]).

mod durable;
pub mod gauges;
pub mod health;
pub mod pass;
pub mod results;
mod snapshots;
pub mod watermark;

use std::time::Duration;

use berth_schemas::Subjects;
use berth_store::leases;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use uuid::Uuid;

/// The lease the reconciler's leader holds.
pub const LEASE_NAME: &str = "reconciler";
/// How long a lease lasts unless renewed; a standby takes over within this after the leader
/// dies.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

/// Errors of the reconciler.
#[derive(Debug, thiserror::Error)]
pub enum ReconcilerError {
    /// A store operation failed; its [`berth_store::op::Op`] names which.
    #[error(transparent)]
    Store(#[from] berth_store::StoreError),
    /// The results stream, or the reconciler's durable consumer on it, could not be set up or
    /// read (the message is the client's error).
    #[error("jetstream setup: {0}")]
    JetStream(String),
}

/// What the reconciler process needs.
#[derive(Debug, Clone)]
pub struct ReconcilerConfig {
    /// NATS subject and stream names under the deployment's prefix (results, consumer).
    pub subjects: Subjects,
    /// Timing and size of the leader's pass.
    pub pass: pass::PassConfig,
    /// How long a lease lasts unless renewed ([`DEFAULT_LEASE_TTL`]); the leader renews it every
    /// third of it (or every pass interval, if shorter).
    pub lease_ttl: Duration,
    /// How often the fleet gauges ([`gauges`]) are recomputed.
    pub gauge_interval: Duration,
    /// Results applied at once ([`results::APPLY_CONCURRENCY`] by default).
    pub result_concurrency: usize,
}

impl ReconcilerConfig {
    /// Defaults for everything but the subjects.
    pub fn new(subjects: Subjects) -> Self {
        Self {
            subjects,
            pass: pass::PassConfig::default(),
            lease_ttl: DEFAULT_LEASE_TTL,
            gauge_interval: gauges::DEFAULT_INTERVAL,
            result_concurrency: results::APPLY_CONCURRENCY,
        }
    }
}

/// Runs the result consumer, the results watermark, the leader loop and the fleet gauges until
/// `shutdown` fires.
///
/// Errors: [`ReconcilerError::JetStream`] when the result stream or consumer cannot be set up.
pub async fn run(
    config: ReconcilerConfig,
    db: PgPool,
    nats: async_nats::Client,
    shutdown: CancellationToken,
) -> Result<(), ReconcilerError> {
    let fleet = tokio::spawn(gauges::run(
        db.clone(),
        config.gauge_interval,
        shutdown.clone(),
    ));
    let watermark = tokio::spawn(watermark::run(
        db.clone(),
        nats.clone(),
        config.subjects.clone(),
        shutdown.clone(),
    ));
    let wake = results::OutboxWake {
        nats: nats.clone(),
        subject: config.subjects.outbox_wake(),
    };
    let leader = tokio::spawn(lead(
        config.clone(),
        db.clone(),
        Uuid::now_v7(),
        Some(wake),
        shutdown.clone(),
    ));
    let consumed = results::consume(
        &config.subjects,
        &db,
        nats,
        config.pass.health,
        config.result_concurrency,
        shutdown.clone(),
    )
    .await;
    shutdown.cancel();
    let _ = leader.await;
    let _ = fleet.await;
    let _ = watermark.await;
    consumed
}

/// The leader loop of candidate `holder`: renew (or try to take) the lease every third of its
/// TTL, and run a pass every `pass.interval` while holding it. Gives the lease up on shutdown.
///
/// After a pass that wrote anything, `wake` (when given) wakes the API's relays to publish the
/// commands and events it wrote; without it they find them at their next poll.
pub async fn lead(
    config: ReconcilerConfig,
    db: PgPool,
    holder: Uuid,
    wake: Option<results::OutboxWake>,
    shutdown: CancellationToken,
) {
    let tick = (config.lease_ttl / 3).min(config.pass.interval);
    let mut last_pass = tokio::time::Instant::now();
    let mut held: Option<leases::Lease> = None;
    loop {
        match leases::acquire(&db, LEASE_NAME, holder, config.lease_ttl).await {
            Ok(Some(l)) => {
                if held.map(|h| h.term) != Some(l.term) {
                    info!(term = l.term, %holder, "reconciler leadership taken");
                    // The first pass waits one interval: results hosts published while no
                    // leader ran (a control-plane restart) are applied first, so commands that
                    // did complete are not timed out.
                    last_pass = tokio::time::Instant::now();
                }
                metrics::gauge!("berth_reconciler_leader_term").set(l.term as f64);
                metrics::gauge!("berth_reconciler_is_leader").set(1.0);
                held = Some(l);
            }
            Ok(None) => {
                if held.take().is_some() {
                    warn!(%holder, "reconciler leadership lost");
                }
                metrics::gauge!("berth_reconciler_is_leader").set(0.0);
            }
            Err(error) => {
                warn!(%error, "lease renewal failed");
                held = None;
                metrics::gauge!("berth_reconciler_is_leader").set(0.0);
            }
        }
        if let Some(l) = held {
            if last_pass.elapsed() >= config.pass.interval {
                last_pass = tokio::time::Instant::now();
                match pass::run_pass(&db, &config.pass, &l).await {
                    Ok(report) => {
                        if report.actions.iter().any(|(_, n)| *n > 0) {
                            if let Some(wake) = &wake {
                                wake.wake().await;
                            }
                        }
                        if report.deposed {
                            held = None;
                        }
                    }
                    Err(error) => warn!(%error, "reconcile pass failed"),
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(tick) => {}
        }
    }
    if let Some(l) = held {
        let _ = leases::release(&db, &l).await;
    }
}
