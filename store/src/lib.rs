//! Berth's one persistence gateway: the SQL migrations and one module per shared table.
//!
//! - [`sandboxes`]: the sandbox row ([`SandboxRow`], one column list, one `from_row`), its
//!   fenced transitions (state + generation + capacity + command + event in the caller's
//!   transaction) and the reconciler's selections.
//! - [`hosts`]: host rows from heartbeats, the host state machine's writes, capacity
//!   reservations, inventory.
//! - [`host_health`]: a host's health from its boots' outcomes (`healthy`, `degraded`,
//!   `probing`) and why placement found nothing (stale heartbeats or degraded hosts with room).
//! - [`heartbeats`]: heartbeat ingest in batches (the newest per host wins) and how old each
//!   host's evidence is.
//! - [`findings`]: what each host's newest inventory disagrees with, judged at ingest; what the
//!   reconciler's pass reads instead of every inventory.
//! - [`breakers`]: the reconciler's circuit breaker trips and the host events they raise.
//! - [`commands`]: the transactional outbox of host commands.
//! - [`events`]: lifecycle event rows.
//! - [`leases`]: leader leases with fencing terms.
//! - [`templates`]: the template registry (name → runtime).
//! - [`idempotency`]: stored idempotent responses and their retention.
//! - [`api_keys`]: hashed API keys.
//! - [`orgs`]: tenants' quotas.
//! - [`snapshots`]: snapshot rows (`creating` → `ready` | `failed`), the chunks each ready one
//!   references, and an org's snapshot usage.
//! - [`drain`]: a draining host's moves (issue 14): whether the drain is live, each sandbox
//!   the reconciler's drive is moving off or failed to, and the progress the host shows.
//! - [`chunks`]: the removal of chunks no snapshot references, safe against a concurrent
//!   upload that reuses them.
//! - [`warm`]: the warm slots each host's newest heartbeat lists (sandboxes booted ahead under
//!   ids the host drew), and a create's claim of one (issue 16 lever 1).
//! - [`sweep`]: the object store sweep's looks for what nothing names, its manifest claims
//!   (`manifest_removals`) and its one-at-a-time lock.
//!
//! Tables one component owns alone stay with it: the API's webhooks, deliveries and attempts.
//!
//! # Guarantees
//! - Every write that races is fenced (`WHERE generation = $g`) and a miss is
//!   [`StoreError::Fenced`], never a generic "row not found".
//! - Capacity (guarantee 4) changes only inside [`sandboxes::write_transition`] and
//!   [`sandboxes::write_result`] (and [`sandboxes::move_create`], which moves a failed
//!   create's hold to its new host), in the same transaction as the state write that decided it
//!   ([`berth_schemas::Capacity`]); no caller flips `holds_capacity` by hand.
//! - Every operation is named ([`Op`]): it labels `berth_db_query_duration_seconds{op}` and
//!   its errors.
//! - Serialization failures and deadlocks are retried in one place: [`retry_transaction`].
//!
//! # Errors
//! [`StoreError`]: `Fenced`, `NotFound`, `NoCapacity`, `Corrupt`, `Database { op, .. }`.

pub mod api_keys;
pub mod breakers;
pub mod chunks;
pub mod commands;
pub mod drain;
pub mod error;
pub mod events;
pub mod findings;
pub mod heartbeats;
pub mod host_health;
pub mod hosts;
pub mod idempotency;
pub mod leases;
pub mod op;
pub mod orgs;
pub mod sandboxes;
pub mod snapshots;
pub mod sweep;
pub mod templates;
pub mod warm;

use std::future::Future;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use tracing::warn;

pub use error::StoreError;
pub use op::Op;
pub use sandboxes::SandboxRow;

/// Whether Postgres answers a trivial query (readiness checks).
pub async fn ping(db: impl sqlx::PgExecutor<'_>) -> bool {
    op::timed(Op::Ping, sqlx::query("SELECT 1").execute(db))
        .await
        .is_ok()
}

/// Every migration in `store/migrations`, embedded at build time.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// How many times [`retry_transaction`] runs a transaction again.
pub const RETRY_ATTEMPTS: usize = 4;
/// The first retry's delay; it doubles (with jitter) up to [`RETRY_MAX_DELAY`].
pub const RETRY_MIN_DELAY: Duration = Duration::from_millis(5);
/// The longest delay between two attempts.
pub const RETRY_MAX_DELAY: Duration = Duration::from_millis(200);

/// An error that may say "run the whole transaction again".
pub trait Retry {
    /// Whether the transaction was aborted by Postgres for a serialization failure or a
    /// deadlock, so running it again may succeed.
    fn is_retryable(&self) -> bool;
}

impl Retry for StoreError {
    fn is_retryable(&self) -> bool {
        StoreError::is_retryable(self)
    }
}

/// Runs `transaction` (a closure that begins, works in and commits one transaction) and runs
/// it again when Postgres aborted it for a serialization failure or a deadlock: up to
/// [`RETRY_ATTEMPTS`] more times, with jittered exponential delays. Any other error, or the
/// last retryable one, is returned as it is.
pub async fn retry_transaction<T, E, F, Fut>(transaction: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: Retry + std::fmt::Display,
{
    transaction
        .retry(
            ExponentialBuilder::default()
                .with_min_delay(RETRY_MIN_DELAY)
                .with_max_delay(RETRY_MAX_DELAY)
                .with_max_times(RETRY_ATTEMPTS)
                .with_jitter(),
        )
        .when(|e: &E| e.is_retryable())
        .notify(|error, after| {
            metrics::counter!("berth_db_transaction_retries_total").increment(1);
            warn!(%error, ?after, "transaction aborted by Postgres; running it again");
        })
        .await
}
