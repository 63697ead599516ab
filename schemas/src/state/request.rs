//! [`on_request`]: a start, stop, delete, restore, archive or restore from backup against the
//! row's state (the table
//! in the parent module's docs), with the capacity change each transition needs. A start of a
//! `stopped` sandbox whose own host cannot take it back is decided by `migrate.rs` instead.
//! [`on_request_unseeded`]: the same for a clone that never ran (the table's `(S)`).

use super::{Capacity, CommandKind, Request, SandboxState};

/// What [`on_request`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Already at, or heading to, the requested target: return the sandbox as it is.
    Unchanged,
    /// Write `to`, bump the generation, apply `capacity` and queue `command` in the same
    /// transaction.
    Transition {
        /// The state to write.
        to: SandboxState,
        /// The host command to queue at the new generation.
        command: CommandKind,
        /// The capacity change to apply with the state write.
        capacity: Capacity,
    },
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A transition that conflicts with the request is in flight (HTTP 409 `conflict`).
    #[error("cannot {request} a sandbox that is {state}")]
    Conflict {
        /// The row's state when the request arrived.
        state: SandboxState,
        /// The refused request.
        request: Request,
    },
}

/// The settled states a restore from backup leaves from (the table's `(B)`): the sandbox's
/// backup replaces whatever it holds in each.
pub const RESTORES_FROM_BACKUP: [SandboxState; 4] = [
    SandboxState::Running,
    SandboxState::Stopped,
    SandboxState::FailedStart,
    SandboxState::Archived,
];

/// Decides a user request against the row's `state`; `deleting` is whether `deleted_at` is set.
///
/// Errors: [`Refusal::Conflict`] per the table in the module docs.
pub fn on_request(
    state: SandboxState,
    deleting: bool,
    request: Request,
) -> Result<Decision, Refusal> {
    use SandboxState as S;
    let conflict = Err(Refusal::Conflict { state, request });
    if deleting || state == S::Deleted {
        return match request {
            Request::Delete => Ok(Decision::Unchanged),
            _ => conflict,
        };
    }
    match request {
        // Nothing of an archived sandbox is left on a host but its record's tombstone: the
        // delete is a tombstone at once (the host's delete only buries what is left), and it
        // holds no capacity.
        Request::Delete if state == S::Archived => Ok(Decision::Transition {
            to: S::Deleted,
            command: CommandKind::Delete,
            capacity: Capacity::Keep,
        }),
        // The capacity is released when the host reports the sandbox deleted.
        Request::Delete => Ok(Decision::Transition {
            to: S::Stopping,
            command: CommandKind::Delete,
            capacity: Capacity::Keep,
        }),
        Request::Start => match state {
            // Both released their capacity when they settled; a boot needs it again.
            S::Stopped | S::FailedStart => Ok(Decision::Transition {
                to: S::Starting,
                command: CommandKind::Start,
                capacity: Capacity::Reserve,
            }),
            // Placement picks a host and reserves there in the same transaction (like a
            // create): the caller places before it writes.
            S::Archived => Ok(Decision::Transition {
                to: S::Unarchiving,
                command: CommandKind::Unarchive,
                capacity: Capacity::Reserve,
            }),
            S::Provisioning
            | S::Starting
            | S::Running
            | S::Resuming
            | S::Restoring
            | S::Migrating
            | S::Unarchiving => Ok(Decision::Unchanged),
            // An archive in flight is not cancelled: the start is refused, and once `archived`
            // a start unarchives it.
            S::Stopping | S::Archiving | S::Pending | S::FailedProvision | S::Lost | S::Deleted => {
                conflict
            }
        },
        Request::Archive => match state {
            // A stopped sandbox holds no capacity: archiving frees its disk only.
            S::Stopped => Ok(Decision::Transition {
                to: S::Archiving,
                command: CommandKind::Archive,
                capacity: Capacity::Keep,
            }),
            S::Archiving | S::Archived => Ok(Decision::Unchanged),
            S::Provisioning
            | S::Starting
            | S::Running
            | S::Stopping
            | S::Resuming
            | S::Restoring
            | S::Migrating
            | S::Unarchiving
            | S::FailedStart
            | S::Pending
            | S::FailedProvision
            | S::Lost
            | S::Deleted => conflict,
        },
        Request::Restore => match state {
            S::Running => Ok(Decision::Transition {
                to: S::Resuming,
                command: CommandKind::Restore,
                capacity: Capacity::Keep,
            }),
            // Released when they settled; the rebuilt sandbox runs and needs it again.
            S::Stopped | S::FailedStart => Ok(Decision::Transition {
                to: S::Resuming,
                command: CommandKind::Restore,
                capacity: Capacity::Reserve,
            }),
            S::Provisioning
            | S::Starting
            | S::Stopping
            | S::Resuming
            | S::Restoring
            | S::Migrating
            | S::Archiving
            | S::Archived
            | S::Unarchiving
            | S::Pending
            | S::FailedProvision
            | S::Lost
            | S::Deleted => conflict,
        },
        // Placement picks a host and reserves there in the same transaction, after what the
        // old host held is released (the store does both, like an unarchive): the backup is
        // cold-booted there, replacing whatever the sandbox had since (`(B)`).
        Request::RestoreFromBackup => match state {
            _ if RESTORES_FROM_BACKUP.contains(&state) => Ok(Decision::Transition {
                to: S::Restoring,
                command: CommandKind::Migrate,
                capacity: Capacity::Reserve,
            }),
            S::Restoring => Ok(Decision::Unchanged),
            S::Running | S::Stopped | S::FailedStart | S::Archived => conflict,
            S::Provisioning
            | S::Starting
            | S::Stopping
            | S::Resuming
            | S::Migrating
            | S::Archiving
            | S::Unarchiving
            | S::Pending
            | S::FailedProvision
            | S::Lost
            | S::Deleted => conflict,
        },
        Request::Stop => match state {
            // Released when the host reports the sandbox stopped.
            S::Running => Ok(Decision::Transition {
                to: S::Stopping,
                command: CommandKind::Stop,
                capacity: Capacity::Keep,
            }),
            S::Stopping | S::Stopped | S::Archiving | S::Archived | S::FailedStart => {
                Ok(Decision::Unchanged)
            }
            S::Provisioning
            | S::Starting
            | S::Resuming
            | S::Restoring
            | S::Migrating
            | S::Unarchiving
            | S::Pending
            | S::FailedProvision
            | S::Lost
            | S::Deleted => conflict,
        },
    }
}

/// [`on_request`] for a clone that has not run yet: a sandbox written from a snapshot (`POST
/// …/clone`, a fork's child, `POST /v1/sandboxes {snapshot_id}`) whose boot never succeeded
/// (`sandboxes.seed_snapshot` is set). Its host holds no disk of it (a failed clone removes
/// what it seeded), so a start of it in `failed-start` boots from the snapshot again:
/// `resuming` + `sandbox.clone`, reserving its capacity, where [`on_request`] would queue a
/// `sandbox.start` that boots the bare template. Every other request decides as
/// [`on_request`] does.
///
/// Errors: [`Refusal::Conflict`] per the table in the module docs.
pub fn on_request_unseeded(
    state: SandboxState,
    deleting: bool,
    request: Request,
) -> Result<Decision, Refusal> {
    match on_request(state, deleting, request)? {
        Decision::Transition {
            to: SandboxState::Starting,
            command: CommandKind::Start,
            capacity,
        } if state == SandboxState::FailedStart => Ok(Decision::Transition {
            to: SandboxState::Resuming,
            command: CommandKind::Clone,
            capacity,
        }),
        other => Ok(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxState as S;

    /// The table in the module docs, spelled out: (state, start, stop, restore, archive) with
    /// `U` for unchanged, `C` for conflict and a state for a transition. Delete is checked
    /// separately, restore from backup by the next test.
    #[test]
    fn start_stop_restore_and_archive_follow_the_request_table_for_every_state() {
        #[derive(Debug, PartialEq)]
        enum E {
            U,
            C,
            T(S, CommandKind, Capacity),
        }
        use CommandKind as K;
        use E::*;
        let table = [
            (S::Pending, C, C, C, C),
            (S::Provisioning, U, C, C, C),
            (S::Starting, U, C, C, C),
            (
                S::Running,
                U,
                T(S::Stopping, K::Stop, Capacity::Keep),
                T(S::Resuming, K::Restore, Capacity::Keep),
                C,
            ),
            (S::Stopping, C, U, C, C),
            (
                S::Stopped,
                T(S::Starting, K::Start, Capacity::Reserve),
                U,
                T(S::Resuming, K::Restore, Capacity::Reserve),
                T(S::Archiving, K::Archive, Capacity::Keep),
            ),
            (S::Resuming, U, C, C, C),
            (S::Restoring, U, C, C, C),
            (S::Migrating, U, C, C, C),
            (S::Archiving, C, U, C, U),
            (
                S::Archived,
                T(S::Unarchiving, K::Unarchive, Capacity::Reserve),
                U,
                C,
                U,
            ),
            (S::Unarchiving, U, C, C, C),
            (
                S::FailedStart,
                T(S::Starting, K::Start, Capacity::Reserve),
                U,
                T(S::Resuming, K::Restore, Capacity::Reserve),
                C,
            ),
            (S::FailedProvision, C, C, C, C),
            (S::Lost, C, C, C, C),
            (S::Deleted, C, C, C, C),
        ];
        assert_eq!(table.len(), S::ALL.len());
        let to_e = |r: Result<Decision, Refusal>| match r {
            Ok(Decision::Unchanged) => U,
            Ok(Decision::Transition {
                to,
                command,
                capacity,
            }) => T(to, command, capacity),
            Err(Refusal::Conflict { .. }) => C,
        };
        for (state, start, stop, restore, archive) in table {
            assert_eq!(
                to_e(on_request(state, false, Request::Archive)),
                archive,
                "archive in {state}"
            );
            assert_eq!(
                to_e(on_request(state, false, Request::Start)),
                start,
                "start in {state}"
            );
            assert_eq!(
                to_e(on_request(state, false, Request::Stop)),
                stop,
                "stop in {state}"
            );
            assert_eq!(
                to_e(on_request(state, false, Request::Restore)),
                restore,
                "restore in {state}"
            );
        }
    }

    /// The table's restore-from-backup column: a settled sandbox (running, stopped, failed or
    /// archived) is rebuilt `restoring` with a `sandbox.migrate` of its backup on the host
    /// placement picks; a restore in flight is unchanged; every other state conflicts.
    #[test]
    fn restore_from_backup_follows_the_request_table_for_every_state() {
        for state in S::ALL {
            let decided = on_request(state, false, Request::RestoreFromBackup);
            match state {
                S::Running | S::Stopped | S::FailedStart | S::Archived => assert_eq!(
                    decided,
                    Ok(Decision::Transition {
                        to: S::Restoring,
                        command: CommandKind::Migrate,
                        capacity: Capacity::Reserve,
                    }),
                    "{state}"
                ),
                S::Restoring => assert_eq!(decided, Ok(Decision::Unchanged)),
                _ => assert_eq!(
                    decided,
                    Err(Refusal::Conflict {
                        state,
                        request: Request::RestoreFromBackup
                    }),
                    "{state}"
                ),
            }
        }
    }

    #[test]
    fn delete_is_accepted_from_every_state_and_repeats_as_a_no_op() {
        for state in S::ALL {
            let first = on_request(state, false, Request::Delete).unwrap();
            if state == S::Deleted {
                assert_eq!(first, Decision::Unchanged);
            } else if state == S::Archived {
                assert_eq!(
                    first,
                    Decision::Transition {
                        to: S::Deleted,
                        command: CommandKind::Delete,
                        capacity: Capacity::Keep,
                    },
                    "an archived sandbox is a tombstone at once"
                );
            } else {
                assert_eq!(
                    first,
                    Decision::Transition {
                        to: S::Stopping,
                        command: CommandKind::Delete,
                        capacity: Capacity::Keep,
                    }
                );
            }
            assert_eq!(
                on_request(state, true, Request::Delete).unwrap(),
                Decision::Unchanged
            );
        }
    }

    /// The `(S)` row of the table: only a start of a failed clone differs, and it boots from
    /// the snapshot again (the defect: it booted the bare template with none of its files).
    #[test]
    fn a_start_of_a_clone_that_never_ran_boots_from_its_snapshot_again() {
        for deleting in [false, true] {
            for state in S::ALL {
                for request in [
                    Request::Start,
                    Request::Stop,
                    Request::Delete,
                    Request::Restore,
                    Request::Archive,
                    Request::RestoreFromBackup,
                ] {
                    let unseeded = on_request_unseeded(state, deleting, request);
                    if !deleting && state == S::FailedStart && request == Request::Start {
                        assert_eq!(
                            unseeded,
                            Ok(Decision::Transition {
                                to: S::Resuming,
                                command: CommandKind::Clone,
                                capacity: Capacity::Reserve,
                            })
                        );
                    } else {
                        assert_eq!(
                            unseeded,
                            on_request(state, deleting, request),
                            "{request} in {state}, deleting {deleting}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_sandbox_being_deleted_refuses_start_stop_restore_and_archive() {
        for state in S::ALL {
            for request in [
                Request::Start,
                Request::Stop,
                Request::Restore,
                Request::Archive,
                Request::RestoreFromBackup,
            ] {
                assert_eq!(
                    on_request(state, true, request),
                    Err(Refusal::Conflict { state, request })
                );
            }
        }
    }
}
