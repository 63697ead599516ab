//! Sandbox routes: create, get, list, and the lifecycle requests (stop/pause, start/resume,
//! delete). Each parses its request, calls [`crate::service::sandboxes`], and renders the
//! answer.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use berth_schemas::state::Request;
use berth_schemas::{HostId, SandboxId, SandboxState};
use serde::Deserialize;

use super::extract::json_error;
use super::extract::parse_path_id;
use super::idempotency::{render_replayable, stored, Idempotency};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::model::{CreateSandbox, Sandbox, SandboxList};
use crate::service::sandboxes::{self, LifecycleOutcome, ListFilter, PlacementPolicy};
use crate::AppState;

/// Default page size of `GET /v1/sandboxes`.
pub const DEFAULT_PAGE_SIZE: u32 = 50;
/// Largest page size of `GET /v1/sandboxes`.
pub const MAX_PAGE_SIZE: u32 = 500;

/// Parses a sandbox id from a path; one that does not parse is "not found".
pub(crate) fn parse_id(raw: &str) -> Result<SandboxId, ApiError> {
    parse_path_id(raw, "sandbox")
}

/// `POST /v1/sandboxes`
#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandbox,
    responses(
        (status = 202, description = "Accepted; the sandbox is `provisioning`", body = Sandbox),
        (status = 400, description = "`invalid_request`: malformed JSON or a size out of range (the field is named; `disk_mib` beyond the operator's maximum too)"),
        (status = 400, description = "`invalid_request`: malformed JSON, a size out of range or a malformed `network` policy (the field is named)"),
        (status = 429, description = "`quota_exceeded`: the org's quota (`limit` names it) would be passed"),
        (status = 422, description = "`unknown_template`, or `idempotency_key_reused`: the Idempotency-Key was used for a different request"),
        (status = 401, description = "`unauthorized`"),
        (status = 503, description = "`no_capacity`: no ready host has the headroom; nothing was written"),
        (status = 503, description = "`unavailable`: hosts with room exist but their heartbeats are stale (the control plane could not write them) or they are degraded; `Retry-After` says when to retry; nothing was written"),
    ), security(("bearer" = [])))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let idem = Idempotency::from_headers(&headers, "POST", "/v1/sandboxes", &body)?;
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        &body
    };
    let Json(create) = Json::<CreateSandbox>::from_bytes(body).map_err(json_error)?;
    let req = create.validate(app.config.disk)?;
    req.network
        .check_tenant(app.config.sandbox_egress_private)
        .map_err(|e| ApiError::invalid("network", e.0))?;
    let policy = PlacementPolicy {
        heartbeat_freshness: app.config.heartbeat_freshness,
        overcommit: app.config.overcommit,
    };
    let outcome = sandboxes::create(&app.db, policy, caller.org_id, req, idem.as_ref(), |s| {
        stored(StatusCode::ACCEPTED, s)
    })
    .await?;
    Ok(render_replayable(outcome))
}

/// Reads one sandbox of the caller's org; another org's sandbox is "not found".
pub(crate) async fn fetch(
    app: &AppState,
    caller: &Caller,
    id: SandboxId,
) -> Result<Sandbox, ApiError> {
    Ok(sandboxes::get(&app.db, caller.org_id, id).await?)
}

/// The caller's sandbox `id` (a path segment) and its host when it runs, marked active for
/// auto-stop: exec, streamed exec and both files routes go through here, so each counts as
/// activity. `not_running` words the 409 for the route.
///
/// Errors: [`ApiError::NotFound`]; `not_running(sandbox)` when it is not `running` or is
/// being deleted.
pub(crate) async fn running_and_active(
    app: &AppState,
    caller: &Caller,
    id: &str,
    not_running: fn(&Sandbox) -> ApiError,
) -> Result<(Sandbox, HostId), ApiError> {
    let sandbox = fetch(app, caller, parse_id(id)?).await?;
    if sandbox.state != SandboxState::Running || sandbox.deleted_at.is_some() {
        return Err(not_running(&sandbox));
    }
    let host = sandbox.host_id.ok_or_else(|| not_running(&sandbox))?;
    sandboxes::mark_active(&app.db, sandbox.id).await?;
    Ok((sandbox, host))
}

/// `GET /v1/sandboxes/{id}`
#[utoipa::path(get, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), (status = 404, description = "`not_found`")),
    security(("bearer" = [])))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Sandbox>, ApiError> {
    Ok(Json(fetch(&app, &caller, parse_id(&id)?).await?))
}

/// `GET /v1/sandboxes` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only sandboxes in this state. Without it, tombstones (`deleted`) are left out.
    pub state: Option<String>,
    /// Page size, 1 to 500; default 50.
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// `GET /v1/sandboxes`: the caller's sandboxes, newest first, cursor-paginated.
#[utoipa::path(get, path = "/v1/sandboxes", params(ListQuery),
    responses((status = 200, body = SandboxList), (status = 400, description = "`invalid_request`")),
    security(("bearer" = [])))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<SandboxList>, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::InvalidRequest {
        field: None,
        message: e.body_text(),
    })?;
    let state = q
        .state
        .as_deref()
        .map(|s| s.parse::<SandboxState>())
        .transpose()
        .map_err(|e| ApiError::invalid("state", e.to_string()))?;
    let limit = q.limit.unwrap_or(DEFAULT_PAGE_SIZE);
    if !(1..=MAX_PAGE_SIZE).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            format!("limit must be between 1 and {MAX_PAGE_SIZE}"),
        ));
    }
    let cursor = q
        .cursor
        .as_deref()
        .map(|c| c.parse::<SandboxId>())
        .transpose()
        .map_err(|_| ApiError::invalid("cursor", "cursor is not one this API returned"))?;
    let page = sandboxes::list(
        &app.db,
        caller.org_id,
        ListFilter {
            state,
            before: cursor,
            limit,
        },
    )
    .await?;
    Ok(Json(SandboxList {
        sandboxes: page.sandboxes,
        next_cursor: page.next.map(|id| id.to_string()),
    }))
}

/// Runs a lifecycle request; 202 with the sandbox when something changed, 200 when the sandbox
/// is already at or heading to the target.
async fn lifecycle(
    app: &AppState,
    caller: &Caller,
    id: SandboxId,
    request: Request,
    idem: Option<Idempotency>,
) -> Result<Response, ApiError> {
    let outcome = sandboxes::lifecycle(
        &app.db,
        app.config.overcommit,
        caller.org_id,
        id,
        request,
        idem.as_ref(),
        |outcome| match outcome {
            LifecycleOutcome::Accepted(s) => stored(StatusCode::ACCEPTED, s),
            LifecycleOutcome::Unchanged(s) => stored(StatusCode::OK, s),
        },
    )
    .await?;
    Ok(render_replayable(outcome))
}

macro_rules! lifecycle_route {
    ($name:ident, $path:literal, $request:expr, $what:literal) => {
        #[doc = concat!("`POST ", $path, "`: ", $what)]
        #[utoipa::path(post, path = $path, params(("id" = String, Path)),
            description = $what,
            responses(
                (status = 202, description = "Accepted; the transition is in flight", body = Sandbox),
                (status = 200, description = "Already at or heading to the target; nothing changed", body = Sandbox),
                (status = 404, description = "`not_found`"),
                (status = 409, description = "`conflict`: a conflicting transition is in flight; `state` is the current state"),
                (status = 503, description = "`no_capacity` (start): the sandbox's host has no headroom"),
            ), security(("bearer" = [])))]
        pub async fn $name(
            State(app): State<AppState>,
            caller: Caller,
            Path(id): Path<String>,
            headers: HeaderMap,
        ) -> Result<Response, ApiError> {
            let idem = Idempotency::from_headers(&headers, "POST", $path, id.as_bytes())?;
            lifecycle(&app, &caller, parse_id(&id)?, $request, idem).await
        }
    };
}

lifecycle_route!(
    stop,
    "/v1/sandboxes/{id}/stop",
    Request::Stop,
    "Stop: keeps the disk (and memory where the runtime can); settles as `stopped`."
);
lifecycle_route!(
    pause,
    "/v1/sandboxes/{id}/pause",
    Request::Stop,
    "Pause: an alias of stop (there is no paused state)."
);
lifecycle_route!(
    start,
    "/v1/sandboxes/{id}/start",
    Request::Start,
    "Start a `stopped` or `failed-start` sandbox on its host; settles as `running`."
);
lifecycle_route!(
    resume,
    "/v1/sandboxes/{id}/resume",
    Request::Start,
    "Resume: an alias of start."
);

/// `DELETE /v1/sandboxes/{id}`: accepted from every state; repeating it changes nothing.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses(
        (status = 202, description = "Accepted; `deleted_at` is set and the sandbox settles as `deleted`", body = Sandbox),
        (status = 200, description = "Already being deleted or deleted", body = Sandbox),
        (status = 404, description = "`not_found`"),
    ), security(("bearer" = [])))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    lifecycle(&app, &caller, parse_id(&id)?, Request::Delete, None).await
}
