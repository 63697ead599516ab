//! `GET /v1/templates` (the templates a create may name; any key, an org's or an operator's), `POST /v1/templates` (a template
//! pulled from an OCI image) and `GET /v1/templates/{name}` (one, with its pull's events).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;

use super::extract::{NoParams, StrictQuery};
use super::idempotency::{render_replayable, stored, Idempotency};
use crate::auth::{Admin, Authenticated};
use crate::error::ApiError;
use crate::model::{CreateTemplate, Template};
use crate::service;
use crate::AppState;

/// The runtime of a template pulled from an image when the request names none: gVisor, whose
/// stop keeps memory.
pub const DEFAULT_IMAGE_RUNTIME: &str = "runsc";

/// `GET /v1/templates`
#[utoipa::path(get, path = "/v1/templates", tag = "sandboxes", responses((status = 200, body = [Template])),
    security(("bearer" = [])))]
pub async fn templates(
    State(app): State<AppState>,
    _caller: Authenticated,
    _query: StrictQuery<NoParams>,
) -> Result<Json<Vec<Template>>, ApiError> {
    Ok(Json(service::templates::list(&app.db).await?))
}

/// `GET /v1/templates/{name}`: the template with its events (the pull's progress and outcome).
#[utoipa::path(get, path = "/v1/templates/{name}", tag = "sandboxes",
    params(("name" = String, Path, description = "template name")),
    responses((status = 200, body = Template), (status = 404, description = "no such template"),
        (status = 400, description = "`invalid_request`: a query parameter (the route takes none)")),
    security(("bearer" = [])))]
pub async fn get(
    State(app): State<AppState>,
    _caller: Authenticated,
    Path(name): Path<String>,
    _query: StrictQuery<NoParams>,
) -> Result<Json<Template>, ApiError> {
    Ok(Json(service::templates::get(&app.db, &name).await?))
}

/// `POST /v1/templates`: registers a template pulled from an OCI image and starts the pull;
/// answers 202 with the template (`pulling`; poll `GET /v1/templates/{name}` until `ready` or
/// `failed`). Asking again with the same name, image and runtime is idempotent (and retries a
/// failed pull). Templates are shared by every org, so only an operator key registers one
/// (an attack run found any tenant could: pull from any registry the API's machine reaches,
/// fill its template cache, and plant a template under a name other tenants create from).
///
/// With an `Idempotency-Key` (the operator's keys share one scope: they have no org), the
/// answer is stored and the same request again replays it; the key with another body is 422.
///
/// Errors: 403 `forbidden` for an org key; 400 `invalid_request` (name, image or runtime, a
/// body that is not a JSON object, a repeated `Idempotency-Key`); 409 `template_exists` (the
/// name is taken by another template); 413 `payload_too_large`; 422 `idempotency_key_reused`;
/// 503 `not_configured` (this API process cannot pull).
#[utoipa::path(post, path = "/v1/templates", tag = "sandboxes", request_body = CreateTemplate,
    responses((status = 202, body = Template), (status = 409, description = "template_exists"),
        (status = 400, description = "`invalid_request`: the field is named, or a query parameter (named; the route takes none)"),
        (status = 403, description = "`forbidden`: an org key (templates are the operator's)"),
        (status = 413, description = "`payload_too_large`: a body over `limit` bytes"),
        (status = 422, description = "`idempotency_key_reused`: the Idempotency-Key was used for a different request")),
    security(("bearer" = [])))]
pub async fn create(
    State(app): State<AppState>,
    _operator: Admin,
    _query: StrictQuery<NoParams>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CreateTemplate = super::body::json(&body)?;
    let idem = Idempotency::from_headers(&headers, "POST", "/v1/templates", &body)?;
    if req.credentials.is_some() {
        return Err(ApiError::invalid(
            "credentials",
            "private registries are not supported yet: Berth pulls anonymously (hosts pull \
             the pinned image again and there is no encrypted store to hand them credentials); \
             use a public image or a registry on the hosts' network",
        ));
    }
    let puller = app.images.clone().ok_or_else(|| {
        ApiError::NotConfigured("this API process has no image cache to pull templates into".into())
    })?;
    let create = service::templates::create_from_image(
        &app.db,
        &puller,
        &req.name,
        &req.image,
        req.runtime.as_deref().unwrap_or(DEFAULT_IMAGE_RUNTIME),
        req.description.as_deref(),
    );
    let outcome = service::idempotency::around(
        &app.db,
        service::idempotency::OPERATOR,
        idem.as_ref(),
        create,
        |t| stored(StatusCode::ACCEPTED, t),
    )
    .await?;
    Ok(render_replayable(outcome))
}

/// `DELETE /v1/templates/{name}` (operator key: templates are shared by every org): deletes
/// a template pulled from an image (204), with its
/// events, and frees its unpacked root in this machine's image cache when no other template
/// pinned the same digest (layer blobs and other machines' copies are kept).
///
/// Errors: 403 `forbidden` for an org's key; 404 `not_found`; 409 `template_in_use` (sandboxes not yet deleted use it) or
/// `template_builtin` (not from an image).
#[utoipa::path(delete, path = "/v1/templates/{name}", tag = "sandboxes",
    params(("name" = String, Path, description = "template name")),
    responses((status = 204, description = "deleted"), (status = 403, description = "not an operator key"), (status = 404, description = "no such template"),
        (status = 409, description = "template_in_use or template_builtin"),
        (status = 400, description = "`invalid_request`: a query parameter (the route takes none)")),
    security(("bearer" = [])))]
pub async fn delete(
    State(app): State<AppState>,
    _operator: crate::auth::Admin,
    Path(name): Path<String>,
    _query: StrictQuery<NoParams>,
) -> Result<StatusCode, ApiError> {
    service::templates::delete(&app.db, app.images.as_ref(), &name).await?;
    Ok(StatusCode::NO_CONTENT)
}
