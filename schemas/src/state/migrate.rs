//! Start elsewhere (issue 14, `migrating`): whether a `stopped` sandbox's own host can take it
//! back ([`away_from_home`]), and, when it cannot, whether the start moves it to another host
//! ([`on_start_elsewhere`]). Pure; the API reads the host and the row, places, and has the
//! store write what these decide.
//!
//! Source: the seed lifecycle doc, "Start a sandbox" ("If the original host is gone or full,
//! the sandbox can be placed on another host, and its snapshot is fetched from object
//! storage") and issue 14 ("gone, lost, draining, cordoned or full").

use std::fmt;

use super::{Capacity, CommandKind, Decision, SandboxState};
use crate::host_state::HostState;

/// Why a stopped sandbox's own host cannot take it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Away {
    /// The row names no host, or a host that is no longer registered.
    Gone,
    /// The host is `lost` (silent past the lost threshold).
    Lost,
    /// The host's last heartbeat is older than the placement freshness window: it (or its
    /// link) is down, and a start sent there would wait for it.
    Silent,
    /// An operator is draining the host: it is to be emptied.
    Draining,
    /// An operator cordoned the host.
    Cordoned,
    /// The host has no room left for the sandbox's resources.
    Full,
}

impl Away {
    /// The spelling used in messages and logs (`cordoned`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Away::Gone => "gone",
            Away::Lost => "lost",
            Away::Silent => "silent",
            Away::Draining => "draining",
            Away::Cordoned => "cordoned",
            Away::Full => "full",
        }
    }
}

impl Away {
    /// Whether the home host can still run the sandbox when it cannot move: a `draining` or
    /// `cordoned` host is in service and admits its own sandboxes (their disk is there), so a
    /// start that cannot go elsewhere (the stop is not durable yet, or no other host has room)
    /// lands at home as before. A gone, lost, silent or full host cannot.
    pub fn home_still_runs(self) -> bool {
        matches!(self, Away::Draining | Away::Cordoned)
    }
}

impl fmt::Display for Away {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether the sandbox's own host can take a start back, from what the control plane knows of
/// it: `home` is its state and whether its heartbeat is fresh, `None` when the row names no
/// registered host. `Some(why)` when it cannot; `None` when it can (it may still turn out
/// full when the start reserves there: [`Away::Full`] is the caller's to find).
pub fn away_from_home(home: Option<(HostState, bool)>) -> Option<Away> {
    match home {
        None => Some(Away::Gone),
        Some((HostState::Lost, _)) => Some(Away::Lost),
        Some((HostState::Draining, _)) => Some(Away::Draining),
        Some((HostState::Cordoned, _)) => Some(Away::Cordoned),
        Some((HostState::Ready, false)) => Some(Away::Silent),
        Some((HostState::Ready, true)) => None,
    }
}

/// A start of a sandbox in `state` (`deleting`: `deleted_at` is set) whose own host cannot take
/// it back: `Some` transition to `migrating` with a `sandbox.migrate`, reserving the sandbox's
/// capacity on the host placement picks (the caller places before it writes), only for a
/// `stopped` sandbox whose stop is `durable` (its stop snapshot is confirmed stored). `None`:
/// the start cannot move it, and is refused with nothing changed (the caller answers 503).
pub fn on_start_elsewhere(state: SandboxState, deleting: bool, durable: bool) -> Option<Decision> {
    (state == SandboxState::Stopped && !deleting && durable).then_some(Decision::Transition {
        to: SandboxState::Migrating,
        command: CommandKind::Migrate,
        capacity: Capacity::Reserve,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxState as S;

    #[test]
    fn only_a_ready_host_heard_from_recently_takes_its_sandbox_back() {
        assert_eq!(away_from_home(None), Some(Away::Gone));
        for state in HostState::ALL {
            for fresh in [false, true] {
                let expected = match (state, fresh) {
                    (HostState::Ready, true) => None,
                    (HostState::Ready, false) => Some(Away::Silent),
                    (HostState::Draining, _) => Some(Away::Draining),
                    (HostState::Cordoned, _) => Some(Away::Cordoned),
                    (HostState::Lost, _) => Some(Away::Lost),
                };
                assert_eq!(away_from_home(Some((state, fresh))), expected, "{state:?}");
            }
        }
    }

    #[test]
    fn only_a_draining_or_cordoned_home_still_runs_a_sandbox_that_cannot_move() {
        let runs: Vec<Away> = [
            Away::Gone,
            Away::Lost,
            Away::Silent,
            Away::Draining,
            Away::Cordoned,
            Away::Full,
        ]
        .into_iter()
        .filter(|a| a.home_still_runs())
        .collect();
        assert_eq!(runs, [Away::Draining, Away::Cordoned]);
    }

    #[test]
    fn only_a_durable_stopped_sandbox_not_being_deleted_starts_elsewhere() {
        let migrate = Decision::Transition {
            to: S::Migrating,
            command: CommandKind::Migrate,
            capacity: Capacity::Reserve,
        };
        for state in S::ALL {
            for deleting in [false, true] {
                for durable in [false, true] {
                    let expected = (state == S::Stopped && !deleting && durable).then_some(migrate);
                    assert_eq!(
                        on_start_elsewhere(state, deleting, durable),
                        expected,
                        "{state} deleting={deleting} durable={durable}"
                    );
                }
            }
        }
    }
}
