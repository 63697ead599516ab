//! Snapshot routes (issue 13 item 3): take one, list a sandbox's, read and delete one.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use berth_schemas::ids::SnapshotId;

use super::extract::{parse_path_id, NoParams, StrictQuery};
use super::idempotency::{render_replayable, stored, Idempotency};
use super::sandboxes::parse_id;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::model::snapshot::{Snapshot, SnapshotList};
use crate::service::snapshots;
use crate::AppState;

fn parse_snapshot_id(raw: &str) -> Result<SnapshotId, ApiError> {
    parse_path_id(raw, "snapshot")
}

/// `POST /v1/sandboxes/{id}/snapshot`
#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshot", params(("id" = String, Path)),
    request_body(content = Option<super::body::NoFields>, description = "`{}` or no body"),
    description = "Snapshot a running sandbox: its disk, and on gVisor its memory, stored in the object store. The sandbox is frozen briefly (`paused_ms`) and keeps running; the snapshot is `creating` until durable (`ready`) or `failed` (the sandbox is untouched either way).",
    responses(
        (status = 202, description = "Accepted; the snapshot is `creating`", body = Snapshot),
        (status = 400, description = "`invalid_request`: a body other than `{}` or none (the route takes no fields; an unknown one is named), or a query parameter (named)"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the sandbox is not `running`, or is being deleted; `state` is its state"),
        (status = 429, description = "`quota_exceeded`: `limit` names `max_snapshots` or `max_snapshot_bytes`"),
    ), security(("bearer" = [])))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    take(
        &app,
        &caller,
        &id,
        &headers,
        &body,
        "/v1/sandboxes/{id}/snapshot",
        berth_store::snapshots::KIND_SNAPSHOT,
    )
    .await
}

/// `POST /v1/sandboxes/{id}/backup`
#[utoipa::path(post, path = "/v1/sandboxes/{id}/backup", params(("id" = String, Path)),
    request_body(content = Option<super::body::NoFields>, description = "`{}` or no body"),
    description = "Back up a running sandbox: its disk (never its memory) stored in the object store, as a snapshot of kind `backup`. The sandbox is frozen briefly for the capture and keeps running; the backup is `creating` until its upload is confirmed (`ready`, and then the sandbox's `last_backup_id` and `last_backup_at` name it) or `failed`.",
    responses(
        (status = 202, description = "Accepted; the backup is `creating`", body = Snapshot),
        (status = 400, description = "`invalid_request`: a body other than `{}` or none, or a query parameter (named)"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the sandbox is not `running`, or is being deleted; `state` is its state"),
        (status = 429, description = "`quota_exceeded`: `limit` names `max_snapshots` or `max_snapshot_bytes` (backups count as snapshots)"),
    ), security(("bearer" = [])))]
pub async fn backup(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    take(
        &app,
        &caller,
        &id,
        &headers,
        &body,
        "/v1/sandboxes/{id}/backup",
        berth_store::snapshots::KIND_BACKUP,
    )
    .await
}

/// Takes a snapshot of `kind` of the caller's sandbox `id` for the route `route` (its
/// `Idempotency-Key` scope): the body is `{}` or none, anything else is refused rather than
/// ignored. 202 with the snapshot `creating`.
async fn take(
    app: &AppState,
    caller: &Caller,
    id: &str,
    headers: &HeaderMap,
    body: &Bytes,
    route: &str,
    kind: &'static str,
) -> Result<Response, ApiError> {
    let super::body::NoFields {} = super::body::json_or_empty(body)?;
    let idem = Idempotency::from_headers(headers, "POST", route, id.as_bytes())?;
    let outcome = snapshots::create(
        &app.db,
        caller.org_id,
        parse_id(id)?,
        kind,
        idem.as_ref(),
        |s| stored(StatusCode::ACCEPTED, s),
    )
    .await?;
    Ok(render_replayable(outcome))
}

/// `GET /v1/sandboxes/{id}/snapshots`
#[utoipa::path(get, path = "/v1/sandboxes/{id}/snapshots", params(("id" = String, Path)),
    responses(
        (status = 200, description = "The sandbox's snapshots, oldest first (also of a deleted sandbox)", body = SnapshotList),
        (status = 404, description = "`not_found`: no such sandbox in the caller's org"),
    ),
    security(("bearer" = [])))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
) -> Result<Json<SnapshotList>, ApiError> {
    let snapshots = snapshots::list(&app.db, caller.org_id, parse_id(&id)?).await?;
    Ok(Json(SnapshotList { snapshots }))
}

/// `GET /v1/snapshots/{id}`
#[utoipa::path(get, path = "/v1/snapshots/{id}", params(("id" = String, Path)),
    responses((status = 200, body = Snapshot), (status = 404, description = "`not_found`"),
        (status = 400, description = "`invalid_request`: a query parameter (the route takes none)")),
    security(("bearer" = [])))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
) -> Result<Json<Snapshot>, ApiError> {
    Ok(Json(
        snapshots::get(&app.db, caller.org_id, parse_snapshot_id(&id)?).await?,
    ))
}

/// `DELETE /v1/snapshots/{id}`
#[utoipa::path(delete, path = "/v1/snapshots/{id}", params(("id" = String, Path)),
    description = "Delete a `ready` or `failed` snapshot, and the stored content no other snapshot references.",
    responses(
        (status = 204, description = "Deleted"),
        (status = 400, description = "`invalid_request`: a query parameter (the route takes none)"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the snapshot is still `creating`"),
    ), security(("bearer" = [])))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
) -> Result<StatusCode, ApiError> {
    let objects = match &app.config.object_store {
        Some(settings) => Some(
            berth_storage::Objects::open(settings)
                .map_err(|e| ApiError::Internal(e.to_string()))?,
        ),
        None => None,
    };
    snapshots::delete(
        &app.db,
        objects.as_ref(),
        caller.org_id,
        parse_snapshot_id(&id)?,
    )
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
