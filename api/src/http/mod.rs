//! The HTTP face of the API: axum extractors and one file per resource. Each handler parses the
//! request (body, path, query, headers, idempotency key) into typed input, calls a
//! [`crate::service`] use case, and renders the answer; [`crate::error::ApiError`] maps every
//! refusal to its status. No SQL here.

pub mod body;
pub mod events;
pub mod exec;
pub mod exec_stream;
pub mod extract;
pub mod files;
pub mod hosts;
pub mod idempotency;
pub mod keys;
pub mod preview;
pub mod resume;
pub mod sandboxes;
pub mod settings;
pub mod shell;
pub mod snapshots;
pub mod templates;
pub mod webhooks;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::error::{self, ApiError};
use crate::{metrics, openapi, service, AppState};

/// The router with every route; `state` is shared by all.
pub fn router(state: AppState) -> Router {
    let metrics_route = if state.config.metrics_on_api {
        get(render_metrics)
    } else {
        get(not_found)
    };
    Router::new()
        .route(
            "/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(
            "/v1/sandboxes/{id}",
            get(sandboxes::get)
                .delete(sandboxes::delete)
                .patch(settings::patch),
        )
        .route("/v1/sandboxes/{id}/renew", post(settings::renew))
        .route("/v1/sandboxes/{id}/snapshot", post(snapshots::create))
        .route("/v1/sandboxes/{id}/backup", post(snapshots::backup))
        .route("/v1/sandboxes/{id}/snapshots", get(snapshots::list))
        .route("/v1/sandboxes/{id}/restore", post(resume::restore))
        .route(
            "/v1/sandboxes/{id}/restore-from-backup",
            post(resume::restore_from_backup),
        )
        .route("/v1/sandboxes/{id}/clone", post(resume::clone))
        .route("/v1/sandboxes/{id}/fork", post(resume::fork))
        .route(
            "/v1/snapshots/{id}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route("/v1/sandboxes/{id}/wait", get(settings::wait_for))
        .route("/v1/sandboxes/{id}/stop", post(sandboxes::stop))
        .route("/v1/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/v1/sandboxes/{id}/archive", post(sandboxes::archive))
        .route("/v1/sandboxes/{id}/start", post(sandboxes::start))
        .route("/v1/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/v1/sandboxes/{id}/exec", post(exec::exec))
        .route(
            "/v1/sandboxes/{id}/exec/stream",
            post(exec_stream::exec_stream),
        )
        .route(
            "/v1/sandboxes/{id}/files",
            // The upload is streamed and limited by `config.limits.max_file_bytes` itself.
            get(files::get)
                .put(files::put)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/v1/sandboxes/{id}/shell", get(shell::shell))
        .route("/v1/sandboxes/{id}/events", get(events::events))
        .route(
            "/v1/sandboxes/{id}/ports/{port}/token",
            post(preview::token).fallback(preview::forward),
        )
        .route(
            "/v1/sandboxes/{id}/ports/{port}",
            axum::routing::any(preview::forward),
        )
        // The catch-all needs at least one character, so `…/ports/{port}/` (the sandbox's `/`)
        // is a route of its own.
        .route(
            "/v1/sandboxes/{id}/ports/{port}/",
            axum::routing::any(preview::forward),
        )
        .route(
            "/v1/sandboxes/{id}/ports/{port}/{*rest}",
            axum::routing::any(preview::forward),
        )
        .route(
            "/v1/templates",
            get(templates::templates).post(templates::create),
        )
        .route(
            "/v1/templates/{name}",
            get(templates::get).delete(templates::delete),
        )
        .route("/v1/events", get(events::stream))
        .route("/v1/webhooks", post(webhooks::create).get(webhooks::list))
        .route(
            "/v1/webhooks/{id}",
            get(webhooks::get).delete(webhooks::delete),
        )
        .route("/v1/webhooks/{id}/deliveries", get(webhooks::deliveries))
        .route("/v1/keys", get(keys::list).post(keys::create))
        .route("/v1/keys/{id}", axum::routing::delete(keys::revoke))
        .route("/v1/hosts", get(hosts::list))
        .route("/v1/hosts/{id}/drain", post(hosts::drain))
        .route("/v1/hosts/{id}/cordon", post(hosts::cordon))
        .route("/v1/hosts/{id}/uncordon", post(hosts::uncordon))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", metrics_route)
        .route("/openapi.json", get(openapi_json))
        .nest(crate::compat::MOUNT, crate::compat::router(state.clone()))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(body::MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            state.guards.clone(),
            crate::limits::per_ip,
        ))
        .layer(axum::middleware::from_fn(error::json_errors))
        .layer(axum::middleware::from_fn(metrics::track))
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

async fn healthz() -> &'static str {
    "ok"
}

/// Ready when Postgres answers and the NATS connection is up.
async fn readyz(State(app): State<AppState>) -> impl IntoResponse {
    let db_ok = service::database_answers(&app.db).await;
    let nats_ok = app.nats.connection_state() == async_nats::connection::State::Connected;
    let status = if db_ok && nats_ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(serde_json::json!({ "database": db_ok, "nats": nats_ok })),
    )
}

async fn render_metrics(State(app): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.prometheus.render(),
    )
}

async fn openapi_json() -> impl IntoResponse {
    Json(openapi::document())
}

async fn not_found() -> ApiError {
    ApiError::NotFound("route".to_owned())
}
