//! Placement: choose a host for a sandbox and reserve its resources there, inside the caller's
//! transaction. Ranking ([`rank`]) is pure; the reads and the reservation are the store's
//! ([`berth_store::hosts`]).
//!
//! Scoring is spread: the host left with the most headroom (the smaller of its free CPU and
//! free memory fractions after placing) wins, ties broken by host id so the choice is
//! deterministic. Source: the seed lifecycle doc, "Create a sandbox": "One transaction picks a
//! ready host with a recent heartbeat and enough headroom, reserves capacity, and inserts the
//! sandbox row and its command."
//!
//! Health (issue 12 item 2): only `healthy` hosts are candidates, and a `degraded` or
//! `probing` host once its probe time has passed; such a host ranks first (its probe decides
//! whether it comes back; a probe that fails is retried on another host by the reconciler).
//! When nothing fits, [`place`] tells a fleet that is really full ([`Placement::NoCapacity`])
//! from one whose hosts with room could not be used now ([`Placement::Unavailable`]: stale
//! heartbeats — a control-plane outage leaves every host stale — or degraded hosts), and from
//! one an operator took out of service ([`Placement::HeldOut`]: every host that is not lost is
//! cordoned or draining).
//!
//! Warm pools (issue 16 lever 1): a create ([`place_warm`]) prefers, among hosts equal in
//! eligibility, one holding a warm slot of its shape, so it can take that booted sandbox.

use std::time::Duration;

use berth_schemas::wire::Resources;
use berth_schemas::HostId;
use berth_store::host_health as hosts_health;
use berth_store::{hosts, warm, StoreError};
use sqlx::PgConnection;

pub use berth_store::hosts::{
    Admit, Overcommit, DEFAULT_CPU_OVERCOMMIT, DEFAULT_MEMORY_OVERCOMMIT,
};

/// A host as placement sees it: its reservable capacity (physical capacity times the
/// overcommit ratio) and what is already reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The host (`hosts.id`).
    pub id: HostId,
    /// Reservable capacity: physical vCPUs and MiB times the [`Overcommit`] ratios.
    pub capacity: Resources,
    /// What its capacity-holding sandboxes already reserve (whole vCPUs, MiB).
    pub reserved: Resources,
    /// Not `healthy`, but due its probe: ranks first, and a create placed there is the probe.
    pub probe_due: bool,
    /// Holds a warm slot of the create's shape ([`berth_store::warm`]): ranks before hosts
    /// that hold none, after those due a probe.
    pub warm: bool,
}

impl Candidate {
    fn fits(&self, need: Resources) -> bool {
        u64::from(self.reserved.vcpus) + u64::from(need.vcpus) <= u64::from(self.capacity.vcpus)
            && u64::from(self.reserved.memory_mib) + u64::from(need.memory_mib)
                <= u64::from(self.capacity.memory_mib)
    }

    /// The smaller free fraction (CPU, memory) once `need` is placed, in [0, 1].
    fn headroom_after(&self, need: Resources) -> f64 {
        let free = |cap: u32, used: u32, add: u32| {
            if cap == 0 {
                0.0
            } else {
                (f64::from(cap) - f64::from(used) - f64::from(add)) / f64::from(cap)
            }
        };
        free(self.capacity.vcpus, self.reserved.vcpus, need.vcpus).min(free(
            self.capacity.memory_mib,
            self.reserved.memory_mib,
            need.memory_mib,
        ))
    }
}

/// Orders the candidates that fit `need`, best first: hosts due a probe, then hosts holding a
/// warm slot of the create's shape, then the most headroom after placing; ties by id. Returns
/// an empty list when nothing fits.
pub fn rank(candidates: &[Candidate], need: Resources) -> Vec<HostId> {
    let mut fitting: Vec<&Candidate> = candidates.iter().filter(|c| c.fits(need)).collect();
    fitting.sort_by(|a, b| {
        b.probe_due
            .cmp(&a.probe_due)
            .then(b.warm.cmp(&a.warm))
            .then(b.headroom_after(need).total_cmp(&a.headroom_after(need)))
            .then(a.id.cmp(&b.id))
    });
    fitting.into_iter().map(|c| c.id).collect()
}

/// Lists the hosts that admit new sandboxes and were heard from within `freshness` (database
/// clock), with their capacity scaled by `overcommit`.
pub async fn candidates(
    conn: &mut PgConnection,
    freshness: Duration,
    overcommit: Overcommit,
) -> Result<Vec<Candidate>, StoreError> {
    Ok(hosts::placeable(conn, freshness)
        .await?
        .into_iter()
        .map(|h| Candidate {
            id: h.id,
            capacity: overcommit.limit(h.capacity),
            reserved: h.reserved,
            probe_due: h.probe_due,
            warm: false,
        })
        .collect())
}

/// Where [`place`] put a sandbox, or why it could not.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Placement {
    /// Reserved on this host, in the caller's transaction.
    Placed {
        /// The host.
        host: HostId,
        /// The create placed there is the host's probe (it was degraded and due one).
        probe: bool,
    },
    /// No host in service would fit the sandbox, even with fresh data and good health.
    NoCapacity,
    /// Hosts with room exist, but none could be used now: their heartbeats are older than the
    /// freshness window (they, or the control plane's ingest, fell silent) or they are
    /// degraded. The client should retry after `retry_after`.
    Unavailable {
        /// The hosts with room and a stale heartbeat, and those degraded.
        why: hosts_health::RoomElsewhere,
        /// When a retry may succeed: the earliest probe, or [`UNAVAILABLE_RETRY_AFTER`].
        retry_after: Duration,
    },
    /// No host takes new sandboxes: every host that is not lost is cordoned or draining (an
    /// operator's doing, not a full fleet). The client should retry after `retry_after`
    /// ([`HELD_OUT_RETRY_AFTER`]).
    HeldOut {
        /// How many hosts there are of each state.
        hosts: hosts_health::InService,
        /// When a retry may succeed.
        retry_after: Duration,
    },
}

/// How long a placement refused because every host is cordoned or draining should wait before
/// retrying: an operator's action ends that, so no host's data says when; a retry is cheap.
pub const HELD_OUT_RETRY_AFTER: Duration = Duration::from_secs(30);

/// How long a create refused because the hosts' data is stale should wait before retrying:
/// about a heartbeat interval, after which fresh heartbeats will have been written.
pub const UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(5);

/// Picks and reserves a host for `need` in the caller's transaction: ranks the fresh `ready`
/// hosts that are healthy or due a probe and reserves on the first that still fits (another
/// transaction may have taken the headroom meanwhile; then the next is tried); a host placed
/// on as its probe becomes `probing`. `avoid` is never chosen (the host a failed create is
/// being retried away from). When nothing fits, says whether the fleet is full, only unusable
/// now, or taken out of service (see [`Placement`]).
///
/// A host whose row another transaction holds right now (a concurrent placement on it, or its
/// heartbeat) is passed over for the next in rank rather than waited for: concurrent creates
/// all rank the same emptiest host first, and waiting on its row made them commit one at a
/// time (`berth bench --runtime sim`). Only when every fitting host is busy does placement
/// wait, in rank order. A host due its probe is never passed over: placement waits for it.
pub async fn place(
    conn: &mut PgConnection,
    need: Resources,
    freshness: Duration,
    overcommit: Overcommit,
    avoid: Option<HostId>,
) -> Result<Placement, StoreError> {
    place_preferring(conn, need, freshness, overcommit, avoid, &[]).await
}

/// [`place`] for a create that may take a warm slot (issue 16 lever 1): of the hosts equal in
/// eligibility (a host due its probe still ranks first), those holding a slot of `shape` that
/// [`warm::claim`] would take now rank before the others, whatever their headroom. The caller
/// claims the slot on the chosen host in the same transaction; placement claims nothing.
pub async fn place_warm(
    conn: &mut PgConnection,
    shape: &warm::Shape<'_>,
    freshness: Duration,
    overcommit: Overcommit,
) -> Result<Placement, StoreError> {
    let warm = warm::hosts_with_slot(conn, shape, freshness).await?;
    place_preferring(conn, shape.resources, freshness, overcommit, None, &warm).await
}

/// [`place`], ranking the hosts of `warm` as holding a warm slot ([`Candidate::warm`]).
async fn place_preferring(
    conn: &mut PgConnection,
    need: Resources,
    freshness: Duration,
    overcommit: Overcommit,
    avoid: Option<HostId>,
    warm: &[HostId],
) -> Result<Placement, StoreError> {
    let candidates: Vec<Candidate> = candidates(conn, freshness, overcommit)
        .await?
        .into_iter()
        .filter(|c| Some(c.id) != avoid)
        .map(|c| Candidate {
            warm: warm.contains(&c.id),
            ..c
        })
        .collect();
    let ranked = rank(&candidates, need);
    let probe_due = |host: HostId| candidates.iter().any(|c| c.id == host && c.probe_due);
    let mut chosen = None;
    for &host in &ranked {
        // A host due its probe is waited for, never passed over as busy: probes are rare,
        // and only a probe brings a degraded host back.
        let free = probe_due(host) || hosts::lock_if_free(conn, host).await?;
        if free && hosts::reserve(conn, host, need, overcommit, Admit::NewSandbox).await? {
            chosen = Some(host);
            break;
        }
    }
    if chosen.is_none() {
        for &host in &ranked {
            if hosts::reserve(conn, host, need, overcommit, Admit::NewSandbox).await? {
                chosen = Some(host);
                break;
            }
        }
    }
    if let Some(host) = chosen {
        let probe = probe_due(host);
        if probe {
            hosts_health::probe_placed(conn, host).await?;
        }
        return Ok(Placement::Placed { host, probe });
    }
    let why = hosts_health::room_elsewhere(conn, need, freshness, overcommit).await?;
    if !why.any() {
        let hosts = hosts_health::in_service(conn).await?;
        if hosts.held_out() {
            return Ok(Placement::HeldOut {
                hosts,
                retry_after: HELD_OUT_RETRY_AFTER,
            });
        }
        return Ok(Placement::NoCapacity);
    }
    let retry_after = match (why.stale, why.next_probe_in) {
        (0, Some(secs)) => Duration::from_secs_f64(secs.ceil().max(1.0)),
        _ => UNAVAILABLE_RETRY_AFTER,
    };
    Ok(Placement::Unavailable { why, retry_after })
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn host(n: u8, cap: (u32, u32), reserved: (u32, u32)) -> Candidate {
        Candidate {
            probe_due: false,
            warm: false,
            id: HostId(Uuid::from_bytes([n; 16])),
            capacity: Resources {
                vcpus: cap.0,
                memory_mib: cap.1,
            },
            reserved: Resources {
                vcpus: reserved.0,
                memory_mib: reserved.1,
            },
        }
    }

    const NEED: Resources = Resources {
        vcpus: 2,
        memory_mib: 1024,
    };

    #[test]
    fn a_host_without_headroom_is_never_ranked() {
        let full_cpu = host(1, (4, 8192), (3, 0));
        let full_mem = host(2, (4, 8192), (0, 7500));
        assert!(rank(&[full_cpu, full_mem], NEED).is_empty());
    }

    #[test]
    fn an_exact_fit_is_allowed() {
        let exact = host(1, (4, 2048), (2, 1024));
        assert_eq!(rank(&[exact], NEED), vec![exact.id]);
    }

    #[test]
    fn placement_spreads_to_the_emptiest_host() {
        let busy = host(1, (8, 16384), (6, 1024));
        let idle = host(2, (8, 16384), (0, 0));
        let mem_busy = host(3, (8, 16384), (0, 14000));
        assert_eq!(
            rank(&[busy, idle, mem_busy], NEED),
            vec![idle.id, mem_busy.id, busy.id]
        );
    }

    #[test]
    fn a_host_due_its_probe_ranks_first_if_it_fits() {
        let idle = host(1, (8, 16384), (0, 0));
        let probe = Candidate {
            probe_due: true,
            ..host(2, (8, 16384), (6, 8192))
        };
        let full_probe = Candidate {
            probe_due: true,
            ..host(3, (2, 1024), (2, 1024))
        };
        assert_eq!(
            rank(&[idle, probe, full_probe], NEED),
            vec![probe.id, idle.id]
        );
    }

    #[test]
    fn a_host_holding_a_warm_slot_ranks_before_emptier_hosts_but_after_a_probe() {
        let idle = host(1, (8, 16384), (0, 0));
        let warm = Candidate {
            warm: true,
            ..host(2, (8, 16384), (6, 8192))
        };
        let probe = Candidate {
            probe_due: true,
            ..host(3, (8, 16384), (4, 4096))
        };
        let full_warm = Candidate {
            warm: true,
            ..host(4, (2, 1024), (2, 1024))
        };
        assert_eq!(
            rank(&[idle, warm, probe, full_warm], NEED),
            vec![probe.id, warm.id, idle.id]
        );
    }

    #[test]
    fn ties_are_broken_by_host_id() {
        let a = host(1, (8, 8192), (0, 0));
        let b = host(2, (8, 8192), (0, 0));
        assert_eq!(rank(&[b, a], NEED), vec![a.id, b.id]);
    }
}
