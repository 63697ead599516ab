//! The operator routes under `/v1/hosts` (operator keys only): list hosts, drain, cordon and
//! uncordon ([`crate::service::hosts`] runs them).
//!
//! Host states (DESIGN.md): `ready` takes new sandboxes; `draining` and `cordoned` take none,
//! but their own sandboxes still start there (their disks live there; moving them needs the
//! backup store, which does not exist yet); `lost` is set by the reconciler when a host is
//! silent and cleared by its next heartbeat.

use axum::extract::{Path, State};
use axum::Json;
use berth_schemas::{HostEvent, HostId};

use super::extract::parse_path_id;
use crate::auth::Admin;
use crate::error::ApiError;
use crate::service::hosts::{self, Host};
use crate::AppState;

/// `GET /v1/hosts`
#[utoipa::path(get, path = "/v1/hosts",
    responses((status = 200, body = [Host]), (status = 403, description = "`forbidden`: not an operator key")),
    security(("bearer" = [])))]
pub async fn list(
    State(app): State<AppState>,
    _admin: Admin,
    _query: super::extract::StrictQuery<super::extract::NoParams>,
) -> Result<Json<Vec<Host>>, ApiError> {
    Ok(Json(hosts::list(&app.db).await?))
}

async fn set_state(app: &AppState, id: &str, action: HostEvent) -> Result<Json<Host>, ApiError> {
    let id: HostId = parse_path_id(id, "host")?;
    Ok(Json(hosts::set_state(&app.db, id, action).await?))
}

macro_rules! host_action {
    ($name:ident, $path:literal, $action:expr, $what:literal) => {
        #[doc = concat!("`POST ", $path, "`: ", $what)]
        #[utoipa::path(post, path = $path, params(("id" = String, Path)), description = $what,
            request_body(content = Option<super::body::NoFields>, description = "`{}` or no body"),
            responses((status = 200, body = Host), (status = 404, description = "`not_found`"),
                (status = 400, description = "`invalid_request`: a body other than `{}` or none"),
                (status = 409, description = "`conflict`: the host is `lost`")),
            security(("bearer" = [])))]
        pub async fn $name(
            State(app): State<AppState>,
            _admin: Admin,
            Path(id): Path<String>,
            body: axum::body::Bytes,
        ) -> Result<Json<Host>, ApiError> {
            let super::body::NoFields {} = super::body::json_or_empty(&body)?;
            set_state(&app, &id, $action).await
        }
    };
}

host_action!(
    drain,
    "/v1/hosts/{id}/drain",
    HostEvent::Drain,
    "Drain: no new sandboxes are placed here; its own sandboxes still start here."
);
host_action!(
    cordon,
    "/v1/hosts/{id}/cordon",
    HostEvent::Cordon,
    "Cordon: no new sandboxes are placed here."
);
host_action!(
    uncordon,
    "/v1/hosts/{id}/uncordon",
    HostEvent::Uncordon,
    "Uncordon: the host takes new sandboxes again."
);
