//! Failover (issue 14): a sandbox stranded on a host `lost` for longer than the failover delay
//! is restored from its newest backup on the host placement picks, when `on_host_lost` says so
//! (running, with a backup: `restoring` + `sandbox.migrate` of the backup, reason `host_lost`);
//! the rest become `failed-start` with reason `host_lost`. The lost host gets a delete at the
//! new generation (its fence lets it through when it comes back) and its inventory shows
//! whatever it still runs as unwanted, so it destroys its stale copy either way.
//!
//! Source: the seed lifecycle doc, "Archive, back up and recover from host loss" ("After a
//! further 10 minutes, each running sandbox on it that has a backup is restored on another
//! host. The rest become failed-start").

use berth_scheduler::placement::{self, Placement};
use berth_schemas::state::snapshot::SnapshotState;
use berth_schemas::state::{on_host_lost, HostLoss, HOST_LOST_MESSAGE};
use berth_schemas::{Reason, SandboxState};
use berth_store::leases::Lease;
use berth_store::sandboxes::{self, BackupRestore, SandboxRow};
use berth_store::snapshots;
use berth_store::StoreError;
use sqlx::{Acquire, PgConnection, PgPool};
use tracing::{info, warn};

use super::{commit, fail_sandbox, fenced, PassConfig, PassError};

/// What the failover did in one pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Failovers {
    /// Sandboxes restored from a backup on another host.
    pub restored: u64,
    /// Sandboxes failed (`host_lost`): no backup, or a state that does not fail over.
    pub failed: u64,
    /// Sandboxes with a backup that no host had room for: left as they are, tried again by the
    /// next pass.
    pub deferred: u64,
}

/// Fails over the sandboxes stranded on lost hosts; what it did.
pub(super) async fn fail_over_lost_hosts(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<Failovers, PassError> {
    let mut tx = fenced(db, lease).await?;
    let silent_for = config.host_lost_after + config.failover_after;
    let mut done = Failovers::default();
    for row in sandboxes::lock_stranded(&mut tx, silent_for, config.batch).await? {
        match on_host_lost(row.state, row.last_backup_id.is_some()) {
            HostLoss::Fail(failure) => {
                fail_sandbox(&mut tx, &row, failure, HOST_LOST_MESSAGE).await?;
                done.failed += 1;
            }
            HostLoss::RestoreBackup => {
                // A savepoint: a placement that finds no room rolls back the release with it.
                let mut attempt = tx.begin().await.map_err(StoreError::from)?;
                if restore_elsewhere(&mut attempt, config, &row).await? {
                    attempt.commit().await.map_err(StoreError::from)?;
                    done.restored += 1;
                } else {
                    done.deferred += 1;
                }
            }
        }
    }
    commit(tx).await?;
    for (result, n) in [
        ("restored", done.restored),
        ("failed", done.failed),
        ("deferred", done.deferred),
    ] {
        metrics::counter!("berth_failovers_total", "result" => result).increment(n);
    }
    Ok(done)
}

/// Restores the locked `row`, stranded on a lost host, from its newest backup on the host
/// placement picks; `false` (nothing written that the caller keeps) when no host can take it.
async fn restore_elsewhere(
    conn: &mut PgConnection,
    config: &PassConfig,
    row: &SandboxRow,
) -> Result<bool, StoreError> {
    // A restore from backup in flight boots the backup its user chose (`seed_snapshot`).
    let chosen = match row.state {
        SandboxState::Restoring => row.seed_snapshot.or(row.last_backup_id),
        _ => row.last_backup_id,
    };
    let (Some(backup), Some(lost)) = (chosen, row.host_id) else {
        return Ok(false);
    };
    // Held against a snapshot delete until this commits (a delete holding it defers the
    // failover to the next pass rather than wait: the sandbox row is locked already, and a
    // delete takes the snapshot first).
    if snapshots::lock_for_boot(&mut *conn, backup, true)
        .await?
        .is_none_or(|b| b.state != SnapshotState::Ready)
    {
        warn!(sandbox_id = %row.id, backup_id = %backup,
            "failover deferred: its backup is being deleted or is not ready");
        return Ok(false);
    }
    sandboxes::vacate_for_backup(&mut *conn, row).await?;
    let placed = placement::place(
        &mut *conn,
        row.resources,
        config.health.heartbeat_freshness,
        config.health.overcommit,
        Some(lost),
    )
    .await?;
    let Placement::Placed { host, .. } = placed else {
        warn!(sandbox_id = %row.id, host_id = %lost, ?placed,
            "failover deferred: no host can take the sandbox's backup now");
        return Ok(false);
    };
    let message =
        format!("host_lost: its host {lost} was lost; restoring backup {backup} on {host}");
    sandboxes::restore_from_backup(
        &mut *conn,
        row,
        BackupRestore {
            to: host,
            backup,
            reason: Reason::HostLost,
            message: &message,
        },
    )
    .await?;
    info!(sandbox_id = %row.id, from = %lost, to = %host, backup_id = %backup,
        "failover: restoring from backup on another host");
    Ok(true)
}
