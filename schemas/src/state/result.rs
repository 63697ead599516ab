//! [`on_result`]: a host's result for a command whose generation matches the row's, decided
//! against the row's state: apply a transition (with its capacity change), compensate a late
//! success the row no longer wants, or ignore a duplicate.
//!
//! Source: DESIGN.md "Lifecycle" ("A late success for a deleted or failed command triggers
//! compensation (stop/destroy on the host), never a state change").

use super::{Capacity, CommandKind, SandboxState};

/// What a host reported for a command (the fenced part: the generation already matched).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The host carried the command out (for a create or start: the guest agent answered).
    Succeeded,
    /// The host could not carry the command out (a boot that failed, a stop that could not stop).
    Failed,
}

/// What [`on_result`] decided for a result whose generation matches the row's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResultDecision {
    /// Write `to` and apply `capacity`, in one transaction.
    Apply {
        /// The state to write.
        to: SandboxState,
        /// The capacity change to apply in the same transaction.
        capacity: Capacity,
    },
    /// The host did something the row no longer wants (the row already failed this boot): queue
    /// this command on the reporting host to undo it; the row does not change. The store queues
    /// it at most once per generation.
    Compensate(CommandKind),
    /// The row is not where this result leads from (a duplicate, or already applied): no write.
    Ignore,
}

/// Decides a host result for `kind` against the row's `state`, once the generation fence has
/// passed. Idempotent: a result already applied finds the row in its target state and is
/// ignored. The first terminal result for a generation wins: a success that contradicts it is
/// compensated — a create or clone that succeeded after its sandbox became `failed-start` is
/// destroyed, a start or restore is stopped (its disk stays, so the sandbox can be started
/// again).
pub fn on_result(
    state: SandboxState,
    deleting: bool,
    kind: CommandKind,
    outcome: Outcome,
) -> ResultDecision {
    use CommandKind as K;
    use Outcome::{Failed, Succeeded};
    use SandboxState as S;
    let apply = |to, capacity| ResultDecision::Apply { to, capacity };
    match (kind, state, outcome, deleting) {
        (K::Create, S::Provisioning, Succeeded, false) => apply(S::Running, Capacity::Keep),
        (K::Create, S::Provisioning, Failed, false) => apply(S::FailedStart, Capacity::Release),
        (K::Start, S::Starting, Succeeded, false) => apply(S::Running, Capacity::Keep),
        (K::Start, S::Starting, Failed, false) => apply(S::FailedStart, Capacity::Release),
        (K::Stop, S::Stopping, Succeeded, false) => apply(S::Stopped, Capacity::Release),
        // The guest is still up: it keeps its capacity and the user may stop or delete again.
        (K::Stop, S::Stopping, Failed, false) => apply(S::Running, Capacity::Keep),
        (K::Delete, S::Stopping, Succeeded, true) => apply(S::Deleted, Capacity::Release),
        // A restore or a clone booted from a snapshot, or could not (`resuming`).
        (K::Restore | K::Clone, S::Resuming, Succeeded, false) => apply(S::Running, Capacity::Keep),
        (K::Restore | K::Clone, S::Resuming, Failed, false) => {
            apply(S::FailedStart, Capacity::Release)
        }
        // An archive's stop snapshot was confirmed stored whole (its host frees the disk only
        // on the delete queued with `archived`); a failed one, or one whose copy the chunk
        // check refused, left the sandbox stopped on its host with its disk. A stopped sandbox
        // holds no capacity.
        (K::Archive, S::Archiving, Succeeded, false) => apply(S::Archived, Capacity::Keep),
        (K::Archive, S::Archiving, Failed, false) => apply(S::Stopped, Capacity::Keep),
        (K::Unarchive, S::Unarchiving, Succeeded, false) => apply(S::Running, Capacity::Keep),
        // The stop snapshot is still whole in the object store: the sandbox stays archived,
        // and a start unarchives it again (placement picks anew).
        (K::Unarchive, S::Unarchiving, Failed, false) => apply(S::Archived, Capacity::Release),
        // A start elsewhere booted on its new host (the store sends the old host a delete of
        // its stale disk), or could not: back to `stopped` on the host it came from, whose
        // disk is the last stop's (the store moves the row back after releasing here).
        (K::Migrate, S::Migrating, Succeeded, false) => apply(S::Running, Capacity::Keep),
        (K::Migrate, S::Migrating, Failed, false) => apply(S::Stopped, Capacity::Release),
        // A restore from backup booted the backup's disk on its new host, or could not: the
        // sandbox failed to start there, and a start boots the backup again (its
        // `seed_snapshot`).
        (K::Migrate, S::Restoring, Succeeded, false) => apply(S::Running, Capacity::Keep),
        (K::Migrate, S::Restoring, Failed, false) => apply(S::FailedStart, Capacity::Release),
        // A restore from backup that booted after its timeout failed it: what it booted is not
        // the sandbox's (a start boots the backup again), so it is destroyed, as a clone is.
        (K::Create | K::Clone | K::Migrate, S::FailedStart, Succeeded, _) => {
            ResultDecision::Compensate(K::Delete)
        }
        // An unarchive that finished after its timeout: stopped there, keeping the fetched
        // disk, so a start of the failed sandbox boots it on that host.
        (K::Start | K::Restore | K::Unarchive, S::FailedStart, Succeeded, _) => {
            ResultDecision::Compensate(K::Stop)
        }
        _ => ResultDecision::Ignore,
    }
}

/// Whose fault a failed create or start was (the host says so in its result).
///
/// - [`Fault::Request`]: the request cannot run on any host as it stands — a template or a
///   runtime the host does not have, a command without a spec. Another host would fail it the
///   same way: it is never retried and never counts against the host's health.
/// - [`Fault::Host`]: everything else — the runtime failed or hung, the network or the disk
///   could not be set up, the agent did not answer. Another host may well run it: a create is
///   retried once elsewhere ([`retries_elsewhere`]) and the failure counts against the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The host could not run it (its runtime, network, disk or agent).
    Host,
    /// No host could run it as asked.
    Request,
}

/// The most hosts one create is tried on: where placement first put it, and one other.
pub const MAX_CREATE_HOSTS: u32 = 2;

/// Whether a failed result should send the sandbox to another host instead of failing it
/// (issue 12 item 2): only a create, failed by the host's [`Fault::Host`], of a sandbox still
/// `provisioning` and not being deleted, that has been tried on fewer than
/// [`MAX_CREATE_HOSTS`] hosts (`hosts_tried` counts the creates issued for it). A start is
/// never moved: its disk lives on its host.
pub fn retries_elsewhere(
    state: SandboxState,
    deleting: bool,
    kind: CommandKind,
    fault: Fault,
    hosts_tried: u32,
) -> bool {
    kind == CommandKind::Create
        && state == SandboxState::Provisioning
        && !deleting
        && fault == Fault::Host
        && hosts_tried < MAX_CREATE_HOSTS
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxState as S;

    #[test]
    fn only_a_first_create_failed_by_its_host_is_retried_elsewhere() {
        use CommandKind as K;
        let mut retried = Vec::new();
        for state in S::ALL {
            for deleting in [false, true] {
                for kind in CommandKind::ALL {
                    for fault in [Fault::Host, Fault::Request] {
                        for tried in 0..=MAX_CREATE_HOSTS {
                            if retries_elsewhere(state, deleting, kind, fault, tried) {
                                retried.push((state, deleting, kind, fault, tried));
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(
            retried,
            [
                (S::Provisioning, false, K::Create, Fault::Host, 0),
                (S::Provisioning, false, K::Create, Fault::Host, 1),
            ],
            "never the request's fault, a start, a deleting row or a second retry"
        );
    }

    #[test]
    fn results_move_transitional_states_to_their_targets() {
        use CommandKind as K;
        use Outcome::*;
        let cases = [
            (
                S::Provisioning,
                false,
                K::Create,
                Succeeded,
                S::Running,
                false,
            ),
            (
                S::Provisioning,
                false,
                K::Create,
                Failed,
                S::FailedStart,
                true,
            ),
            (S::Starting, false, K::Start, Succeeded, S::Running, false),
            (S::Starting, false, K::Start, Failed, S::FailedStart, true),
            (S::Stopping, false, K::Stop, Succeeded, S::Stopped, true),
            (S::Stopping, false, K::Stop, Failed, S::Running, false),
            (S::Stopping, true, K::Delete, Succeeded, S::Deleted, true),
            (S::Resuming, false, K::Restore, Succeeded, S::Running, false),
            (S::Resuming, false, K::Restore, Failed, S::FailedStart, true),
            (S::Resuming, false, K::Clone, Succeeded, S::Running, false),
            (S::Resuming, false, K::Clone, Failed, S::FailedStart, true),
            (
                S::Archiving,
                false,
                K::Archive,
                Succeeded,
                S::Archived,
                false,
            ),
            (S::Archiving, false, K::Archive, Failed, S::Stopped, false),
            (
                S::Unarchiving,
                false,
                K::Unarchive,
                Succeeded,
                S::Running,
                false,
            ),
            (
                S::Unarchiving,
                false,
                K::Unarchive,
                Failed,
                S::Archived,
                true,
            ),
            (
                S::Migrating,
                false,
                K::Migrate,
                Succeeded,
                S::Running,
                false,
            ),
            (S::Migrating, false, K::Migrate, Failed, S::Stopped, true),
            (
                S::Restoring,
                false,
                K::Migrate,
                Succeeded,
                S::Running,
                false,
            ),
            (
                S::Restoring,
                false,
                K::Migrate,
                Failed,
                S::FailedStart,
                true,
            ),
        ];
        for (state, deleting, kind, outcome, to, releases_capacity) in cases {
            assert_eq!(
                on_result(state, deleting, kind, outcome),
                ResultDecision::Apply {
                    to,
                    capacity: if releases_capacity {
                        Capacity::Release
                    } else {
                        Capacity::Keep
                    }
                },
                "{kind} {outcome:?} in {state}"
            );
        }
    }

    #[test]
    fn a_result_that_does_not_lead_from_the_current_state_is_ignored() {
        use CommandKind as K;
        // Every combination not listed above is ignored: duplicates, and results that race a
        // newer request. Count them to be sure the match has no accidental catch-all apply.
        let mut applied = 0;
        for state in S::ALL {
            for deleting in [false, true] {
                for kind in CommandKind::ALL {
                    for outcome in [Outcome::Succeeded, Outcome::Failed] {
                        if let ResultDecision::Apply { .. } =
                            on_result(state, deleting, kind, outcome)
                        {
                            applied += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(applied, 19);
        assert_eq!(
            on_result(S::Running, false, K::Create, Outcome::Succeeded),
            ResultDecision::Ignore,
            "a duplicate create result is a no-op"
        );
        assert_eq!(
            on_result(S::Stopping, true, K::Start, Outcome::Succeeded),
            ResultDecision::Ignore,
            "a late start cannot bring a deleting sandbox back"
        );
        assert_eq!(
            on_result(S::Stopping, true, K::Clone, Outcome::Succeeded),
            ResultDecision::Ignore,
            "a late clone cannot bring a deleting sandbox back (its delete destroys it)"
        );
    }

    #[test]
    fn a_late_success_after_a_failed_boot_is_compensated_never_applied() {
        use CommandKind as K;
        assert_eq!(
            on_result(S::FailedStart, false, K::Create, Outcome::Succeeded),
            ResultDecision::Compensate(K::Delete),
            "a create that succeeded after its sandbox failed is destroyed"
        );
        assert_eq!(
            on_result(S::FailedStart, false, K::Start, Outcome::Succeeded),
            ResultDecision::Compensate(K::Stop),
            "a start that succeeded after its sandbox failed is stopped, keeping its disk"
        );
        // Failures and every other late success change nothing.
        let mut compensated = 0;
        for state in S::ALL {
            for deleting in [false, true] {
                for kind in CommandKind::ALL {
                    for outcome in [Outcome::Succeeded, Outcome::Failed] {
                        if let ResultDecision::Compensate(_) =
                            on_result(state, deleting, kind, outcome)
                        {
                            compensated += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(
            on_result(S::FailedStart, false, K::Clone, Outcome::Succeeded),
            ResultDecision::Compensate(K::Delete),
            "a clone that succeeded after it timed out is destroyed"
        );
        assert_eq!(
            on_result(S::FailedStart, false, K::Restore, Outcome::Succeeded),
            ResultDecision::Compensate(K::Stop),
            "a restore that succeeded after it timed out is stopped, keeping its disk"
        );
        assert_eq!(
            on_result(S::FailedStart, false, K::Unarchive, Outcome::Succeeded),
            ResultDecision::Compensate(K::Stop),
            "an unarchive that succeeded after it timed out is stopped, keeping its disk"
        );
        assert_eq!(
            on_result(S::FailedStart, false, K::Migrate, Outcome::Succeeded),
            ResultDecision::Compensate(K::Delete),
            "a restore from backup that booted after it timed out is destroyed"
        );
        assert_eq!(
            compensated, 12,
            "six (kind, state) pairs, with or without deleted_at"
        );
    }
}
