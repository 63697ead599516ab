//! The operator routes under `/v1/hosts` (operator keys only): list hosts, read one, drain
//! (`{"live": true}` moves running sandboxes too), cordon and uncordon
//! ([`crate::service::hosts`] runs them).
//!
//! Host states (DESIGN.md): `ready` takes new sandboxes; `draining` and `cordoned` take none,
//! but their own sandboxes still start there (their disks live there); the reconciler moves a
//! draining host's sandboxes off it; `lost` is set by the reconciler when a host is silent and
//! cleared by its next heartbeat.

use axum::extract::{Path, State};
use axum::Json;
use berth_schemas::{HostEvent, HostId};

use super::extract::{parse_path_id, NoParams, StrictQuery};
use crate::auth::Admin;
use crate::error::ApiError;
use crate::service::hosts::{self, Host};
use crate::AppState;

/// `GET /v1/hosts`
#[utoipa::path(get, path = "/v1/hosts",
    description = "Every host: its physical capacity (`capacity_*`, from its heartbeats), what \
        placement reserves against (`schedulable_*` = capacity × `overcommit`, rounded down; \
        vCPUs ×4 by default), what is reserved, its health and its drain's progress.",
    responses((status = 200, body = [Host]), (status = 403, description = "`forbidden`: not an operator key")),
    security(("bearer" = [])))]
pub async fn list(
    State(app): State<AppState>,
    _admin: Admin,
    _query: super::extract::StrictQuery<super::extract::NoParams>,
) -> Result<Json<Vec<Host>>, ApiError> {
    Ok(Json(hosts::list(&app.db, app.config.overcommit).await?))
}

/// `GET /v1/hosts/{id}`
#[utoipa::path(get, path = "/v1/hosts/{id}", params(("id" = String, Path)),
    description = "One host, with its physical and schedulable capacity (see `GET /v1/hosts`), \
        its health and its drain's progress (`drain`).",
    responses((status = 200, body = Host), (status = 404, description = "`not_found`"),
        (status = 403, description = "`forbidden`: not an operator key")),
    security(("bearer" = [])))]
pub async fn get(
    State(app): State<AppState>,
    _admin: Admin,
    Path(id): Path<String>,
    _query: super::extract::StrictQuery<super::extract::NoParams>,
) -> Result<Json<Host>, ApiError> {
    let id: HostId = parse_path_id(&id, "host")?;
    Ok(Json(hosts::get(&app.db, id, app.config.overcommit).await?))
}

async fn set_state(
    app: &AppState,
    id: &str,
    action: HostEvent,
    live: bool,
) -> Result<Json<Host>, ApiError> {
    let id: HostId = parse_path_id(id, "host")?;
    Ok(Json(
        hosts::set_state(&app.db, id, action, live, app.config.overcommit).await?,
    ))
}

/// The body of `POST /v1/hosts/{id}/drain` (`{}` or none: not live).
#[derive(Debug, Default, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DrainBody {
    /// Move the host's running sandboxes too (stop with memory where the runtime keeps it,
    /// upload, start on another host; on gVisor their processes continue), not only its stopped
    /// ones (archived). Default `false`.
    #[serde(default)]
    pub live: bool,
}

/// `POST /v1/hosts/{id}/drain`
#[utoipa::path(post, path = "/v1/hosts/{id}/drain", params(("id" = String, Path)),
    description = "Drain: no new sandboxes are placed here, and the reconciler moves its \
        sandboxes off, a few at a time: its stopped ones are archived (a later start brings \
        them back on another host), and with `live` its running ones are stopped, uploaded and \
        started on another host. The host's `drain` shows what is left, moving and failed. \
        Draining again (live or not) retries the failed moves; cordon or uncordon ends it.",
    request_body(content = Option<DrainBody>, description = "`{\"live\": true}`, `{}` or no body"),
    responses((status = 200, body = Host), (status = 404, description = "`not_found`"),
        (status = 400, description = "`invalid_request`: a body with other fields, or a query parameter (`?live=true` is not read: `live` goes in the body)"),
        (status = 409, description = "`conflict`: the host is `lost`")),
    security(("bearer" = [])))]
pub async fn drain(
    State(app): State<AppState>,
    _admin: Admin,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
    body: axum::body::Bytes,
) -> Result<Json<Host>, ApiError> {
    let DrainBody { live } = super::body::json_or_empty(&body)?;
    set_state(&app, &id, HostEvent::Drain, live).await
}

macro_rules! host_action {
    ($name:ident, $path:literal, $action:expr, $what:literal) => {
        #[doc = concat!("`POST ", $path, "`: ", $what)]
        #[utoipa::path(post, path = $path, params(("id" = String, Path)), description = $what,
            request_body(content = Option<super::body::NoFields>, description = "`{}` or no body"),
            responses((status = 200, body = Host), (status = 404, description = "`not_found`"),
                (status = 400, description = "`invalid_request`: a body other than `{}` or none, or a query parameter"),
                (status = 409, description = "`conflict`: the host is `lost`")),
            security(("bearer" = [])))]
        pub async fn $name(
            State(app): State<AppState>,
            _admin: Admin,
            Path(id): Path<String>,
            _query: StrictQuery<NoParams>,
            body: axum::body::Bytes,
        ) -> Result<Json<Host>, ApiError> {
            let super::body::NoFields {} = super::body::json_or_empty(&body)?;
            set_state(&app, &id, $action, false).await
        }
    };
}

host_action!(
    cordon,
    "/v1/hosts/{id}/cordon",
    HostEvent::Cordon,
    "Cordon: no new sandboxes are placed here; ends a drain (its moves in flight finish)."
);
host_action!(
    uncordon,
    "/v1/hosts/{id}/uncordon",
    HostEvent::Uncordon,
    "Uncordon: the host takes new sandboxes again; ends a drain (its moves in flight finish)."
);
