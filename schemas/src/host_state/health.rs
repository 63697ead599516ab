//! A host's health, judged from the outcomes of the creates and starts it ran (issue 12 item 2):
//! `healthy`, `degraded`, `probing`. It is a condition beside the [`super::HostState`] (which
//! operators and heartbeats decide): a host whose heartbeats are perfect but whose runtime
//! fails or hangs on `run` stays `ready` and becomes `degraded`.
//!
//! - `healthy`: placement chooses it as usual. Each create or start it fails (the host's
//!   fault, not the request's: see [`crate::state::Fault`]), never answers in time, or boots
//!   slower than [`HealthPolicy::slow_boot`] counts one; [`HealthPolicy::degrade_after`]
//!   consecutive ones make it `degraded`. A good boot resets the count.
//! - `degraded`: placement avoids it until its probe time (now + its back-off, first
//!   [`HealthPolicy::initial_backoff`]). Once that has passed, placement puts the next create
//!   there — the probe — and the host is `probing`. Its own sandboxes still start there (their
//!   disks live there), and a good boot of one of them makes it `healthy` too.
//! - `probing`: placement avoids it while the probe is out. The probe's good boot makes it
//!   `healthy`; a bad one makes it `degraded` again with its back-off doubled (at most
//!   [`HealthPolicy::max_backoff`]). A probe that never reports (deleted before its result)
//!   lets another probe go after one back-off.
//!
//! Pure: the store writes what [`HostHealth::on`] decides.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::state::UnknownState;

/// Default [`HealthPolicy::degrade_after`]: consecutive bad boots that make a host `degraded`.
pub const DEFAULT_DEGRADE_AFTER: u32 = 3;
/// Default [`HealthPolicy::initial_backoff`]: how long a newly degraded host waits for its
/// first probe.
pub const DEFAULT_INITIAL_BACKOFF: Duration = Duration::from_secs(30);
/// Default [`HealthPolicy::max_backoff`]: the longest wait between probes.
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(600);
/// Default [`HealthPolicy::slow_boot`]: a create or start that took its host this long (the
/// runtime call plus the agent's boot, as the host reports it in its result's `apply_ms`)
/// counts as a bad boot even though it succeeded.
pub const DEFAULT_SLOW_BOOT: Duration = Duration::from_secs(60);

/// When a host counts as unhealthy and how it comes back (operator settings: `berth
/// reconciler --host-degrade-after …`, see the README's Configuration table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthPolicy {
    /// Consecutive bad boots (failed, timed out or slow) that make a `healthy` host
    /// `degraded` ([`DEFAULT_DEGRADE_AFTER`]; at least 1).
    pub degrade_after: u32,
    /// The first back-off before a degraded host gets its probe ([`DEFAULT_INITIAL_BACKOFF`]).
    pub initial_backoff: Duration,
    /// The longest back-off; each failed probe doubles it up to this ([`DEFAULT_MAX_BACKOFF`]).
    pub max_backoff: Duration,
    /// A successful boot slower than this counts as a bad one ([`DEFAULT_SLOW_BOOT`]).
    pub slow_boot: Duration,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            degrade_after: DEFAULT_DEGRADE_AFTER,
            initial_backoff: DEFAULT_INITIAL_BACKOFF,
            max_backoff: DEFAULT_MAX_BACKOFF,
            slow_boot: DEFAULT_SLOW_BOOT,
        }
    }
}

/// A host's condition, as the `hosts.health` column and `/v1/hosts` spell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostCondition {
    /// Placement chooses it as usual.
    Healthy,
    /// Too many bad boots in a row: placement avoids it until its probe time.
    Degraded,
    /// Its probe create is out: placement avoids it until the probe reports (or one back-off
    /// passes without a report).
    Probing,
}

impl HostCondition {
    /// Every condition.
    pub const ALL: [HostCondition; 3] = [
        HostCondition::Healthy,
        HostCondition::Degraded,
        HostCondition::Probing,
    ];

    /// The database and API spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            HostCondition::Healthy => "healthy",
            HostCondition::Degraded => "degraded",
            HostCondition::Probing => "probing",
        }
    }

    /// Whether placement may choose the host: always when `healthy`; otherwise only for a
    /// probe, once `probe_due` (its probe time has passed).
    pub fn admits_new_sandboxes(self, probe_due: bool) -> bool {
        match self {
            HostCondition::Healthy => true,
            HostCondition::Degraded | HostCondition::Probing => probe_due,
        }
    }
}

/// What happened on a host that bears on its health.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HealthEvent {
    /// A create or start succeeded within [`HealthPolicy::slow_boot`].
    Booted,
    /// A create or start succeeded, but slower than [`HealthPolicy::slow_boot`].
    Slow,
    /// The host failed a create or start by its own fault (its runtime, its network, its
    /// agent), not the request's.
    Failed,
    /// A create or start the host never answered within its command timeout.
    TimedOut,
    /// Placement put a create on the host as its probe (its probe time had passed).
    ProbePlaced,
}

impl HealthEvent {
    /// Every event.
    pub const ALL: [HealthEvent; 5] = [
        HealthEvent::Booted,
        HealthEvent::Slow,
        HealthEvent::Failed,
        HealthEvent::TimedOut,
        HealthEvent::ProbePlaced,
    ];

    /// The event of a successful boot that took `elapsed` (command published → result).
    pub fn of_boot(elapsed: Duration, policy: &HealthPolicy) -> HealthEvent {
        if elapsed > policy.slow_boot {
            HealthEvent::Slow
        } else {
            HealthEvent::Booted
        }
    }

    /// Whether the event counts against the host.
    pub fn is_bad(self) -> bool {
        matches!(
            self,
            HealthEvent::Slow | HealthEvent::Failed | HealthEvent::TimedOut
        )
    }

    /// The event's name (`booted`, `failed`, …): a metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            HealthEvent::Booted => "booted",
            HealthEvent::Slow => "slow",
            HealthEvent::Failed => "failed",
            HealthEvent::TimedOut => "timed_out",
            HealthEvent::ProbePlaced => "probe_placed",
        }
    }
}

/// A host's health as stored (`hosts.health`, `health_failures`, `health_backoff_ms`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostHealth {
    /// Its condition.
    pub condition: HostCondition,
    /// Bad boots in a row since the last good one.
    pub failures: u32,
    /// The back-off in force while not `healthy` (zero when `healthy`).
    pub backoff: Duration,
}

/// What [`HostHealth::on`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthChange {
    /// The health to write.
    pub health: HostHealth,
    /// `Some(d)`: the next probe may go `d` from now (write `probe_at = now + d`); `None`:
    /// keep the probe time as it is (cleared when `healthy`).
    pub probe_in: Option<Duration>,
}

impl HostHealth {
    /// A host with no history.
    pub const HEALTHY: HostHealth = HostHealth {
        condition: HostCondition::Healthy,
        failures: 0,
        backoff: Duration::ZERO,
    };

    /// The health after `event`. Total: every (condition, event) pair has an answer.
    pub fn on(self, event: HealthEvent, policy: &HealthPolicy) -> HealthChange {
        use HealthEvent as E;
        use HostCondition as C;
        let failures = self.failures.saturating_add(1);
        let keep = |health| HealthChange {
            health,
            probe_in: None,
        };
        let degraded = |backoff: Duration| HealthChange {
            health: HostHealth {
                condition: C::Degraded,
                failures,
                backoff,
            },
            probe_in: Some(backoff),
        };
        match (self.condition, event) {
            (_, E::Booted) => keep(HostHealth::HEALTHY),
            (C::Healthy, E::Slow | E::Failed | E::TimedOut) => {
                if failures >= policy.degrade_after.max(1) {
                    degraded(policy.initial_backoff.min(policy.max_backoff))
                } else {
                    keep(HostHealth { failures, ..self })
                }
            }
            // A race with a good boot: the host is healthy again, the create goes as any.
            (C::Healthy, E::ProbePlaced) => keep(self),
            // More bad news while it waits: counted; the probe time stays.
            (C::Degraded, E::Slow | E::Failed | E::TimedOut) => {
                keep(HostHealth { failures, ..self })
            }
            (C::Degraded | C::Probing, E::ProbePlaced) => HealthChange {
                health: HostHealth {
                    condition: C::Probing,
                    ..self
                },
                probe_in: Some(self.backoff),
            },
            (C::Probing, E::Slow | E::Failed | E::TimedOut) => degraded(
                self.backoff
                    .saturating_mul(2)
                    .max(policy.initial_backoff)
                    .min(policy.max_backoff),
            ),
        }
    }
}

impl fmt::Display for HostCondition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for HealthEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HostCondition {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        HostCondition::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use HealthEvent as E;
    use HostCondition as C;

    const POLICY: HealthPolicy = HealthPolicy {
        degrade_after: 3,
        initial_backoff: Duration::from_secs(10),
        max_backoff: Duration::from_secs(35),
        slow_boot: Duration::from_secs(60),
    };

    fn health(condition: C, failures: u32, backoff_secs: u64) -> HostHealth {
        HostHealth {
            condition,
            failures,
            backoff: Duration::from_secs(backoff_secs),
        }
    }

    /// A starting health, and for each event of [`HealthEvent::ALL`] the health after and the
    /// probe delay written.
    type Row = (HostHealth, [(HostHealth, Option<Duration>); 5]);

    /// Every (condition, event) pair, from a host with one failure and a 20 s back-off (a
    /// healthy host has none): the health after, and the probe delay written.
    #[test]
    fn every_health_event_follows_the_table() {
        let secs = |s| Some(Duration::from_secs(s));
        let healthy = HostHealth::HEALTHY;
        #[rustfmt::skip]
        let table: [Row; 3] = [
            //   booted           slow                     failed                  timed out               probe placed
            (health(C::Healthy, 1, 0), [
                (healthy, None), (health(C::Healthy, 2, 0), None), (health(C::Healthy, 2, 0), None),
                (health(C::Healthy, 2, 0), None), (health(C::Healthy, 1, 0), None)]),
            (health(C::Degraded, 1, 20), [
                (healthy, None), (health(C::Degraded, 2, 20), None), (health(C::Degraded, 2, 20), None),
                (health(C::Degraded, 2, 20), None), (health(C::Probing, 1, 20), secs(20))]),
            (health(C::Probing, 1, 20), [
                // Doubled to 40 s, capped at the 35 s maximum.
                (healthy, None), (health(C::Degraded, 2, 35), secs(35)), (health(C::Degraded, 2, 35), secs(35)),
                (health(C::Degraded, 2, 35), secs(35)), (health(C::Probing, 1, 20), secs(20))]),
        ];
        assert_eq!(table.len(), C::ALL.len());
        for (from, row) in table {
            for (event, (to, probe_in)) in E::ALL.into_iter().zip(row) {
                let change = from.on(event, &POLICY);
                assert_eq!(change.health, to, "{event} in {from:?}");
                assert_eq!(change.probe_in, probe_in, "{event} in {from:?}");
            }
        }
    }

    #[test]
    fn the_third_bad_boot_in_a_row_degrades_with_the_initial_backoff() {
        let mut h = HostHealth::HEALTHY;
        for event in [E::Failed, E::TimedOut] {
            h = h.on(event, &POLICY).health;
            assert_eq!(h.condition, C::Healthy);
        }
        let change = h.on(E::Slow, &POLICY);
        assert_eq!(change.health, health(C::Degraded, 3, 10));
        assert_eq!(change.probe_in, Some(Duration::from_secs(10)));
    }

    #[test]
    fn a_good_boot_between_failures_resets_the_count() {
        let mut h = HostHealth::HEALTHY;
        for event in [E::Failed, E::Failed, E::Booted, E::Failed, E::Failed] {
            h = h.on(event, &POLICY).health;
        }
        assert_eq!(h, health(C::Healthy, 2, 0));
    }

    #[test]
    fn failed_probes_double_the_backoff_up_to_the_cap_and_a_good_probe_heals() {
        let mut h = health(C::Degraded, 3, 10);
        let mut waits = Vec::new();
        for _ in 0..3 {
            h = h.on(E::ProbePlaced, &POLICY).health;
            assert_eq!(h.condition, C::Probing);
            let change = h.on(E::Failed, &POLICY);
            waits.push(change.probe_in.unwrap().as_secs());
            h = change.health;
        }
        assert_eq!(waits, [20, 35, 35]);
        let h = h.on(E::ProbePlaced, &POLICY).health;
        assert_eq!(h.on(E::Booted, &POLICY).health, HostHealth::HEALTHY);
    }

    #[test]
    fn degrade_after_zero_is_read_as_one_and_backoff_never_exceeds_the_cap() {
        let policy = HealthPolicy {
            degrade_after: 0,
            initial_backoff: Duration::from_secs(100),
            ..POLICY
        };
        let change = HostHealth::HEALTHY.on(E::Failed, &policy);
        assert_eq!(change.health.condition, C::Degraded);
        assert_eq!(change.probe_in, Some(POLICY.max_backoff));
    }

    #[test]
    fn only_a_healthy_host_or_a_due_probe_is_placed_on() {
        for c in C::ALL {
            assert!(c.admits_new_sandboxes(true));
            assert_eq!(c.admits_new_sandboxes(false), c == C::Healthy);
            assert_eq!(c.as_str().parse::<C>().unwrap(), c);
        }
        assert!("sick".parse::<C>().is_err());
    }

    #[test]
    fn a_boot_slower_than_the_threshold_is_slow() {
        assert_eq!(
            HealthEvent::of_boot(Duration::from_secs(60), &POLICY),
            E::Booted
        );
        assert_eq!(
            HealthEvent::of_boot(Duration::from_secs(61), &POLICY),
            E::Slow
        );
        assert!(E::ALL.iter().filter(|e| e.is_bad()).count() == 3);
    }
}
