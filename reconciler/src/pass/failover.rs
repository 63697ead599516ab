//! Failover (issue 14): a sandbox stranded on a host `lost` for longer than the failover delay
//! is restored from its newest backup on the host placement picks, when `on_host_lost` says so
//! (running, with a backup: `restoring` + `sandbox.migrate` of the backup, reason `host_lost`);
//! the rest become `failed-start` with reason `host_lost`. The lost host gets a delete at the
//! new generation (its fence lets it through when it comes back) and its inventory shows
//! whatever it still runs as unwanted, so it destroys its stale copy either way.
//!
//! A restore that placement cannot place (no host in service has room: [`Deferral::NoRoom`]; or
//! the hosts with room are stale or degraded: [`Deferral::HostsUnavailable`]), or whose backup is
//! being deleted or not ready, is deferred: left as it is and tried again by the next pass. The
//! first deferral during its host's current silence is recorded on the row
//! (`sandboxes::note_failover_deferred`); once that is older than
//! [`PassConfig::failover_retry_for`], a pass that defers it again gives it up: it fails
//! `host_lost` too, its message saying why ([`on_failover_deferred`]). The bound counts from
//! the first deferral, not from the host's last heartbeat, so every deferred failover is
//! retried for that long however late a pass first reached it (the reconciler was down, or a
//! backlog of full batches came first).
//!
//! # Guarantees
//! - Progress: a pass acts on up to [`PassConfig::batch`] sandboxes (restored or failed); the
//!   rows it defers do not count against that and are skipped by its next read, so deferred
//!   sandboxes never keep the ones behind them from failing over.
//! - Capacity: a deferred restore's release on the lost host is rolled back with its
//!   savepoint; a sandbox failed (at once or given up) releases what it held there once, in
//!   the write of its `failed-start`.
//! - Work: once placement found no room in service for some resources in a pass, a sandbox
//!   needing at least as much of each is deferred without placing again (room only shrinks in
//!   a pass); once it found the hosts with room unusable for some resources, a sandbox needing
//!   exactly as much is (a larger one may find no room at all: it is placed, to say which).
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
    /// Sandboxes whose restore was deferred again past [`PassConfig::failover_retry_for`]
    /// after its first deferral: failed (`host_lost`) with the reason, by reason.
    pub gave_up: ByDeferral,
    /// Sandboxes whose restore could not be done now: left as they are, tried again by the
    /// next pass, by reason.
    pub deferred: ByDeferral,
}

/// Counts by [`Deferral`] (its [`Deferral::label`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByDeferral {
    /// By [`Deferral::LABELS`], in that order.
    pub counts: [u64; Deferral::LABELS.len()],
}

impl ByDeferral {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    fn add(&mut self, why: Deferral) {
        self.counts[why.index()] += 1;
    }
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
    let mut deferred: Vec<SandboxId> = Vec::new();
    // Resources placement could not place in this pass, and why.
    let mut refused: Vec<(Resources, Deferral)> = Vec::new();
    loop {
        let acted = (done.restored + done.failed + done.gave_up.total()) as i64;
        if acted >= config.batch {
            break;
        }
        let found = sandboxes::lock_stranded(
            &mut tx,
            silent_for,
            config.failover_retry_for,
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
                    let why = if let Some(known) = refused_before(&refused, row.resources) {
                        Some(known)
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
                        if let Some(why @ (Deferral::NoRoom | Deferral::HostsUnavailable { .. })) =
                            why
                        {
                            refused.push((row.resources, why));
                        }
                        why
                    };
                    match why {
                        None => done.restored += 1,
                        Some(why) => {
                            if let Some(failure) = on_failover_deferred(stranded.overdue) {
                                let message = gave_up_message(config, row, why);
                                warn!(sandbox_id = %row.id, reason = why.label(), %why,
                                    "failover given up: failed host_lost");
                                fail_sandbox(&mut tx, row, failure, &message).await?;
                                done.gave_up.add(why);
                            } else {
                                sandboxes::note_failover_deferred(&mut tx, row.id).await?;
                                deferred.push(row.id);
                                done.deferred.add(why);
                            }
                        }
                    }
                }
            }
        }
    }
    commit(tx).await?;
    for (result, n) in [("restored", done.restored), ("failed", done.failed)] {
        metrics::counter!("berth_failovers_total", "result" => result).increment(n);
    }
    for (result, by) in [("deferred", done.deferred), ("gave_up", done.gave_up)] {
        for (reason, n) in Deferral::LABELS.iter().zip(by.counts) {
            metrics::counter!("berth_failovers_total", "result" => result, "reason" => *reason)
                .increment(n);
        }
    }
    Ok(done)
}

/// Why placement is known, from earlier in this pass, to refuse `need` without placing again:
/// no room in service for resources `need` covers; or hosts with room unusable for exactly
/// `need` (for more, there may be no room at all).
fn refused_before(refused: &[(Resources, Deferral)], need: Resources) -> Option<Deferral> {
    refused.iter().find_map(|&(r, why)| match why {
        Deferral::NoRoom if covers(need, r) => Some(why),
        Deferral::HostsUnavailable { .. } if need == r => Some(why),
        _ => None,
    })
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
        "host_lost: its host {host} was lost and its backup could not be restored in the {}s \
         its failover was retried for: {why}",
        config.failover_retry_for.as_secs(),
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
            reason = Deferral::BackupUnavailable.label(),
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
    let host = match placed {
        Placement::Placed { host, .. } => host,
        // Every host cordoned or draining: no room in service, as for a full fleet.
        Placement::NoCapacity | Placement::HeldOut { .. } => {
            warn!(sandbox_id = %row.id, host_id = %lost, reason = Deferral::NoRoom.label(),
                "failover deferred: no host in service has room for the sandbox's backup");
            return Ok(Some(Deferral::NoRoom));
        }
        Placement::Unavailable { why, .. } => {
            let why = Deferral::HostsUnavailable {
                stale: u32::try_from(why.stale).unwrap_or(u32::MAX),
                unhealthy: u32::try_from(why.unhealthy).unwrap_or(u32::MAX),
            };
            warn!(sandbox_id = %row.id, host_id = %lost, reason = why.label(), %why,
                "failover deferred: the hosts with room for the sandbox's backup cannot be used now");
            return Ok(Some(why));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn r(vcpus: u32, memory_mib: u32) -> Resources {
        Resources { vcpus, memory_mib }
    }

    #[test]
    fn a_refusal_is_reused_only_where_placement_would_say_the_same() {
        let unusable = Deferral::HostsUnavailable {
            stale: 1,
            unhealthy: 0,
        };
        let refused = [(r(2, 1024), Deferral::NoRoom), (r(1, 256), unusable)];
        // No room for less of either: no room for more.
        assert_eq!(refused_before(&refused, r(2, 1024)), Some(Deferral::NoRoom));
        assert_eq!(refused_before(&refused, r(4, 2048)), Some(Deferral::NoRoom));
        assert_eq!(refused_before(&refused, r(1, 4096)), None, "fewer vcpus");
        // Unusable hosts with room for exactly as much: the same; for more, maybe no room at
        // all; for less, maybe a usable host.
        assert_eq!(refused_before(&refused, r(1, 256)), Some(unusable));
        assert_eq!(refused_before(&refused, r(1, 512)), None);
        assert_eq!(refused_before(&refused, r(1, 128)), None);
        assert_eq!(refused_before(&[], r(1, 256)), None);
    }
}
