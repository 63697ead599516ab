//! What the reconciler's pass decides when no host result says what happened: a command that
//! timed out, a guest that stopped answering or vanished, a host that was lost, and a container
//! a host reports that no row wants there. Pure; the pass selects the rows (its SQL is built
//! from the constants here) and the store writes what these functions return.
//!
//! Source: the seed lifecycle doc, "Let the reconciler converge" (`shared/reference/003_…`).

use std::fmt;

use super::{Capacity, CommandKind, Reason, SandboxState};

/// The commands the pass times out, each with the state its sandbox waits in while the command
/// is open. A delete is not timed: the row is already a tombstone-to-be and its capacity goes
/// with its `deleted` result or with the host's inventory.
pub const TIMED_COMMANDS: [(CommandKind, SandboxState); 9] = [
    (CommandKind::Create, SandboxState::Provisioning),
    (CommandKind::Start, SandboxState::Starting),
    (CommandKind::Stop, SandboxState::Stopping),
    (CommandKind::Restore, SandboxState::Resuming),
    (CommandKind::Clone, SandboxState::Resuming),
    (CommandKind::Archive, SandboxState::Archiving),
    (CommandKind::Unarchive, SandboxState::Unarchiving),
    (CommandKind::Migrate, SandboxState::Migrating),
    (CommandKind::Migrate, SandboxState::Restoring),
];

/// The states in which a sandbox lives on its host and is stranded when the host is lost. Not
/// `unarchiving` or `migrating`: their stop snapshot is whole in the object store, and their
/// timeout settles them (`archived`/`failed-start`, or `stopped` on the host a migration
/// came from).
pub const STRANDED_ON_LOST_HOST: [SandboxState; 6] = [
    SandboxState::Provisioning,
    SandboxState::Starting,
    SandboxState::Running,
    SandboxState::Stopping,
    SandboxState::Resuming,
    SandboxState::Restoring,
];

/// The states in which a row does not want a running container on its own host.
pub const UNWANTED_RUNNING_ON_ITS_HOST: [SandboxState; 3] = [
    SandboxState::Stopped,
    SandboxState::FailedStart,
    SandboxState::Deleted,
];

/// A sandbox failing without a host result: the transition to write and the command that undoes
/// whatever its host may still do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The state to write (always `failed-start` today).
    pub to: SandboxState,
    /// The event's reason (`timeout`, `host_lost`, …).
    pub reason: Reason,
    /// The capacity change written with the state.
    pub capacity: Capacity,
    /// Queued on the sandbox's host at the new generation (so the host's fence refuses the
    /// old command if it has not run it yet); `None` when the host cannot be reached.
    pub compensation: Option<CommandKind>,
}

/// A command of `kind` its sandbox (in `state`) still waits on was not answered in time. `None`
/// when the sandbox no longer waits on it (a compensation queued at the current generation of a
/// `failed-start` sandbox is such a command, and must not fail it again). A create or clone is
/// destroyed; a start, stop, restore or unarchive ends stopped on the host, keeping the disk.
/// An archive that timed out leaves the sandbox `stopped` on its host (nothing is sent: the
/// host frees the disk only after its upload is confirmed, and its late result is fenced).
/// A migration that timed out goes back `stopped` to the host it came from (the store moves
/// the row back), releasing its capacity on the new host, which gets a delete (its fence then
/// refuses the migrate if it has not run it; if it has, what it booted is destroyed). A
/// restore from backup that timed out is `failed-start` and what it may have booted is
/// destroyed, as a clone's (a start boots the backup again).
pub fn on_timeout(kind: CommandKind, state: SandboxState) -> Option<Failure> {
    if !TIMED_COMMANDS.contains(&(kind, state)) {
        return None;
    }
    if (kind, state) == (CommandKind::Migrate, SandboxState::Migrating) {
        return Some(Failure {
            to: SandboxState::Stopped,
            reason: Reason::Timeout,
            capacity: Capacity::Release,
            compensation: Some(CommandKind::Delete),
        });
    }
    if kind == CommandKind::Archive {
        return Some(Failure {
            to: SandboxState::Stopped,
            reason: Reason::Timeout,
            capacity: Capacity::Keep,
            compensation: None,
        });
    }
    Some(Failure {
        to: SandboxState::FailedStart,
        reason: Reason::Timeout,
        capacity: Capacity::Release,
        compensation: Some(
            if matches!(
                kind,
                CommandKind::Create | CommandKind::Clone | CommandKind::Migrate
            ) {
                CommandKind::Delete
            } else {
                CommandKind::Stop
            },
        ),
    })
}

/// How a `running` sandbox's guest failed, as its host's inventory shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestFailure {
    /// Listed, but its agent does not answer.
    Unhealthy,
    /// Not listed at all.
    Missing,
}

impl GuestFailure {
    /// The `state_reason` written with the failure.
    pub fn message(self) -> &'static str {
        match self {
            GuestFailure::Unhealthy => "guest stopped answering (agent health check failed)",
            GuestFailure::Missing => "guest missing from its host's inventory",
        }
    }
}

/// A `running` sandbox whose guest failed: it becomes `failed-start` and whatever is left of it
/// on the host is stopped (its disk stays, so a start recovers it).
pub fn on_guest_failure(_failure: GuestFailure) -> Failure {
    Failure {
        to: SandboxState::FailedStart,
        reason: Reason::RuntimeError,
        capacity: Capacity::Release,
        compensation: Some(CommandKind::Stop),
    }
}

/// The `state_reason` of a sandbox [`on_host_lost`] fails.
pub const HOST_LOST_MESSAGE: &str = "host_lost: its host was lost and it has no backup to restore";

/// The states whose sandbox is restored from its backup on another host when its host is lost
/// (the seed: "each running sandbox on it that has a backup is restored on another host"); a
/// restore from backup in flight there is restored again.
pub const FAILS_OVER: [SandboxState; 2] = [SandboxState::Running, SandboxState::Restoring];

/// What the failover does with a sandbox stranded on a host `lost` for longer than the
/// failover delay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostLoss {
    /// Restore its newest backup on the host placement picks (`restoring` + `sandbox.migrate`
    /// of the backup, reason `host_lost`), releasing what the lost host held; the lost host
    /// gets a delete at the new generation, which its fence lets through when it comes back.
    RestoreBackup,
    /// Fail it: nothing can bring it back elsewhere.
    Fail(Failure),
}

/// A sandbox in `state` stranded on a lost host ([`STRANDED_ON_LOST_HOST`]); `has_backup`: it
/// names a ready backup. A running sandbox (or one being restored from backup) with a backup is
/// restored elsewhere ([`HostLoss::RestoreBackup`]); the rest become `failed-start` with reason
/// `host_lost`, releasing their capacity, and nothing is sent to the lost host (if it comes
/// back, its inventory shows the container as unwanted).
///
/// Source: the seed lifecycle doc, "Archive, back up and recover from host loss".
pub fn on_host_lost(state: SandboxState, has_backup: bool) -> HostLoss {
    if has_backup && FAILS_OVER.contains(&state) {
        return HostLoss::RestoreBackup;
    }
    HostLoss::Fail(HOST_LOST_FAILURE)
}

/// A stranded sandbox failed `host_lost`: `failed-start`, its capacity on the lost host
/// released, nothing sent there (if it comes back, its inventory shows the container as
/// unwanted).
const HOST_LOST_FAILURE: Failure = Failure {
    to: SandboxState::FailedStart,
    reason: Reason::HostLost,
    capacity: Capacity::Release,
    compensation: None,
};

/// Why a pass could not restore a sandbox [`on_host_lost`] would restore from its backup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deferral {
    /// No host in service would fit it, even with fresh data and good health (placement's
    /// `NoCapacity`): the fleet is full.
    NoRoom,
    /// Hosts in service would fit it, but placement could use none of them now (placement's
    /// `Unavailable`): their last heartbeat is older than the freshness window, or they are
    /// degraded and not due a probe.
    HostsUnavailable {
        /// Hosts with room whose last heartbeat is stale.
        stale: u32,
        /// Hosts with room, heard from, that are degraded (or probing) and not due a probe.
        unhealthy: u32,
    },
    /// Its backup is being deleted (a delete holds it) or is not `ready`.
    BackupUnavailable,
}

impl Deferral {
    /// Every [`Deferral::label`], in declaration order.
    pub const LABELS: [&'static str; 3] = ["no_room", "hosts_unavailable", "backup_unavailable"];

    /// The `reason` label of `berth_failovers_total{result="deferred"|"gave_up"}` and the
    /// `reason` field of the pass's log lines.
    pub const fn label(self) -> &'static str {
        Self::LABELS[self.index()]
    }

    /// Its position in [`Deferral::LABELS`].
    pub const fn index(self) -> usize {
        match self {
            Deferral::NoRoom => 0,
            Deferral::HostsUnavailable { .. } => 1,
            Deferral::BackupUnavailable => 2,
        }
    }
}

/// Says why, for the `state_reason` of a failover given up.
impl fmt::Display for Deferral {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Deferral::NoRoom => f.write_str("no host had room for its backup"),
            Deferral::HostsUnavailable { stale, unhealthy } => write!(
                f,
                "the hosts with room for its backup could not be used: {stale} with a stale \
                 heartbeat, {unhealthy} degraded and not due a probe"
            ),
            Deferral::BackupUnavailable => f.write_str("its backup was being deleted or not ready"),
        }
    }
}

/// A failover a pass deferred ([`Deferral`], whatever the cause): `None` while it is not
/// `overdue` (the next pass tries again); once its first deferral while its host is lost is
/// older than the bound on deferred failovers, the sandbox fails `host_lost` like one without
/// a backup, so a deferral never keeps it `running` on a lost host for good.
pub fn on_failover_deferred(overdue: bool) -> Option<Failure> {
    overdue.then_some(HOST_LOST_FAILURE)
}

/// What to do with a container a host reports running (or unhealthy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InventoryVerdict {
    /// Its row wants it there.
    Wanted,
    /// Its row is its host's own stopped or failed sandbox: stop it, keeping the disk.
    Stop,
    /// No row wants it anywhere on this host (purged, deleted, or placed on another host):
    /// destroy it (guarantee 5: no sandbox runs on two hosts).
    Destroy,
}

/// Judges a running container a host reported. `row` is its sandbox row, if one exists: the
/// row's state and whether the row places it on the reporting host.
pub fn on_inventory(row: Option<(SandboxState, bool)>) -> InventoryVerdict {
    match row {
        None | Some((_, false)) | Some((SandboxState::Deleted, true)) => InventoryVerdict::Destroy,
        Some((state, true)) if UNWANTED_RUNNING_ON_ITS_HOST.contains(&state) => {
            InventoryVerdict::Stop
        }
        Some(_) => InventoryVerdict::Wanted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxState as S;

    #[test]
    fn a_deferred_failover_is_tried_again_until_overdue_then_fails_host_lost() {
        assert_eq!(on_failover_deferred(false), None);
        let failure = on_failover_deferred(true).expect("overdue fails");
        assert_eq!(
            (
                failure.to,
                failure.reason,
                failure.capacity,
                failure.compensation
            ),
            (S::FailedStart, Reason::HostLost, Capacity::Release, None)
        );
        assert_eq!(
            HostLoss::Fail(failure),
            on_host_lost(S::Running, false),
            "the same failure as a sandbox without a backup"
        );
    }

    #[test]
    fn each_deferral_has_its_own_label_and_says_why_in_its_own_words() {
        let all = [
            Deferral::NoRoom,
            Deferral::HostsUnavailable {
                stale: 2,
                unhealthy: 1,
            },
            Deferral::BackupUnavailable,
        ];
        let labels: Vec<&str> = all.iter().map(|d| d.label()).collect();
        assert_eq!(labels, Deferral::LABELS);
        let messages: Vec<String> = all.iter().map(|d| d.to_string()).collect();
        for (i, m) in messages.iter().enumerate() {
            assert_eq!(messages.iter().filter(|o| *o == m).count(), 1, "{m}");
            assert_eq!(m.contains("no host had room"), i == 0, "{m}");
        }
        assert_eq!(
            messages[1],
            "the hosts with room for its backup could not be used: 2 with a stale heartbeat, \
             1 degraded and not due a probe"
        );
    }

    #[test]
    fn only_a_command_its_sandbox_still_waits_on_times_out() {
        for kind in CommandKind::ALL {
            for state in S::ALL {
                let failure = on_timeout(kind, state);
                let waits = matches!(
                    (kind, state),
                    (CommandKind::Create, S::Provisioning)
                        | (CommandKind::Start, S::Starting)
                        | (CommandKind::Stop, S::Stopping)
                        | (CommandKind::Restore | CommandKind::Clone, S::Resuming)
                        | (CommandKind::Archive, S::Archiving)
                        | (CommandKind::Unarchive, S::Unarchiving)
                        | (CommandKind::Migrate, S::Migrating | S::Restoring)
                );
                assert_eq!(failure.is_some(), waits, "{kind} in {state}");
                let settles_stopped = matches!(
                    (kind, state),
                    (CommandKind::Archive, _) | (CommandKind::Migrate, S::Migrating)
                );
                if let Some(f) = failure.filter(|_| !settles_stopped) {
                    assert_eq!(f.to, S::FailedStart);
                    assert_eq!(f.capacity, Capacity::Release);
                    assert_eq!(f.reason, Reason::Timeout);
                }
            }
        }
    }

    #[test]
    fn a_timed_out_archive_leaves_the_sandbox_stopped_with_its_disk_and_sends_nothing() {
        assert_eq!(
            on_timeout(CommandKind::Archive, S::Archiving),
            Some(Failure {
                to: S::Stopped,
                reason: Reason::Timeout,
                capacity: Capacity::Keep,
                compensation: None,
            })
        );
    }

    #[test]
    fn a_timed_out_migration_goes_back_stopped_releasing_and_deleting_on_the_new_host() {
        assert_eq!(
            on_timeout(CommandKind::Migrate, S::Migrating),
            Some(Failure {
                to: S::Stopped,
                reason: Reason::Timeout,
                capacity: Capacity::Release,
                compensation: Some(CommandKind::Delete),
            })
        );
        assert!(
            !STRANDED_ON_LOST_HOST.contains(&S::Migrating),
            "a migration on a lost host is settled by its timeout, back on its old host"
        );
    }

    #[test]
    fn a_timed_out_create_or_clone_is_destroyed_and_a_start_stop_or_restore_is_stopped() {
        assert_eq!(
            on_timeout(CommandKind::Unarchive, S::Unarchiving)
                .unwrap()
                .compensation,
            Some(CommandKind::Stop),
            "an unarchive's fetched disk is kept"
        );
        let compensation = |k, s| on_timeout(k, s).unwrap().compensation;
        assert_eq!(
            compensation(CommandKind::Clone, S::Resuming),
            Some(CommandKind::Delete)
        );
        assert_eq!(
            compensation(CommandKind::Restore, S::Resuming),
            Some(CommandKind::Stop)
        );
        assert_eq!(
            compensation(CommandKind::Create, S::Provisioning),
            Some(CommandKind::Delete)
        );
        assert_eq!(
            compensation(CommandKind::Start, S::Starting),
            Some(CommandKind::Stop)
        );
        assert_eq!(
            compensation(CommandKind::Stop, S::Stopping),
            Some(CommandKind::Stop)
        );
    }

    #[test]
    fn a_failed_guest_is_stopped_and_a_lost_host_is_left_alone() {
        for g in [GuestFailure::Unhealthy, GuestFailure::Missing] {
            let f = on_guest_failure(g);
            assert_eq!(
                (f.to, f.capacity, f.compensation),
                (S::FailedStart, Capacity::Release, Some(CommandKind::Stop))
            );
        }
        for state in STRANDED_ON_LOST_HOST {
            for has_backup in [false, true] {
                let decided = on_host_lost(state, has_backup);
                if has_backup && matches!(state, S::Running | S::Restoring) {
                    assert_eq!(decided, HostLoss::RestoreBackup, "{state}");
                    continue;
                }
                let HostLoss::Fail(f) = decided else {
                    panic!("{state} with backup {has_backup}: {decided:?}");
                };
                assert_eq!(
                    (f.to, f.reason, f.capacity, f.compensation),
                    (S::FailedStart, Reason::HostLost, Capacity::Release, None),
                    "{state}"
                );
            }
        }
    }

    #[test]
    fn a_timed_out_restore_from_backup_fails_and_destroys_what_it_booted() {
        assert_eq!(
            on_timeout(CommandKind::Migrate, S::Restoring),
            Some(Failure {
                to: S::FailedStart,
                reason: Reason::Timeout,
                capacity: Capacity::Release,
                compensation: Some(CommandKind::Delete),
            })
        );
    }

    #[test]
    fn a_container_no_row_wants_on_its_host_is_destroyed_or_stopped() {
        assert_eq!(on_inventory(None), InventoryVerdict::Destroy, "purged row");
        for state in S::ALL {
            assert_eq!(
                on_inventory(Some((state, false))),
                InventoryVerdict::Destroy,
                "a sandbox placed on another host is destroyed on the old one ({state})"
            );
            let expected = match state {
                S::Deleted => InventoryVerdict::Destroy,
                S::Stopped | S::FailedStart => InventoryVerdict::Stop,
                _ => InventoryVerdict::Wanted,
            };
            assert_eq!(on_inventory(Some((state, true))), expected, "{state}");
        }
    }
}
