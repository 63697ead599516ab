//! Webhook routes: register an endpoint for an org's events, list and delete endpoints, and
//! read a webhook's delivery log ([`crate::service::webhooks`] runs them). Delivery itself is
//! [`crate::webhooks::delivery`]; signing is [`crate::webhooks::signature`].

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use berth_schemas::WebhookId;
use serde::Deserialize;

use super::extract::{parse_path_id, KnownParams, NoParams, StrictQuery};
use super::idempotency::{render_replayable, stored, Idempotency};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::service::webhooks;
use crate::webhooks::model::{
    CreateWebhook, Delivery, Webhook, DEFAULT_DELIVERY_PAGE, MAX_DELIVERY_PAGE,
};
use crate::AppState;

fn parse_id(raw: &str) -> Result<WebhookId, ApiError> {
    parse_path_id(raw, "webhook")
}

/// `POST /v1/webhooks`
#[utoipa::path(post, path = "/v1/webhooks", tag = "crate::webhooks", request_body = CreateWebhook,
    responses(
        (status = 201, description = "Created; the response carries the secret, shown only now", body = Webhook),
        (status = 400, description = "`invalid_request`: a bad `url` (including one that points at a loopback, private, link-local or special-use address, unless the operator allows them), `secret` or `event_types` (the field is named), the org has its maximum of webhooks, or a query parameter (named; the route takes none)"),
        (status = 401, description = "`unauthorized`"),
    ), security(("bearer" = [])))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    _query: StrictQuery<NoParams>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let idem = Idempotency::from_headers(&headers, "POST", "/v1/webhooks", &body)?;
    let create: CreateWebhook = super::body::json(&body)?;
    let valid = create.validate()?;
    if !app.config.webhooks.allow_private_targets {
        let url = reqwest::Url::parse(&valid.url).expect("validate re-serialized a parsed URL");
        if crate::webhooks::target::refused_at_create(&url).await {
            return Err(ApiError::invalid(
                "url",
                "url points at a loopback, private, link-local or special-use address, where \
                 deliveries are refused (an operator may allow them: \
                 --webhook-allow-private-targets)",
            ));
        }
    }
    let outcome = webhooks::create(&app.db, caller.org_id, valid, idem.as_ref(), |w| {
        stored(StatusCode::CREATED, w)
    })
    .await?;
    Ok(render_replayable(outcome))
}

/// `GET /v1/webhooks`: the org's webhooks, oldest first (secrets are never returned).
#[utoipa::path(get, path = "/v1/webhooks", tag = "crate::webhooks", responses((status = 200, body = [Webhook])),
    security(("bearer" = [])))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    _query: StrictQuery<NoParams>,
) -> Result<Json<Vec<Webhook>>, ApiError> {
    Ok(Json(webhooks::list(&app.db, caller.org_id).await?))
}

/// `GET /v1/webhooks/{id}`
#[utoipa::path(get, path = "/v1/webhooks/{id}", tag = "crate::webhooks", params(("id" = String, Path)),
    responses((status = 200, body = Webhook), (status = 404, description = "`not_found`"),
        (status = 400, description = "`invalid_request`: a query parameter (the route takes none)")),
    security(("bearer" = [])))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
) -> Result<Json<Webhook>, ApiError> {
    Ok(Json(
        webhooks::get(&app.db, caller.org_id, parse_id(&id)?).await?,
    ))
}

/// `DELETE /v1/webhooks/{id}`: stops deliveries; pending ones are abandoned.
#[utoipa::path(delete, path = "/v1/webhooks/{id}", tag = "crate::webhooks", params(("id" = String, Path)),
    responses((status = 204, description = "Deleted"), (status = 404, description = "`not_found`"),
        (status = 400, description = "`invalid_request`: a query parameter (the route takes none)")),
    security(("bearer" = [])))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
) -> Result<StatusCode, ApiError> {
    webhooks::delete(&app.db, caller.org_id, parse_id(&id)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Query of the delivery log.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeliveriesQuery {
    /// 1 to 500; default 50.
    pub limit: Option<i64>,
}

impl KnownParams for DeliveriesQuery {
    const NAMES: &'static [&'static str] = &["limit"];
}

/// `GET /v1/webhooks/{id}/deliveries`: the delivery log, newest event first, each delivery
/// with its attempts.
#[utoipa::path(get, path = "/v1/webhooks/{id}/deliveries", tag = "crate::webhooks",
    params(("id" = String, Path), DeliveriesQuery),
    responses((status = 200, body = [Delivery]), (status = 404, description = "`not_found`")),
    security(("bearer" = [])))]
pub async fn deliveries(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    StrictQuery(query): StrictQuery<DeliveriesQuery>,
) -> Result<Json<Vec<Delivery>>, ApiError> {
    let limit = query.limit.unwrap_or(DEFAULT_DELIVERY_PAGE);
    if !(1..=MAX_DELIVERY_PAGE).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            format!("limit must be between 1 and {MAX_DELIVERY_PAGE}"),
        ));
    }
    Ok(Json(
        webhooks::deliveries(&app.db, caller.org_id, parse_id(&id)?, limit).await?,
    ))
}
