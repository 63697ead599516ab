//! The host state machine: `ready`, `draining`, `cordoned`, `lost` (DESIGN.md "Lifecycle").
//!
//! - `ready` takes new sandboxes; `draining` and `cordoned` take none, but their own sandboxes
//!   still start there (their disks live there); `lost` takes nothing.
//! - An operator drains, cordons or uncordons a host that is not `lost`; repeating an action is
//!   accepted and changes nothing.
//! - The reconciler marks a host `lost` when it is silent for too long; the host's next
//!   heartbeat makes it `ready` again. A heartbeat leaves the operator's `draining` and
//!   `cordoned` as they are.
//!
//! Pure: the store writes what [`HostState::on`] decides.
//!
//! A host's health — `healthy`, `degraded`, `probing`, judged from the outcomes of its boots
//! rather than its heartbeats — is a second machine beside this one: [`health`].

use std::fmt;
use std::str::FromStr;

use crate::state::UnknownState;

pub mod drain;
pub mod health;

pub use health::{HealthChange, HealthEvent, HealthPolicy, HostCondition, HostHealth};

/// A host's state, as the `hosts.state` column spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostState {
    /// In service: takes new sandboxes (the state a heartbeat restores after `lost`).
    Ready,
    /// Set by an operator (`drain`): takes no new sandboxes, and a start of one of its own
    /// stopped sandboxes moves it to another host (`crate::state::away_from_home`); a
    /// restore or a failed-start's start still runs there. The reconciler's drive moves its
    /// sandboxes off ([`drain`]).
    Draining,
    /// Set by an operator (`cordon`): takes no new sandboxes, as `draining`, but nothing is
    /// moved off it (a cordon ends a drain; its moves in flight finish).
    Cordoned,
    /// Silent past the reconciler's lost threshold (5 minutes by default): takes nothing.
    Lost,
}

/// What happens to a host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostEvent {
    /// `POST /v1/hosts/{id}/drain`.
    Drain,
    /// `POST /v1/hosts/{id}/cordon`.
    Cordon,
    /// `POST /v1/hosts/{id}/uncordon`.
    Uncordon,
    /// A heartbeat arrived.
    Heartbeat,
    /// The host stayed silent past the lost threshold.
    Silent,
}

/// A host event refused in the host's current state (HTTP 409 for an operator action).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot {event} a host that is {state}")]
pub struct HostRefusal {
    /// The host's state when the event arrived.
    pub state: HostState,
    /// The event refused (only operator actions are ever refused).
    pub event: HostEvent,
}

impl HostState {
    /// Every state.
    pub const ALL: [HostState; 4] = [
        HostState::Ready,
        HostState::Draining,
        HostState::Cordoned,
        HostState::Lost,
    ];

    /// The database and API spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            HostState::Ready => "ready",
            HostState::Draining => "draining",
            HostState::Cordoned => "cordoned",
            HostState::Lost => "lost",
        }
    }

    /// Whether placement may put a new sandbox here.
    pub fn admits_new_sandboxes(self) -> bool {
        self == HostState::Ready
    }

    /// Whether a sandbox whose disk lives here may start here (reserve capacity again).
    pub fn admits_resident_sandboxes(self) -> bool {
        self != HostState::Lost
    }

    /// The state after `event`, or a refusal. Staying in the same state is a valid answer (a
    /// repeated operator action, a heartbeat of a `ready` host).
    ///
    /// Errors: [`HostRefusal`] for an operator action on a `lost` host.
    pub fn on(self, event: HostEvent) -> Result<HostState, HostRefusal> {
        use HostEvent as E;
        use HostState as S;
        match (self, event) {
            (S::Lost, E::Drain | E::Cordon | E::Uncordon) => {
                Err(HostRefusal { state: self, event })
            }
            (_, E::Drain) => Ok(S::Draining),
            (_, E::Cordon) => Ok(S::Cordoned),
            (_, E::Uncordon) => Ok(S::Ready),
            (S::Lost, E::Heartbeat) => Ok(S::Ready),
            (state, E::Heartbeat) => Ok(state),
            (_, E::Silent) => Ok(S::Lost),
        }
    }

    /// The states from which `event` leads to `to` (what a fenced `UPDATE … WHERE state =
    /// ANY(…)` accepts).
    pub fn sources(event: HostEvent, to: HostState) -> Vec<HostState> {
        HostState::ALL
            .into_iter()
            .filter(|s| s.on(event) == Ok(to))
            .collect()
    }
}

impl HostEvent {
    /// The event's name (`drain`, `heartbeat`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            HostEvent::Drain => "drain",
            HostEvent::Cordon => "cordon",
            HostEvent::Uncordon => "uncordon",
            HostEvent::Heartbeat => "heartbeat",
            HostEvent::Silent => "silent",
        }
    }
}

impl fmt::Display for HostState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for HostEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HostState {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        HostState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use HostEvent as E;
    use HostState as S;

    /// Every (state, event) pair: `Some(to)` for a transition, `None` for a refusal.
    #[test]
    fn every_host_event_follows_the_table() {
        let table: [(S, [Option<S>; 5]); 4] = [
            //            drain             cordon            uncordon      heartbeat          silent
            (
                S::Ready,
                [
                    Some(S::Draining),
                    Some(S::Cordoned),
                    Some(S::Ready),
                    Some(S::Ready),
                    Some(S::Lost),
                ],
            ),
            (
                S::Draining,
                [
                    Some(S::Draining),
                    Some(S::Cordoned),
                    Some(S::Ready),
                    Some(S::Draining),
                    Some(S::Lost),
                ],
            ),
            (
                S::Cordoned,
                [
                    Some(S::Draining),
                    Some(S::Cordoned),
                    Some(S::Ready),
                    Some(S::Cordoned),
                    Some(S::Lost),
                ],
            ),
            (S::Lost, [None, None, None, Some(S::Ready), Some(S::Lost)]),
        ];
        let events = [E::Drain, E::Cordon, E::Uncordon, E::Heartbeat, E::Silent];
        assert_eq!(table.len(), S::ALL.len());
        for (state, row) in table {
            for (event, expected) in events.into_iter().zip(row) {
                assert_eq!(state.on(event).ok(), expected, "{event} in {state}");
            }
        }
    }

    #[test]
    fn only_a_ready_host_takes_new_sandboxes_and_only_a_lost_one_refuses_its_own() {
        for s in S::ALL {
            assert_eq!(s.admits_new_sandboxes(), s == S::Ready);
            assert_eq!(s.admits_resident_sandboxes(), s != S::Lost);
            assert_eq!(s.as_str().parse::<S>().unwrap(), s);
        }
    }

    #[test]
    fn an_operator_action_is_accepted_from_every_state_but_lost() {
        assert_eq!(
            HostState::sources(E::Drain, S::Draining),
            vec![S::Ready, S::Draining, S::Cordoned]
        );
        assert_eq!(
            HostState::sources(E::Uncordon, S::Ready),
            vec![S::Ready, S::Draining, S::Cordoned]
        );
    }
}
