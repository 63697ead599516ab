//! The operator use cases on hosts: list hosts (with their health and drain progress), read
//! one, drain (live or not), cordon and uncordon.
//!
//! Host states (DESIGN.md): `ready` takes new sandboxes; `draining` and `cordoned` take none,
//! but their own sandboxes still start there (their disks live there); `lost` is set by the
//! reconciler when a host is silent and cleared by its next heartbeat. A draining host's
//! sandboxes are moved off by the reconciler's drive (issue 14,
//! [`berth_schemas::host_state::drain`]): its stopped ones archived, with `live` its running
//! ones stopped and started elsewhere; the host shows the progress ([`Drain`]). Draining again
//! retries the moves that failed; cordon and uncordon end the drive (moves in flight finish).
//! Beside its state, a host has a health condition judged from its boots (`healthy`,
//! `degraded`, `probing`: see [`berth_schemas::host_state::health`]); placement avoids a
//! degraded host until its probe.

use berth_schemas::host_state::HostRefusal;
use berth_schemas::{HostEvent, HostId};
use berth_store::drain::{self, Progress};
use berth_store::host_health::{self, HealthView};
use berth_store::hosts::{self, HostChange, HostRow, Overcommit};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use utoipa::ToSchema;

use super::ServiceError;

/// A host as operators see it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Host {
    /// The host's id, as its heartbeats carry it.
    #[schema(value_type = String, format = Uuid)]
    pub id: HostId,
    /// Human-readable name from its heartbeat (hostname plus index in `berth dev`).
    pub name: String,
    /// `ready`, `draining`, `cordoned` or `lost`.
    pub state: String,
    /// Whole vCPUs the host offers to sandboxes (its heartbeat's: physical).
    pub capacity_vcpus: i32,
    /// MiB of memory the host offers to sandboxes (its heartbeat's: physical).
    pub capacity_memory_mib: i64,
    /// Whole vCPUs placement reserves against: `capacity_vcpus` × `overcommit.cpu`, rounded
    /// down. A sandbox fits while `reserved_vcpus` plus its vCPUs stays within it.
    pub schedulable_vcpus: i64,
    /// MiB placement reserves against: `capacity_memory_mib` × `overcommit.memory`, rounded
    /// down.
    pub schedulable_memory_mib: i64,
    /// The overcommit ratios this API places with (the control plane's configuration: CPU 4.0
    /// and memory 1.0, `berth_scheduler::placement::DEFAULT_*_OVERCOMMIT`).
    pub overcommit: HostOvercommit,
    /// Whole vCPUs reserved by sandboxes placed here (the control plane's count).
    pub reserved_vcpus: i32,
    /// MiB of memory reserved by sandboxes placed here.
    pub reserved_memory_mib: i64,
    /// The OCI runtimes it offers (`runc`, `runsc`).
    pub runtimes: Vec<String>,
    /// Whether a stop can keep memory on this host (checkpoint/restore).
    pub memory_snapshot: bool,
    /// Sandboxes placed here that hold capacity.
    pub sandboxes: i64,
    /// When the last heartbeat was recorded (database clock).
    pub last_seen: DateTime<Utc>,
    /// Seconds since the last heartbeat (database clock).
    pub heartbeat_age_seconds: f64,
    /// Its health, judged from the outcomes of its boots.
    pub health: HostHealth,
    /// The progress of its drain: present while it is `draining`, and while moves of an ended
    /// drain are still in flight; `null` otherwise.
    pub drain: Option<Drain>,
}

/// How far placement reserves beyond a host's physical capacity: reservable = physical ×
/// ratio, rounded down.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema)]
pub struct HostOvercommit {
    /// vCPUs reserved per physical vCPU (4.0 by default: sandboxes rarely use all theirs at
    /// once).
    pub cpu: f64,
    /// MiB reserved per physical MiB (1.0 by default: no memory overcommit).
    pub memory: f64,
}

/// A host's drain progress: how many of its sandboxes the reconciler still has to move, is
/// moving, or failed to move.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Drain {
    /// Whether running sandboxes move too (`POST …/drain {"live": true}`), not only stopped
    /// ones.
    pub live: bool,
    /// Sandboxes still on the host that the drain is to move and has not begun to: `stopped`
    /// ones (and `stopping`, `archiving`), and with `live` every one but `archived` and
    /// `failed-start`.
    pub left: i64,
    /// Sandboxes on the host the drain does not move and that stay there when it is done:
    /// `failed-start` ones (their disk, when they have one, is on this host: start or delete
    /// them before the host is removed), and without `live` the running ones and those in a
    /// transition.
    pub staying: i64,
    /// Moves in flight (at most the reconciler's `--drain-parallel` per host): an archive, or
    /// a live move's stop, upload and start elsewhere.
    pub moving: i64,
    /// Moves that failed: the sandbox stays on the host (a running one the drain stopped is
    /// started there again). Not retried until the host is drained again.
    pub failed: i64,
    /// Up to 20 of the failed moves, with their reasons.
    pub failures: Vec<DrainFailure>,
}

/// A sandbox the drain could not move, and why.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DrainFailure {
    /// The sandbox.
    #[schema(value_type = String, format = Uuid)]
    pub sandbox_id: berth_schemas::SandboxId,
    /// Why (`no other host has room for it`, `its stop did not become durable in time; …`,
    /// `the move failed; it stays on its host`, `its stop failed`, `it was started or changed
    /// on its own host before it moved`).
    pub reason: String,
}

impl From<Progress> for Drain {
    fn from(p: Progress) -> Self {
        Drain {
            live: p.live,
            left: p.left,
            staying: p.staying,
            moving: p.moving,
            failed: p.failed,
            failures: p
                .failures
                .into_iter()
                .map(|(sandbox_id, reason)| DrainFailure { sandbox_id, reason })
                .collect(),
        }
    }
}

/// A host's health as operators see it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct HostHealth {
    /// `healthy` (placement chooses it), `degraded` (placement avoids it until `probe_at`)
    /// or `probing` (its probe create is out).
    pub condition: String,
    /// Bad boots in a row (failed by the host, timed out, or slow) since its last good one.
    pub consecutive_failures: u32,
    /// When placement may send its next probe; absent while healthy.
    pub probe_at: Option<DateTime<Utc>>,
    /// When the condition last changed.
    pub changed_at: DateTime<Utc>,
    /// The last bad boot's reason, if any.
    pub reason: Option<String>,
}

impl From<HealthView> for HostHealth {
    fn from(h: HealthView) -> Self {
        HostHealth {
            condition: h.condition.as_str().to_owned(),
            consecutive_failures: h.consecutive_failures,
            probe_at: h.probe_at,
            changed_at: h.changed_at,
            reason: h.reason,
        }
    }
}

/// The health a host row was read with, or `healthy` for a row the health read missed (a
/// host whose first heartbeat landed between the two reads).
fn health_of(id: HostId, health: &[HealthView], at: DateTime<Utc>) -> HostHealth {
    health.iter().find(|h| h.id == id).cloned().map_or_else(
        || HostHealth {
            condition: berth_schemas::HostCondition::Healthy.as_str().to_owned(),
            consecutive_failures: 0,
            probe_at: None,
            changed_at: at,
            reason: None,
        },
        HostHealth::from,
    )
}

impl Host {
    fn new(h: HostRow, health: &[HealthView], drains: &[Progress], overcommit: Overcommit) -> Self {
        let (capacity, reserved) = (h.capacity, h.reserved);
        let schedulable = overcommit.limit(capacity);
        Host {
            drain: drains
                .iter()
                .find(|d| d.host == h.id)
                .cloned()
                .map(Drain::from),
            health: health_of(h.id, health, h.last_seen),
            id: h.id,
            name: h.name,
            state: h.state.as_str().to_owned(),
            capacity_vcpus: i32::try_from(capacity.vcpus).unwrap_or(i32::MAX),
            capacity_memory_mib: i64::from(capacity.memory_mib),
            schedulable_vcpus: i64::from(schedulable.vcpus),
            schedulable_memory_mib: i64::from(schedulable.memory_mib),
            overcommit: HostOvercommit {
                cpu: overcommit.cpu,
                memory: overcommit.memory,
            },
            reserved_vcpus: i32::try_from(reserved.vcpus).unwrap_or(i32::MAX),
            reserved_memory_mib: i64::from(reserved.memory_mib),
            runtimes: h.runtimes,
            memory_snapshot: h.memory_snapshot,
            sandboxes: h.sandboxes,
            last_seen: h.last_seen,
            heartbeat_age_seconds: h.heartbeat_age_seconds,
        }
    }
}

/// Every host, by name, with its health and drain progress; its schedulable capacity under
/// `overcommit`.
pub async fn list(db: &PgPool, overcommit: Overcommit) -> Result<Vec<Host>, ServiceError> {
    let mut conn = db.acquire().await?;
    let rows = hosts::list(&mut *conn).await?;
    let health = host_health::conditions(&mut *conn, None).await?;
    let drains = drain::progress(&mut conn, None).await?;
    Ok(rows
        .into_iter()
        .map(|h| Host::new(h, &health, &drains, overcommit))
        .collect())
}

/// One host, with its health and drain progress; its schedulable capacity under `overcommit`.
///
/// Errors: [`ServiceError::NotFound`].
pub async fn get(db: &PgPool, id: HostId, overcommit: Overcommit) -> Result<Host, ServiceError> {
    let mut conn = db.acquire().await?;
    let Some(row) = hosts::get(&mut *conn, id).await? else {
        return Err(ServiceError::NotFound(format!("host {id}")));
    };
    let health = host_health::conditions(&mut *conn, Some(id)).await?;
    let drains = drain::progress(&mut conn, Some(id)).await?;
    Ok(Host::new(row, &health, &drains, overcommit))
}

/// Applies an operator action ([`HostEvent::Drain`], [`HostEvent::Cordon`] or
/// [`HostEvent::Uncordon`]) as the host state machine decides; repeating one changes nothing.
/// A drain records whether it is `live` and forgets the host's failed moves (so they are tried
/// again); a cordon or uncordon ends the drive (moves in flight finish). `live` is read only
/// for a drain. Returns the host as it is now (its schedulable capacity under `overcommit`).
///
/// Errors: [`ServiceError::NotFound`]; [`ServiceError::HostConflict`] when the host's state
/// refuses the action (it is `lost`).
pub async fn set_state(
    db: &PgPool,
    id: HostId,
    action: HostEvent,
    live: bool,
    overcommit: Overcommit,
) -> Result<Host, ServiceError> {
    let mut tx = db.begin().await?;
    let changed = hosts::apply_event(&mut tx, id, action).await?;
    if let Some(HostChange::Applied(_)) = changed {
        match action {
            HostEvent::Drain => drain::begin(&mut tx, id, live).await?,
            _ => drain::end(&mut tx, id).await?,
        }
    }
    let health = host_health::conditions(&mut *tx, Some(id)).await?;
    let drains = drain::progress(&mut tx, Some(id)).await?;
    tx.commit().await?;
    match changed {
        None => Err(ServiceError::NotFound(format!("host {id}"))),
        Some(HostChange::Applied(host)) => Ok(Host::new(host, &health, &drains, overcommit)),
        Some(HostChange::Refused(host)) => Err(ServiceError::HostConflict {
            message: HostRefusal {
                state: host.state,
                event: action,
            }
            .to_string(),
            state: host.state.as_str().to_owned(),
        }),
    }
}
