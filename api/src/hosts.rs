//! The operator API under `/v1/hosts` (operator keys only): list hosts, drain, cordon and
//! uncordon.
//!
//! Host states (DESIGN.md): `ready` takes new sandboxes; `draining` and `cordoned` take none,
//! but their own sandboxes still start there (their disks live there; moving them needs the
//! backup store, which does not exist yet); `lost` is set by the reconciler when a host is
//! silent and cleared by its next heartbeat.

use axum::extract::{Path, State};
use axum::Json;
use berth_schemas::HostId;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::Row;
use utoipa::ToSchema;

use crate::auth::Admin;
use crate::error::ApiError;
use crate::AppState;

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

/// `GET /v1/hosts`
#[utoipa::path(get, path = "/v1/hosts",
    responses((status = 200, body = [Host]), (status = 403, description = "`forbidden`: not an operator key")),
    security(("bearer" = [])))]
pub async fn list(State(app): State<AppState>, _admin: Admin) -> Result<Json<Vec<Host>>, ApiError> {
    let rows = sqlx::query(&format!("{HOST_SELECT} ORDER BY h.name, h.id"))
        .fetch_all(&app.db)
        .await?;
    Ok(Json(
        rows.iter().map(host_from_row).collect::<Result<_, _>>()?,
    ))
}

/// Which operator action.
#[derive(Debug, Clone, Copy)]
enum Action {
    Drain,
    Cordon,
    Uncordon,
}

async fn set_state(app: &AppState, id: &str, action: Action) -> Result<Json<Host>, ApiError> {
    let id: HostId = crate::sandboxes::parse_path_id(id, "host")?;
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
    .fetch_optional(&app.db)
    .await?;
    let row = sqlx::query(&format!("{HOST_SELECT} WHERE h.id = $1"))
        .bind(id)
        .fetch_optional(&app.db)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("host {id}")))?;
    let host = host_from_row(&row)?;
    if updated.is_none() {
        return Err(ApiError::HostConflict {
            state: host.state,
            message: format!(
                "cannot {action:?} a host that is {}",
                row.try_get::<String, _>("state")?
            )
            .to_lowercase(),
        });
    }
    Ok(Json(host))
}

macro_rules! host_action {
    ($name:ident, $path:literal, $action:expr, $what:literal) => {
        #[doc = concat!("`POST ", $path, "`: ", $what)]
        #[utoipa::path(post, path = $path, params(("id" = String, Path)), description = $what,
            responses((status = 200, body = Host), (status = 404, description = "`not_found`"),
                (status = 409, description = "`conflict`: the host is `lost`")),
            security(("bearer" = [])))]
        pub async fn $name(
            State(app): State<AppState>,
            _admin: Admin,
            Path(id): Path<String>,
        ) -> Result<Json<Host>, ApiError> {
            set_state(&app, &id, $action).await
        }
    };
}

host_action!(
    drain,
    "/v1/hosts/{id}/drain",
    Action::Drain,
    "Drain: no new sandboxes are placed here; its own sandboxes still start here."
);
host_action!(
    cordon,
    "/v1/hosts/{id}/cordon",
    Action::Cordon,
    "Cordon: no new sandboxes are placed here."
);
host_action!(
    uncordon,
    "/v1/hosts/{id}/uncordon",
    Action::Uncordon,
    "Uncordon: the host takes new sandboxes again."
);
