//! The pass's guest failures: `running` sandboxes whose host's inventory shows them gone or
//! not answering become `failed-start` — judged only on evidence, and behind a circuit breaker.
//!
//! # Evidence
//! A host's inventory is evidence about a sandbox only when it was taken (the heartbeat's
//! host-side send time, never later than its arrival) [`PassConfig::inventory_grace`] after
//! the sandbox's last change, after the host applied every command of the sandbox (the
//! heartbeat's `seq` is greater than the one the command's result carried), and while the
//! host's evidence is younger than [`PassConfig::evidence_max_age`]. A host whose newest
//! inventory is older than that is left alone this pass and named in a warning
//! (`berth_reconciler_stale_evidence_hosts`): a lagging heartbeat consumer or a silent host
//! is not a dead guest.
//!
//! # Circuit breaker
//! When more than [`GuestBreaker::host_share`] of a host's running sandboxes (or
//! [`GuestBreaker::fleet_share`] of the fleet's), and at least [`GuestBreaker::min_failures`],
//! would fail at once, the breaker trips ([`berth_schemas::state::breaker::judge`]): the pass
//! fails none of them, logs a warning, counts `berth_reconciler_breaker_trips_total{scope}`,
//! raises a `host.breaker_tripped` host event and stores the trip. The trip acts when the
//! share stayed exceeded on new evidence for [`GuestBreaker::persist_passes`] consecutive
//! passes, or once an operator released it (`berth admin breaker-release`); it is cleared as
//! soon as the share is no longer exceeded. An operator's release of the fleet's trip lets
//! every host act.

use std::collections::{HashMap, HashSet};

use berth_schemas::state::breaker::{judge, Release, Tally, Trip, Verdict};
use berth_schemas::state::on_guest_failure;
use berth_schemas::HostId;
use berth_store::breakers::{self, HostEventType, ReleasedBy, Scope, TripRow, TripWrite};
use berth_store::sandboxes::{self, GuestTally, Judging};
use berth_store::{heartbeats, StoreError};
use sqlx::{PgConnection, PgPool};
use tracing::{info, warn};

use super::{commit, fail_sandbox, fenced, GuestBreaker, PassConfig, PassError, PassReport};
use berth_store::leases::Lease;

/// Fails the guests the evidence shows failed, where the breaker lets it; returns how many.
pub(crate) async fn fail_unhealthy_guests(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
    report: &mut PassReport,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let stale = heartbeats::stale_evidence(&mut tx, config.evidence_max_age).await?;
    for (host, age) in &stale {
        warn!(host_id = %host, evidence_age_seconds = age,
            max_age_seconds = config.evidence_max_age.as_secs_f64(),
            "host's newest inventory is too old to judge by; none of its sandboxes is judged this pass");
    }
    metrics::gauge!("berth_reconciler_stale_evidence_hosts").set(stale.len() as f64);
    report.stale_hosts = stale.len() as u64;

    let judging = Judging {
        grace: config.inventory_grace,
        max_age: config.evidence_max_age,
    };
    let tallies = sandboxes::guest_tallies(&mut tx, judging).await?;
    let trips: HashMap<Scope, TripRow> = breakers::trips(&mut *tx)
        .await?
        .into_iter()
        .map(|t| (t.scope, t))
        .collect();
    let decided = decide(&config.breaker, &tallies, &trips);
    for (scope, verdict, tally, seq) in &decided.verdicts {
        record(&mut tx, *scope, *verdict, *tally, *seq, trips.get(scope)).await?;
    }
    metrics::gauge!("berth_reconciler_breaker_held_sandboxes").set(decided.held as f64);
    report.breaker_held = decided.held;
    if decided.act_on.is_empty() {
        commit(tx).await?;
        return Ok(0);
    }
    let mut n = 0;
    for (row, guest) in
        sandboxes::lock_failed_guests(&mut tx, judging, &decided.act_on, config.batch).await?
    {
        fail_sandbox(&mut tx, &row, on_guest_failure(guest), guest.message()).await?;
        warn!(sandbox_id = %row.id, host_id = ?row.host_id, message = guest.message(), "running sandbox failed");
        n += 1;
    }
    commit(tx).await?;
    Ok(n)
}

/// The breaker's verdicts for one pass.
#[derive(Debug, Default)]
struct Decided {
    /// Every scope's verdict (with its tally and, for a host, the heartbeat `seq` judged) that
    /// has something to store: a trip to write or to clear.
    verdicts: Vec<(Scope, Verdict, Tally, Option<i64>)>,
    /// Hosts whose failing guests the pass fails.
    act_on: Vec<HostId>,
    /// Failing guests held back.
    held: u64,
}

fn stored(trip: Option<&TripRow>) -> Option<Trip> {
    trip.map(|t| Trip {
        passes: t.passes,
        released: t.released.is_some(),
    })
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// Judges the fleet, then every host, from this pass's tallies and the stored trips.
fn decide(
    breaker: &GuestBreaker,
    tallies: &[GuestTally],
    trips: &HashMap<Scope, TripRow>,
) -> Decided {
    let mut out = Decided::default();
    let fleet_tally = Tally {
        running: tallies.iter().map(|t| count(t.running)).sum(),
        would_fail: tallies.iter().map(|t| count(t.would_fail)).sum(),
    };
    // The fleet's evidence is new when a failing host sent a newer heartbeat: its newest
    // `seq` among them stands for the evidence the fleet was judged on.
    let fleet_seq = tallies
        .iter()
        .filter(|t| t.would_fail > 0)
        .map(|t| t.heartbeat_seq)
        .max();
    let fleet_prior = trips.get(&Scope::Fleet);
    let fleet = judge(
        &breaker.fleet(),
        fleet_tally,
        stored(fleet_prior),
        fleet_prior.is_none_or(|p| p.last_seq != fleet_seq),
    );
    out.verdicts
        .push((Scope::Fleet, fleet, fleet_tally, fleet_seq));
    let fleet_released = matches!(fleet, Verdict::ActReleased { .. });
    let mut seen = HashSet::new();
    for t in tallies {
        let scope = Scope::Host(t.host);
        seen.insert(scope);
        let prior = trips.get(&scope);
        let tally = Tally {
            running: count(t.running),
            would_fail: count(t.would_fail),
        };
        let new_evidence = prior.is_none_or(|p| p.last_seq != Some(t.heartbeat_seq));
        let verdict = judge(&breaker.host(), tally, stored(prior), new_evidence);
        out.verdicts
            .push((scope, verdict, tally, Some(t.heartbeat_seq)));
        if tally.would_fail == 0 {
            continue;
        }
        if fleet_released || (fleet.acts() && verdict.acts()) {
            out.act_on.push(t.host);
        } else {
            out.held += tally.would_fail;
        }
    }
    // A host with no running sandbox left (or lost) no longer exceeds anything.
    for scope in trips.keys() {
        if matches!(scope, Scope::Host(_)) && !seen.contains(scope) {
            let none = Tally {
                running: 0,
                would_fail: 0,
            };
            out.verdicts
                .push((*scope, Verdict::Act { cleared: true }, none, None));
        }
    }
    out
}

fn scope_label(scope: Scope) -> &'static str {
    match scope {
        Scope::Host(_) => "host",
        Scope::Fleet => "fleet",
    }
}

/// Stores one scope's verdict: writes or clears its trip, and logs, counts and raises an
/// event when it trips, is released by persistence, or clears.
async fn record(
    conn: &mut PgConnection,
    scope: Scope,
    verdict: Verdict,
    tally: Tally,
    seq: Option<i64>,
    prior: Option<&TripRow>,
) -> Result<(), StoreError> {
    let write = |passes: u32, released_by: Option<ReleasedBy>| TripWrite {
        scope,
        passes,
        seq,
        would_fail: i64::try_from(tally.would_fail).unwrap_or(i64::MAX),
        running: i64::try_from(tally.running).unwrap_or(i64::MAX),
        released_by,
    };
    let label = scope_label(scope);
    match verdict {
        Verdict::Act { cleared: false } => {}
        Verdict::Act { cleared: true } => {
            breakers::clear(conn, scope).await?;
            let message = format!(
                "circuit breaker cleared: {} of {} running sandboxes would fail now",
                tally.would_fail, tally.running
            );
            info!(scope = label, host_id = ?scope.host(), "{message}");
            breakers::insert_event(&mut *conn, scope, HostEventType::BreakerCleared, &message)
                .await?;
        }
        Verdict::ActReleased { why, passes } => {
            let by = (why == Release::Persisted).then_some(ReleasedBy::Persisted);
            breakers::record(conn, &write(passes, by)).await?;
            if prior.is_none_or(|p| p.released.is_none()) {
                let message = format!(
                    "circuit breaker released after {passes} passes: failing {} of {} running sandboxes",
                    tally.would_fail, tally.running
                );
                warn!(scope = label, host_id = ?scope.host(), "{message}");
                breakers::insert_event(&mut *conn, scope, HostEventType::BreakerReleased, &message)
                    .await?;
            }
        }
        Verdict::Hold { passes, tripped } => {
            breakers::record(conn, &write(passes, None)).await?;
            if tripped {
                let message = format!(
                    "circuit breaker tripped: {} of {} running sandboxes would fail at once; holding (release: berth admin breaker-release)",
                    tally.would_fail, tally.running
                );
                warn!(scope = label, host_id = ?scope.host(), "{message}");
                metrics::counter!("berth_reconciler_breaker_trips_total", "scope" => label)
                    .increment(1);
                breakers::insert_event(&mut *conn, scope, HostEventType::BreakerTripped, &message)
                    .await?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(host: HostId, running: i64, would_fail: i64) -> GuestTally {
        GuestTally {
            host,
            heartbeat_seq: 7,
            running,
            would_fail,
        }
    }

    fn breaker() -> GuestBreaker {
        GuestBreaker {
            host_share: 0.5,
            fleet_share: 0.3,
            min_failures: 2,
            persist_passes: 3,
        }
    }

    #[test]
    fn a_host_over_its_share_is_held_while_another_acts() {
        let (a, b) = (HostId::new(), HostId::new());
        let d = decide(
            &breaker(),
            &[tally(a, 10, 8), tally(b, 100, 1)],
            &HashMap::new(),
        );
        assert_eq!(d.act_on, vec![b]);
        assert_eq!(d.held, 8);
    }

    #[test]
    fn a_fleet_over_its_share_holds_every_host() {
        let (a, b) = (HostId::new(), HostId::new());
        let d = decide(
            &breaker(),
            &[tally(a, 10, 4), tally(b, 10, 4)],
            &HashMap::new(),
        );
        assert!(d.act_on.is_empty());
        assert_eq!(d.held, 8);
        assert!(matches!(
            d.verdicts[0],
            (Scope::Fleet, Verdict::Hold { tripped: true, .. }, _, _)
        ));
    }
}
