//! The circuit breaker of the reconciler's guest failures: whether a pass may fail the guests
//! its evidence shows failed, or must hold because too many of a host's (or the fleet's)
//! running sandboxes would fail at once — a pattern that points at the control plane's own
//! view (lagging heartbeats, a database restored from an old backup) more often than at the
//! guests.
//!
//! A pure decision: the reconciler's pass supplies the tally and the stored trip, and writes
//! what [`judge`] returns.

/// When the breaker trips, and when a trip lets the pass act anyway.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerPolicy {
    /// The breaker trips when more than this share (0..=1) of the scope's running sandboxes
    /// would fail at once. 1 or more never trips.
    pub share: f64,
    /// ... and at least this many would fail (a host of two sandboxes losing one is not a
    /// pattern).
    pub min_failures: u64,
    /// A trip acts once the share stayed exceeded on new evidence for this many consecutive
    /// passes (counting the one that tripped); 1 acts at once.
    pub persist_passes: u32,
}

/// What one scope (a host, or the fleet) looks like in this pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Running sandboxes.
    pub running: u64,
    /// Of those, the ones the pass would fail.
    pub would_fail: u64,
}

/// A stored trip of the scope, from earlier passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trip {
    /// Consecutive passes that found the share exceeded on new evidence.
    pub passes: u32,
    /// An operator confirmed the failures, or they persisted: the pass acts while the share
    /// stays exceeded.
    pub released: bool,
}

/// Why a trip was released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The share stayed exceeded for [`BreakerPolicy::persist_passes`] passes.
    Persisted,
    /// It was released before (by an operator, or by persistence) and still holds.
    Earlier,
}

/// What the pass does with a scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not over the share: act, and clear any trip (`cleared`: there was one).
    Act {
        /// A stored trip is to be deleted.
        cleared: bool,
    },
    /// Over the share, and the trip was released: act; store the trip as released.
    ActReleased {
        /// Why it may act.
        why: Release,
        /// The trip's pass count to store.
        passes: u32,
    },
    /// Over the share: fail nothing there this pass; store the trip with `passes`.
    Hold {
        /// The trip's pass count to store.
        passes: u32,
        /// This pass tripped it (log, count and raise an event once).
        tripped: bool,
    },
}

impl Verdict {
    /// Whether the pass fails the scope's guests.
    pub fn acts(self) -> bool {
        !matches!(self, Verdict::Hold { .. })
    }
}

/// Whether `tally` exceeds `policy`'s share and floor.
pub fn exceeds(policy: &BreakerPolicy, tally: Tally) -> bool {
    tally.would_fail >= policy.min_failures.max(1)
        && tally.would_fail as f64 > policy.share * tally.running as f64
}

/// Decides a scope: `trip` is what earlier passes stored; `new_evidence` says whether this
/// pass looks at newer evidence than the one that last counted (a pass on the same heartbeat
/// does not count twice).
pub fn judge(
    policy: &BreakerPolicy,
    tally: Tally,
    trip: Option<Trip>,
    new_evidence: bool,
) -> Verdict {
    if !exceeds(policy, tally) {
        return Verdict::Act {
            cleared: trip.is_some(),
        };
    }
    let passes = match trip {
        None => 1,
        Some(t) if new_evidence => t.passes.saturating_add(1),
        Some(t) => t.passes,
    };
    match trip {
        Some(t) if t.released => Verdict::ActReleased {
            why: Release::Earlier,
            passes,
        },
        _ if passes >= policy.persist_passes => Verdict::ActReleased {
            why: Release::Persisted,
            passes,
        },
        _ => Verdict::Hold {
            passes,
            tripped: trip.is_none(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: BreakerPolicy = BreakerPolicy {
        share: 0.5,
        min_failures: 3,
        persist_passes: 3,
    };

    fn tally(running: u64, would_fail: u64) -> Tally {
        Tally {
            running,
            would_fail,
        }
    }

    #[test]
    fn failures_up_to_the_share_act_at_once() {
        assert_eq!(
            judge(&POLICY, tally(10, 5), None, true),
            Verdict::Act { cleared: false }
        );
        assert_eq!(
            judge(&POLICY, tally(10, 0), None, true),
            Verdict::Act { cleared: false }
        );
    }

    #[test]
    fn failures_below_the_floor_act_even_when_they_are_all_of_a_host() {
        assert!(judge(&POLICY, tally(2, 2), None, true).acts());
        assert!(!judge(&POLICY, tally(3, 3), None, true).acts());
    }

    #[test]
    fn more_than_the_share_trips_and_holds() {
        assert_eq!(
            judge(&POLICY, tally(10, 6), None, true),
            Verdict::Hold {
                passes: 1,
                tripped: true
            }
        );
    }

    #[test]
    fn a_trip_acts_once_the_evidence_persisted_for_the_configured_passes() {
        let held = Trip {
            passes: 1,
            released: false,
        };
        assert_eq!(
            judge(&POLICY, tally(10, 6), Some(held), true),
            Verdict::Hold {
                passes: 2,
                tripped: false
            }
        );
        let twice = Trip {
            passes: 2,
            released: false,
        };
        assert_eq!(
            judge(&POLICY, tally(10, 6), Some(twice), true),
            Verdict::ActReleased {
                why: Release::Persisted,
                passes: 3
            }
        );
    }

    #[test]
    fn a_pass_on_the_same_evidence_does_not_count_towards_persistence() {
        let twice = Trip {
            passes: 2,
            released: false,
        };
        assert_eq!(
            judge(&POLICY, tally(10, 6), Some(twice), false),
            Verdict::Hold {
                passes: 2,
                tripped: false
            }
        );
    }

    #[test]
    fn a_released_trip_acts_while_the_share_stays_exceeded() {
        let released = Trip {
            passes: 1,
            released: true,
        };
        assert_eq!(
            judge(&POLICY, tally(10, 9), Some(released), false),
            Verdict::ActReleased {
                why: Release::Earlier,
                passes: 1
            }
        );
    }

    #[test]
    fn a_trip_clears_once_the_share_is_no_longer_exceeded() {
        let held = Trip {
            passes: 2,
            released: false,
        };
        assert_eq!(
            judge(&POLICY, tally(10, 1), Some(held), true),
            Verdict::Act { cleared: true }
        );
    }

    #[test]
    fn one_persisting_pass_means_no_hold_and_a_full_share_never_trips() {
        let at_once = BreakerPolicy {
            persist_passes: 1,
            ..POLICY
        };
        assert!(judge(&at_once, tally(10, 10), None, true).acts());
        let never = BreakerPolicy {
            share: 1.0,
            ..POLICY
        };
        assert_eq!(
            judge(&never, tally(10, 10), None, true),
            Verdict::Act { cleared: false }
        );
    }
}
