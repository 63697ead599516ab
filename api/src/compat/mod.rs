//! The OpenSandbox compatibility surface, mounted under `/compat/opensandbox` on the API's
//! listener: the real `opensandbox` Python SDK (pinned: 1.1.1) works against Berth unchanged
//! with `ConnectionConfig(domain="host:port/compat/opensandbox", api_key=<a Berth key>)`.
//!
//! Source of behaviour: `../shared/compat/opensandbox-sdk.md` (what the SDK sends and expects,
//! observed against the real SDK); the SDK's behaviour is the authority over the published
//! `specs/sandbox-lifecycle.yml`.
//!
//! Two surfaces:
//! - [`lifecycle`], under `/compat/opensandbox/v1`: create, get, list, delete, pause, resume,
//!   renew-expiration, endpoint lookup, telemetry. Authenticated by `OPEN-SANDBOX-API-KEY: <a
//!   Berth key>` before any route or id is looked at.
//! - [`execd`] (and [`command`]), under `/compat/opensandbox/execd/{id}`: the per-sandbox
//!   surface the SDK's endpoint lookup of port 44772 points at (`/ping`, `/command` as
//!   Server-Sent Events, `/files/upload`, `/files/download`). Served by the API itself, mapped
//!   onto Berth's exec and files paths through the host's agent, rather than by a process in
//!   the sandbox: nothing of it runs where the sandbox's code could touch it, and it needs no
//!   port forwarding. Authorised by the sandbox's execd token (`X-Berth-Execd-Token`, handed
//!   out in the lookup's `headers`; the SDK sends those on every execd request and never the
//!   API key), which opens that sandbox's exec and files only. The egress sidecar's port
//!   18080 points at `/compat/opensandbox/egress/{id}`, whose routes answer 501.
//!
//! # Guarantees
//! - Every non-2xx answer under `/compat/opensandbox` is `{"code", "message"}` with the real
//!   status ([`CompatError`]); the SDK raises `KeyError: 'code'` on any other shape.
//! - Optional fields are omitted, never `null` (`expiresAt`, `status.reason`, …): a `null`
//!   makes the SDK raise after the sandbox exists.
//! - A field Berth cannot honour is refused with a 400 that names it, never ignored.
//! - One org never reaches another's sandbox (guarantee 7): the lifecycle routes are scoped by
//!   the key's org, and an execd token is checked against the one sandbox it was made for.

pub mod command;
pub mod execd;
pub mod image;
pub mod lifecycle;
pub mod model;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::AppState;

/// Where the surface is mounted on the API's listener.
pub const MOUNT: &str = "/compat/opensandbox";
/// The header that carries an org's Berth key on the lifecycle routes (the SDK's name).
pub const API_KEY_HEADER: &str = "open-sandbox-api-key";
/// The header that carries a sandbox's execd token on its execd surface.
pub const EXECD_TOKEN_HEADER: &str = "x-berth-execd-token";
/// The port the SDK looks up for the execd surface.
pub const EXECD_PORT: u16 = 44772;
/// The port the SDK looks up for the egress sidecar.
pub const EGRESS_PORT: u16 = 18080;

/// An error of the compatibility surface: the real status with `{"code", "message"}`.
#[derive(Debug)]
pub struct CompatError {
    /// The HTTP status.
    pub status: StatusCode,
    /// A stable code (Berth's own codes: `unauthorized`, `not_found`, `invalid_request`, …).
    pub code: &'static str,
    /// For people.
    pub message: String,
    /// `Retry-After` in seconds, on a 429 or 503 that has one.
    pub retry_after_secs: Option<u64>,
}

impl CompatError {
    /// A 400 `invalid_request` naming `field` in its message.
    pub fn invalid(field: &str, message: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            format!("{field}: {message}"),
        )
    }

    /// An error of `status` and `code`.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }

    /// 401: no key, an unknown one, or an execd token that is not this sandbox's.
    pub fn unauthorized(message: &str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    /// 501: a route of OpenSandbox that Berth does not serve.
    pub fn not_implemented(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_IMPLEMENTED,
            "not_implemented",
            format!("{what} is not served by Berth's OpenSandbox surface"),
        )
    }
}

impl From<ApiError> for CompatError {
    fn from(e: ApiError) -> Self {
        let (status, code) = e.status_and_code();
        if let ApiError::Internal(cause) = &e {
            tracing::error!(%cause, "internal error");
        }
        let retry_after_secs = match &e {
            ApiError::RateLimited {
                retry_after_secs, ..
            }
            | ApiError::Unavailable {
                retry_after_secs, ..
            }
            | ApiError::ForkNoCapacity {
                retry_after_secs, ..
            } => Some(*retry_after_secs),
            _ => None,
        };
        let message = match &e {
            ApiError::InvalidRequest {
                field: Some(field),
                message,
            } => format!("{field}: {message}"),
            other => other.to_string(),
        };
        Self {
            status,
            code,
            message,
            retry_after_secs,
        }
    }
}

impl From<crate::service::ServiceError> for CompatError {
    fn from(e: crate::service::ServiceError) -> Self {
        ApiError::from(e).into()
    }
}

impl From<berth_store::StoreError> for CompatError {
    fn from(e: berth_store::StoreError) -> Self {
        ApiError::from(e).into()
    }
}

impl IntoResponse for CompatError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            Json(json!({ "code": self.code, "message": self.message })),
        )
            .into_response();
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// The surface's router, to be nested at [`MOUNT`].
pub fn router(state: AppState) -> Router<AppState> {
    let v1 = Router::new()
        .route("/sandboxes", post(lifecycle::create).get(lifecycle::list))
        .route(
            "/sandboxes/{id}",
            get(lifecycle::get).delete(lifecycle::kill),
        )
        .route("/sandboxes/{id}/pause", post(lifecycle::pause))
        .route("/sandboxes/{id}/resume", post(lifecycle::resume))
        .route("/sandboxes/{id}/renew-expiration", post(lifecycle::renew))
        .route("/sandboxes/{id}/endpoints/{port}", get(lifecycle::endpoint))
        .route("/metrics/events", post(lifecycle::telemetry))
        .fallback(unserved)
        .layer(axum::middleware::from_fn_with_state(state, require_key));
    let execd = Router::new()
        .route("/ping", get(execd::ping))
        .route("/command", post(command::run))
        .route(
            "/files/upload",
            // The upload is streamed and limited by `config.limits.max_file_bytes` itself.
            post(execd::upload).layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/files/download", get(execd::download))
        .fallback(unserved);
    Router::new()
        .nest("/v1", v1)
        .nest("/execd/{id}", execd)
        .route("/egress/{id}", any(unserved))
        .route("/egress/{id}/{*rest}", any(unserved))
        .fallback(unserved)
        .layer(axum::middleware::from_fn(shape_errors))
}

/// A route of OpenSandbox that Berth does not serve (snapshots, templates, sessions, the
/// egress sidecar, …): 501.
async fn unserved(req: Request) -> CompatError {
    CompatError::not_implemented(&format!("{} {}", req.method(), req.uri().path()))
}

/// Resolves `OPEN-SANDBOX-API-KEY` to its org before anything else is looked at (an unknown
/// route or id gets 401 first), and hands the handlers the [`Caller`].
async fn require_key(
    State(app): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, CompatError> {
    let key = req
        .headers()
        .get(API_KEY_HEADER)
        .and_then(|v| v.to_str().ok());
    let peer = crate::limits::peer_ip(req.extensions());
    let principal = crate::auth::principal_of_key(key, peer, &app.db, &app.guards)
        .await
        .map_err(|e| match e {
            ApiError::Unauthorized => {
                CompatError::unauthorized("missing or invalid OPEN-SANDBOX-API-KEY")
            }
            other => other.into(),
        })?;
    let org_id = principal.org_id.ok_or_else(|| {
        CompatError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "an operator key manages hosts, not sandboxes",
        )
    })?;
    req.extensions_mut().insert(Caller {
        org_id,
        key_id: Some(principal.key_id),
    });
    Ok(next.run(req).await)
}

/// Gives axum's own refusals inside the surface (a 405, a body over a limit, a path that does
/// not parse) the surface's error shape; answers already in JSON (ours) and successes pass.
async fn shape_errors(req: Request, next: Next) -> Response {
    match crate::error::plain_error(next.run(req).await).await {
        Ok((status, code, message, _)) => CompatError::new(status, code, message).into_response(),
        Err(passed) => passed,
    }
}
