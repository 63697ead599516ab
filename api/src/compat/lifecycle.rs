//! The OpenSandbox lifecycle routes (`/compat/opensandbox/v1/…`), each answering with the
//! exact success status the SDK's generated client parses: 202 create, 200 get and list, 204
//! delete, 202 pause and resume (empty bodies), 200 renew-expiration and endpoints.
//!
//! Pause is Berth's stop and resume its start: on gVisor (runsc) a stop keeps memory, so
//! processes continue after a resume; on runc a stop keeps the disk only and a resume boots
//! from it (the entrypoint is started again; other processes are gone).

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use berth_schemas::preview::PreviewToken;
use berth_schemas::state::Request;
use berth_schemas::{SandboxId, SandboxState};
use berth_store::SandboxRow;
use chrono::Utc;
use serde_json::json;

use super::model::{self, CreateBody, Pagination, RenewBody, SandboxShown};
use super::{CompatError, EGRESS_PORT, EXECD_PORT, EXECD_TOKEN_HEADER, MOUNT};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::http::idempotency::stored;
use crate::model::settings::{expiry_at, Renewal};
use crate::preview::access::TOKEN_HEADER;
use crate::service::sandboxes::{self, PlacementPolicy};
use crate::AppState;

/// Default page size of the list (the SDK's).
pub const DEFAULT_PAGE_SIZE: u32 = 20;
/// Largest page size of the list.
pub const MAX_PAGE_SIZE: u32 = 500;
/// The most sandboxes one list looks at (newest first): pages beyond them are empty.
pub const MAX_LISTED: i64 = 10_000;

/// Parses a sandbox id; one that does not parse is not found.
fn parse_id(raw: &str) -> Result<SandboxId, CompatError> {
    raw.parse().map_err(|_| {
        CompatError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("sandbox {raw} not found"),
        )
    })
}

/// A JSON body, or a 400 naming what serde complained about.
fn body<T: serde::de::DeserializeOwned>(raw: &Bytes) -> Result<T, CompatError> {
    let Json(value) = Json::<T>::from_bytes(raw)
        .map_err(|e| CompatError::new(StatusCode::BAD_REQUEST, "invalid_request", e.body_text()))?;
    Ok(value)
}

/// The org's sandbox, as a row.
async fn row(app: &AppState, caller: &Caller, id: SandboxId) -> Result<SandboxRow, CompatError> {
    berth_store::sandboxes::get(&app.db, caller.org_id, id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("sandbox {id}")).into())
}

/// `POST /v1/sandboxes` → 202 with the new sandbox (`Pending`).
pub async fn create(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    raw: Bytes,
) -> Result<Response, CompatError> {
    let mut valid = body::<CreateBody>(&raw)?.validate(app.config.disk)?;
    let by_image = valid.by_image;
    if let Some(uri) = valid.create.image_uri.clone() {
        valid.create.template = super::image::template_for(&app, &uri).await?;
    }
    let template = valid.create.template.clone();
    let policy = PlacementPolicy {
        heartbeat_freshness: app.config.heartbeat_freshness,
        overcommit: app.config.overcommit,
    };
    let created = sandboxes::create(&app.db, policy, caller.org_id, valid.create, None, |s| {
        stored(StatusCode::ACCEPTED, s)
    })
    .await
    .map_err(ApiError::from)
    .map_err(|e| match e {
        // The image's template was deleted between its pull and this create.
        ApiError::UnknownTemplate(_) if by_image => CompatError::new(
            StatusCode::CONFLICT,
            "template_not_ready",
            format!("the template {template} of this image was deleted meanwhile; create again"),
        ),
        ApiError::UnknownTemplate(_) => CompatError::new(
            StatusCode::BAD_REQUEST,
            "unknown_template",
            format!("templateId {template:?} names no template of this Berth"),
        ),
        other => other.into(),
    })?;
    let id = match created {
        crate::service::idempotency::Replayable::Fresh(sandbox, _) => sandbox.id,
        crate::service::idempotency::Replayable::Replayed(_) => {
            return Err(ApiError::Internal("a create without a key was replayed".into()).into())
        }
    };
    let shown = SandboxShown::from(&row(&app, &caller, id).await?);
    let mut answer = json!({
        "id": shown.id,
        "status": shown.status,
        "createdAt": shown.created_at,
        "entrypoint": shown.entrypoint,
        "metadata": shown.metadata,
    });
    if let Some(at) = shown.expires_at {
        answer["expiresAt"] = json!(at);
    }
    Ok((StatusCode::ACCEPTED, Json(answer)).into_response())
}

/// `GET /v1/sandboxes/{id}` → 200.
pub async fn get(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<SandboxShown>, CompatError> {
    let row = row(&app, &caller, parse_id(&id)?).await?;
    Ok(Json(SandboxShown::from(&row)))
}

/// `GET /v1/sandboxes?state=…&metadata=k=v&page=&pageSize=`: `state` is repeatable (any of
/// them), `metadata` is one parameter holding `k=v` pairs joined by `&` and percent-encoded
/// once more (the SDK's `encode_metadata_filter`), every pair must match. Newest first.
pub async fn list(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    query: Result<Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<serde_json::Value>, CompatError> {
    let Query(pairs) = query
        .map_err(|e| CompatError::new(StatusCode::BAD_REQUEST, "invalid_request", e.body_text()))?;
    let (mut states, mut wanted) = (Vec::<SandboxState>::new(), Vec::<String>::new());
    let (mut metadata, mut page, mut page_size) = (None, 1u32, DEFAULT_PAGE_SIZE);
    let number = |name: &str, value: &str| {
        value
            .parse::<u32>()
            .map_err(|_| CompatError::invalid(name, format!("{value:?} is not a number")))
    };
    for (name, value) in &pairs {
        match name.as_str() {
            "state" => {
                let covered = model::berth_states(value).ok_or_else(|| {
                    CompatError::invalid("state", format!("{value:?} is not an OpenSandbox state"))
                })?;
                wanted.push(value.clone());
                states.extend(covered);
            }
            "metadata" => metadata = Some(metadata_filter(value)?),
            "page" => page = number("page", value)?,
            "pageSize" => page_size = number("pageSize", value)?,
            other => {
                return Err(CompatError::invalid(
                    other,
                    "unknown query parameter (state, metadata, page, pageSize)",
                ))
            }
        }
    }
    if page == 0 || !(1..=MAX_PAGE_SIZE).contains(&page_size) {
        return Err(CompatError::invalid(
            "pageSize",
            format!("page is from 1 and pageSize 1 to {MAX_PAGE_SIZE}"),
        ));
    }
    let rows = berth_store::sandboxes::list_in_states(
        &app.db,
        caller.org_id,
        &states,
        metadata.as_ref(),
        MAX_LISTED,
    )
    .await?;
    let matching: Vec<SandboxShown> = rows
        .iter()
        .map(SandboxShown::from)
        .filter(|s| wanted.is_empty() || wanted.iter().any(|w| w == s.status.state))
        .collect();
    let total = matching.len() as u64;
    let size = u64::from(page_size);
    let start = (u64::from(page) - 1).saturating_mul(size);
    let items: Vec<&SandboxShown> = matching
        .iter()
        .skip(start.min(total) as usize)
        .take(page_size as usize)
        .collect();
    Ok(Json(json!({
        "items": items,
        "pagination": Pagination {
            page,
            page_size,
            total_items: total,
            total_pages: total.div_ceil(size),
            has_next_page: start + size < total,
        },
    })))
}

/// The `metadata` parameter's pairs as a JSON object of strings.
///
/// Errors: 400 naming `metadata` for a pair without `=` or beyond the metadata bounds.
fn metadata_filter(value: &str) -> Result<serde_json::Value, CompatError> {
    let mut filter = serde_json::Map::new();
    for pair in value.split('&').filter(|p| !p.is_empty()) {
        if !pair.contains('=') {
            return Err(CompatError::invalid(
                "metadata",
                format!("{pair:?} is not key=value"),
            ));
        }
    }
    for (key, value) in url::form_urlencoded::parse(value.as_bytes()) {
        let value = serde_json::Value::String(value.into_owned());
        crate::model::check_metadata_entry(&key, Some(&value))?;
        filter.insert(key.into_owned(), value);
    }
    if filter.len() > crate::model::MAX_METADATA_KEYS {
        return Err(crate::model::too_many_keys().into());
    }
    Ok(serde_json::Value::Object(filter))
}

/// Runs a lifecycle request (Berth's stop, start or delete).
async fn lifecycle(
    app: &AppState,
    caller: &Caller,
    id: &str,
    request: Request,
) -> Result<(), CompatError> {
    sandboxes::lifecycle(
        &app.db,
        app.config.overcommit,
        caller.org_id,
        parse_id(id)?,
        request,
        None,
        |_| stored(StatusCode::ACCEPTED, &()),
    )
    .await?;
    Ok(())
}

/// `DELETE /v1/sandboxes/{id}` → 204 (also when already being deleted).
pub async fn kill(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, CompatError> {
    lifecycle(&app, &caller, &id, Request::Delete).await?;
    // As Berth's own delete: the durable stop's stored content goes with the sandbox.
    crate::http::sandboxes::collect_now(&app, parse_id(&id)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/sandboxes/{id}/pause` → 202, empty: Berth's stop (memory kept on gVisor, the disk
/// only on runc). 409 while a conflicting transition is in flight.
pub async fn pause(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, CompatError> {
    lifecycle(&app, &caller, &id, Request::Stop).await?;
    Ok(StatusCode::ACCEPTED)
}

/// `POST /v1/sandboxes/{id}/resume` → 202, empty: Berth's start.
pub async fn resume(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<StatusCode, CompatError> {
    lifecycle(&app, &caller, &id, Request::Start).await?;
    Ok(StatusCode::ACCEPTED)
}

/// `POST /v1/sandboxes/{id}/renew-expiration` `{"expiresAt"}` → 200 `{"expiresAt"}`; a time
/// not in the future (or more than a year ahead) is 400.
pub async fn renew(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Json<serde_json::Value>, CompatError> {
    let id = parse_id(&id)?;
    let RenewBody { expires_at } = body(&raw)?;
    let until = expiry_at("expiresAt", &expires_at, Utc::now())?;
    let renewed = crate::service::settings::renew(
        &app.db,
        caller.org_id,
        id,
        Renewal::Until(until),
        None,
        |s| stored(StatusCode::OK, s),
    )
    .await?;
    let at = match renewed {
        crate::service::idempotency::Replayable::Fresh(sandbox, _) => sandbox.expires_at,
        crate::service::idempotency::Replayable::Replayed(_) => Some(until),
    };
    Ok(Json(json!({ "expiresAt": at.map(model::time) })))
}

/// `GET /v1/sandboxes/{id}/endpoints/{port}` → 200 `{"endpoint": "host:port/path", "headers"}`
/// (no scheme; the SDK adds its own). Port 44772 is the execd surface, authorised by the
/// sandbox's execd token in `headers`; 18080, the egress sidecar, answers 501 on every route;
/// any other port is the sandbox's own, through the preview path route with a preview token
/// (503 `not_configured` without a preview secret). The host is the one the SDK called.
pub async fn endpoint(
    State(app): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((id, port)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, CompatError> {
    let id = parse_id(&id)?;
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| CompatError::invalid("port", "must be 1 to 65535"))?;
    if port == berth_schemas::preview::AGENT_PORT {
        return Err(CompatError::invalid(
            "port",
            "is Berth's agent's port: it has no endpoint",
        ));
    }
    let row = row(&app, &caller, id).await?;
    if row.deleting() {
        return Err(ApiError::NotFound(format!("sandbox {id}")).into());
    }
    let host = authority(&headers, &app);
    let answer = match port {
        EXECD_PORT => {
            let fresh = hex::encode(rand::random::<[u8; 32]>());
            let token = berth_store::sandboxes::execd_token(&app.db, caller.org_id, id, &fresh)
                .await?
                .ok_or_else(|| ApiError::NotFound(format!("sandbox {id}")))?;
            json!({
                "endpoint": format!("{host}{MOUNT}/execd/{id}"),
                "headers": { EXECD_TOKEN_HEADER: token },
            })
        }
        EGRESS_PORT => json!({
            "endpoint": format!("{host}{MOUNT}/egress/{id}"),
            "headers": {},
        }),
        port => {
            let config = app.preview.config();
            let key = config
                .token_key()
                .ok_or_else(|| ApiError::NotConfigured("previews are not configured".into()))?;
            let expires = Utc::now() + chrono::Duration::seconds(config.token_ttl.as_secs() as i64);
            let token = PreviewToken {
                sandbox: id,
                port,
                expires: expires.timestamp(),
            }
            .sign(&key);
            json!({
                "endpoint": format!("{host}/v1/sandboxes/{id}/ports/{port}"),
                "headers": { TOKEN_HEADER: token },
            })
        }
    };
    Ok(Json(answer))
}

/// The `Host` the SDK called (what it can reach), else the API's listen address.
fn authority(headers: &HeaderMap, app: &AppState) -> String {
    headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .filter(|h| {
            !h.is_empty()
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
        })
        .map_or_else(|| app.config.listen.to_string(), str::to_owned)
}

/// `POST /v1/metrics/events`: the SDK's telemetry, accepted and dropped (204).
pub async fn telemetry() -> StatusCode {
    StatusCode::NO_CONTENT
}
