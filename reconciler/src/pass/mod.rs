//! The leader's periodic pass: converge what results alone cannot — silent hosts, commands a
//! host never answered, guests that stopped answering, sandboxes stranded on lost hosts,
//! expiry, auto-stop, auto-delete, tombstone purge — and export the capacity invariant.
//!
//! Source: the seed lifecycle doc, "Let the reconciler converge" (`shared/reference/003_…`).
//!
//! # Guarantees
//! - Idempotent and level-triggered: every action reads the current rows and acts only on
//!   what still needs it; running a pass twice changes nothing the second time.
//! - Fenced: each action commits in its own transaction that first re-checks the leader lease
//!   ([`Lease::check`]); a deposed leader's writes roll back.
//! - Bounded: each action handles at most [`PassConfig::batch`] rows per pass.
//! - When every in-service host is silent at once, the pass does nothing but say so (a log
//!   line and `berth_reconciler_all_hosts_silent`): that pattern points at the control plane's
//!   own network or database, not at the hosts.
//! - A sandbox is judged by its host's inventory only when that inventory was taken after the
//!   sandbox's last change and after the host applied its last command, and only while the
//!   host's evidence is younger than [`PassConfig::evidence_max_age`]; a host whose evidence
//!   is older is left alone and named in the log ([`guests`]).
//! - Guest failures pass a circuit breaker ([`guests`]): when more than a configured share of
//!   a host's or the fleet's running sandboxes would fail at once, the pass holds them until
//!   the evidence persisted or an operator released the trip.

use std::time::{Duration, Instant};

use berth_schemas::state::breaker::BreakerPolicy;
use berth_schemas::state::snapshot::{on_snapshot_timeout, SNAPSHOT_TIMED_OUT};
use berth_schemas::state::{
    on_expiry, on_inventory, on_request, on_timeout, Decision, Expiry, ExpiryAction, Failure,
    InventoryVerdict, Request,
};
use berth_schemas::wire::Command;
use berth_schemas::{CommandId, CommandKind, Generation, Reason};
use berth_store::hosts::{self, Overcommit};
use berth_store::leases::Lease;
use berth_store::sandboxes::{self, CommandTimeouts, Due, Transition};
use berth_store::{commands, idempotency, SandboxRow, StoreError};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use tracing::{info, warn};

mod backups;
mod drain;
mod failover;
pub mod guests;
mod report;

pub use drain::DEFAULT_DRAIN_PARALLEL;
pub use report::{Action, PassReport};

/// Default [`PassConfig::interval`]: a pass every 10 seconds.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
/// Default [`PassConfig::host_lost_after`]: 5 minutes of silence (DESIGN.md "Lifecycle").
pub const DEFAULT_HOST_LOST_AFTER: Duration = Duration::from_secs(5 * 60);
/// Default [`PassConfig::failover_after`]: 10 minutes after `lost` (DESIGN.md "Lifecycle").
pub const DEFAULT_FAILOVER_AFTER: Duration = Duration::from_secs(10 * 60);
/// Default [`PassConfig::failover_retry_for`]: 2 minutes, the default create timeout (see the
/// field).
pub const DEFAULT_FAILOVER_RETRY_FOR: Duration = Duration::from_secs(120);
/// Default [`PassConfig::create_timeout`]: 2 minutes.
pub const DEFAULT_CREATE_TIMEOUT: Duration = Duration::from_secs(120);
/// Default [`PassConfig::start_timeout`]: 2 minutes.
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(120);
/// Default [`PassConfig::stop_timeout`]: 2 minutes.
pub const DEFAULT_STOP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a snapshot may stay `creating` (capture and upload) before it fails: 30 minutes,
/// room for a large sandbox on a slow object store.
pub const DEFAULT_SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// Default [`PassConfig::archive_timeout`]: 30 minutes, room to upload (archive) or fetch
/// (unarchive) a large sandbox on a slow object store, as a snapshot has.
pub const DEFAULT_ARCHIVE_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// One minute of `backup_interval_min`.
pub const DEFAULT_BACKUP_UNIT: Duration = Duration::from_secs(60);
/// Default [`PassConfig::template_pull_timeout`]: 30 minutes without any sign of a template's
/// image pull (a progress event per layer), room for one large layer on a slow registry.
pub const DEFAULT_TEMPLATE_PULL_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// Default [`PassConfig::inventory_grace`]: 30 seconds (several heartbeats).
pub const DEFAULT_INVENTORY_GRACE: Duration = Duration::from_secs(30);
/// Default [`PassConfig::tombstone_retention`]: a day.
pub const DEFAULT_TOMBSTONE_RETENTION: Duration = Duration::from_secs(24 * 3600);
/// Default [`PassConfig::idempotency_retention`]: a day.
pub const DEFAULT_IDEMPOTENCY_RETENTION: Duration = Duration::from_secs(24 * 3600);
/// Default [`PassConfig::batch`]: 500 rows per action per pass.
pub const DEFAULT_BATCH: i64 = 500;
/// Default [`PassConfig::evidence_max_age`]: a minute (30 heartbeats at hostd's default 2 s).
pub const DEFAULT_EVIDENCE_MAX_AGE: Duration = Duration::from_secs(60);
/// Default [`GuestBreaker::host_share`]: half of a host's running sandboxes.
pub const DEFAULT_BREAKER_HOST_SHARE: f64 = 0.5;
/// Default [`GuestBreaker::fleet_share`]: a tenth of the fleet's running sandboxes.
pub const DEFAULT_BREAKER_FLEET_SHARE: f64 = 0.1;
/// Default [`GuestBreaker::min_failures`]: fewer than 5 failures never trip a breaker.
pub const DEFAULT_BREAKER_MIN_FAILURES: u64 = 5;
/// Default [`GuestBreaker::persist_passes`]: a trip acts on its third consecutive pass.
pub const DEFAULT_BREAKER_PERSIST_PASSES: u32 = 3;

/// The circuit breaker of guest failures (see [`guests`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuestBreaker {
    /// Trip when more than this share (0..=1) of one host's running sandboxes would fail.
    pub host_share: f64,
    /// Trip when more than this share of the fleet's running sandboxes would fail.
    pub fleet_share: f64,
    /// Never trip for fewer failures than this (per scope).
    pub min_failures: u64,
    /// A trip acts once its share stayed exceeded, on new evidence, this many passes.
    pub persist_passes: u32,
}

impl Default for GuestBreaker {
    fn default() -> Self {
        Self {
            host_share: DEFAULT_BREAKER_HOST_SHARE,
            fleet_share: DEFAULT_BREAKER_FLEET_SHARE,
            min_failures: DEFAULT_BREAKER_MIN_FAILURES,
            persist_passes: DEFAULT_BREAKER_PERSIST_PASSES,
        }
    }
}

impl GuestBreaker {
    /// The policy of one host's breaker.
    pub fn host(&self) -> BreakerPolicy {
        BreakerPolicy {
            share: self.host_share,
            min_failures: self.min_failures,
            persist_passes: self.persist_passes,
        }
    }

    /// The policy of the fleet's breaker.
    pub fn fleet(&self) -> BreakerPolicy {
        BreakerPolicy {
            share: self.fleet_share,
            ..self.host()
        }
    }
}

/// Timing and size of a pass. Every duration is configurable so tests run in milliseconds.
#[derive(Debug, Clone)]
pub struct PassConfig {
    /// Time between two passes of the leader.
    pub interval: Duration,
    /// A host silent this long becomes `lost`.
    pub host_lost_after: Duration,
    /// Sandboxes on a host `lost` this much longer fail over: restored from their newest backup
    /// on another host, or `failed-start` (`host_lost`) without one.
    pub failover_after: Duration,
    /// How long a failover a pass defers (no host in service has room for the sandbox's
    /// backup, the hosts with room are stale or degraded, or the backup is being deleted or not
    /// ready) is tried again by each pass, counted from the first pass that deferred it while
    /// its host is lost (not from the host's last heartbeat: a pass may first reach it long
    /// after it was due); the first pass after that which still cannot restore it makes the
    /// sandbox `failed-start` (`host_lost`, the message saying why) instead of leaving it
    /// `running` on a lost host. Default
    /// [`DEFAULT_FAILOVER_RETRY_FOR`], the default create timeout: the restore is a boot like a
    /// create, and a create that finds nothing to run on within that long fails too. By then
    /// the sandbox has been down for the lost and failover delays already; `failed-start` tells
    /// its user, who can restore from the backup (or start it) once there is room.
    pub failover_retry_for: Duration,
    /// How long a `sandbox.create` may stay unanswered before the sandbox is `failed-start`.
    pub create_timeout: Duration,
    /// How long a `sandbox.start` may stay unanswered before the sandbox is `failed-start`.
    pub start_timeout: Duration,
    /// How long a `sandbox.stop` may stay unanswered before the sandbox is `failed-start`.
    pub stop_timeout: Duration,
    /// A `running` sandbox is judged by inventory only once a heartbeat this much newer than its
    /// last change arrived.
    pub inventory_grace: Duration,
    /// How long a `deleted` row stays before it is purged (once its events are published).
    pub tombstone_retention: Duration,
    /// How long an `Idempotency-Key` is remembered.
    pub idempotency_retention: Duration,
    /// At most this many rows per action in one pass (the rest wait for the next pass).
    pub batch: i64,
    /// Host health: how bad boots (a timed-out create or start among them) degrade a host,
    /// and where a failed create is retried (also read by the result consumer).
    pub health: crate::health::HealthConfig,
    /// A host whose newest inventory is older than this (host send time, database clock) is
    /// not judged: no guest failed, no orphan compensated there, until fresher evidence comes.
    pub evidence_max_age: Duration,
    /// The circuit breaker of guest failures.
    pub breaker: GuestBreaker,
    /// How long a snapshot may stay `creating` before it fails ([`SNAPSHOT_TIMED_OUT`]).
    pub snapshot_timeout: Duration,
    /// How long a template may stay `pulling` without a sign of its pull (the start, or its
    /// last progress event) before it fails with `pull_timed_out`: the API process pulling it
    /// died mid-pull.
    pub template_pull_timeout: Duration,
    /// How long a `sandbox.archive` may stay unanswered before the sandbox is `stopped` again
    /// (with its disk, reason `timeout`), a `sandbox.unarchive` before it is
    /// `failed-start` (capacity released), and a `sandbox.migrate` before it is `stopped`
    /// again on the host it came from (capacity released on the new one, which gets a delete).
    pub archive_timeout: Duration,
    /// The length of one of `backup_interval_min`'s minutes ([`DEFAULT_BACKUP_UNIT`]; tests
    /// shorten it).
    pub backup_unit: Duration,
    /// Moves in flight per draining host ([`DEFAULT_DRAIN_PARALLEL`]); a live move also
    /// waits at most [`PassConfig::archive_timeout`] for its stop to be durable.
    pub drain_parallel: i64,
}

impl Default for PassConfig {
    fn default() -> Self {
        Self {
            interval: DEFAULT_INTERVAL,
            host_lost_after: DEFAULT_HOST_LOST_AFTER,
            failover_after: DEFAULT_FAILOVER_AFTER,
            failover_retry_for: DEFAULT_FAILOVER_RETRY_FOR,
            create_timeout: DEFAULT_CREATE_TIMEOUT,
            start_timeout: DEFAULT_START_TIMEOUT,
            stop_timeout: DEFAULT_STOP_TIMEOUT,
            inventory_grace: DEFAULT_INVENTORY_GRACE,
            tombstone_retention: DEFAULT_TOMBSTONE_RETENTION,
            idempotency_retention: DEFAULT_IDEMPOTENCY_RETENTION,
            batch: DEFAULT_BATCH,
            health: crate::health::HealthConfig::default(),
            evidence_max_age: DEFAULT_EVIDENCE_MAX_AGE,
            breaker: GuestBreaker::default(),
            snapshot_timeout: DEFAULT_SNAPSHOT_TIMEOUT,
            template_pull_timeout: DEFAULT_TEMPLATE_PULL_TIMEOUT,
            archive_timeout: DEFAULT_ARCHIVE_TIMEOUT,
            backup_unit: DEFAULT_BACKUP_UNIT,
            drain_parallel: drain::DEFAULT_DRAIN_PARALLEL,
        }
    }
}

/// Errors of a pass.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    /// A store operation failed; the pass's open transaction rolled back.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The lease was no longer held when a transaction began; nothing was written.
    #[error("lease lost")]
    Deposed,
}

/// Begins a transaction that holds the lease (fenced write), or fails with
/// [`PassError::Deposed`].
pub(crate) async fn fenced(
    db: &PgPool,
    lease: &Lease,
) -> Result<Transaction<'static, Postgres>, PassError> {
    let mut tx = db.begin().await.map_err(StoreError::from)?;
    if !lease.check(&mut tx).await? {
        return Err(PassError::Deposed);
    }
    Ok(tx)
}

/// Runs one pass as the holder of `lease`.
pub async fn run_pass(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<PassReport, PassError> {
    let started = Instant::now();
    let mut report = PassReport::default();
    let result = run_actions(db, config, lease, &mut report).await;
    metrics::histogram!("berth_reconciler_pass_duration_seconds")
        .record(started.elapsed().as_secs_f64());
    for (action, n) in &report.actions {
        if *n > 0 {
            metrics::counter!("berth_reconciler_actions_total", "action" => action.as_str())
                .increment(*n);
        }
    }
    if let Err(e) = record_capacity_drift(db).await {
        warn!(error = %e, "capacity drift not measured");
    }
    match result {
        Ok(()) => Ok(report),
        Err(PassError::Deposed) => {
            report.deposed = true;
            Ok(report)
        }
        Err(e) => Err(e),
    }
}

async fn run_actions(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
    report: &mut PassReport,
) -> Result<(), PassError> {
    let (alive, in_service) = hosts::liveness(db, config.host_lost_after).await?;
    report.all_hosts_silent = in_service > 0 && alive == 0;
    metrics::gauge!("berth_reconciler_all_hosts_silent").set(if report.all_hosts_silent {
        1.0
    } else {
        0.0
    });
    if report.all_hosts_silent {
        warn!(in_service, "every in-service host is silent at once; doing nothing (check the control plane's network and database)");
        return Ok(());
    }
    let n = step("host_lost", mark_lost_hosts(db, config, lease)).await?;
    report.actions.push((Action::HostLost, n));
    let n = step("command_timeout", time_out_commands(db, config, lease)).await?;
    report.actions.push((Action::CommandTimeout, n));
    let n = step(
        "guest_unhealthy",
        guests::fail_unhealthy_guests(db, config, lease, report),
    )
    .await?;
    report.actions.push((Action::GuestUnhealthy, n));
    let failed_over = step(
        "failover",
        failover::fail_over_lost_hosts(db, config, lease),
    )
    .await?;
    report.actions.push((
        Action::HostLostFailover,
        failed_over.failed + failed_over.gave_up.total(),
    ));
    report
        .actions
        .push((Action::FailoverRestored, failed_over.restored));
    let n = step("expire", expire(db, config, lease)).await?;
    report.actions.push((Action::Expired, n));
    let n = step(
        "auto_stop",
        auto_lifecycle(db, config, lease, Request::Stop),
    )
    .await?;
    report.actions.push((Action::AutoStop, n));
    let n = step(
        "auto_delete",
        auto_lifecycle(db, config, lease, Request::Delete),
    )
    .await?;
    report.actions.push((Action::AutoDelete, n));
    let n = step("tombstone_purge", purge(db, config, lease)).await?;
    report.actions.push((Action::TombstonePurge, n));
    let (destroyed, stopped) = step("inventory", reconcile_inventory(db, config, lease)).await?;
    report.actions.push((Action::OrphanDestroyed, destroyed));
    report.actions.push((Action::OrphanStopped, stopped));
    let n = step("snapshot_timeout", time_out_snapshots(db, config, lease)).await?;
    report.actions.push((Action::SnapshotTimeout, n));
    let n = step(
        "template_pull_timeout",
        time_out_template_pulls(db, config, lease),
    )
    .await?;
    report.actions.push((Action::TemplatePullTimeout, n));
    let n = step(
        "auto_archive",
        auto_lifecycle(db, config, lease, Request::Archive),
    )
    .await?;
    report.actions.push((Action::AutoArchive, n));
    let n = step("auto_backup", backups::auto_backup(db, config, lease)).await?;
    report.actions.push((Action::AutoBackup, n));
    let (begun, ended) = step("drain", drain::drive(db, config, lease)).await?;
    report.actions.push((Action::DrainEnded, ended));
    report.actions.push((Action::DrainBegun, begun));
    Ok(())
}

/// Runs one step of a pass, recording its time in
/// `berth_reconciler_step_duration_seconds{step}` (seconds; also when it fails), so a slow pass
/// shows which step it spent its time in.
async fn step<T>(
    name: &'static str,
    work: impl std::future::Future<Output = Result<T, PassError>>,
) -> Result<T, PassError> {
    let started = Instant::now();
    let done = work.await;
    metrics::histogram!("berth_reconciler_step_duration_seconds", "step" => name)
        .record(started.elapsed().as_secs_f64());
    done
}

/// Templates `pulling` with no sign of their pull for [`PassConfig::template_pull_timeout`]
/// fail with `pull_timed_out` and a `template.failed` event (the process pulling them died);
/// asking for the template again pulls it again. A pull that still finishes later writes
/// nothing (`store::templates::finish_pull` is fenced on `pulling`).
async fn time_out_template_pulls(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let failed = berth_store::templates::fail_stale_pulls(
        &mut *tx,
        config.template_pull_timeout,
        config.batch,
    )
    .await?;
    commit(tx).await?;
    for name in &failed {
        info!(template = %name, "template pull showed no sign of life; failed");
    }
    Ok(failed.len() as u64)
}

/// Snapshots still `creating` past [`PassConfig::snapshot_timeout`] fail with
/// [`SNAPSHOT_TIMED_OUT`] and a `snapshot.failed` event; their sandboxes are untouched. A late
/// upload of one is not revived (`berth_schemas::state::snapshot`).
async fn time_out_snapshots(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let mut n = 0;
    let older = config.snapshot_timeout.as_secs_f64();
    for row in berth_store::snapshots::lock_timed_out(&mut tx, older, config.batch).await? {
        if on_snapshot_timeout(row.state).is_none() {
            continue;
        }
        berth_store::snapshots::write_failed(&mut tx, row.id, SNAPSHOT_TIMED_OUT).await?;
        crate::snapshots::event(
            &mut tx,
            &row,
            "snapshot.failed",
            Reason::Timeout,
            Some(SNAPSHOT_TIMED_OUT),
        )
        .await?;
        info!(snapshot_id = %row.id, "snapshot timed out; failed");
        n += 1;
    }
    commit(tx).await?;
    Ok(n)
}

async fn mark_lost_hosts(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let lost = hosts::mark_silent_lost(&mut tx, config.host_lost_after).await?;
    commit(tx).await?;
    for host in &lost {
        warn!(host_id = %host, "host silent too long; marked lost");
    }
    Ok(lost.len() as u64)
}

pub(crate) async fn commit(tx: Transaction<'_, Postgres>) -> Result<(), PassError> {
    tx.commit().await.map_err(StoreError::from)?;
    Ok(())
}

/// Writes `failure` of the locked sandbox `row`: `failed-start` with the failure's reason and
/// `message`, its capacity released and its compensation queued (by the store, in this
/// transaction), and every open command of the sandbox up to its old generation completed as
/// timed out.
pub(crate) async fn fail_sandbox(
    conn: &mut PgConnection,
    row: &SandboxRow,
    failure: Failure,
    message: &str,
) -> Result<(), StoreError> {
    sandboxes::write_transition(
        &mut *conn,
        row,
        &Transition {
            to: failure.to,
            command: failure.compensation,
            capacity: failure.capacity,
            reason: failure.reason,
            delete: false,
            message: Some(message),
            activity: false,
            overcommit: Overcommit::default(),
            snapshot: None,
        },
    )
    .await?;
    commands::time_out_open(conn, row.id, row.generation).await
}

async fn time_out_commands(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let timeouts = CommandTimeouts {
        create: config.create_timeout,
        start: config.start_timeout,
        stop: config.stop_timeout,
        archive: config.archive_timeout,
    };
    let mut n = 0;
    for timed_out in sandboxes::lock_timed_out(&mut tx, timeouts, config.batch).await? {
        let (row, kind) = (&timed_out.row, timed_out.kind);
        let Some(failure) = on_timeout(kind, row.state) else {
            continue;
        };
        // A boot the relay held back behind the cap of a host that is not healthy never
        // reached it: the reason says so, and the host's health is not charged again.
        let message = if timed_out.published {
            format!("timeout: host never answered {kind}")
        } else {
            format!(
                "timeout: {kind} was never delivered: its host is not healthy and its earlier \
                 boots hold the cap"
            )
        };
        fail_sandbox(&mut tx, row, failure, &message).await?;
        if let (Some(host), true) = (row.host_id, timed_out.published) {
            crate::health::record_timeout(&mut tx, host, kind, &config.health.policy).await?;
        }
        info!(sandbox_id = %row.id, %kind, to = %failure.to, "command timed out");
        n += 1;
    }
    commit(tx).await?;
    Ok(n)
}

/// Expiry: each sandbox whose `expires_at` passed gets its `on_expiry` action as
/// [`on_expiry`] decides — the request's transition with reason `expired` (and its expiry
/// cleared: it fires once), only the expiry cleared when the sandbox is already there, or
/// nothing yet while a conflicting transition is in flight (a later pass sees it settled).
/// An expiry that stops (or finds stopped) a sandbox also turns its `auto_resume` off
/// ([`keep_asleep`]). Returns how many transitions it wrote.
async fn expire(db: &PgPool, config: &PassConfig, lease: &Lease) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let mut n = 0;
    for row in sandboxes::lock_expired(&mut tx, config.batch).await? {
        let Decision::Transition {
            to,
            command,
            capacity,
        } = (match on_expiry(row.state, row.deleting(), row.on_expiry) {
            Expiry::Apply(decision) => decision,
            Expiry::Settled => {
                sandboxes::clear_expiry(&mut tx, &row, row.generation).await?;
                keep_asleep(&mut tx, &row).await?;
                continue;
            }
            Expiry::Later => continue,
        })
        else {
            continue;
        };
        let message = format!(
            "expired at {}: {}",
            row.expires_at.map(|t| t.to_rfc3339()).unwrap_or_default(),
            row.on_expiry
        );
        let written = sandboxes::write_transition(
            &mut tx,
            &row,
            &Transition {
                to,
                command: Some(command),
                capacity,
                reason: Reason::Expired,
                delete: row.on_expiry == ExpiryAction::Delete,
                message: Some(&message),
                activity: false,
                overcommit: Overcommit::default(),
                snapshot: None,
            },
        )
        .await?;
        sandboxes::clear_expiry(&mut tx, &row, written.row.generation).await?;
        keep_asleep(&mut tx, &written.row).await?;
        info!(sandbox_id = %row.id, action = %row.on_expiry, "sandbox expired");
        n += 1;
    }
    commit(tx).await?;
    Ok(n)
}

/// The `sandbox.updated` message of an expiry that turned `auto_resume` off.
pub const EXPIRY_RESUME_OFF: &str = "auto_resume: off, stopped by its expiry";

/// An expiry that stops a sandbox turns its `auto_resume` off, in the expiry's transaction:
/// otherwise any preview request (a shared link, a public port) would start again what the
/// owner's deadline stopped, and it would then run with no expiry at all (the expiry fired
/// once and is cleared). The owner's own start still works, and a PATCH turns `auto_resume`
/// back on. The `sandbox.updated` event says so ([`EXPIRY_RESUME_OFF`], reason `expired`).
async fn keep_asleep(conn: &mut PgConnection, row: &SandboxRow) -> Result<(), PassError> {
    if row.on_expiry != ExpiryAction::Stop || !row.auto_resume {
        return Ok(());
    }
    sandboxes::update_settings(
        conn,
        row,
        &sandboxes::SettingsChange {
            auto_resume: Some(false),
            message: EXPIRY_RESUME_OFF,
            ..Default::default()
        },
        Reason::Expired,
    )
    .await?;
    Ok(())
}

/// Auto-stop (`Request::Stop`: running, idle for `auto_stop_minutes`), auto-delete
/// (`Request::Delete`: stopped or failed-start for `auto_delete_minutes`) and auto-archive
/// (`Request::Archive`: stopped for `auto_archive_days`), decided by
/// [`on_request`] as a user's request would be.
async fn auto_lifecycle(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
    request: Request,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let (rows, reason) = match request {
        Request::Stop => (
            sandboxes::lock_due(&mut tx, Due::AutoStop, config.batch).await?,
            Reason::AutoStop,
        ),
        Request::Delete => (
            sandboxes::lock_due(&mut tx, Due::AutoDelete, config.batch).await?,
            Reason::AutoDelete,
        ),
        Request::Archive => (
            sandboxes::lock_due(&mut tx, Due::AutoArchive, config.batch).await?,
            Reason::AutoArchive,
        ),
        Request::Start | Request::Restore | Request::RestoreFromBackup => return Ok(0),
    };
    let mut n = 0;
    for row in &rows {
        let Ok(Decision::Transition {
            to,
            command,
            capacity,
        }) = on_request(row.state, row.deleting(), request)
        else {
            continue;
        };
        sandboxes::write_transition(
            &mut tx,
            row,
            &Transition {
                to,
                command: Some(command),
                capacity,
                reason,
                delete: request == Request::Delete,
                message: None,
                activity: false,
                overcommit: Overcommit::default(),
                snapshot: None,
            },
        )
        .await?;
        info!(sandbox_id = %row.id, reason = reason.as_str(), "automatic lifecycle request");
        n += 1;
    }
    commit(tx).await?;
    Ok(n)
}

async fn purge(db: &PgPool, config: &PassConfig, lease: &Lease) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let purged =
        sandboxes::purge_tombstones(&mut tx, config.tombstone_retention, config.batch).await?;
    commands::purge_completed(&mut tx, &purged).await?;
    idempotency::purge(&mut *tx, config.idempotency_retention).await?;
    commit(tx).await?;
    Ok(purged.len() as u64)
}

/// Guarantee 5 from the hosts' side: a container a host reports running that no row wants
/// there ([`on_inventory`]: no row at all (purged), a deleted row, a row placed on another
/// host, or a row that is `stopped`/`failed-start`) gets a command: destroyed, or stopped when
/// the row is the host's own stopped or failed sandbox (its disk stays). Only on evidence: an
/// inventory taken [`PassConfig::inventory_grace`] after the row's last change and after the
/// host applied every command of that sandbox (none still open), from a host whose evidence is
/// younger than [`PassConfig::evidence_max_age`]. Returns (destroyed, stopped).
async fn reconcile_inventory(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<(u64, u64), PassError> {
    let mut tx = fenced(db, lease).await?;
    let (mut destroyed, mut stopped) = (0, 0);
    let found = hosts::unwanted_containers(
        &mut tx,
        config.inventory_grace,
        config.evidence_max_age,
        config.batch,
    )
    .await?;
    for item in found {
        let verdict = on_inventory(item.row.as_ref().map(|r| (r.state, r.on_reporting_host)));
        let kind = match verdict {
            InventoryVerdict::Wanted => continue,
            InventoryVerdict::Stop => CommandKind::Stop,
            InventoryVerdict::Destroy => CommandKind::Delete,
        };
        let row_generation = item.row.as_ref().map_or(Generation(0), |r| r.generation);
        let command = Command {
            snapshot: None,
            id: CommandId::new(),
            sandbox_id: item.sandbox,
            // Never older than what the host applied, so its fence lets the command through.
            generation: item.generation.max(row_generation),
            kind,
            // A purged row leaves no spec; the host destroys from its own record.
            spec: item.row.as_ref().map(|r| r.spec.clone()),
        };
        commands::insert(&mut tx, item.host, &command).await?;
        warn!(sandbox_id = %item.sandbox, host_id = %item.host, command = %kind,
            state = ?item.row.as_ref().map(|r| r.state), "container no row wants there; compensating");
        metrics::counter!("berth_compensations_total", "kind" => kind.as_str()).increment(1);
        match verdict {
            InventoryVerdict::Stop => stopped += 1,
            _ => destroyed += 1,
        }
    }
    commit(tx).await?;
    Ok((destroyed, stopped))
}

/// Guarantee 4 as a metric: `berth_capacity_drift_vcpus` and `berth_capacity_drift_memory_mib`
/// are the summed absolute differences, over hosts, between what a host has reserved and what
/// its capacity-holding sandboxes need ([`sandboxes::capacity_drift`]). They must read 0.
pub async fn capacity_drift(db: &PgPool) -> Result<(i64, i64), StoreError> {
    sandboxes::capacity_drift(db).await
}

async fn record_capacity_drift(db: &PgPool) -> Result<(), StoreError> {
    let (vcpus, memory) = capacity_drift(db).await?;
    metrics::gauge!("berth_capacity_drift_vcpus").set(vcpus as f64);
    metrics::gauge!("berth_capacity_drift_memory_mib").set(memory as f64);
    Ok(())
}
