//! The leader's periodic pass: converge what results alone cannot — silent hosts, commands a
//! host never answered, guests that stopped answering, sandboxes stranded on lost hosts,
//! auto-stop, auto-delete, tombstone purge — and export the capacity invariant.
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

use std::time::{Duration, Instant};

use berth_schemas::db::{
    insert_command_on, write_transition, SandboxSnapshot, Transition, SNAPSHOT_COLUMNS,
};
use berth_schemas::state::{on_request, Decision, Request};
use berth_schemas::wire::{Command, Resources, SandboxSpec};
use berth_schemas::{CommandId, CommandKind, Generation, OrgId, Reason, SandboxState};
use sqlx::{PgPool, Postgres, Row, Transaction};
use tracing::{info, warn};

use crate::lease::Lease;

/// Defaults of [`PassConfig`].
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
pub const DEFAULT_HOST_LOST_AFTER: Duration = Duration::from_secs(5 * 60);
pub const DEFAULT_FAILOVER_AFTER: Duration = Duration::from_secs(10 * 60);
pub const DEFAULT_CREATE_TIMEOUT: Duration = Duration::from_secs(120);
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(120);
pub const DEFAULT_STOP_TIMEOUT: Duration = Duration::from_secs(120);
pub const DEFAULT_INVENTORY_GRACE: Duration = Duration::from_secs(30);
pub const DEFAULT_TOMBSTONE_RETENTION: Duration = Duration::from_secs(24 * 3600);
pub const DEFAULT_IDEMPOTENCY_RETENTION: Duration = Duration::from_secs(24 * 3600);
pub const DEFAULT_BATCH: i64 = 500;

/// Timing and size of a pass. Every duration is configurable so tests run in milliseconds.
#[derive(Debug, Clone)]
pub struct PassConfig {
    pub interval: Duration,
    /// A host silent this long becomes `lost`.
    pub host_lost_after: Duration,
    /// Sandboxes on a host `lost` this much longer become `failed-start` (`host_lost`).
    pub failover_after: Duration,
    pub create_timeout: Duration,
    pub start_timeout: Duration,
    pub stop_timeout: Duration,
    /// A `running` sandbox is judged by inventory only once a heartbeat this much newer than its
    /// last change arrived.
    pub inventory_grace: Duration,
    pub tombstone_retention: Duration,
    pub idempotency_retention: Duration,
    pub batch: i64,
}

impl Default for PassConfig {
    fn default() -> Self {
        Self {
            interval: DEFAULT_INTERVAL,
            host_lost_after: DEFAULT_HOST_LOST_AFTER,
            failover_after: DEFAULT_FAILOVER_AFTER,
            create_timeout: DEFAULT_CREATE_TIMEOUT,
            start_timeout: DEFAULT_START_TIMEOUT,
            stop_timeout: DEFAULT_STOP_TIMEOUT,
            inventory_grace: DEFAULT_INVENTORY_GRACE,
            tombstone_retention: DEFAULT_TOMBSTONE_RETENTION,
            idempotency_retention: DEFAULT_IDEMPOTENCY_RETENTION,
            batch: DEFAULT_BATCH,
        }
    }
}

/// One kind of pass action; the `action` label of `berth_reconciler_actions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    HostLost,
    CommandTimeout,
    GuestUnhealthy,
    HostLostFailover,
    AutoStop,
    AutoDelete,
    TombstonePurge,
    OrphanDestroyed,
    OrphanStopped,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::HostLost => "host_lost",
            Action::CommandTimeout => "command_timeout",
            Action::GuestUnhealthy => "guest_unhealthy",
            Action::HostLostFailover => "host_lost_failover",
            Action::AutoStop => "auto_stop",
            Action::AutoDelete => "auto_delete",
            Action::TombstonePurge => "tombstone_purge",
            Action::OrphanDestroyed => "orphan_destroyed",
            Action::OrphanStopped => "orphan_stopped",
        }
    }
}

/// What a pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassReport {
    pub actions: Vec<(Action, u64)>,
    /// The pass stood down because every in-service host was silent.
    pub all_hosts_silent: bool,
    /// The lease was lost during the pass; the rest was skipped.
    pub deposed: bool,
}

impl PassReport {
    /// How many times `action` happened.
    pub fn count(&self, action: Action) -> u64 {
        self.actions
            .iter()
            .filter(|(a, _)| *a == action)
            .map(|(_, n)| n)
            .sum()
    }
}

/// Errors of a pass.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("lease lost")]
    Deposed,
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Begins a transaction that holds the lease (fenced write), or fails with
/// [`PassError::Deposed`].
async fn fenced(db: &PgPool, lease: &Lease) -> Result<Transaction<'static, Postgres>, PassError> {
    let mut tx = db.begin().await?;
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
    let (alive, in_service): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE last_seen > now() - make_interval(secs => $1)),
                count(*)
           FROM hosts WHERE state <> 'lost'",
    )
    .bind(secs(config.host_lost_after))
    .fetch_one(db)
    .await?;
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
    let n = mark_lost_hosts(db, config, lease).await?;
    report.actions.push((Action::HostLost, n));
    let n = time_out_commands(db, config, lease).await?;
    report.actions.push((Action::CommandTimeout, n));
    let n = fail_unhealthy_guests(db, config, lease).await?;
    report.actions.push((Action::GuestUnhealthy, n));
    let n = fail_over_lost_hosts(db, config, lease).await?;
    report.actions.push((Action::HostLostFailover, n));
    let n = auto_lifecycle(db, config, lease, Request::Stop).await?;
    report.actions.push((Action::AutoStop, n));
    let n = auto_lifecycle(db, config, lease, Request::Delete).await?;
    report.actions.push((Action::AutoDelete, n));
    let n = purge(db, config, lease).await?;
    report.actions.push((Action::TombstonePurge, n));
    let (destroyed, stopped) = reconcile_inventory(db, config, lease).await?;
    report.actions.push((Action::OrphanDestroyed, destroyed));
    report.actions.push((Action::OrphanStopped, stopped));
    Ok(())
}

async fn mark_lost_hosts(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let lost: Vec<uuid::Uuid> = sqlx::query_scalar(
        "UPDATE hosts SET state = 'lost'
          WHERE state <> 'lost' AND last_seen < now() - make_interval(secs => $1)
          RETURNING id",
    )
    .bind(secs(config.host_lost_after))
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    for host in &lost {
        warn!(host_id = %host, "host silent too long; marked lost");
    }
    Ok(lost.len() as u64)
}

/// Moves a locked sandbox to `failed-start` with `reason`, releasing its capacity and queueing
/// `compensation` on its host (at the new generation, so the host's fence refuses the old
/// command if it has not run it yet).
async fn fail_sandbox(
    tx: &mut Transaction<'_, Postgres>,
    snap: &SandboxSnapshot,
    reason: Reason,
    message: &str,
    compensation: Option<CommandKind>,
) -> Result<(), sqlx::Error> {
    if snap.holds_capacity {
        if let Some(host) = snap.host_id {
            berth_scheduler::placement::release(tx, host, snap.resources).await?;
        }
    }
    write_transition(
        tx,
        snap,
        &Transition {
            to: SandboxState::FailedStart,
            command: compensation,
            reason,
            holds_capacity: false,
            delete: false,
            message: Some(message),
        },
    )
    .await?;
    sqlx::query(
        "UPDATE commands SET completed_at = now(), outcome = 'timeout'
          WHERE sandbox_id = $1 AND completed_at IS NULL AND generation <= $2",
    )
    .bind(snap.id)
    .bind(snap.generation)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn time_out_commands(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let rows = sqlx::query(&format!(
        "SELECT c.kind AS command_kind, {cols}
           FROM commands c JOIN sandboxes s ON s.id = c.sandbox_id
          WHERE c.completed_at IS NULL
            -- Only a command its sandbox still waits on: a compensation queued at the
            -- current generation of a failed-start sandbox is not, and must not fail it again.
            AND (c.kind, s.state) IN (('sandbox.create', 'provisioning'),
                                      ('sandbox.start', 'starting'),
                                      ('sandbox.stop', 'stopping'))
            AND c.generation = s.generation AND s.deleted_at IS NULL
            AND c.created_at < now() - make_interval(secs => CASE c.kind
                    WHEN 'sandbox.create' THEN $1
                    WHEN 'sandbox.start' THEN $2
                    ELSE $3 END)
          ORDER BY c.created_at
          LIMIT $4
          FOR UPDATE OF s SKIP LOCKED",
        cols = prefixed(SNAPSHOT_COLUMNS, "s")
    ))
    .bind(secs(config.create_timeout))
    .bind(secs(config.start_timeout))
    .bind(secs(config.stop_timeout))
    .bind(config.batch)
    .fetch_all(&mut *tx)
    .await?;
    let mut n = 0;
    for row in &rows {
        let snap = SandboxSnapshot::from_row(row)?;
        let kind: String = row.try_get("command_kind")?;
        // Undo whatever the host may still do: a create is destroyed; a start or stop ends
        // stopped, keeping the disk.
        let compensation = if kind == CommandKind::Create.as_str() {
            CommandKind::Delete
        } else {
            CommandKind::Stop
        };
        let message = format!("timeout: host never answered {kind}");
        fail_sandbox(
            &mut tx,
            &snap,
            Reason::Timeout,
            &message,
            Some(compensation),
        )
        .await?;
        info!(sandbox_id = %snap.id, %kind, "command timed out; sandbox failed-start");
        n += 1;
    }
    tx.commit().await?;
    Ok(n)
}

async fn fail_unhealthy_guests(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let rows = sqlx::query(&format!(
        "SELECT {cols},
                EXISTS (SELECT 1 FROM jsonb_array_elements(h.inventory) i
                         WHERE i->>'sandbox_id' = s.id::text) AS listed
           FROM sandboxes s JOIN hosts h ON h.id = s.host_id
          WHERE s.state = 'running' AND s.deleted_at IS NULL AND h.state <> 'lost'
            AND h.last_seen > s.updated_at + make_interval(secs => $1)
            AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(h.inventory) i
                             WHERE i->>'sandbox_id' = s.id::text AND i->>'status' = 'running')
          LIMIT $2
          FOR UPDATE OF s SKIP LOCKED",
        cols = prefixed(SNAPSHOT_COLUMNS, "s")
    ))
    .bind(secs(config.inventory_grace))
    .bind(config.batch)
    .fetch_all(&mut *tx)
    .await?;
    let mut n = 0;
    for row in &rows {
        let snap = SandboxSnapshot::from_row(row)?;
        let listed: bool = row.try_get("listed")?;
        let message = if listed {
            "guest stopped answering (agent health check failed)"
        } else {
            "guest missing from its host's inventory"
        };
        fail_sandbox(
            &mut tx,
            &snap,
            Reason::RuntimeError,
            message,
            Some(CommandKind::Stop),
        )
        .await?;
        warn!(sandbox_id = %snap.id, message, "running sandbox failed");
        n += 1;
    }
    tx.commit().await?;
    Ok(n)
}

async fn fail_over_lost_hosts(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let rows = sqlx::query(&format!(
        "SELECT {cols}
           FROM sandboxes s JOIN hosts h ON h.id = s.host_id
          WHERE h.state = 'lost' AND s.deleted_at IS NULL
            AND h.last_seen < now() - make_interval(secs => $1)
            AND s.state IN ('provisioning', 'starting', 'running', 'stopping', 'resuming',
                            'restoring', 'migrating')
          LIMIT $2
          FOR UPDATE OF s SKIP LOCKED",
        cols = prefixed(SNAPSHOT_COLUMNS, "s")
    ))
    .bind(secs(config.host_lost_after + config.failover_after))
    .bind(config.batch)
    .fetch_all(&mut *tx)
    .await?;
    let mut n = 0;
    for row in &rows {
        let snap = SandboxSnapshot::from_row(row)?;
        // No backup store yet: the sandbox cannot be restored elsewhere. Nothing is sent to the
        // lost host; if it comes back, its inventory shows the container as an orphan.
        fail_sandbox(
            &mut tx,
            &snap,
            Reason::HostLost,
            "host_lost: its host was lost and no backup exists",
            None,
        )
        .await?;
        n += 1;
    }
    tx.commit().await?;
    Ok(n)
}

/// Auto-stop (`Request::Stop`: running, idle for `auto_stop_minutes`) and auto-delete
/// (`Request::Delete`: stopped or failed-start for `auto_delete_minutes`).
async fn auto_lifecycle(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
    request: Request,
) -> Result<u64, PassError> {
    let (filter, reason) = match request {
        Request::Stop => (
            "state = 'running' AND auto_stop_minutes IS NOT NULL
             AND last_activity_at < now() - make_interval(mins => auto_stop_minutes)",
            Reason::AutoStop,
        ),
        Request::Delete => (
            "state IN ('stopped', 'failed-start') AND auto_delete_minutes IS NOT NULL
             AND updated_at < now() - make_interval(mins => auto_delete_minutes)",
            Reason::AutoDelete,
        ),
        Request::Start => return Ok(0),
    };
    let mut tx = fenced(db, lease).await?;
    let rows = sqlx::query(&format!(
        "SELECT {SNAPSHOT_COLUMNS} FROM sandboxes
          WHERE deleted_at IS NULL AND {filter}
          LIMIT $1 FOR UPDATE SKIP LOCKED"
    ))
    .bind(config.batch)
    .fetch_all(&mut *tx)
    .await?;
    let mut n = 0;
    for row in &rows {
        let snap = SandboxSnapshot::from_row(row)?;
        let Ok(Decision::Transition { to, command }) =
            on_request(snap.state, snap.deleting, request)
        else {
            continue;
        };
        write_transition(
            &mut tx,
            &snap,
            &Transition {
                to,
                command: Some(command),
                reason,
                holds_capacity: snap.holds_capacity,
                delete: request == Request::Delete,
                message: None,
            },
        )
        .await?;
        info!(sandbox_id = %snap.id, reason = reason.as_str(), "automatic lifecycle request");
        n += 1;
    }
    tx.commit().await?;
    Ok(n)
}

async fn purge(db: &PgPool, config: &PassConfig, lease: &Lease) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let purged: Vec<uuid::Uuid> = sqlx::query_scalar(
        "DELETE FROM sandboxes WHERE id IN (
             SELECT id FROM sandboxes
              WHERE state = 'deleted' AND updated_at < now() - make_interval(secs => $1)
                -- Keep a tombstone until its events are out: purging cascades to them.
                AND NOT EXISTS (SELECT 1 FROM events e
                                 WHERE e.sandbox_id = sandboxes.id AND e.published_at IS NULL)
              LIMIT $2 FOR UPDATE SKIP LOCKED)
         RETURNING id",
    )
    .bind(secs(config.tombstone_retention))
    .bind(config.batch)
    .fetch_all(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM commands WHERE sandbox_id = ANY($1) AND completed_at IS NOT NULL")
        .bind(&purged)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "DELETE FROM idempotency_keys WHERE created_at < now() - make_interval(secs => $1)",
    )
    .bind(secs(config.idempotency_retention))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(purged.len() as u64)
}

/// Guarantee 5 from the hosts' side: a container a host reports running that no row wants
/// there — no row at all (purged), a deleted row, a row placed on another host, or a row that
/// is `stopped`/`failed-start` — gets a command: destroyed, or stopped when the row is the
/// host's own stopped or failed sandbox (its disk stays). Only once the host's heartbeat is
/// [`PassConfig::inventory_grace`] newer than the row's last change, and only when no command
/// for that sandbox on that host is still open. Returns (destroyed, stopped).
async fn reconcile_inventory(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<(u64, u64), PassError> {
    let mut tx = fenced(db, lease).await?;
    let rows = sqlx::query(
        "SELECT h.id AS host_id, (i->>'sandbox_id')::uuid AS sandbox_id,
                (i->>'generation')::int8 AS item_generation,
                s.id IS NOT NULL AS known, s.state, s.generation, s.org_id, s.template,
                s.vcpus, s.memory_mib, s.host_id = h.id AS same_host
           FROM hosts h
          CROSS JOIN LATERAL jsonb_array_elements(h.inventory) i
           LEFT JOIN sandboxes s ON s.id = (i->>'sandbox_id')::uuid
          WHERE h.state <> 'lost' AND i->>'status' IN ('running', 'unhealthy')
            AND (s.id IS NULL OR s.host_id IS DISTINCT FROM h.id
                 OR s.state IN ('stopped', 'failed-start', 'deleted'))
            AND (s.id IS NULL OR h.last_seen > s.updated_at + make_interval(secs => $1))
            AND NOT EXISTS (SELECT 1 FROM commands c
                             WHERE c.sandbox_id = (i->>'sandbox_id')::uuid
                               AND c.host_id = h.id AND c.completed_at IS NULL)
          LIMIT $2",
    )
    .bind(secs(config.inventory_grace))
    .bind(config.batch)
    .fetch_all(&mut *tx)
    .await?;
    let (mut destroyed, mut stopped) = (0, 0);
    for row in &rows {
        let host: berth_schemas::HostId = row.try_get("host_id")?;
        let sandbox: berth_schemas::SandboxId = row.try_get("sandbox_id")?;
        let known: bool = row.try_get("known")?;
        let state: Option<String> = row.try_get("state")?;
        let same_host: Option<bool> = row.try_get("same_host")?;
        let item_generation: i64 = row
            .try_get::<Option<i64>, _>("item_generation")?
            .unwrap_or(0);
        let row_generation: i64 = row.try_get::<Option<i64>, _>("generation")?.unwrap_or(0);
        let keep_disk = known
            && same_host == Some(true)
            && matches!(state.as_deref(), Some("stopped") | Some("failed-start"));
        let kind = if keep_disk {
            CommandKind::Stop
        } else {
            CommandKind::Delete
        };
        // A purged row leaves no spec; a destroy needs none.
        let spec = if known {
            SandboxSpec {
                org_id: row.try_get("org_id")?,
                template: row.try_get("template")?,
                resources: Resources {
                    vcpus: u32::try_from(row.try_get::<i32, _>("vcpus")?).unwrap_or(0),
                    memory_mib: u32::try_from(row.try_get::<i32, _>("memory_mib")?).unwrap_or(0),
                },
            }
        } else {
            SandboxSpec {
                org_id: OrgId(uuid::Uuid::nil()),
                template: String::new(),
                resources: Resources::default(),
            }
        };
        let command = Command {
            id: CommandId::new(),
            sandbox_id: sandbox,
            generation: Generation(item_generation.max(row_generation)),
            kind,
            spec,
        };
        insert_command_on(&mut tx, host, &command).await?;
        warn!(sandbox_id = %sandbox, host_id = %host, command = %kind, state = ?state,
            "container no row wants there; compensating");
        metrics::counter!("berth_compensations_total", "kind" => kind.as_str()).increment(1);
        if keep_disk {
            stopped += 1;
        } else {
            destroyed += 1;
        }
    }
    tx.commit().await?;
    Ok((destroyed, stopped))
}

/// Guarantee 4 as a metric: `berth_capacity_drift_vcpus` and `berth_capacity_drift_memory_mib`
/// are the summed absolute differences, over hosts, between what a host has reserved and what
/// its capacity-holding sandboxes need. They must read 0.
pub async fn capacity_drift(db: &PgPool) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as(
        "SELECT COALESCE(sum(abs(h.reserved_vcpus - COALESCE(s.vcpus, 0))), 0)::int8,
                COALESCE(sum(abs(h.reserved_memory_mib - COALESCE(s.mem, 0))), 0)::int8
           FROM hosts h
           LEFT JOIN (SELECT host_id, sum(vcpus) AS vcpus, sum(memory_mib) AS mem
                        FROM sandboxes WHERE holds_capacity GROUP BY host_id) s
             ON s.host_id = h.id",
    )
    .fetch_one(db)
    .await
}

async fn record_capacity_drift(db: &PgPool) -> Result<(), sqlx::Error> {
    let (vcpus, memory) = capacity_drift(db).await?;
    metrics::gauge!("berth_capacity_drift_vcpus").set(vcpus as f64);
    metrics::gauge!("berth_capacity_drift_memory_mib").set(memory as f64);
    Ok(())
}

/// `"a, b AS c"` → `"s.a, s.b AS c"`: qualifies a column list with a table alias.
fn prefixed(columns: &str, alias: &str) -> String {
    columns
        .split(", ")
        .map(|c| format!("{alias}.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_lists_are_qualified_with_the_alias() {
        assert_eq!(
            prefixed("id, deleted_at IS NOT NULL AS deleting", "s"),
            "s.id, s.deleted_at IS NOT NULL AS deleting"
        );
    }
}
