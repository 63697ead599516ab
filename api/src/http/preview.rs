//! Preview routes on the API: the preview token (`POST /v1/sandboxes/{id}/ports/{port}/token`)
//! and the path route (`/v1/sandboxes/{id}/ports/{port}/…`, any method), which the preview
//! proxy ([`crate::preview`]) serves.

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_schemas::preview::{PreviewToken, AGENT_PORT};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::extract::{NoParams, StrictQuery};
use super::sandboxes::{fetch, parse_id};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::preview::access::TOKEN_QUERY;
use crate::preview::{page::Page, target, MAX_TOKEN_TTL};
use crate::AppState;

/// `POST /v1/sandboxes/{id}/ports/{port}/token` body (optional).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenRequest {
    /// The token's lifetime in seconds, 1 to 86400; default the operator's (3600).
    pub ttl_seconds: Option<u64>,
}

/// A preview token and the URL that carries it.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PreviewTokenResponse {
    /// The preview URL with the token as its query parameter: open it in a browser.
    pub url: String,
    /// The token, for the `X-Berth-Preview-Token` header or the `berth_preview_token`
    /// query parameter.
    pub token: String,
    /// When it stops working.
    pub expires_at: DateTime<Utc>,
}

/// `POST /v1/sandboxes/{id}/ports/{port}/token`: a short-lived grant to one port of one of the
/// caller's sandboxes, for sharing without a key.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/ports/{port}/token",
    params(("id" = String, Path), ("port" = u16, Path)),
    request_body(content = Option<TokenRequest>),
    responses(
        (status = 200, body = PreviewTokenResponse),
        (status = 400, description = "`invalid_request`: a port or `ttl_seconds` out of range, or a query parameter (named; the route takes none) (`ttl_seconds` goes in the body)"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the sandbox is deleted or being deleted (a token for it would open nothing)"),
        (status = 503, description = "`not_configured`: previews are not configured (no preview secret)"),
    ), security(("bearer" = [])))]
pub async fn token(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, port)): Path<(String, String)>,
    _query: StrictQuery<NoParams>,
    body: Bytes,
) -> Result<Json<PreviewTokenResponse>, ApiError> {
    let sandbox = fetch(&app, &caller, parse_id(&id)?).await?;
    if sandbox.deleted_at.is_some() {
        return Err(ApiError::Conflict {
            state: sandbox.state,
            message: format!(
                "sandbox {} is deleted or being deleted: no preview token for it",
                sandbox.id
            ),
        });
    }
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| ApiError::invalid("port", "port must be 1 to 65535"))?;
    if port == AGENT_PORT {
        return Err(ApiError::invalid(
            "port",
            format!("port {AGENT_PORT} is Berth's agent's port: it has no preview"),
        ));
    }
    let req: TokenRequest = super::body::json_or_empty(&body)?;
    let config = app.preview.config();
    let ttl = match req.ttl_seconds {
        None => config.token_ttl,
        Some(s) if (1..=MAX_TOKEN_TTL.as_secs()).contains(&s) => std::time::Duration::from_secs(s),
        Some(s) => {
            return Err(ApiError::invalid(
                "ttl_seconds",
                format!(
                    "ttl_seconds must be 1 to {}, got {s}",
                    MAX_TOKEN_TTL.as_secs()
                ),
            ))
        }
    };
    let key = config
        .token_key()
        .ok_or_else(|| ApiError::NotConfigured("previews are not configured".into()))?;
    let expires_at = Utc::now() + chrono::Duration::seconds(ttl.as_secs() as i64);
    let token = PreviewToken {
        sandbox: sandbox.id,
        port,
        expires: expires_at.timestamp(),
    }
    .sign(&key);
    Ok(Json(PreviewTokenResponse {
        url: format!("{}?{TOKEN_QUERY}={token}", config.url(sandbox.id, port)),
        token,
        expires_at,
    }))
}

/// `/v1/sandboxes/{id}/ports/{port}/…` (any method): the request, forwarded to that port of
/// the sandbox by the preview proxy. Answers are the sandbox's own, or the proxy's pages.
pub async fn forward(State(app): State<AppState>, req: Request<Body>) -> Response {
    let Some(target) = target::from_path(req.uri()) else {
        return Page::new(StatusCode::NOT_FOUND, "No such sandbox port.").into_response();
    };
    let peer = crate::limits::peer_ip(req.extensions());
    app.preview.handle(req, target, peer).await.into_response()
}
