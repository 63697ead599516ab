//! The sandbox lifecycle state machine: pure functions from (state, request) and
//! (state, result) to a decision or a typed refusal. No I/O here; the API and the reconciler
//! write what these functions decide.
//!
//! Source: the seed platform's lifecycle documentation (`shared/reference/003_…txt`, "Read the
//! states") and DESIGN.md "Lifecycle". There is no paused state: `pause` is an alias of `stop`,
//! `resume` an alias of `start`.
//!
//! # Request × state
//!
//! `=` means "already at or heading to that target: return the sandbox, change nothing";
//! `409` means a conflicting transition is in flight; otherwise the new state and the command
//! queued. A sandbox being deleted (`deleted_at` set) answers `=` to delete and `409` to
//! everything else.
//!
//! | state          | start / resume        | stop / pause         | delete               |
//! |----------------|-----------------------|----------------------|----------------------|
//! | provisioning   | =                     | 409                  | stopping + delete    |
//! | starting       | =                     | 409                  | stopping + delete    |
//! | running        | =                     | stopping + stop      | stopping + delete    |
//! | stopping       | 409                   | =                    | stopping + delete    |
//! | stopped        | starting + start      | =                    | stopping + delete    |
//! | resuming       | =                     | 409                  | stopping + delete    |
//! | restoring      | =                     | 409                  | stopping + delete    |
//! | migrating      | 409                   | 409                  | stopping + delete    |
//! | archiving      | 409                   | =                    | stopping + delete    |
//! | archived       | 409                   | =                    | stopping + delete    |
//! | unarchiving    | =                     | 409                  | stopping + delete    |
//! | failed-start   | starting + start      | =                    | stopping + delete    |
//! | deleted        | 409                   | 409                  | =                    |

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Every state of the public sandbox enum. Serialized in kebab-case (`failed-start`).
///
/// `Pending`, `FailedProvision` and `Lost` exist for SDK compatibility and are never written
/// (see [`SandboxState::is_written`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum SandboxState {
    Pending,
    Provisioning,
    Starting,
    Running,
    Stopping,
    Stopped,
    Resuming,
    Restoring,
    Migrating,
    Archiving,
    Archived,
    Unarchiving,
    FailedStart,
    FailedProvision,
    Lost,
    Deleted,
}

impl SandboxState {
    /// Every state, in declaration order.
    pub const ALL: [SandboxState; 16] = [
        SandboxState::Pending,
        SandboxState::Provisioning,
        SandboxState::Starting,
        SandboxState::Running,
        SandboxState::Stopping,
        SandboxState::Stopped,
        SandboxState::Resuming,
        SandboxState::Restoring,
        SandboxState::Migrating,
        SandboxState::Archiving,
        SandboxState::Archived,
        SandboxState::Unarchiving,
        SandboxState::FailedStart,
        SandboxState::FailedProvision,
        SandboxState::Lost,
        SandboxState::Deleted,
    ];

    /// The wire and database spelling (`failed-start`).
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Pending => "pending",
            SandboxState::Provisioning => "provisioning",
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Stopping => "stopping",
            SandboxState::Stopped => "stopped",
            SandboxState::Resuming => "resuming",
            SandboxState::Restoring => "restoring",
            SandboxState::Migrating => "migrating",
            SandboxState::Archiving => "archiving",
            SandboxState::Archived => "archived",
            SandboxState::Unarchiving => "unarchiving",
            SandboxState::FailedStart => "failed-start",
            SandboxState::FailedProvision => "failed-provision",
            SandboxState::Lost => "lost",
            SandboxState::Deleted => "deleted",
        }
    }

    /// Whether the control plane ever writes this state to a row. `pending`,
    /// `failed-provision` and `lost` are listed only for SDK compatibility.
    pub fn is_written(self) -> bool {
        !matches!(
            self,
            SandboxState::Pending | SandboxState::FailedProvision | SandboxState::Lost
        )
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The string did not name a sandbox state.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown sandbox state {0:?}")]
pub struct UnknownState(pub String);

impl FromStr for SandboxState {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SandboxState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// A user's lifecycle request. `resume` maps to `Start` and `pause` to `Stop`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Request {
    Start,
    Stop,
    Delete,
}

impl Request {
    /// The request's name as the API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Request::Start => "start",
            Request::Stop => "stop",
            Request::Delete => "delete",
        }
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The kind of a host command. Its numeric order is part of the wire format: append only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CommandKind {
    /// Provision from a template and boot.
    Create,
    /// Boot a stopped sandbox from its saved disk (or memory snapshot).
    Start,
    /// Stop, keeping the disk (and memory where the runtime can).
    Stop,
    /// Destroy the container, network and files.
    Delete,
}

impl CommandKind {
    /// The kind's name as stored in `commands.kind` (`sandbox.create`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            CommandKind::Create => "sandbox.create",
            CommandKind::Start => "sandbox.start",
            CommandKind::Stop => "sandbox.stop",
            CommandKind::Delete => "sandbox.delete",
        }
    }
}

impl fmt::Display for CommandKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What [`on_request`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Already at, or heading to, the requested target: return the sandbox as it is.
    Unchanged,
    /// Write `to`, bump the generation and queue `command` in the same transaction.
    Transition {
        to: SandboxState,
        command: CommandKind,
    },
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A transition that conflicts with the request is in flight (HTTP 409 `conflict`).
    #[error("cannot {request} a sandbox that is {state}")]
    Conflict {
        state: SandboxState,
        request: Request,
    },
}

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
        Request::Delete => Ok(Decision::Transition {
            to: S::Stopping,
            command: CommandKind::Delete,
        }),
        Request::Start => match state {
            S::Stopped | S::FailedStart => Ok(Decision::Transition {
                to: S::Starting,
                command: CommandKind::Start,
            }),
            S::Provisioning
            | S::Starting
            | S::Running
            | S::Resuming
            | S::Restoring
            | S::Unarchiving => Ok(Decision::Unchanged),
            S::Stopping
            | S::Migrating
            | S::Archiving
            | S::Archived
            | S::Pending
            | S::FailedProvision
            | S::Lost
            | S::Deleted => conflict,
        },
        Request::Stop => match state {
            S::Running => Ok(Decision::Transition {
                to: S::Stopping,
                command: CommandKind::Stop,
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

/// What a host reported for a command (the fenced part: the generation already matched).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
}

/// What [`on_result`] decided for a result whose generation matches the row's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResultDecision {
    /// Write `to`. `releases_capacity` says whether the sandbox stops holding host capacity.
    Apply {
        to: SandboxState,
        releases_capacity: bool,
    },
    /// The row is not where this result leads from (a duplicate, or already applied): no write.
    Ignore,
}

/// Decides a host result for `kind` against the row's `state`, once the generation fence has
/// passed. Idempotent: a result already applied finds the row in its target state and is
/// ignored.
pub fn on_result(
    state: SandboxState,
    deleting: bool,
    kind: CommandKind,
    outcome: Outcome,
) -> ResultDecision {
    use SandboxState as S;
    let apply = |to, releases_capacity| ResultDecision::Apply {
        to,
        releases_capacity,
    };
    match (kind, state, outcome, deleting) {
        (CommandKind::Create, S::Provisioning, Outcome::Succeeded, false) => {
            apply(S::Running, false)
        }
        (CommandKind::Create, S::Provisioning, Outcome::Failed, false) => {
            apply(S::FailedStart, true)
        }
        (CommandKind::Start, S::Starting, Outcome::Succeeded, false) => apply(S::Running, false),
        (CommandKind::Start, S::Starting, Outcome::Failed, false) => apply(S::FailedStart, true),
        (CommandKind::Stop, S::Stopping, Outcome::Succeeded, false) => apply(S::Stopped, true),
        // The guest is still up: it keeps its capacity and the user may stop or delete again.
        (CommandKind::Stop, S::Stopping, Outcome::Failed, false) => apply(S::Running, false),
        (CommandKind::Delete, S::Stopping, Outcome::Succeeded, true) => apply(S::Deleted, true),
        _ => ResultDecision::Ignore,
    }
}

/// Why a state changed; stored on every event row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// A user's API request.
    UserRequest,
    /// A host reported the command's result.
    HostReport,
    /// A command's host never answered in time.
    Timeout,
    /// `auto_stop_minutes` passed without activity.
    AutoStop,
    /// `auto_delete_minutes` passed while stopped.
    AutoDelete,
    /// The sandbox's host was lost.
    HostLost,
    /// The runtime failed (boot, restore, stop).
    RuntimeError,
    /// The control plane undid a late or contradicting host action.
    Compensation,
}

impl Reason {
    /// The snake_case spelling stored in `events.reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::UserRequest => "user_request",
            Reason::HostReport => "host_report",
            Reason::Timeout => "timeout",
            Reason::AutoStop => "auto_stop",
            Reason::AutoDelete => "auto_delete",
            Reason::HostLost => "host_lost",
            Reason::RuntimeError => "runtime_error",
            Reason::Compensation => "compensation",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxState as S;

    #[test]
    fn every_state_round_trips_through_its_spelling() {
        for s in S::ALL {
            assert_eq!(s.as_str().parse::<S>().unwrap(), s);
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.as_str())
            );
        }
        assert!("paused".parse::<S>().is_err());
    }

    #[test]
    fn three_public_states_are_never_written() {
        let unwritten: Vec<_> = S::ALL.into_iter().filter(|s| !s.is_written()).collect();
        assert_eq!(unwritten, [S::Pending, S::FailedProvision, S::Lost]);
    }

    /// The table in the module docs, spelled out: (state, start, stop) with `U` for unchanged,
    /// `C` for conflict and a state for a transition. Delete is checked separately.
    #[test]
    fn start_and_stop_follow_the_request_table_for_every_state() {
        #[derive(Debug, PartialEq)]
        enum E {
            U,
            C,
            T(S, CommandKind),
        }
        use CommandKind as K;
        use E::*;
        let table = [
            (S::Pending, C, C),
            (S::Provisioning, U, C),
            (S::Starting, U, C),
            (S::Running, U, T(S::Stopping, K::Stop)),
            (S::Stopping, C, U),
            (S::Stopped, T(S::Starting, K::Start), U),
            (S::Resuming, U, C),
            (S::Restoring, U, C),
            (S::Migrating, C, C),
            (S::Archiving, C, U),
            (S::Archived, C, U),
            (S::Unarchiving, U, C),
            (S::FailedStart, T(S::Starting, K::Start), U),
            (S::FailedProvision, C, C),
            (S::Lost, C, C),
            (S::Deleted, C, C),
        ];
        assert_eq!(table.len(), S::ALL.len());
        let to_e = |r: Result<Decision, Refusal>| match r {
            Ok(Decision::Unchanged) => U,
            Ok(Decision::Transition { to, command }) => T(to, command),
            Err(Refusal::Conflict { .. }) => C,
        };
        for (state, start, stop) in table {
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
        }
    }

    #[test]
    fn delete_is_accepted_from_every_state_and_repeats_as_a_no_op() {
        for state in S::ALL {
            let first = on_request(state, false, Request::Delete).unwrap();
            if state == S::Deleted {
                assert_eq!(first, Decision::Unchanged);
            } else {
                assert_eq!(
                    first,
                    Decision::Transition {
                        to: S::Stopping,
                        command: CommandKind::Delete
                    }
                );
            }
            assert_eq!(
                on_request(state, true, Request::Delete).unwrap(),
                Decision::Unchanged
            );
        }
    }

    #[test]
    fn a_sandbox_being_deleted_refuses_start_and_stop() {
        for state in S::ALL {
            for request in [Request::Start, Request::Stop] {
                assert_eq!(
                    on_request(state, true, request),
                    Err(Refusal::Conflict { state, request })
                );
            }
        }
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
        ];
        for (state, deleting, kind, outcome, to, releases_capacity) in cases {
            assert_eq!(
                on_result(state, deleting, kind, outcome),
                ResultDecision::Apply {
                    to,
                    releases_capacity
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
                for kind in [K::Create, K::Start, K::Stop, K::Delete] {
                    for outcome in [Outcome::Succeeded, Outcome::Failed] {
                        if on_result(state, deleting, kind, outcome) != ResultDecision::Ignore {
                            applied += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(applied, 7);
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
    }
}
