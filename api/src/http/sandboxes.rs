//! Sandbox routes: create, get, list, and the lifecycle requests (stop/pause, start/resume,
//! delete). Each parses its request, calls [`crate::service::sandboxes`], and renders the
//! answer.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::{Extension, Json};
use berth_schemas::state::{Request, WaitTarget};
use berth_schemas::{HostId, SandboxId, SandboxState};

use super::events::StreamShutdown;
use super::extract::{parse_path_id, NoParams, StrictQuery};
use super::idempotency::{render_replayable, stored, Idempotency};
use super::settings::{answer_when, stop_token, wait_slot, WaitFor, WaitQuery};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::limits::ConcurrencyPermit;
use crate::model::{check_metadata_entry, CreateSandbox, Sandbox, SandboxList, MAX_METADATA_KEYS};
use crate::service::idempotency::Replayable;
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

/// Parses the `?wait=` parameters of a create (`request` `None`) or lifecycle route. A wait for
/// another state than the one `request` settles in ([`WaitTarget::of_request`]) is a 400
/// before anything is done: `POST …/stop?wait=running` would stop the sandbox and then answer
/// 409, and the client would take the stop for refused.
pub(crate) fn wait_of(
    query: Result<Query<WaitQuery>, axum::extract::rejection::QueryRejection>,
    request: Option<Request>,
) -> Result<Option<WaitFor>, ApiError> {
    let Query(q) = query.map_err(super::extract::query_error)?;
    let wait = q.parse()?;
    let settles_in = WaitTarget::of_request(request);
    match wait {
        Some(w) if w.target != settles_in => Err(ApiError::InvalidRequest {
            field: Some("wait".into()),
            message: format!(
                "this request settles the sandbox as `{settles_in}`: wait for `{settles_in}`, not `{}`",
                w.target
            ),
        }),
        wait => Ok(wait),
    }
}

/// `POST /v1/sandboxes`
#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandbox, params(WaitQuery),
    responses(
        (status = 202, description = "Accepted; the sandbox is `provisioning` (or, with `snapshot_id`, a clone of that ready snapshot: `resuming`, its template and size the snapshot's, and `template`, `vcpus`, `memory_mib`, `disk_mib` refused)", body = Sandbox),
        (status = 200, description = "With `?wait=`: the sandbox in that state", body = Sandbox),
        (status = 408, description = "With `?wait=`: `timeout`; the sandbox was created (`sandbox_id`) and is in `state`"),
        (status = 409, description = "With `?wait=`: `conflict`; the sandbox was created (`sandbox_id`) but settled in `state` (e.g. `failed-start`)"),
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
    shutdown: Option<Extension<StreamShutdown>>,
    query: Result<Query<WaitQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let wait = wait_slot(&app, &caller, wait_of(query, None)?)?;
    let idem = Idempotency::from_headers(&headers, "POST", "/v1/sandboxes", &body)?;
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        &body
    };
    if let Some((snapshot, create)) = super::resume::clone_request(body)? {
        return super::resume::create_from_snapshot(
            &app, &caller, snapshot, create, idem, wait, shutdown,
        )
        .await;
    }
    let create: CreateSandbox = super::body::json(body)?;
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
    let Some(wait) = wait else {
        return Ok(render_replayable(outcome));
    };
    let id = match &outcome {
        Replayable::Fresh(sandbox, _) => Some(sandbox.id),
        Replayable::Replayed(stored) => stored.body["id"].as_str().and_then(|s| s.parse().ok()),
    };
    match id {
        Some(id) => answer_when(&app, &caller, id, wait, &stop_token(shutdown)).await,
        None => Ok(render_replayable(outcome)),
    }
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
    responses((status = 200, body = Sandbox), (status = 404, description = "`not_found`"),
        (status = 400, description = "`invalid_request`: a query parameter (the route takes none)")),
    security(("bearer" = [])))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
) -> Result<Json<Sandbox>, ApiError> {
    Ok(Json(fetch(&app, &caller, parse_id(&id)?).await?))
}

/// The prefix of a metadata filter's parameter name (`metadata.team=ml`).
pub const METADATA_FILTER_PREFIX: &str = "metadata.";

/// `GET /v1/sandboxes` query. Besides these, `metadata.KEY=VALUE` (repeatable for different
/// keys, at most 64) keeps only sandboxes whose metadata holds every such pair. Unknown
/// parameters are refused.
#[derive(Debug, Default, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only sandboxes in this state. Without it, tombstones (`deleted`) are left out.
    pub state: Option<String>,
    /// Page size, 1 to 500; default 50.
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
    /// `metadata.KEY=VALUE` pairs, as a JSON object of strings.
    #[param(rename = "metadata.KEY", value_type = Option<String>)]
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

impl ListQuery {
    /// Reads the query's pairs.
    ///
    /// Errors: 400 naming the parameter: an unknown one, one given twice, a `limit` that is
    /// not a number, metadata keys or values beyond the metadata bounds.
    pub fn from_pairs(pairs: Vec<(String, String)>) -> Result<Self, ApiError> {
        let mut q = ListQuery::default();
        let twice = |name: &str| ApiError::invalid(name, format!("{name} is given twice"));
        for (name, value) in pairs {
            match name.as_str() {
                "state" if q.state.is_none() => q.state = Some(value),
                "cursor" if q.cursor.is_none() => q.cursor = Some(value),
                "limit" if q.limit.is_none() => {
                    q.limit = Some(value.parse().map_err(|_| {
                        ApiError::invalid("limit", format!("limit must be a number, got {value:?}"))
                    })?)
                }
                "state" | "cursor" | "limit" => return Err(twice(&name)),
                _ => {
                    let Some(key) = name.strip_prefix(METADATA_FILTER_PREFIX) else {
                        return Err(ApiError::invalid(
                            &name,
                            format!("unknown query parameter {name:?}"),
                        ));
                    };
                    let value = serde_json::Value::String(value);
                    check_metadata_entry(key, Some(&value))?;
                    let filter = q.metadata.get_or_insert_with(Default::default);
                    if filter.insert(key.to_owned(), value).is_some() {
                        return Err(twice(&name));
                    }
                    if filter.len() > MAX_METADATA_KEYS {
                        return Err(ApiError::invalid(
                            "metadata",
                            format!("at most {MAX_METADATA_KEYS} metadata filters"),
                        ));
                    }
                }
            }
        }
        Ok(q)
    }
}

/// `GET /v1/sandboxes`: the caller's sandboxes, newest first, cursor-paginated.
#[utoipa::path(get, path = "/v1/sandboxes", params(ListQuery),
    responses((status = 200, body = SandboxList), (status = 400, description = "`invalid_request`")),
    security(("bearer" = [])))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    query: Result<Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<SandboxList>, ApiError> {
    let Query(pairs) = query.map_err(super::extract::query_error)?;
    let q = ListQuery::from_pairs(pairs)?;
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
            metadata: q.metadata.map(serde_json::Value::Object),
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
///
/// With `wait`, answers once the sandbox is in the state it names instead (200, or the wait's
/// 408/409).
async fn lifecycle(
    app: &AppState,
    caller: &Caller,
    id: SandboxId,
    request: Request,
    idem: Option<Idempotency>,
    wait: Option<(WaitFor, ConcurrencyPermit)>,
    stop: &tokio_util::sync::CancellationToken,
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
    match wait {
        Some(wait) => answer_when(app, caller, id, wait, stop).await,
        None => Ok(render_replayable(outcome)),
    }
}

macro_rules! lifecycle_route {
    ($name:ident, $path:literal, $request:expr, $what:literal) => {
        #[doc = concat!("`POST ", $path, "`: ", $what)]
        #[utoipa::path(post, path = $path, params(("id" = String, Path), WaitQuery),
            description = $what,
            request_body(content = Option<super::body::NoFields>, description = "`{}` or no body"),
            responses(
                (status = 400, description = "`invalid_request`: a body other than `{}` or none, or a `wait` the request does not settle in"),
                (status = 202, description = "Accepted; the transition is in flight", body = Sandbox),
                (status = 200, description = "Already at or heading to the target; nothing changed. With `?wait=`: the sandbox in that state", body = Sandbox),
                (status = 404, description = "`not_found`"),
                (status = 408, description = "With `?wait=`: `timeout`; the request was accepted, the sandbox is in `state`"),
                (status = 409, description = "`conflict`: a conflicting transition is in flight; `state` is the current state (with `?wait=`: also a sandbox that settled where it cannot reach the waited state)"),
                (status = 503, description = "`no_capacity` (start): the sandbox's host has no headroom and no other host can take it; `unavailable` (start, with `Retry-After`): its host is gone, lost or silent and its stop is not durable yet"),
            ), security(("bearer" = [])))]
        pub async fn $name(
            State(app): State<AppState>,
            caller: Caller,
            Path(id): Path<String>,
            headers: HeaderMap,
            shutdown: Option<Extension<StreamShutdown>>,
            query: Result<Query<WaitQuery>, axum::extract::rejection::QueryRejection>,
            body: Bytes,
        ) -> Result<Response, ApiError> {
            // No fields: `{}` or nothing; anything else is refused rather than ignored.
            let super::body::NoFields {} = super::body::json_or_empty(&body)?;
            let wait = wait_slot(&app, &caller, wait_of(query, Some($request))?)?;
            let idem = Idempotency::from_headers(&headers, "POST", $path, id.as_bytes())?;
            let stop = stop_token(shutdown);
            lifecycle(&app, &caller, parse_id(&id)?, $request, idem, wait, &stop).await
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
    "Start a `stopped` or `failed-start` sandbox on its host; settles as `running`. A `stopped` sandbox whose host is gone, lost, silent, draining, cordoned or full starts elsewhere from its durable stop (`migrating`); 503 when it cannot (not durable yet: `unavailable` with `Retry-After`; no room: `no_capacity`), except that a draining or cordoned host still starts its own. A `failed-start` clone that never ran boots from its snapshot again (`resuming`); 409 `snapshot_unavailable` once that snapshot is not `ready`."
);
lifecycle_route!(
    resume,
    "/v1/sandboxes/{id}/resume",
    Request::Start,
    "Resume: an alias of start."
);

lifecycle_route!(
    archive,
    "/v1/sandboxes/{id}/archive",
    Request::Archive,
    "Archive a `stopped` sandbox: its stop snapshot is made durable in the object store, then its local disk is freed; settles as `archived` (or back to `stopped` with the reason in its event when the upload fails). A start of an `archived` sandbox unarchives it on whatever host placement picks."
);

/// `DELETE /v1/sandboxes/{id}`: accepted from every state; repeating it changes nothing.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", params(("id" = String, Path), WaitQuery),
    responses(
        (status = 202, description = "Accepted; `deleted_at` is set and the sandbox settles as `deleted`", body = Sandbox),
        (status = 200, description = "Already being deleted or deleted (with `?wait=deleted`: deleted)", body = Sandbox),
        (status = 404, description = "`not_found`"),
        (status = 408, description = "With `?wait=`: `timeout`"),
    ), security(("bearer" = [])))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    shutdown: Option<Extension<StreamShutdown>>,
    query: Result<Query<WaitQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let wait = wait_slot(&app, &caller, wait_of(query, Some(Request::Delete))?)?;
    let stop = stop_token(shutdown);
    let id = parse_id(&id)?;
    let response = lifecycle(&app, &caller, id, Request::Delete, None, wait, &stop).await?;
    collect_now(&app, id).await?;
    Ok(response)
}

/// After a delete was accepted (`DELETE /v1/sandboxes/{id}`, the compat kill): what the
/// sandbox's durable stop or archive stored goes with it at once (issue 14). A store that
/// cannot be opened leaves it to the collector (`crate::collector`).
pub(crate) async fn collect_now(
    app: &AppState,
    id: berth_schemas::SandboxId,
) -> Result<(), crate::service::ServiceError> {
    if let Some(settings) = &app.config.object_store {
        match berth_storage::Objects::open(settings) {
            Ok(objects) => sandboxes::collect_durable(&app.db, &objects, id).await?,
            Err(error) => tracing::warn!(%error, "object store not opened; durable content kept"),
        }
    }
    Ok(())
}
