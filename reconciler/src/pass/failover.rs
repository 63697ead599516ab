//! Failover (issue 14): a sandbox stranded on a host `lost` for longer than the failover delay
//! is restored from its newest backup on the host placement picks, when `on_host_lost` says so
//! (running, with a backup: `restoring` + `sandbox.migrate` of the backup, reason `host_lost`);
//! the rest become `failed-start` with reason `host_lost`. The lost host gets a delete at the
//! new generation (its fence lets it through when it comes back) and its inventory shows
//! whatever it still runs as unwanted, so it destroys its stale copy either way.
//!
//! A restore no host has room for, or whose backup is being deleted or not ready, is deferred:
//! left as it is and tried again by the next pass, until its host has been silent for
//! [`PassConfig::failover_retry_for`] past the failover delay; then it fails `host_lost` too,
//! its message saying why ([`on_failover_deferred`]).
//!
//! # Guarantees
//! - Progress: a pass acts on up to [`PassConfig::batch`] sandboxes (restored or failed); the
//!   rows it defers do not count against that and are skipped by its next read, so deferred
//!   sandboxes never keep the ones behind them from failing over. The rows come oldest
//!   silence first, so the deferred ones ahead are also the first to be given up.
//! - Capacity: a deferred restore's release on the lost host is rolled back with its
//!   savepoint; a sandbox failed (at once or given up) releases what it held there once, in
//!   the write of its `failed-start`.
//! - Work: once placement found no room for some resources in a pass, a sandbox needing at
//!   least as much of each is deferred without placing again (room only shrinks in a pass).
//!
//! Source: the seed lifecycle doc, "Archive, back up and recover from host loss" ("After a
//! further 10 minutes, each running sandbox on it that has a backup is restored on another
//! host. The rest become failed-start").

use berth_scheduler::placement::{self, Placement};
use berth_schemas::state::snapshot::SnapshotState;
use berth_schemas::state::{
    on_failover_deferred, on_host_lost, Deferral, HostLoss, HOST_LOST_MESSAGE,
};
use berth_schemas::wire::Resources;
use berth_schemas::{Reason, SandboxId, SandboxState};
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
    /// Sandboxes whose restore was deferred past [`PassConfig::failover_retry_for`]: failed
    /// (`host_lost`) with the reason.
    pub gave_up: u64,
    /// Sandboxes with a backup that no host had room for (or whose backup was being deleted or
    /// not ready): left as they are, tried again by the next pass.
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
    let overdue_after = silent_for + config.failover_retry_for;
    let mut done = Failovers::default();
    let mut deferred: Vec<SandboxId> = Vec::new();
    // Resources placement found no room for in this pass.
    let mut no_room: Vec<Resources> = Vec::new();
    loop {
        let acted = (done.restored + done.failed + done.gave_up) as i64;
        if acted >= config.batch {
            break;
        }
        let found = sandboxes::lock_stranded(
            &mut tx,
            silent_for,
            overdue_after,
            &deferred,
            config.batch - acted,
        )
        .await?;
        if found.is_empty() {
            break;
        }
        for stranded in found {
            let row = &stranded.row;
            match on_host_lost(row.state, row.last_backup_id.is_some()) {
                HostLoss::Fail(failure) => {
                    fail_sandbox(&mut tx, row, failure, HOST_LOST_MESSAGE).await?;
                    done.failed += 1;
                }
                HostLoss::RestoreBackup => {
                    let why = if no_room.iter().any(|r| covers(row.resources, *r)) {
                        Some(Deferral::NoRoom)
                    } else {
                        // A savepoint: a placement that finds no room rolls back the release
                        // with it.
                        let mut attempt = tx.begin().await.map_err(StoreError::from)?;
                        let why = restore_elsewhere(&mut attempt, config, row).await?;
                        if why.is_none() {
                            attempt.commit().await.map_err(StoreError::from)?;
                        } else {
                            attempt.rollback().await.map_err(StoreError::from)?;
                        }
                        if why == Some(Deferral::NoRoom) {
                            no_room.push(row.resources);
                        }
                        why
                    };
                    match why {
                        None => done.restored += 1,
                        Some(why) => {
                            if let Some(failure) = on_failover_deferred(stranded.overdue) {
                                let message = gave_up_message(config, row, why);
                                warn!(sandbox_id = %row.id, reason = why.as_str(),
                                    "failover given up: failed host_lost");
                                fail_sandbox(&mut tx, row, failure, &message).await?;
                                done.gave_up += 1;
                            } else {
                                deferred.push(row.id);
                                done.deferred += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    commit(tx).await?;
    for (result, n) in [
        ("restored", done.restored),
        ("failed", done.failed),
        ("gave_up", done.gave_up),
        ("deferred", done.deferred),
    ] {
        metrics::counter!("berth_failovers_total", "result" => result).increment(n);
    }
    Ok(done)
}

/// Whether `need` asks for at least `r` of each resource (so no host has room for it when
/// none had for `r`).
fn covers(need: Resources, r: Resources) -> bool {
    need.vcpus >= r.vcpus && need.memory_mib >= r.memory_mib
}

/// The `state_reason` of a sandbox whose failover was deferred until it was given up.
fn gave_up_message(config: &PassConfig, row: &SandboxRow, why: Deferral) -> String {
    let host = row.host_id.map(|h| h.to_string()).unwrap_or_default();
    format!(
        "host_lost: its host {host} was lost and its backup could not be restored within {}s \
         of the failover: {}",
        config.failover_retry_for.as_secs(),
        why.as_str()
    )
}

/// Restores the locked `row`, stranded on a lost host, from its newest backup on the host
/// placement picks; `Some(why)` (roll back what was written) when it cannot now.
async fn restore_elsewhere(
    conn: &mut PgConnection,
    config: &PassConfig,
    row: &SandboxRow,
) -> Result<Option<Deferral>, StoreError> {
    // A restore from backup in flight boots the backup its user chose (`seed_snapshot`).
    let chosen = match row.state {
        SandboxState::Restoring => row.seed_snapshot.or(row.last_backup_id),
        _ => row.last_backup_id,
    };
    let (Some(backup), Some(lost)) = (chosen, row.host_id) else {
        return Ok(Some(Deferral::BackupUnavailable));
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
        return Ok(Some(Deferral::BackupUnavailable));
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
        return Ok(Some(Deferral::NoRoom));
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
    Ok(None)
}
