//! Placement: choose a host for a sandbox and reserve its resources there, inside the caller's
//! transaction. Ranking ([`rank`]) is pure; the reads and the reservation are the store's
//! ([`berth_store::hosts`]).
//!
//! Scoring is spread: the host left with the most headroom (the smaller of its free CPU and
//! free memory fractions after placing) wins, ties broken by host id so the choice is
//! deterministic. Source: the seed lifecycle doc, "Create a sandbox": "One transaction picks a
//! ready host with a recent heartbeat and enough headroom, reserves capacity, and inserts the
//! sandbox row and its command."

use std::time::Duration;

use berth_schemas::wire::Resources;
use berth_schemas::HostId;
use berth_store::{hosts, StoreError};
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

/// Orders the candidates that fit `need`, best first (most headroom after placing; ties by id).
/// Returns an empty list when nothing fits.
pub fn rank(candidates: &[Candidate], need: Resources) -> Vec<HostId> {
    let mut fitting: Vec<&Candidate> = candidates.iter().filter(|c| c.fits(need)).collect();
    fitting.sort_by(|a, b| {
        b.headroom_after(need)
            .total_cmp(&a.headroom_after(need))
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
        })
        .collect())
}

/// Picks and reserves a host for `need` in the caller's transaction: ranks the fresh `ready`
/// hosts and reserves on the first that still fits (another transaction may have taken the
/// headroom meanwhile; then the next is tried). `None` when no host fits.
///
/// A host whose row another transaction holds right now (a concurrent placement on it, or its
/// heartbeat) is passed over for the next in rank rather than waited for: concurrent creates
/// all rank the same emptiest host first, and waiting on its row made them commit one at a
/// time (`berth bench --runtime sim`). Only when every fitting host is busy does placement
/// wait, in rank order.
pub async fn place(
    conn: &mut PgConnection,
    need: Resources,
    freshness: Duration,
    overcommit: Overcommit,
) -> Result<Option<HostId>, StoreError> {
    let ranked = rank(&candidates(conn, freshness, overcommit).await?, need);
    for &host in &ranked {
        if hosts::lock_if_free(conn, host).await?
            && hosts::reserve(conn, host, need, overcommit, Admit::NewSandbox).await?
        {
            return Ok(Some(host));
        }
    }
    for host in ranked {
        if hosts::reserve(conn, host, need, overcommit, Admit::NewSandbox).await? {
            return Ok(Some(host));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn host(n: u8, cap: (u32, u32), reserved: (u32, u32)) -> Candidate {
        Candidate {
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
    fn ties_are_broken_by_host_id() {
        let a = host(1, (8, 8192), (0, 0));
        let b = host(2, (8, 8192), (0, 0));
        assert_eq!(rank(&[b, a], NEED), vec![a.id, b.id]);
    }
}
