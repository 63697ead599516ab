//! Two decisions about time and settled states: what the reconciler's pass does with a
//! sandbox whose `expires_at` passed ([`on_expiry`]), and what a waiting request answers for a
//! sandbox in a given state ([`wait_verdict`]). Pure; the pass and the API's wait act on them.
//!
//! Sources: OpenSandbox's TTL renewal (`renew-expiration`, `shared/reference/000_…`), E2B's
//! sandbox timeout, Fly's `GET /machines/{id}/wait?state=` (issue 15 items 4 and 5).

use std::fmt;
use std::str::FromStr;

use super::{on_request, Decision, Request, SandboxState, UnknownState};

/// What an expired sandbox gets (`sandboxes.on_expiry`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ExpiryAction {
    /// Stop it, keeping its disk (the default: nothing is lost).
    #[default]
    Stop,
    /// Delete it.
    Delete,
}

impl ExpiryAction {
    /// The API and column spelling (`stop`, `delete`).
    pub fn as_str(self) -> &'static str {
        match self {
            ExpiryAction::Stop => "stop",
            ExpiryAction::Delete => "delete",
        }
    }

    /// The lifecycle request the action is.
    pub fn request(self) -> Request {
        match self {
            ExpiryAction::Stop => Request::Stop,
            ExpiryAction::Delete => Request::Delete,
        }
    }
}

impl fmt::Display for ExpiryAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ExpiryAction {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [ExpiryAction::Stop, ExpiryAction::Delete]
            .into_iter()
            .find(|a| a.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// What the pass does with a sandbox whose `expires_at` has passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// Apply the action as a request would ([`on_request`]'s transition, with reason
    /// `expired`), and clear `expires_at`: an expiry fires once.
    Apply(Decision),
    /// The sandbox is already where the action leads (a stop of a `stopped` or `failed-start`
    /// sandbox): clear `expires_at`, change nothing else.
    Settled,
    /// A transition that conflicts with the action is in flight (a stop while `starting`):
    /// leave it for a later pass, which sees it settled.
    Later,
}

/// Decides an expiry of `action` against the row's `state` (`deleting`: `deleted_at` is set),
/// through the request table of [`on_request`] so an expiry never does what a user's request
/// could not.
pub fn on_expiry(state: SandboxState, deleting: bool, action: ExpiryAction) -> Expiry {
    match on_request(state, deleting, action.request()) {
        Ok(d @ Decision::Transition { .. }) => Expiry::Apply(d),
        Ok(Decision::Unchanged) => Expiry::Settled,
        Err(_) => Expiry::Later,
    }
}

/// The states a waiting request may ask for (`?state=` of `GET …/wait`, `?wait=` of the
/// lifecycle requests): the settled states a request leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WaitTarget {
    /// `running`.
    Running,
    /// `stopped`.
    Stopped,
    /// `deleted`.
    Deleted,
    /// `archived`.
    Archived,
}

impl WaitTarget {
    /// Every target.
    pub const ALL: [WaitTarget; 4] = [
        WaitTarget::Running,
        WaitTarget::Stopped,
        WaitTarget::Deleted,
        WaitTarget::Archived,
    ];

    /// The one target a wait on `request` may name (`None`: a create), the state it settles in:
    /// a create and a start lead to `running`, a stop to `stopped`, a delete to `deleted`. A
    /// request that waits for another state is refused before it does anything.
    pub fn of_request(request: Option<super::Request>) -> WaitTarget {
        match request {
            None
            | Some(
                super::Request::Start | super::Request::Restore | super::Request::RestoreFromBackup,
            ) => WaitTarget::Running,
            Some(super::Request::Stop) => WaitTarget::Stopped,
            Some(super::Request::Delete) => WaitTarget::Deleted,
            Some(super::Request::Archive) => WaitTarget::Archived,
        }
    }

    /// The state it waits for.
    pub fn state(self) -> SandboxState {
        match self {
            WaitTarget::Running => SandboxState::Running,
            WaitTarget::Stopped => SandboxState::Stopped,
            WaitTarget::Deleted => SandboxState::Deleted,
            WaitTarget::Archived => SandboxState::Archived,
        }
    }
}

impl FromStr for WaitTarget {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        WaitTarget::ALL
            .into_iter()
            .find(|t| t.state().as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

impl fmt::Display for WaitTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.state().as_str())
    }
}

/// What a waiting request answers now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitVerdict {
    /// The sandbox is in the target state: answer it (200).
    Reached,
    /// A transition is in flight (or the row may still get there): keep waiting.
    Pending,
    /// The sandbox settled elsewhere, or is being deleted: it cannot get there without a new
    /// request (409 with the state).
    Impossible,
}

/// States in which a transition is in flight: the row will move without a new request.
const IN_FLIGHT: [SandboxState; 8] = [
    SandboxState::Provisioning,
    SandboxState::Starting,
    SandboxState::Stopping,
    SandboxState::Resuming,
    SandboxState::Restoring,
    SandboxState::Migrating,
    SandboxState::Archiving,
    SandboxState::Unarchiving,
];

/// The sandbox's own timers that move it out of a settled state without a new request: the
/// reconciler's auto-stop and auto-delete, and its expiry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timers {
    /// `auto_stop_minutes` is set: a `running` sandbox stops once idle that long.
    pub auto_stop: bool,
    /// `auto_delete_minutes` is set: a `stopped` or `failed-start` sandbox is deleted after it.
    pub auto_delete: bool,
    /// `expires_at` is set, with what happens then.
    pub expiry: Option<ExpiryAction>,
}

impl Timers {
    /// Whether a sandbox settled in `state` gets to `target` by these timers alone (also in two
    /// steps: auto-stop, then auto-delete).
    fn reach(self, state: SandboxState, target: WaitTarget) -> bool {
        let stops = state == SandboxState::Running
            && (self.auto_stop || self.expiry == Some(ExpiryAction::Stop));
        match target {
            WaitTarget::Stopped => stops,
            WaitTarget::Deleted => {
                self.expiry == Some(ExpiryAction::Delete)
                    || (self.auto_delete
                        && (stops
                            || matches!(state, SandboxState::Stopped | SandboxState::FailedStart)))
            }
            WaitTarget::Running | WaitTarget::Archived => false,
        }
    }
}

/// Judges a sandbox in `state` (`deleting`: `deleted_at` is set) with `timers` for a wait on
/// `target`.
///
/// A sandbox being deleted can only become `deleted`; otherwise an in-flight state is pending,
/// and so is a settled one its own timers will move to the target (a running sandbox with
/// auto-stop or a stop expiry, waited for as `stopped`; a delete expiry, or auto-delete,
/// waited for as `deleted`); any other settled state than the target (`running`, `stopped`,
/// `failed-start`, `archived`) is impossible: nothing moves it without a new request.
pub fn wait_verdict(
    target: WaitTarget,
    state: SandboxState,
    deleting: bool,
    timers: Timers,
) -> WaitVerdict {
    if state == target.state() && (target == WaitTarget::Deleted || !deleting) {
        return WaitVerdict::Reached;
    }
    if deleting || state == SandboxState::Deleted {
        return if target == WaitTarget::Deleted {
            WaitVerdict::Pending
        } else {
            WaitVerdict::Impossible
        };
    }
    if IN_FLIGHT.contains(&state) || timers.reach(state, target) {
        WaitVerdict::Pending
    } else {
        WaitVerdict::Impossible
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Capacity, CommandKind};
    use SandboxState as S;

    #[test]
    fn an_expiry_stops_a_running_sandbox_and_deletes_from_any_state() {
        assert_eq!(
            on_expiry(S::Running, false, ExpiryAction::Stop),
            Expiry::Apply(Decision::Transition {
                to: S::Stopping,
                command: CommandKind::Stop,
                capacity: Capacity::Keep,
            })
        );
        for state in S::ALL.into_iter().filter(|s| *s != S::Deleted) {
            assert!(
                matches!(
                    on_expiry(state, false, ExpiryAction::Delete),
                    Expiry::Apply(Decision::Transition {
                        command: CommandKind::Delete,
                        ..
                    })
                ),
                "{state}"
            );
        }
    }

    #[test]
    fn an_expiry_follows_the_request_table_in_every_state() {
        for state in S::ALL {
            for deleting in [false, true] {
                for action in [ExpiryAction::Stop, ExpiryAction::Delete] {
                    let expected = match on_request(state, deleting, action.request()) {
                        Ok(d @ Decision::Transition { .. }) => Expiry::Apply(d),
                        Ok(Decision::Unchanged) => Expiry::Settled,
                        Err(_) => Expiry::Later,
                    };
                    assert_eq!(
                        on_expiry(state, deleting, action),
                        expected,
                        "{action} in {state}"
                    );
                }
            }
        }
        assert_eq!(
            on_expiry(S::Stopped, false, ExpiryAction::Stop),
            Expiry::Settled
        );
        assert_eq!(
            on_expiry(S::FailedStart, false, ExpiryAction::Stop),
            Expiry::Settled
        );
        assert_eq!(
            on_expiry(S::Starting, false, ExpiryAction::Stop),
            Expiry::Later
        );
        assert_eq!(
            on_expiry(S::Provisioning, false, ExpiryAction::Stop),
            Expiry::Later
        );
        assert_eq!(
            on_expiry(S::Running, true, ExpiryAction::Delete),
            Expiry::Settled
        );
    }

    #[test]
    fn expiry_actions_and_wait_targets_round_trip_through_their_spelling() {
        for a in [ExpiryAction::Stop, ExpiryAction::Delete] {
            assert_eq!(a.as_str().parse::<ExpiryAction>().unwrap(), a);
        }
        assert!("pause".parse::<ExpiryAction>().is_err());
        for t in WaitTarget::ALL {
            assert_eq!(t.to_string().parse::<WaitTarget>().unwrap(), t);
        }
        for bad in ["starting", "failed-start", "", "RUNNING"] {
            assert!(bad.parse::<WaitTarget>().is_err(), "{bad}");
        }
    }

    /// Every (target, state, deleting): reached only in the target, pending while a
    /// transition is in flight, impossible once settled elsewhere or being deleted.
    #[test]
    fn a_wait_is_reached_pending_or_impossible_in_every_state() {
        use WaitVerdict::*;
        for target in WaitTarget::ALL {
            for state in S::ALL {
                let in_flight = IN_FLIGHT.contains(&state);
                let expected = if state == target.state() {
                    Reached
                } else if state == S::Deleted {
                    Impossible
                } else if in_flight {
                    Pending
                } else {
                    Impossible
                };
                assert_eq!(
                    wait_verdict(target, state, false, Timers::default()),
                    expected,
                    "{target} in {state}"
                );
                let deleting = wait_verdict(target, state, true, Timers::default());
                let expected = match (target, state) {
                    (WaitTarget::Deleted, S::Deleted) => Reached,
                    (WaitTarget::Deleted, _) => Pending,
                    _ => Impossible,
                };
                assert_eq!(deleting, expected, "{target} in {state}, being deleted");
            }
        }
        assert_eq!(
            wait_verdict(
                WaitTarget::Running,
                S::FailedStart,
                false,
                Timers::default()
            ),
            Impossible
        );
        assert_eq!(
            wait_verdict(
                WaitTarget::Running,
                S::Provisioning,
                false,
                Timers::default()
            ),
            Pending
        );
        assert_eq!(
            wait_verdict(WaitTarget::Stopped, S::Running, false, Timers::default()),
            Impossible
        );
        assert_eq!(
            wait_verdict(WaitTarget::Stopped, S::Stopping, false, Timers::default()),
            Pending
        );
    }

    #[test]
    fn a_settled_sandbox_its_own_timers_will_move_is_pending() {
        use WaitVerdict::*;
        let auto_stop = Timers {
            auto_stop: true,
            ..Timers::default()
        };
        let stop_expiry = Timers {
            expiry: Some(ExpiryAction::Stop),
            ..Timers::default()
        };
        let delete_expiry = Timers {
            expiry: Some(ExpiryAction::Delete),
            ..Timers::default()
        };
        let auto_delete = Timers {
            auto_delete: true,
            ..Timers::default()
        };
        let both = Timers {
            auto_stop: true,
            auto_delete: true,
            ..Timers::default()
        };
        for (target, state, timers, expected) in [
            (WaitTarget::Stopped, S::Running, auto_stop, Pending),
            (WaitTarget::Stopped, S::Running, stop_expiry, Pending),
            (WaitTarget::Stopped, S::Running, auto_delete, Impossible),
            (WaitTarget::Stopped, S::FailedStart, auto_stop, Impossible),
            (WaitTarget::Deleted, S::Running, delete_expiry, Pending),
            (WaitTarget::Deleted, S::Stopped, delete_expiry, Pending),
            (WaitTarget::Deleted, S::Stopped, auto_delete, Pending),
            (WaitTarget::Deleted, S::FailedStart, auto_delete, Pending),
            (WaitTarget::Deleted, S::Running, auto_delete, Impossible),
            (WaitTarget::Deleted, S::Running, both, Pending),
            (WaitTarget::Deleted, S::Running, stop_expiry, Impossible),
            (WaitTarget::Running, S::Stopped, both, Impossible),
        ] {
            assert_eq!(
                wait_verdict(target, state, false, timers),
                expected,
                "{target} from {state} with {timers:?}"
            );
        }
    }
}
