//! Restore, clone and fork routes (issue 13 items 5–7), and the clone form of
//! `POST /v1/sandboxes {snapshot_id, …}`. Each parses its body, calls
//! [`crate::service::resume`] and renders the answer; `?wait=running` works as on a create.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Extension;
use berth_schemas::ids::SnapshotId;
use berth_schemas::state::Request;

use super::events::StreamShutdown;
use super::extract::{NoParams, StrictQuery};
use super::idempotency::{render_replayable, stored, Idempotency};
use super::sandboxes::{parse_id, wait_of};
use super::settings::{answer_when, stop_token, wait_slot, WaitFor, WaitQuery};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::limits::ConcurrencyPermit;
use crate::model::snapshot::{Fork, ForkRequest, FromBackup, FromSnapshot};
use crate::model::{CreateSandbox, Sandbox};
use crate::service::backup;
use crate::service::idempotency::Replayable;
use crate::service::resume::{self, CloneSettings};
use crate::service::sandboxes::PlacementPolicy;
use crate::AppState;

/// The fields of a create body a clone takes from its snapshot instead.
const SNAPSHOT_FIELDS: [&str; 4] = ["template", "vcpus", "memory_mib", "disk_mib"];

fn policy(app: &AppState) -> PlacementPolicy {
    PlacementPolicy {
        heartbeat_freshness: app.config.heartbeat_freshness,
        overcommit: app.config.overcommit,
    }
}

fn body_of<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    super::body::json(body)
}

/// Answers `outcome`, or with a wait, the sandbox once it is `running`.
async fn answer(
    app: &AppState,
    caller: &Caller,
    outcome: Replayable<Sandbox>,
    wait: Option<(WaitFor, ConcurrencyPermit)>,
    shutdown: Option<Extension<StreamShutdown>>,
) -> Result<Response, ApiError> {
    let Some(wait) = wait else {
        return Ok(render_replayable(outcome));
    };
    let id = match &outcome {
        Replayable::Fresh(sandbox, _) => Some(sandbox.id),
        Replayable::Replayed(stored) => stored.body["id"].as_str().and_then(|s| s.parse().ok()),
    };
    match id {
        Some(id) => answer_when(app, caller, id, wait, &stop_token(shutdown)).await,
        None => Ok(render_replayable(outcome)),
    }
}

/// `POST /v1/sandboxes/{id}/restore`
#[utoipa::path(post, path = "/v1/sandboxes/{id}/restore", request_body = FromSnapshot,
    params(("id" = String, Path), WaitQuery),
    description = "Rebuild a running or stopped sandbox from one of its own ready snapshots: `resuming` at the next generation, then `running`. Files written after the snapshot are gone; on a memory snapshot (gVisor) its processes continue from it.",
    responses(
        (status = 202, description = "Accepted; the sandbox is `resuming`", body = Sandbox),
        (status = 200, description = "With `?wait=running`: the sandbox running again", body = Sandbox),
        (status = 400, description = "`invalid_request`: malformed body"),
        (status = 404, description = "`not_found`: the sandbox, or a snapshot of it"),
        (status = 409, description = "`conflict`: the sandbox's state refuses a restore (`state`), or the snapshot is not `ready`"),
        (status = 429, description = "`quota_exceeded`: a stopped sandbox's size would pass the org's quota"),
        (status = 503, description = "`no_capacity`: a stopped sandbox's host has no headroom"),
    ), security(("bearer" = [])))]
pub async fn restore(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    shutdown: Option<Extension<StreamShutdown>>,
    query: Result<Query<WaitQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let wait = wait_slot(&app, &caller, wait_of(query, Some(Request::Restore))?)?;
    let idem = Idempotency::from_headers(
        &headers,
        "POST",
        &format!("/v1/sandboxes/{id}/restore"),
        &body,
    )?;
    let FromSnapshot { snapshot_id } = body_of(&body)?;
    let outcome = resume::restore(
        &app.db,
        policy(&app),
        caller.org_id,
        parse_id(&id)?,
        snapshot_id,
        idem.as_ref(),
        |s| stored(StatusCode::ACCEPTED, s),
    )
    .await?;
    answer(&app, &caller, outcome, wait, shutdown).await
}

/// `POST /v1/sandboxes/{id}/restore-from-backup`
#[utoipa::path(post, path = "/v1/sandboxes/{id}/restore-from-backup",
    request_body(content = Option<FromBackup>, description = "`{\"backup_id\": …}`, or `{}` / no body for the newest ready backup"),
    params(("id" = String, Path), WaitQuery),
    description = "Rebuild a sandbox from one of its backups on a new placement (any host in service, its own included): what its host held is released, the backup's disk is fetched onto the host placement picks and cold-booted there (`restoring`, then `running`). Memory is not restored, and whatever the sandbox wrote since the backup is discarded, including its stop snapshot. A restore that fails leaves it `failed-start`, and a start of it boots the backup again. Accepted from `running`, `stopped`, `failed-start` and `archived`; a sandbox already `restoring` is returned as it is.",
    responses(
        (status = 202, description = "Accepted; the sandbox is `restoring`", body = Sandbox),
        (status = 200, description = "With `?wait=running`: the sandbox running from its backup", body = Sandbox),
        (status = 400, description = "`invalid_request`: malformed body"),
        (status = 404, description = "`not_found`: the sandbox, or the backup named is not one of its own"),
        (status = 409, description = "`conflict`: the sandbox's state refuses it (`state`); `snapshot_unavailable`: it has no ready backup; the backup named is not `ready` or is a user snapshot"),
        (status = 429, description = "`quota_exceeded`: a sandbox holding no capacity would pass the org's quota"),
        (status = 503, description = "`no_capacity` or `unavailable`, as a create"),
    ), security(("bearer" = [])))]
pub async fn restore_from_backup(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    shutdown: Option<Extension<StreamShutdown>>,
    query: Result<Query<WaitQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let wait = wait_slot(
        &app,
        &caller,
        wait_of(query, Some(Request::RestoreFromBackup))?,
    )?;
    let idem = Idempotency::from_headers(
        &headers,
        "POST",
        &format!("/v1/sandboxes/{id}/restore-from-backup"),
        &body,
    )?;
    let FromBackup { backup_id } = super::body::json_or_empty(&body)?;
    let outcome = backup::restore_from_backup(
        &app.db,
        policy(&app),
        caller.org_id,
        parse_id(&id)?,
        backup_id,
        idem.as_ref(),
        |s| stored(StatusCode::ACCEPTED, s),
    )
    .await?;
    answer(&app, &caller, outcome, wait, shutdown).await
}

/// `POST /v1/sandboxes/{id}/clone`
#[utoipa::path(post, path = "/v1/sandboxes/{id}/clone", request_body = FromSnapshot,
    params(("id" = String, Path), WaitQuery),
    description = "A new sandbox booted from a ready snapshot of this one, on any host (from the host's cached chunks or the object store), with this sandbox's settings and the snapshot's template and size: `resuming`, then `running`. On a memory snapshot (gVisor) its processes continue; it has its own id and address.",
    responses(
        (status = 202, description = "Accepted; the new sandbox is `resuming`", body = Sandbox),
        (status = 200, description = "With `?wait=running`: the new sandbox running", body = Sandbox),
        (status = 400, description = "`invalid_request`: malformed body"),
        (status = 404, description = "`not_found`: the sandbox (also once deleted), or a snapshot of it"),
        (status = 409, description = "`conflict`: the sandbox is not settled (`running`, `stopped`, `failed-start`, `archived`) or is being deleted (`state`), or the snapshot is not `ready`"),
        (status = 429, description = "`quota_exceeded`"),
        (status = 503, description = "`no_capacity` or `unavailable`, as a create"),
    ), security(("bearer" = [])))]
pub async fn clone(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    shutdown: Option<Extension<StreamShutdown>>,
    query: Result<Query<WaitQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let wait = wait_slot(&app, &caller, wait_of(query, None)?)?;
    let idem = Idempotency::from_headers(
        &headers,
        "POST",
        &format!("/v1/sandboxes/{id}/clone"),
        &body,
    )?;
    let FromSnapshot { snapshot_id } = body_of(&body)?;
    let outcome = resume::clone(
        &app.db,
        policy(&app),
        caller.org_id,
        Some(parse_id(&id)?),
        snapshot_id,
        CloneSettings::FromSource,
        idem.as_ref(),
        |s| stored(StatusCode::ACCEPTED, s),
    )
    .await?;
    answer(&app, &caller, outcome, wait, shutdown).await
}

/// `POST /v1/sandboxes/{id}/fork`
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", request_body = ForkRequest,
    params(("id" = String, Path)),
    description = "A snapshot of this running sandbox and `count` (1 to 16) new sandboxes booted from it, in one call, with this sandbox's settings and its `expires_at`. The clones are `resuming` until the snapshot is durable and they run; on gVisor each continues this sandbox's processes, with its own id and address.",
    responses(
        (status = 202, description = "Accepted: the snapshot (`creating`) and the new sandboxes (`resuming`)", body = Fork),
        (status = 400, description = "`invalid_request`: `count` out of range, malformed body, or a query parameter (named; the route takes none)"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the sandbox is not `running`, or is being deleted"),
        (status = 429, description = "`quota_exceeded`: snapshots or sandboxes; nothing was written"),
        (status = 503, description = "`no_capacity` (with `Retry-After`, counting the fork's sandboxes) or `unavailable` for one of the clones; nothing was written"),
    ), security(("bearer" = [])))]
pub async fn fork(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let idem =
        Idempotency::from_headers(&headers, "POST", &format!("/v1/sandboxes/{id}/fork"), &body)?;
    let ForkRequest { count } = body_of(&body)?;
    let outcome = resume::fork(
        &app.db,
        policy(&app),
        caller.org_id,
        parse_id(&id)?,
        count,
        idem.as_ref(),
        |f: &Fork| stored(StatusCode::ACCEPTED, f),
    )
    .await?;
    Ok(render_replayable(outcome))
}

/// The snapshot a create body names (`snapshot_id`), taken out of `body`, with the body's
/// other fields; `None` for a plain create. A clone's template and size are its snapshot's:
/// a body that names them is refused.
///
/// Errors: [`ApiError::InvalidRequest`] naming `snapshot_id` or the refused field.
pub(crate) fn clone_request(body: &[u8]) -> Result<Option<(SnapshotId, CreateSandbox)>, ApiError> {
    let Ok(serde_json::Value::Object(mut fields)) = serde_json::from_slice(body) else {
        return Ok(None);
    };
    let Some(raw) = fields.remove("snapshot_id") else {
        return Ok(None);
    };
    let snapshot_id = raw
        .as_str()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ApiError::invalid("snapshot_id", "snapshot_id must be a snapshot's id"))?;
    if let Some(field) = SNAPSHOT_FIELDS
        .into_iter()
        .find(|f| fields.contains_key(*f))
    {
        return Err(ApiError::invalid(
            field,
            format!("a sandbox made from a snapshot takes its {field} from the snapshot"),
        ));
    }
    let rest = serde_json::to_vec(&fields).map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Some((snapshot_id, body_of(&rest)?)))
}

/// `POST /v1/sandboxes {snapshot_id, …}`: the rest of a create for a clone (its body already
/// split by [`clone_request`]).
pub(crate) async fn create_from_snapshot(
    app: &AppState,
    caller: &Caller,
    snapshot_id: SnapshotId,
    create: CreateSandbox,
    idem: Option<Idempotency>,
    wait: Option<(WaitFor, ConcurrencyPermit)>,
    shutdown: Option<Extension<StreamShutdown>>,
) -> Result<Response, ApiError> {
    let req = create.validate(app.config.disk)?;
    req.network
        .check_tenant(app.config.sandbox_egress_private)
        .map_err(|e| ApiError::invalid("network", e.0))?;
    let outcome = resume::clone(
        &app.db,
        policy(app),
        caller.org_id,
        None,
        snapshot_id,
        CloneSettings::Given(Box::new(req)),
        idem.as_ref(),
        |s| stored(StatusCode::ACCEPTED, s),
    )
    .await?;
    answer(app, caller, outcome, wait, shutdown).await
}
