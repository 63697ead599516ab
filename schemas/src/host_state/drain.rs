//! Drain moves sandboxes (issue 14): what the reconciler's drive does with each sandbox of a
//! `draining` host. Pure; the pass reads the rows, and the store writes what these decide.
//!
//! - A `stopped` sandbox is archived ([`DrainKind::Archive`]): its stop snapshot goes to the
//!   object store (already there when the stop is durable; then only the local disk is
//!   freed) and the host no longer holds it. A later start unarchives it on whatever host
//!   placement picks. No boot, no wire change.
//! - With `live`, a `running` sandbox is stopped (keeping its memory where the runtime can:
//!   gVisor), then, once that stop is durable, started elsewhere (`migrating`, the path of a
//!   user's start of a stopped sandbox whose host is draining) and so ends `running` on another
//!   host ([`DrainKind::Live`]); on gVisor its processes continue.
//! - A move that cannot finish ends `failed` with a [`DrainFailure`] and is not retried until
//!   the operator drains the host again. A sandbox the drain stopped is started again on its
//!   own host when it cannot move ([`DrainStep::Fail`] with `restart`), so a drain never leaves
//!   a running sandbox stopped.
//! - A sandbox deleted mid-drain is forgotten; one its user started again on its own host before
//!   it could move fails (`interrupted`) rather than being stopped a second time.
//!
//! Source: issue 14 ("Drain moves sandboxes: `POST /v1/hosts/{id}/drain` migrates its stopped
//! sandboxes, and with `{"live": true}` its running ones too … a bounded number at a time").

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::state::{Request, SandboxState, UnknownState};

/// How a sandbox leaves a draining host (`drain_moves.kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DrainKind {
    /// A stopped sandbox, archived.
    Archive,
    /// A running sandbox, stopped and started elsewhere (a live drain).
    Live,
}

/// Where a move is (`drain_moves.phase`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DrainPhase {
    /// A live move's stop was requested; waiting for `stopped` and its durable stop snapshot.
    Stopping,
    /// The archive or the start elsewhere was requested; waiting for it to settle.
    Moving,
    /// It could not move; not retried until the host is drained again.
    Failed,
}

/// Why a move failed (`drain_moves.reason`, shown on the host).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DrainFailure {
    /// No other host in service has room for it (checked before a move begins, and for a live
    /// move again by the placement of its start).
    NoRoom,
    /// Its stop did not become durable in time (the upload failed or is too slow).
    NotDurable,
    /// The archive or the migration failed; it went back `stopped` to its host.
    MoveFailed,
    /// Its stop failed (`failed-start`).
    StopFailed,
    /// It was started (or otherwise changed) on its own host before it could move.
    Interrupted,
}

/// A move the drive looks at again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tracked {
    /// How it moves.
    pub kind: DrainKind,
    /// Where it was ([`DrainPhase::Stopping`] or [`DrainPhase::Moving`]).
    pub phase: DrainPhase,
    /// The sandbox's state now.
    pub state: SandboxState,
    /// A delete was accepted (`deleted_at` is set).
    pub deleting: bool,
    /// The row still names the drained host (a migration names the new one).
    pub at_home: bool,
    /// Its stop is durable (`durable_at` is set).
    pub durable: bool,
    /// How long the move has been in its phase.
    pub waited: Duration,
}

/// What the drive does with a tracked move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainStep {
    /// Its stop, upload, archive or migration is under way.
    Wait,
    /// A live move's stop is durable: start it (elsewhere while its host is draining; at home
    /// when the drain ended meanwhile, and also when no other host has room).
    Start,
    /// It left the host (runs elsewhere, or is archived): the move is over.
    Done,
    /// It is being deleted: the move is forgotten.
    Forget,
    /// The move failed for `why`; `restart`: the drain stopped it, so it is started again on
    /// its own host.
    Fail {
        /// Why.
        why: DrainFailure,
        /// Start it again at home.
        restart: bool,
    },
}

/// The request the drive makes of an untracked sandbox in `state` on a draining host, and how
/// it moves: `stopped` → archive; `running` (only when `live`) → stop. `None`: nothing to do
/// now (being deleted, in a transition that will settle first, or a state a drain leaves).
pub fn drain_request(
    state: SandboxState,
    deleting: bool,
    live: bool,
) -> Option<(DrainKind, Request)> {
    match state {
        _ if deleting => None,
        SandboxState::Stopped => Some((DrainKind::Archive, Request::Archive)),
        SandboxState::Running if live => Some((DrainKind::Live, Request::Stop)),
        _ => None,
    }
}

/// The next step of the tracked move `t`. A live move waits at most `durable_wait` for its stop
/// to be durable.
pub fn on_drain_progress(t: &Tracked, durable_wait: Duration) -> DrainStep {
    use SandboxState as S;
    let transitional = !matches!(
        t.state,
        S::Running | S::Stopped | S::FailedStart | S::Archived | S::Deleted
    );
    if t.deleting || t.state == S::Deleted {
        return DrainStep::Forget;
    }
    if t.state == S::Archived || (!t.at_home && t.state == S::Running) {
        return DrainStep::Done;
    }
    if !t.at_home {
        // Placed elsewhere (a migration, by the drive or by its user's start): it left this
        // host once it settles; a migration that fails comes back here `stopped`.
        return if transitional {
            DrainStep::Wait
        } else {
            DrainStep::Done
        };
    }
    let fail = |why, restart| DrainStep::Fail { why, restart };
    match (t.kind, t.phase, t.state) {
        (DrainKind::Archive, _, S::Archiving) => DrainStep::Wait,
        (DrainKind::Archive, _, S::Stopped) => fail(DrainFailure::MoveFailed, false),
        (DrainKind::Live, _, S::Stopping | S::Archiving) => DrainStep::Wait,
        (DrainKind::Live, DrainPhase::Stopping, S::Stopped) if t.durable => DrainStep::Start,
        (DrainKind::Live, DrainPhase::Stopping, S::Stopped) if t.waited >= durable_wait => {
            fail(DrainFailure::NotDurable, true)
        }
        (DrainKind::Live, DrainPhase::Stopping, S::Stopped) => DrainStep::Wait,
        (DrainKind::Live, _, S::Stopped) => fail(DrainFailure::MoveFailed, true),
        (DrainKind::Live, _, S::FailedStart) => fail(DrainFailure::StopFailed, false),
        (_, _, _) => fail(DrainFailure::Interrupted, false),
    }
}

impl DrainKind {
    /// The database spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            DrainKind::Archive => "archive",
            DrainKind::Live => "live",
        }
    }
}

impl DrainPhase {
    /// The database spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            DrainPhase::Stopping => "stopping",
            DrainPhase::Moving => "moving",
            DrainPhase::Failed => "failed",
        }
    }
}

impl DrainFailure {
    /// The reason shown on the host (`drain.failures[].reason`).
    pub const fn as_str(self) -> &'static str {
        match self {
            DrainFailure::NoRoom => "no other host has room for it",
            DrainFailure::NotDurable => {
                "its stop did not become durable in time; started again on its own host"
            }
            DrainFailure::MoveFailed => "the move failed; it stays on its host",
            DrainFailure::StopFailed => "its stop failed",
            DrainFailure::Interrupted => {
                "it was started or changed on its own host before it moved"
            }
        }
    }
}

impl fmt::Display for DrainFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DrainKind {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [DrainKind::Archive, DrainKind::Live]
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

impl FromStr for DrainPhase {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [DrainPhase::Stopping, DrainPhase::Moving, DrainPhase::Failed]
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxState as S;

    const WAIT: Duration = Duration::from_secs(60);

    fn live(phase: DrainPhase, state: S) -> Tracked {
        Tracked {
            kind: DrainKind::Live,
            phase,
            state,
            deleting: false,
            at_home: true,
            durable: false,
            waited: Duration::ZERO,
        }
    }

    #[test]
    fn a_drain_archives_stopped_sandboxes_and_stops_running_ones_only_when_live() {
        for state in S::ALL {
            for live in [false, true] {
                let expected = match state {
                    S::Stopped => Some((DrainKind::Archive, Request::Archive)),
                    S::Running if live => Some((DrainKind::Live, Request::Stop)),
                    _ => None,
                };
                assert_eq!(
                    drain_request(state, false, live),
                    expected,
                    "{state:?} {live}"
                );
                assert_eq!(drain_request(state, true, live), None, "{state:?} deleting");
            }
        }
    }

    #[test]
    fn a_live_move_waits_for_its_durable_stop_then_starts() {
        assert_eq!(
            on_drain_progress(&live(DrainPhase::Stopping, S::Stopping), WAIT),
            DrainStep::Wait
        );
        let stopped = live(DrainPhase::Stopping, S::Stopped);
        assert_eq!(on_drain_progress(&stopped, WAIT), DrainStep::Wait);
        let durable = Tracked {
            durable: true,
            ..stopped
        };
        assert_eq!(on_drain_progress(&durable, WAIT), DrainStep::Start);
        let late = Tracked {
            waited: WAIT,
            ..stopped
        };
        assert_eq!(
            on_drain_progress(&late, WAIT),
            DrainStep::Fail {
                why: DrainFailure::NotDurable,
                restart: true
            }
        );
    }

    #[test]
    fn a_move_is_over_once_its_sandbox_runs_elsewhere_or_is_archived() {
        let moving = Tracked {
            at_home: false,
            ..live(DrainPhase::Moving, S::Migrating)
        };
        assert_eq!(on_drain_progress(&moving, WAIT), DrainStep::Wait);
        let running = Tracked {
            state: S::Running,
            ..moving
        };
        assert_eq!(on_drain_progress(&running, WAIT), DrainStep::Done);
        for kind in [DrainKind::Archive, DrainKind::Live] {
            let archived = Tracked {
                kind,
                ..live(DrainPhase::Moving, S::Archived)
            };
            assert_eq!(on_drain_progress(&archived, WAIT), DrainStep::Done);
        }
    }

    #[test]
    fn a_failed_move_fails_once_and_a_sandbox_the_drain_stopped_starts_again_at_home() {
        assert_eq!(
            on_drain_progress(&live(DrainPhase::Moving, S::Stopped), WAIT),
            DrainStep::Fail {
                why: DrainFailure::MoveFailed,
                restart: true
            }
        );
        let archive = Tracked {
            kind: DrainKind::Archive,
            ..live(DrainPhase::Moving, S::Stopped)
        };
        assert_eq!(
            on_drain_progress(&archive, WAIT),
            DrainStep::Fail {
                why: DrainFailure::MoveFailed,
                restart: false
            }
        );
        assert_eq!(
            on_drain_progress(
                &Tracked {
                    state: S::Archiving,
                    ..archive
                },
                WAIT
            ),
            DrainStep::Wait
        );
        assert_eq!(
            on_drain_progress(&live(DrainPhase::Stopping, S::FailedStart), WAIT),
            DrainStep::Fail {
                why: DrainFailure::StopFailed,
                restart: false
            }
        );
    }

    #[test]
    fn a_deleted_sandbox_is_forgotten_and_one_started_at_home_is_not_stopped_again() {
        for state in S::ALL {
            let deleting = Tracked {
                deleting: true,
                ..live(DrainPhase::Stopping, state)
            };
            assert_eq!(
                on_drain_progress(&deleting, WAIT),
                DrainStep::Forget,
                "{state:?}"
            );
        }
        assert_eq!(
            on_drain_progress(&live(DrainPhase::Stopping, S::Deleted), WAIT),
            DrainStep::Forget
        );
        for state in [S::Starting, S::Running, S::Resuming, S::Restoring] {
            assert_eq!(
                on_drain_progress(&live(DrainPhase::Stopping, state), WAIT),
                DrainStep::Fail {
                    why: DrainFailure::Interrupted,
                    restart: false
                },
                "{state:?}"
            );
        }
    }

    #[test]
    fn spellings_round_trip() {
        for kind in [DrainKind::Archive, DrainKind::Live] {
            assert_eq!(kind.as_str().parse::<DrainKind>().unwrap(), kind);
        }
        for phase in [DrainPhase::Stopping, DrainPhase::Moving, DrainPhase::Failed] {
            assert_eq!(phase.as_str().parse::<DrainPhase>().unwrap(), phase);
        }
    }
}
