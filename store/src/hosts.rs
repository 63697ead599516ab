//! The `hosts` table: rows kept current by heartbeats (on the database clock), the host state
//! machine's writes ([`HostState::on`]), capacity reservations, and the inventory hosts report.
//!
//! # Guarantees
//! - A reservation never takes a host past its capacity: [`reserve`]'s `UPDATE` re-checks
//!   headroom under the row lock, so concurrent reservations on one host serialize.
//! - Every state write goes through [`HostState::on`]: the `UPDATE` accepts exactly the source
//!   states the state machine allows ([`HostState::sources`]).

use std::time::Duration;

use berth_schemas::state::UNWANTED_RUNNING_ON_ITS_HOST;
use berth_schemas::wire::{Heartbeat, Resources, SandboxSpec};
use berth_schemas::{Generation, HostEvent, HostId, HostState, SandboxId, SandboxState};
use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgExecutor, Row};

use crate::op::{timed, Op};
use crate::sandboxes::resources;
use crate::StoreError;

/// How far reservations may go beyond a host's physical capacity: sandboxes rarely use all
/// their vCPUs at once, so CPU is overcommitted by default; memory is not (an OOM kill is worse
/// than a refused create).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overcommit {
    /// vCPUs that may be reserved per physical vCPU ([`DEFAULT_CPU_OVERCOMMIT`] = 4.0).
    pub cpu: f64,
    /// MiB that may be reserved per physical MiB ([`DEFAULT_MEMORY_OVERCOMMIT`] = 1.0: none).
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
    /// What may be reserved on a host of `capacity`.
    pub fn limit(&self, capacity: Resources) -> Resources {
        let scale =
            |v: u32, r: f64| (f64::from(v) * r).floor().clamp(0.0, f64::from(u32::MAX)) as u32;
        Resources {
            vcpus: scale(capacity.vcpus, self.cpu),
            memory_mib: scale(capacity.memory_mib, self.memory),
        }
    }
}

/// Which host states accept a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// A sandbox placed for the first time ([`HostState::admits_new_sandboxes`]).
    NewSandbox,
    /// A sandbox whose disk lives on the host, starting again
    /// ([`HostState::admits_resident_sandboxes`]).
    ResidentSandbox,
}

impl Admit {
    pub(crate) fn states(self) -> Vec<&'static str> {
        HostState::ALL
            .into_iter()
            .filter(|s| match self {
                Admit::NewSandbox => s.admits_new_sandboxes(),
                Admit::ResidentSandbox => s.admits_resident_sandboxes(),
            })
            .map(HostState::as_str)
            .collect()
    }
}

fn states_str(states: Vec<HostState>) -> Vec<&'static str> {
    states.into_iter().map(HostState::as_str).collect()
}

/// `integer`/`bigint` capacity columns as a `u32` (negative reads as 0).
fn clamp_u32(v: i64) -> u32 {
    u32::try_from(v.max(0)).unwrap_or(u32::MAX)
}

fn host_resources(vcpus: i32, memory_mib: i64) -> Resources {
    Resources {
        vcpus: clamp_u32(vcpus.into()),
        memory_mib: clamp_u32(memory_mib),
    }
}

/// Where `host`'s port forwarder listens (`ip:port`, from its last heartbeat); `None` when
/// the host is unknown or runs none.
pub async fn forwarder(
    db: impl PgExecutor<'_>,
    host: HostId,
) -> Result<Option<String>, StoreError> {
    let found: Option<(Option<String>,)> = timed(
        Op::HostForwarder,
        sqlx::query_as("SELECT forwarder FROM hosts WHERE id = $1")
            .bind(host)
            .fetch_optional(db),
    )
    .await?;
    Ok(found.and_then(|(f,)| f))
}

/// Upserts the host's row from one heartbeat: [`crate::heartbeats::upsert`] of a batch of
/// one (the newest heartbeat wins; `last_seen` on the database clock). The state follows
/// [`HostEvent::Heartbeat`]: a `lost` host that speaks again is `ready`; `draining` and
/// `cordoned` are operator decisions and stay.
pub async fn upsert_heartbeat(db: impl PgExecutor<'_>, hb: &Heartbeat) -> Result<(), StoreError> {
    crate::heartbeats::upsert(db, std::slice::from_ref(hb)).await?;
    Ok(())
}

/// A host's physical capacity and what is reserved on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostCapacity {
    /// The host (`hosts.id`).
    pub id: HostId,
    /// Physical capacity as the host reports it (whole vCPUs, MiB), before overcommit.
    pub capacity: Resources,
    /// The sum of the resources of its sandboxes that hold capacity (guarantee 4).
    pub reserved: Resources,
    /// The host is not `healthy` but due its probe ([`crate::host_health`]): a create placed
    /// there is the probe.
    pub probe_due: bool,
}

/// Lists hosts that admit new sandboxes, were heard from within `freshness` (database
/// clock), and are `healthy` or due a probe ([`berth_schemas::HostCondition::admits_new_sandboxes`]).
pub async fn placeable(
    conn: &mut PgConnection,
    freshness: Duration,
) -> Result<Vec<HostCapacity>, StoreError> {
    let rows = timed(
        Op::HostCandidates,
        sqlx::query(
            "SELECT id, capacity_vcpus, capacity_memory_mib, reserved_vcpus, reserved_memory_mib,
                    health <> $3 AS probe_due
               FROM hosts
              WHERE state = ANY($1) AND last_seen > now() - make_interval(secs => $2)
                AND (health = $3 OR probe_at <= now())",
        )
        .bind(Admit::NewSandbox.states())
        .bind(freshness.as_secs_f64())
        .bind(berth_schemas::HostCondition::Healthy.as_str())
        .fetch_all(conn),
    )
    .await?;
    rows.iter()
        .map(|r| {
            let get = StoreError::database(Op::HostCandidates);
            Ok(HostCapacity {
                id: r.try_get("id").map_err(get)?,
                capacity: host_resources(
                    r.try_get("capacity_vcpus").map_err(get)?,
                    r.try_get("capacity_memory_mib").map_err(get)?,
                ),
                reserved: host_resources(
                    r.try_get("reserved_vcpus").map_err(get)?,
                    r.try_get("reserved_memory_mib").map_err(get)?,
                ),
                probe_due: r.try_get("probe_due").map_err(get)?,
            })
        })
        .collect()
}

/// Locks the host's row for the rest of the caller's transaction unless another transaction
/// holds it; whether it is now locked.
pub async fn lock_if_free(conn: &mut PgConnection, host: HostId) -> Result<bool, StoreError> {
    let locked: Option<HostId> = timed(
        Op::HostLock,
        sqlx::query_scalar("SELECT id FROM hosts WHERE id = $1 FOR NO KEY UPDATE SKIP LOCKED")
            .bind(host)
            .fetch_optional(conn),
    )
    .await?;
    Ok(locked.is_some())
}

/// Reserves `need` on `host` if it still fits within `overcommit` and the host admits it (see
/// [`Admit`]). The `UPDATE` takes the host row's lock until the caller's transaction ends and
/// re-checks headroom under it. Returns whether the reservation was made.
///
/// Only the store's capacity paths and placement call this: a reservation is always paired
/// with a sandbox that holds it in the same transaction (guarantee 4).
pub async fn reserve(
    conn: &mut PgConnection,
    host: HostId,
    need: Resources,
    overcommit: Overcommit,
    admit: Admit,
) -> Result<bool, StoreError> {
    let updated = timed(
        Op::HostReserve,
        sqlx::query(
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
        .bind(admit.states())
        .execute(conn),
    )
    .await?;
    Ok(updated.rows_affected() == 1)
}

/// Releases a reservation made by [`reserve`]. Only [`crate::sandboxes`] calls it, when a
/// sandbox stops holding capacity in the same transaction.
pub(crate) async fn release(
    conn: &mut PgConnection,
    host: HostId,
    held: Resources,
) -> Result<(), StoreError> {
    timed(
        Op::HostRelease,
        sqlx::query(
            "UPDATE hosts
                SET reserved_vcpus = reserved_vcpus - $2,
                    reserved_memory_mib = reserved_memory_mib - $3
              WHERE id = $1",
        )
        .bind(host)
        .bind(i32::try_from(held.vcpus).unwrap_or(i32::MAX))
        .bind(i64::from(held.memory_mib))
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// How many hosts are in service (not `lost`), and how many of those were heard from within
/// `window`: (alive, in_service).
pub async fn liveness(db: impl PgExecutor<'_>, window: Duration) -> Result<(i64, i64), StoreError> {
    timed(
        Op::HostLiveness,
        sqlx::query_as(
            "SELECT count(*) FILTER (WHERE last_seen > now() - make_interval(secs => $1)),
                    count(*)
               FROM hosts WHERE state <> $2",
        )
        .bind(window.as_secs_f64())
        .bind(HostState::Lost.as_str())
        .fetch_one(db),
    )
    .await
}

/// Marks `lost` ([`HostEvent::Silent`]) every host not heard from within `silent_for`; returns
/// their ids.
pub async fn mark_silent_lost(
    conn: &mut PgConnection,
    silent_for: Duration,
) -> Result<Vec<HostId>, StoreError> {
    let from: Vec<HostState> = HostState::sources(HostEvent::Silent, HostState::Lost)
        .into_iter()
        .filter(|s| *s != HostState::Lost)
        .collect();
    timed(
        Op::HostMarkLost,
        sqlx::query_scalar(
            "UPDATE hosts SET state = $3, state_changed_at = now()
              WHERE state = ANY($1) AND last_seen < now() - make_interval(secs => $2)
              RETURNING id",
        )
        .bind(states_str(from))
        .bind(silent_for.as_secs_f64())
        .bind(HostState::Lost.as_str())
        .fetch_all(conn),
    )
    .await
}

/// A host as operators see it.
#[derive(Debug, Clone, PartialEq)]
pub struct HostRow {
    /// The host's id (`hosts.id`, chosen by hostd).
    pub id: HostId,
    /// The name hostd is configured with, from its last heartbeat.
    pub name: String,
    /// `ready`, `draining`, `cordoned` or `lost` (`hosts.state`).
    pub state: HostState,
    /// Physical capacity (whole vCPUs, MiB), before overcommit.
    pub capacity: Resources,
    /// Reserved by the sandboxes that hold capacity there (whole vCPUs, MiB).
    pub reserved: Resources,
    /// The OCI runtimes the host offers (`runc`, `runsc`), from its last heartbeat.
    pub runtimes: Vec<String>,
    /// Whether any of its runtimes can keep memory on stop (checkpoint); else stops are disk-only.
    pub memory_snapshot: bool,
    /// Sandboxes holding capacity there.
    pub sandboxes: i64,
    /// When its last heartbeat arrived (`hosts.last_seen`, database clock).
    pub last_seen: DateTime<Utc>,
    /// Seconds since `last_seen`, on the database clock.
    pub heartbeat_age_seconds: f64,
}

const HOST_SELECT: &str = "SELECT h.id, h.name, h.state, h.capacity_vcpus, h.capacity_memory_mib,
        h.reserved_vcpus, h.reserved_memory_mib, h.runtimes, h.memory_snapshot, h.last_seen,
        GREATEST(EXTRACT(EPOCH FROM now() - h.last_seen), 0)::float8 AS age,
        (SELECT count(*) FROM sandboxes s WHERE s.host_id = h.id AND s.holds_capacity) AS sandboxes
   FROM hosts h";

impl HostRow {
    fn from_row(r: &PgRow) -> Result<Self, StoreError> {
        let get = StoreError::database(Op::HostList);
        let state: String = r.try_get("state").map_err(get)?;
        Ok(HostRow {
            id: r.try_get("id").map_err(get)?,
            name: r.try_get("name").map_err(get)?,
            state: state.parse().map_err(|e| StoreError::Corrupt {
                column: "hosts.state",
                message: format!("{e}"),
            })?,
            capacity: host_resources(
                r.try_get("capacity_vcpus").map_err(get)?,
                r.try_get("capacity_memory_mib").map_err(get)?,
            ),
            reserved: host_resources(
                r.try_get("reserved_vcpus").map_err(get)?,
                r.try_get("reserved_memory_mib").map_err(get)?,
            ),
            runtimes: r.try_get("runtimes").map_err(get)?,
            memory_snapshot: r.try_get("memory_snapshot").map_err(get)?,
            sandboxes: r.try_get("sandboxes").map_err(get)?,
            last_seen: r.try_get("last_seen").map_err(get)?,
            heartbeat_age_seconds: r.try_get("age").map_err(get)?,
        })
    }
}

/// A registered host ([`register`]): admitted to send heartbeats; `nkey` is the public key of
/// its NATS credentials, when some were issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The host.
    pub host_id: HostId,
    /// Its public NATS nkey (`U…`), or `None` (registered without NATS credentials).
    pub nkey: Option<String>,
}

/// Registers `host` (table `host_registrations`), or re-registers it with a new `nkey` (the
/// old key is forgotten: issuing new credentials rotates them). Idempotent for the same pair.
///
/// Errors: [`StoreError`] (also when `nkey` is already another host's: a unique violation).
pub async fn register(
    db: impl PgExecutor<'_>,
    host: HostId,
    nkey: Option<&str>,
) -> Result<(), StoreError> {
    timed(
        Op::HostRegister,
        sqlx::query(
            "INSERT INTO host_registrations (host_id, nkey) VALUES ($1, $2)
             ON CONFLICT (host_id) DO UPDATE SET nkey = COALESCE(EXCLUDED.nkey, host_registrations.nkey)",
        )
        .bind(host)
        .bind(nkey)
        .execute(db),
    )
    .await?;
    Ok(())
}

/// Forgets `host`'s registration (its heartbeats are dropped from now on, and the next
/// rendered NATS user list leaves its key out). Returns whether it was registered.
///
/// Errors: [`StoreError`].
pub async fn unregister(db: impl PgExecutor<'_>, host: HostId) -> Result<bool, StoreError> {
    let done = timed(
        Op::HostRegister,
        sqlx::query("DELETE FROM host_registrations WHERE host_id = $1")
            .bind(host)
            .execute(db),
    )
    .await?;
    Ok(done.rows_affected() > 0)
}

/// Which of `hosts` are registered (one query for a batch of heartbeats).
///
/// Errors: [`StoreError`].
pub async fn registered(
    db: impl PgExecutor<'_>,
    hosts: &[HostId],
) -> Result<std::collections::HashSet<HostId>, StoreError> {
    let ids: Vec<uuid::Uuid> = hosts.iter().map(|h| h.as_uuid()).collect();
    let rows: Vec<uuid::Uuid> = timed(
        Op::HostRegistered,
        sqlx::query_scalar("SELECT host_id FROM host_registrations WHERE host_id = ANY($1)")
            .bind(&ids)
            .fetch_all(db),
    )
    .await?;
    Ok(rows.into_iter().map(HostId).collect())
}

/// Every registration, oldest first (what the NATS server's user list is rendered from).
///
/// Errors: [`StoreError`].
pub async fn registrations(db: impl PgExecutor<'_>) -> Result<Vec<Registration>, StoreError> {
    let rows: Vec<(uuid::Uuid, Option<String>)> = timed(
        Op::HostRegistered,
        sqlx::query_as(
            "SELECT host_id, nkey FROM host_registrations ORDER BY registered_at, host_id",
        )
        .fetch_all(db),
    )
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, nkey)| Registration {
            host_id: HostId(id),
            nkey,
        })
        .collect())
}

/// Every host, by name.
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<HostRow>, StoreError> {
    let rows = timed(
        Op::HostList,
        sqlx::query(&format!("{HOST_SELECT} ORDER BY h.name, h.id")).fetch_all(db),
    )
    .await?;
    rows.iter().map(HostRow::from_row).collect()
}

/// One host, or `None`.
pub async fn get(db: impl PgExecutor<'_>, id: HostId) -> Result<Option<HostRow>, StoreError> {
    let row = timed(
        Op::HostList,
        sqlx::query(&format!("{HOST_SELECT} WHERE h.id = $1"))
            .bind(id)
            .fetch_optional(db),
    )
    .await?;
    row.as_ref().map(HostRow::from_row).transpose()
}

/// What [`apply_event`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum HostChange {
    /// The host is now as shown (the event was accepted; it may have changed nothing).
    Applied(HostRow),
    /// The state machine refused the event in the host's current state (shown).
    Refused(HostRow),
}

/// Applies an operator's `event` (drain, cordon, uncordon) to the host, as [`HostState::on`]
/// decides. `None` when no such host exists.
pub async fn apply_event(
    conn: &mut PgConnection,
    id: HostId,
    event: HostEvent,
) -> Result<Option<HostChange>, StoreError> {
    let Some(current) = get(&mut *conn, id).await? else {
        return Ok(None);
    };
    let Ok(to) = current.state.on(event) else {
        return Ok(Some(HostChange::Refused(current)));
    };
    let updated = timed(
        Op::HostSetState,
        sqlx::query(
            "UPDATE hosts SET state = $2,
                    state_changed_at = CASE WHEN state = $2 THEN state_changed_at ELSE now() END
              WHERE id = $1 AND state = ANY($3) RETURNING id",
        )
        .bind(id)
        .bind(to.as_str())
        .bind(states_str(HostState::sources(event, to)))
        .fetch_optional(&mut *conn),
    )
    .await?;
    let now = get(&mut *conn, id).await?.ok_or(StoreError::NotFound {
        what: "host",
        id: id.to_string(),
    })?;
    Ok(Some(match updated {
        Some(_) => HostChange::Applied(now),
        // The state changed between the read and the update (the host was marked lost).
        None => HostChange::Refused(now),
    }))
}

/// A container a host reports running (or unhealthy) that its row may not want there.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportedContainer {
    /// The host whose inventory lists the container.
    pub host: HostId,
    /// The sandbox the container belongs to, per the inventory.
    pub sandbox: SandboxId,
    /// The generation the host last applied for it.
    pub generation: Generation,
    /// Its sandbox row, if one exists.
    pub row: Option<ReportedRow>,
}

/// What the inventory pass needs of a reported container's row.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportedRow {
    /// The row's state.
    pub state: SandboxState,
    /// Whether the row places it on the reporting host.
    pub on_reporting_host: bool,
    /// The row's current generation (a compensation is queued at it).
    pub generation: Generation,
    /// What the host needs to act on the sandbox (org, template, resources).
    pub spec: SandboxSpec,
}

/// Up to `batch` running or unhealthy containers in the inventories of hosts in service whose
/// row is missing, names another host, or is in [`UNWANTED_RUNNING_ON_ITS_HOST`] (read from the
/// findings of each host's current inventory, [`crate::findings`], and checked again on the
/// current rows; the inventories themselves are not expanded) — only when
/// the host's evidence is younger than `max_age` ([`crate::heartbeats::EVIDENCE_AGE_SQL`]),
/// its inventory was taken `grace` after the row's last change
/// ([`crate::heartbeats::INVENTORY_TAKEN_SQL`]), and the host applied every command for that
/// sandbox before taking it (none open, none whose result carried a heartbeat `seq` at or
/// above the inventory's).
pub async fn unwanted_containers(
    conn: &mut PgConnection,
    grace: Duration,
    max_age: Duration,
    batch: i64,
) -> Result<Vec<ReportedContainer>, StoreError> {
    use crate::heartbeats::{EVIDENCE_AGE_SQL, INVENTORY_TAKEN_SQL};
    let unwanted: Vec<&str> = UNWANTED_RUNNING_ON_ITS_HOST
        .iter()
        .map(|s| s.as_str())
        .collect();
    let live = crate::findings::live_statuses();
    let rows = timed(
        Op::HostUnwantedInventory,
        sqlx::query(&format!(
            "SELECT h.id AS host_id, f.sandbox_id, f.generation AS item_generation,
                    s.id IS NOT NULL AS known, s.state, s.generation, s.org_id, s.template,
                    s.vcpus, s.memory_mib, s.runtime, s.disk_mib, s.network, s.image,
                    s.host_id = h.id AS same_host
               FROM inventory_findings f
               JOIN hosts h ON h.id = f.host_id AND {current}
               LEFT JOIN LATERAL (SELECT * FROM sandboxes s WHERE s.id = f.sandbox_id OFFSET 0) s
                      ON true
              WHERE NOT f.unlisted AND h.state <> $5 AND f.status = ANY($3)
                AND (s.id IS NULL OR s.host_id IS DISTINCT FROM h.id OR s.state = ANY($4))
                AND (s.id IS NULL
                     OR {INVENTORY_TAKEN_SQL} > s.updated_at + make_interval(secs => $1))
                AND {EVIDENCE_AGE_SQL} < make_interval(secs => $6)
                AND NOT EXISTS (SELECT 1 FROM commands c
                                 WHERE c.sandbox_id = f.sandbox_id
                                   AND c.host_id = h.id
                                   AND (c.completed_at IS NULL
                                        OR c.host_seq >= h.heartbeat_seq))
              LIMIT $2",
            current = crate::findings::CURRENT_SQL,
        ))
        .bind(grace.as_secs_f64())
        .bind(batch)
        .bind(&live[..])
        .bind(&unwanted)
        .bind(HostState::Lost.as_str())
        .bind(max_age.as_secs_f64())
        .fetch_all(conn),
    )
    .await?;
    rows.iter()
        .map(|r| {
            let get = StoreError::database(Op::HostUnwantedInventory);
            let known: bool = r.try_get("known").map_err(get)?;
            let row = if known {
                let state: String = r.try_get("state").map_err(get)?;
                Some(ReportedRow {
                    state: state.parse().map_err(|e| StoreError::Corrupt {
                        column: "sandboxes.state",
                        message: format!("{e}"),
                    })?,
                    on_reporting_host: r.try_get("same_host").map_err(get)?,
                    generation: r.try_get("generation").map_err(get)?,
                    spec: SandboxSpec {
                        org_id: r.try_get("org_id").map_err(get)?,
                        template: r.try_get("template").map_err(get)?,
                        resources: resources(
                            r.try_get("vcpus").map_err(get)?,
                            r.try_get("memory_mib").map_err(get)?,
                        ),
                        runtime: crate::sandboxes::runtime(
                            &r.try_get::<String, _>("runtime").map_err(get)?,
                        )?,
                        disk_mib: u32::try_from(r.try_get::<i32, _>("disk_mib").map_err(get)?)
                            .unwrap_or(0),
                        network: crate::sandboxes::network(&r.try_get("network").map_err(get)?)?,
                        // A compensation stops or deletes: it never boots, so it needs neither.
                        env: Vec::new(),
                        entrypoint: Vec::new(),
                        image: r.try_get("image").map_err(get)?,
                    },
                })
            } else {
                None
            };
            Ok(ReportedContainer {
                host: r.try_get("host_id").map_err(get)?,
                sandbox: r.try_get("sandbox_id").map_err(get)?,
                generation: Generation(
                    r.try_get::<Option<i64>, _>("item_generation")
                        .map_err(get)?
                        .unwrap_or(0),
                ),
                row,
            })
        })
        .collect()
}

/// `(state, heartbeat age in seconds)` of every host (for the `berth_hosts` gauges).
pub async fn states_and_ages(
    db: impl PgExecutor<'_>,
) -> Result<Vec<(HostId, HostState, f64)>, StoreError> {
    let rows: Vec<(HostId, String, f64)> = timed(
        Op::HostList,
        sqlx::query_as(
            "SELECT id, state, GREATEST(EXTRACT(EPOCH FROM now() - last_seen), 0)::float8
               FROM hosts",
        )
        .fetch_all(db),
    )
    .await?;
    rows.into_iter()
        .map(|(id, state, age)| {
            let state = state.parse().map_err(|e| StoreError::Corrupt {
                column: "hosts.state",
                message: format!("{e}"),
            })?;
            Ok((id, state, age))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_new_sandbox_goes_only_to_a_ready_host_and_a_resident_one_anywhere_but_lost() {
        assert_eq!(Admit::NewSandbox.states(), ["ready"]);
        assert_eq!(
            Admit::ResidentSandbox.states(),
            ["ready", "draining", "cordoned"]
        );
    }
}
