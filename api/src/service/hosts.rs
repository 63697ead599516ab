//! The operator use cases on hosts: list hosts, drain, cordon and uncordon.
//!
//! Host states (DESIGN.md): `ready` takes new sandboxes; `draining` and `cordoned` take none,
//! but their own sandboxes still start there (their disks live there; moving them needs the
//! backup store, which does not exist yet); `lost` is set by the reconciler when a host is
//! silent and cleared by its next heartbeat.

use berth_schemas::HostId;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Row};
use utoipa::ToSchema;

use super::ServiceError;

/// A host as operators see it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Host {
    #[schema(value_type = String, format = Uuid)]
    pub id: HostId,
    pub name: String,
    /// `ready`, `draining`, `cordoned` or `lost`.
    pub state: String,
    pub capacity_vcpus: i32,
    pub capacity_memory_mib: i64,
    pub reserved_vcpus: i32,
    pub reserved_memory_mib: i64,
    pub runtimes: Vec<String>,
    pub memory_snapshot: bool,
    /// Sandboxes placed here that hold capacity.
    pub sandboxes: i64,
    pub last_seen: DateTime<Utc>,
    /// Seconds since the last heartbeat (database clock).
    pub heartbeat_age_seconds: f64,
}

const HOST_SELECT: &str = "SELECT h.id, h.name, h.state, h.capacity_vcpus, h.capacity_memory_mib,
        h.reserved_vcpus, h.reserved_memory_mib, h.runtimes, h.memory_snapshot, h.last_seen,
        EXTRACT(EPOCH FROM now() - h.last_seen)::float8 AS age,
        (SELECT count(*) FROM sandboxes s WHERE s.host_id = h.id AND s.holds_capacity) AS sandboxes
   FROM hosts h";

fn host_from_row(r: &sqlx::postgres::PgRow) -> Result<Host, sqlx::Error> {
    Ok(Host {
        id: r.try_get("id")?,
        name: r.try_get("name")?,
        state: r.try_get("state")?,
        capacity_vcpus: r.try_get("capacity_vcpus")?,
        capacity_memory_mib: r.try_get("capacity_memory_mib")?,
        reserved_vcpus: r.try_get("reserved_vcpus")?,
        reserved_memory_mib: r.try_get("reserved_memory_mib")?,
        runtimes: r.try_get("runtimes")?,
        memory_snapshot: r.try_get("memory_snapshot")?,
        sandboxes: r.try_get("sandboxes")?,
        last_seen: r.try_get("last_seen")?,
        heartbeat_age_seconds: r.try_get("age")?,
    })
}

/// Every host, by name.
pub async fn list(db: &PgPool) -> Result<Vec<Host>, ServiceError> {
    let rows = sqlx::query(&format!("{HOST_SELECT} ORDER BY h.name, h.id"))
        .fetch_all(db)
        .await?;
    Ok(rows.iter().map(host_from_row).collect::<Result<_, _>>()?)
}

/// An operator action on a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// No new sandboxes are placed here; its own sandboxes still start here.
    Drain,
    /// No new sandboxes are placed here.
    Cordon,
    /// The host takes new sandboxes again.
    Uncordon,
}

/// Applies an operator action; repeating one changes nothing. Returns the host as it is now.
///
/// Errors: [`ServiceError::NotFound`]; [`ServiceError::HostConflict`] when the host's state
/// refuses the action (it is `lost`).
pub async fn set_state(db: &PgPool, id: HostId, action: Action) -> Result<Host, ServiceError> {
    let (to, from): (&str, &[&str]) = match action {
        Action::Drain => ("draining", &["ready", "cordoned", "draining"]),
        Action::Cordon => ("cordoned", &["ready", "draining", "cordoned"]),
        Action::Uncordon => ("ready", &["draining", "cordoned", "ready"]),
    };
    let from: Vec<String> = from.iter().map(|s| s.to_string()).collect();
    let updated = sqlx::query(
        "UPDATE hosts SET state = $2,
                state_changed_at = CASE WHEN state = $2 THEN state_changed_at ELSE now() END
          WHERE id = $1 AND state = ANY($3) RETURNING id",
    )
    .bind(id)
    .bind(to)
    .bind(&from)
    .fetch_optional(db)
    .await?;
    let row = sqlx::query(&format!("{HOST_SELECT} WHERE h.id = $1"))
        .bind(id)
        .fetch_optional(db)
        .await?
        .ok_or_else(|| ServiceError::NotFound(format!("host {id}")))?;
    let host = host_from_row(&row)?;
    if updated.is_none() {
        return Err(ServiceError::HostConflict {
            state: host.state,
            message: format!(
                "cannot {action:?} a host that is {}",
                row.try_get::<String, _>("state")?
            )
            .to_lowercase(),
        });
    }
    Ok(host)
}
