//! Placement: choose a host for a sandbox and reserve its resources there, inside the caller's
//! transaction.
//!
//! Scoring is spread: the host left with the most headroom (the smaller of its free CPU and
//! free memory fractions after placing) wins, ties broken by host id so the choice is
//! deterministic. Source: the seed lifecycle doc, "Create a sandbox": "One transaction picks a
//! ready host with a recent heartbeat and enough headroom, reserves capacity, and inserts the
//! sandbox row and its command."

use std::time::Duration;

use berth_schemas::wire::Resources;
use berth_schemas::HostId;
use sqlx::{PgConnection, Row};

/// How far placement may reserve beyond a host's physical capacity: sandboxes rarely use all
/// their vCPUs at once, so CPU is overcommitted by default; memory is not (an OOM kill is worse
/// than a refused create).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overcommit {
    pub cpu: f64,
    pub memory: f64,
}

/// Default CPU overcommit ratio.
pub const DEFAULT_CPU_OVERCOMMIT: f64 = 4.0;
/// Default memory overcommit ratio.
pub const DEFAULT_MEMORY_OVERCOMMIT: f64 = 1.0;

impl Default for Overcommit {
    fn default() -> Self {
        Self {
            cpu: DEFAULT_CPU_OVERCOMMIT,
            memory: DEFAULT_MEMORY_OVERCOMMIT,
        }
    }
}

impl Overcommit {
    /// What placement may reserve on a host of `capacity`.
    pub fn limit(&self, capacity: Resources) -> Resources {
        let scale =
            |v: u32, r: f64| (f64::from(v) * r).floor().clamp(0.0, f64::from(u32::MAX)) as u32;
        Resources {
            vcpus: scale(capacity.vcpus, self.cpu),
            memory_mib: scale(capacity.memory_mib, self.memory),
        }
    }
}

/// A host as placement sees it: its reservable capacity (physical capacity times the
/// overcommit ratio) and what is already reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub id: HostId,
    pub capacity: Resources,
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

/// Lists `ready` hosts whose last heartbeat (database clock) is younger than `freshness`, with
/// their capacity scaled by `overcommit`.
pub async fn candidates(
    conn: &mut PgConnection,
    freshness: Duration,
    overcommit: Overcommit,
) -> Result<Vec<Candidate>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, capacity_vcpus, capacity_memory_mib, reserved_vcpus, reserved_memory_mib
           FROM hosts
          WHERE state = 'ready' AND last_seen > now() - make_interval(secs => $1)",
    )
    .bind(freshness.as_secs_f64())
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| Candidate {
            id: r.get("id"),
            capacity: overcommit.limit(Resources {
                vcpus: clamp_u32(r.get::<i32, _>("capacity_vcpus").into()),
                memory_mib: clamp_u32(r.get("capacity_memory_mib")),
            }),
            reserved: Resources {
                vcpus: clamp_u32(r.get::<i32, _>("reserved_vcpus").into()),
                memory_mib: clamp_u32(r.get("reserved_memory_mib")),
            },
        })
        .collect())
}

fn clamp_u32(v: i64) -> u32 {
    u32::try_from(v.max(0)).unwrap_or(u32::MAX)
}

/// Which host states accept a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// A sandbox placed for the first time: only `ready` hosts.
    NewSandbox,
    /// A sandbox whose disk lives on the host (a start): `ready`, `draining` or `cordoned`;
    /// never `lost`.
    ResidentSandbox,
}

/// Reserves `need` on `host` if it still fits and the host admits it (see [`Admit`]). The `UPDATE` takes the
/// host row's lock until the caller's transaction ends and re-checks headroom under it, so two
/// concurrent reservations can never overcommit. Returns whether the reservation was made.
pub async fn reserve(
    conn: &mut PgConnection,
    host: HostId,
    need: Resources,
    overcommit: Overcommit,
    admit: Admit,
) -> Result<bool, sqlx::Error> {
    let states: &[&str] = match admit {
        Admit::NewSandbox => &["ready"],
        Admit::ResidentSandbox => &["ready", "draining", "cordoned"],
    };
    let updated = sqlx::query(
        "UPDATE hosts
            SET reserved_vcpus = reserved_vcpus + $2,
                reserved_memory_mib = reserved_memory_mib + $3
          WHERE id = $1 AND state = ANY($6)
            AND reserved_vcpus + $2 <= floor(capacity_vcpus * $4)
            AND reserved_memory_mib + $3 <= floor(capacity_memory_mib * $5)",
    )
    .bind(host)
    .bind(i32::try_from(need.vcpus).unwrap_or(i32::MAX))
    .bind(i64::from(need.memory_mib))
    .bind(overcommit.cpu)
    .bind(overcommit.memory)
    .bind(states)
    .execute(conn)
    .await?;
    Ok(updated.rows_affected() == 1)
}

/// Releases a reservation made by [`reserve`]. Callers release exactly once, when a sandbox
/// stops holding capacity (its `holds_capacity` flag flips in the same transaction).
pub async fn release(
    conn: &mut PgConnection,
    host: HostId,
    held: Resources,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE hosts
            SET reserved_vcpus = reserved_vcpus - $2,
                reserved_memory_mib = reserved_memory_mib - $3
          WHERE id = $1",
    )
    .bind(host)
    .bind(i32::try_from(held.vcpus).unwrap_or(i32::MAX))
    .bind(i64::from(held.memory_mib))
    .execute(conn)
    .await?;
    Ok(())
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
) -> Result<Option<HostId>, sqlx::Error> {
    let ranked = rank(&candidates(conn, freshness, overcommit).await?, need);
    for &host in &ranked {
        if lock_if_free(conn, host).await?
            && reserve(conn, host, need, overcommit, Admit::NewSandbox).await?
        {
            return Ok(Some(host));
        }
    }
    for host in ranked {
        if reserve(conn, host, need, overcommit, Admit::NewSandbox).await? {
            return Ok(Some(host));
        }
    }
    Ok(None)
}

/// Locks the host's row for the rest of the caller's transaction unless another transaction
/// holds it; whether it is now locked.
async fn lock_if_free(conn: &mut PgConnection, host: HostId) -> Result<bool, sqlx::Error> {
    let locked: Option<HostId> =
        sqlx::query_scalar("SELECT id FROM hosts WHERE id = $1 FOR NO KEY UPDATE SKIP LOCKED")
            .bind(host)
            .fetch_optional(conn)
            .await?;
    Ok(locked.is_some())
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
    fn overcommit_scales_cpu_but_not_memory_by_default() {
        let limit = Overcommit::default().limit(Resources {
            vcpus: 2,
            memory_mib: 1000,
        });
        assert_eq!(
            limit,
            Resources {
                vcpus: 8,
                memory_mib: 1000
            }
        );
    }

    #[test]
    fn ties_are_broken_by_host_id() {
        let a = host(1, (8, 8192), (0, 0));
        let b = host(2, (8, 8192), (0, 0));
        assert_eq!(rank(&[b, a], NEED), vec![a.id, b.id]);
    }
}
