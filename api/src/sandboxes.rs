//! Sandbox routes: create, get, list, the lifecycle requests (stop/pause, start/resume,
//! delete), and events. Each state change commits its row, command and event in one
//! transaction (guarantee 1); the relay publishes the command afterwards.

use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use berth_scheduler::placement;
use berth_schemas::db::{
    insert_command, insert_event, write_transition, NewEvent, SandboxSnapshot, Transition,
    SNAPSHOT_COLUMNS,
};
use berth_schemas::state::{on_request, Decision, Reason, Refusal, Request};
use berth_schemas::wire::{Command, SandboxSpec};
use berth_schemas::{CommandId, CommandKind, Generation, SandboxId, SandboxState};
use serde::Deserialize;
use sqlx::Row;
use tracing::{info, instrument};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::idempotency::{commit_with_replay, Idempotency};
use crate::model::{CreateSandbox, Event, Sandbox, SandboxList, Template, SANDBOX_COLUMNS};
use crate::AppState;

/// Default page size of `GET /v1/sandboxes`.
pub const DEFAULT_PAGE_SIZE: u32 = 50;
/// Largest page size of `GET /v1/sandboxes`.
pub const MAX_PAGE_SIZE: u32 = 500;

/// Maps axum's JSON rejection to a 400 that names the field serde complained about.
pub(crate) fn json_error(rejection: JsonRejection) -> ApiError {
    let text = rejection.body_text();
    // axum reports "...: <path>: <serde message>" for data errors; the path is the field.
    let field = text
        .split_once("target type: ")
        .and_then(|(_, rest)| rest.split_once(": "))
        .map(|(path, _)| path.to_owned())
        .filter(|p| !p.contains(' '));
    ApiError::InvalidRequest {
        field,
        message: text,
    }
}

pub(crate) fn parse_id(raw: &str) -> Result<SandboxId, ApiError> {
    parse_path_id(raw, "sandbox")
}

/// Parses an id from a path; one that does not parse names nothing, so it is "not found".
pub(crate) fn parse_path_id<T: std::str::FromStr>(raw: &str, what: &str) -> Result<T, ApiError> {
    raw.parse()
        .map_err(|_| ApiError::NotFound(format!("{what} {raw}")))
}

/// `POST /v1/sandboxes`
#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandbox,
    responses(
        (status = 202, description = "Accepted; the sandbox is `provisioning`", body = Sandbox),
        (status = 400, description = "`invalid_request`: malformed JSON or a size out of range (the field is named)"),
        (status = 429, description = "`quota_exceeded`: the org's quota (`limit` names it) would be passed"),
        (status = 422, description = "`unknown_template`, or `idempotency_key_reused`: the Idempotency-Key was used for a different request"),
        (status = 401, description = "`unauthorized`"),
        (status = 503, description = "`no_capacity`: no ready host has the headroom; nothing was written"),
    ), security(("bearer" = [])))]
#[instrument(skip_all, fields(org_id = %caller.org_id))]
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
    let req = create.validate()?;
    let mut tx = app.db.begin().await?;
    if let Some(idem) = &idem {
        if let Some(stored) = idem.replay(&mut tx, caller.org_id).await? {
            return Ok(stored);
        }
    }
    let known = sqlx::query("SELECT 1 FROM templates WHERE name = $1")
        .bind(&req.template)
        .fetch_optional(&mut *tx)
        .await?;
    if known.is_none() {
        return Err(ApiError::UnknownTemplate(req.template));
    }
    crate::quota::check(&mut tx, caller.org_id, req.resources).await?;
    let Some(host) = placement::place(
        &mut tx,
        req.resources,
        app.config.heartbeat_freshness,
        app.config.overcommit,
    )
    .await?
    else {
        // Dropping the transaction rolls back: nothing is written.
        return Err(ApiError::NoCapacity {
            vcpus: req.resources.vcpus,
            memory_mib: req.resources.memory_mib,
        });
    };
    let id = SandboxId::new();
    let generation = Generation::INITIAL;
    let row = sqlx::query(&format!(
        "INSERT INTO sandboxes (id, org_id, template, host_id, state, generation, vcpus,
                                memory_mib, holds_capacity, metadata, auto_stop_minutes,
                                auto_delete_minutes)
         VALUES ($1, $2, $3, $4, 'provisioning', $5, $6, $7, true, $8, $9, $10)
         RETURNING {SANDBOX_COLUMNS}"
    ))
    .bind(id)
    .bind(caller.org_id)
    .bind(&req.template)
    .bind(host)
    .bind(generation)
    .bind(i32::try_from(req.resources.vcpus).unwrap_or(i32::MAX))
    .bind(i32::try_from(req.resources.memory_mib).unwrap_or(i32::MAX))
    .bind(&req.metadata)
    .bind(req.auto_stop_minutes)
    .bind(req.auto_delete_minutes)
    .fetch_one(&mut *tx)
    .await?;
    let command = Command {
        id: CommandId::new(),
        sandbox_id: id,
        generation,
        kind: CommandKind::Create,
        spec: SandboxSpec {
            org_id: caller.org_id,
            template: req.template,
            resources: req.resources,
        },
    };
    insert_command(&mut tx, host, &command).await?;
    insert_event(
        &mut tx,
        &NewEvent {
            sandbox_id: id,
            org_id: caller.org_id,
            from: None,
            to: SandboxState::Provisioning,
            reason: Reason::UserRequest,
            generation,
            command_id: Some(command.id),
            message: None,
        },
    )
    .await?;
    let sandbox = Sandbox::from_row(&row)?;
    let response = commit_with_replay(
        tx,
        &app.db,
        caller.org_id,
        idem.as_ref(),
        StatusCode::ACCEPTED,
        &sandbox,
    )
    .await?;
    metrics::counter!("berth_sandboxes_created_total").increment(1);
    info!(sandbox_id = %id, host_id = %host, "sandbox placed");
    Ok(response)
}

/// Reads one sandbox of the caller's org; another org's sandbox is "not found".
pub(crate) async fn fetch(
    app: &AppState,
    caller: &Caller,
    id: SandboxId,
) -> Result<Sandbox, ApiError> {
    let row = sqlx::query(&format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = $1 AND org_id = $2"
    ))
    .bind(id)
    .bind(caller.org_id)
    .fetch_optional(&app.db)
    .await?
    .ok_or_else(|| ApiError::NotFound(format!("sandbox {id}")))?;
    Sandbox::from_row(&row)
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
    let rows = sqlx::query(&format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes
          WHERE org_id = $1
            AND ($2::text IS NULL AND state <> 'deleted' OR state = $2)
            AND ($3::uuid IS NULL OR id < $3)
          ORDER BY id DESC
          LIMIT $4"
    ))
    .bind(caller.org_id)
    .bind(state.map(SandboxState::as_str))
    .bind(cursor)
    .bind(i64::from(limit) + 1)
    .fetch_all(&app.db)
    .await?;
    let mut sandboxes = rows
        .iter()
        .map(Sandbox::from_row)
        .collect::<Result<Vec<_>, _>>()?;
    let next_cursor = if sandboxes.len() > limit as usize {
        sandboxes.truncate(limit as usize);
        sandboxes.last().map(|s| s.id.to_string())
    } else {
        None
    };
    Ok(Json(SandboxList {
        sandboxes,
        next_cursor,
    }))
}

/// Decides and, when it changes something, commits a lifecycle request: the row (new state,
/// next generation), a reservation when a start needs capacity again, the command and the
/// event, in one transaction. Returns 202 with the sandbox when something changed, 200 when the
/// sandbox is already at or heading to the target.
#[instrument(skip_all, fields(org_id = %caller.org_id, sandbox_id = %id, request = %request))]
pub(crate) async fn lifecycle(
    app: &AppState,
    caller: &Caller,
    id: SandboxId,
    request: Request,
    idem: Option<Idempotency>,
) -> Result<Response, ApiError> {
    let mut tx = app.db.begin().await?;
    if let Some(idem) = &idem {
        if let Some(stored) = idem.replay(&mut tx, caller.org_id).await? {
            return Ok(stored);
        }
    }
    let row = sqlx::query(&format!(
        "SELECT {SNAPSHOT_COLUMNS} FROM sandboxes WHERE id = $1 AND org_id = $2 FOR UPDATE"
    ))
    .bind(id)
    .bind(caller.org_id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| ApiError::NotFound(format!("sandbox {id}")))?;
    let snap = SandboxSnapshot::from_row(&row)?;
    let decision =
        on_request(snap.state, snap.deleting, request).map_err(|refusal| match refusal {
            Refusal::Conflict { state, .. } => ApiError::Conflict {
                state,
                message: refusal.to_string(),
            },
        })?;
    let (to, kind) = match decision {
        Decision::Unchanged => {
            let current = read_in(&mut tx, id).await?;
            return commit_with_replay(
                tx,
                &app.db,
                caller.org_id,
                idem.as_ref(),
                StatusCode::OK,
                &current,
            )
            .await;
        }
        Decision::Transition { to, command } => (to, command),
    };
    let host = snap
        .host_id
        .ok_or_else(|| ApiError::Internal(format!("sandbox {id} has no host")))?;
    let mut holds_capacity = snap.holds_capacity;
    if kind == CommandKind::Start && !holds_capacity {
        crate::quota::check(&mut tx, caller.org_id, snap.resources).await?;
        let admitted = placement::reserve(
            &mut tx,
            host,
            snap.resources,
            app.config.overcommit,
            placement::Admit::ResidentSandbox,
        )
        .await?;
        if !admitted {
            return Err(ApiError::NoCapacity {
                vcpus: snap.resources.vcpus,
                memory_mib: snap.resources.memory_mib,
            });
        }
        holds_capacity = true;
    }
    let (generation, command_id) = write_transition(
        &mut tx,
        &snap,
        &Transition {
            to,
            command: Some(kind),
            reason: Reason::UserRequest,
            holds_capacity,
            delete: kind == CommandKind::Delete,
            message: None,
        },
    )
    .await?;
    sqlx::query("UPDATE sandboxes SET last_activity_at = now() WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    let sandbox = read_in(&mut tx, id).await?;
    let response = commit_with_replay(
        tx,
        &app.db,
        caller.org_id,
        idem.as_ref(),
        StatusCode::ACCEPTED,
        &sandbox,
    )
    .await?;
    info!(command_id = ?command_id, generation = %generation, to = %to, "lifecycle request accepted");
    Ok(response)
}

async fn read_in(conn: &mut sqlx::PgConnection, id: SandboxId) -> Result<Sandbox, ApiError> {
    let row = sqlx::query(&format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = $1"
    ))
    .bind(id)
    .fetch_one(conn)
    .await?;
    Sandbox::from_row(&row)
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

/// `GET /v1/sandboxes/{id}/events`: the sandbox's state changes, oldest first.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/events", params(("id" = String, Path)),
    responses((status = 200, body = [Event]), (status = 404, description = "`not_found`")),
    security(("bearer" = [])))]
pub async fn events(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Vec<Event>>, ApiError> {
    let sandbox = fetch(&app, &caller, parse_id(&id)?).await?;
    let rows = sqlx::query(
        "SELECT id, sandbox_id, type, from_state, to_state, reason, generation, message, at
           FROM events WHERE sandbox_id = $1 AND org_id = $2 ORDER BY id",
    )
    .bind(sandbox.id)
    .bind(caller.org_id)
    .fetch_all(&app.db)
    .await?;
    let events = rows
        .iter()
        .map(|r| {
            Ok(Event {
                id: r.try_get("id")?,
                sandbox_id: r.try_get("sandbox_id")?,
                kind: r.try_get("type")?,
                from: r.try_get("from_state")?,
                to: r.try_get("to_state")?,
                reason: r.try_get("reason")?,
                generation: r.try_get("generation")?,
                message: r.try_get("message")?,
                at: r.try_get("at")?,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    Ok(Json(events))
}

/// `GET /v1/templates`
#[utoipa::path(get, path = "/v1/templates", responses((status = 200, body = [Template])),
    security(("bearer" = [])))]
pub async fn templates(
    State(app): State<AppState>,
    _caller: Caller,
) -> Result<Json<Vec<Template>>, ApiError> {
    let rows = sqlx::query("SELECT name, description, runtime FROM templates ORDER BY name")
        .fetch_all(&app.db)
        .await?;
    Ok(Json(
        rows.iter()
            .map(|r| {
                Ok(Template {
                    name: r.try_get("name")?,
                    description: r.try_get("description")?,
                    runtime: r.try_get("runtime")?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?,
    ))
}
