//! Berth's HTTP API (axum), its auth, its OpenAPI document, and the outbox relay.
//!
//! # Guarantees
//! - A create commits placement, the sandbox row, its `sandbox.create` command and its event in
//!   one transaction, or writes nothing (guarantee 1). Bad input writes nothing.
//! - Every sandbox query is scoped by the caller's org: another org's sandbox is `404`
//!   (guarantee 7).
//! - Errors are `{"error":{"code","message"}}` with the status of [`error::ApiError`].

pub mod auth;
pub mod error;
pub mod event_relay;
pub mod event_stream;
pub mod events;
pub mod hosts;
pub mod http;
pub mod idempotency;
pub mod metrics;
pub mod model;
pub mod openapi;
pub mod quota;
pub mod relay;
pub mod sandboxes;
pub mod templates;
pub mod webhook_delivery;
pub mod webhook_signature;
pub mod webhooks;

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use berth_schemas::Subjects;
use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::info;

/// Default listen address of the API.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// What the API needs besides its connections.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    pub listen: SocketAddr,
    pub subjects: Subjects,
    /// Placement only chooses hosts heard from within this window.
    pub heartbeat_freshness: Duration,
    /// How far placement reserves beyond hosts' physical capacity.
    pub overcommit: berth_scheduler::placement::Overcommit,
    /// The relay publishes at most this many in-flight creates/starts per host.
    pub max_concurrent_starts: i64,
    /// Timing of `GET /v1/events`.
    pub events: event_stream::EventStreamConfig,
    /// Timing and limits of webhook delivery.
    pub webhooks: webhook_delivery::WebhookConfig,
}

impl ApiConfig {
    /// Defaults for everything but the subjects.
    pub fn new(listen: SocketAddr, subjects: Subjects) -> Self {
        Self {
            listen,
            subjects,
            heartbeat_freshness: berth_scheduler::DEFAULT_HEARTBEAT_FRESHNESS,
            overcommit: Default::default(),
            max_concurrent_starts: relay::DEFAULT_MAX_CONCURRENT_STARTS,
            events: Default::default(),
            webhooks: Default::default(),
        }
    }
}

/// Shared state of every route.
#[derive(Clone)]
pub struct AppState {
    pub db: PgPool,
    pub nats: async_nats::Client,
    pub subjects: Subjects,
    pub config: ApiConfig,
    pub prometheus: PrometheusHandle,
}

/// Errors of [`run`].
#[derive(Debug, thiserror::Error)]
pub enum ApiRunError {
    #[error("bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("serve: {0}")]
    Serve(std::io::Error),
}

/// The router with every route; `state` is shared by all.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route(
            "/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(
            "/v1/sandboxes/{id}",
            get(sandboxes::get).delete(sandboxes::delete),
        )
        .route("/v1/sandboxes/{id}/stop", post(sandboxes::stop))
        .route("/v1/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/v1/sandboxes/{id}/start", post(sandboxes::start))
        .route("/v1/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/v1/sandboxes/{id}/exec", post(http::exec::exec))
        .route(
            "/v1/sandboxes/{id}/exec/stream",
            post(http::exec_stream::exec_stream),
        )
        .route(
            "/v1/sandboxes/{id}/files",
            get(http::files::get)
                .put(http::files::put)
                .layer(axum::extract::DefaultBodyLimit::max(
                    http::files::MAX_FILE_BYTES as usize,
                )),
        )
        .route("/v1/sandboxes/{id}/events", get(sandboxes::events))
        .route("/v1/templates", get(sandboxes::templates))
        .route("/v1/events", get(event_stream::stream))
        .route("/v1/webhooks", post(webhooks::create).get(webhooks::list))
        .route(
            "/v1/webhooks/{id}",
            get(webhooks::get).delete(webhooks::delete),
        )
        .route("/v1/webhooks/{id}/deliveries", get(webhooks::deliveries))
        .route("/v1/hosts", get(hosts::list))
        .route("/v1/hosts/{id}/drain", post(hosts::drain))
        .route("/v1/hosts/{id}/cordon", post(hosts::cordon))
        .route("/v1/hosts/{id}/uncordon", post(hosts::uncordon))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .route("/openapi.json", get(openapi_json))
        .fallback(not_found)
        .layer(axum::middleware::from_fn(error::json_errors))
        .layer(axum::middleware::from_fn(metrics::track))
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

/// Serves the API and runs the outbox relay and the webhook delivery worker until `shutdown`
/// fires.
///
/// Errors: [`ApiRunError::Bind`] when the address is taken, [`ApiRunError::Serve`] on a
/// server failure.
pub async fn run(state: AppState, shutdown: CancellationToken) -> Result<(), ApiRunError> {
    let addr = state.config.listen;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ApiRunError::Bind { addr, source })?;
    serve(listener, state, shutdown).await
}

/// Like [`run`], on a listener the caller bound (tests bind port 0).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: CancellationToken,
) -> Result<(), ApiRunError> {
    info!(addr = ?listener.local_addr().ok(), "api listening");
    let relay = tokio::spawn(relay::run(
        state.db.clone(),
        state.nats.clone(),
        state.subjects.clone(),
        state.config.max_concurrent_starts,
        shutdown.clone(),
    ));
    event_stream::describe_metrics();
    let webhooks = tokio::spawn(webhook_delivery::run(
        state.db.clone(),
        state.config.webhooks.clone(),
        shutdown.clone(),
    ));
    // Long-lived responses (the SSE stream) end on shutdown, or graceful shutdown would wait
    // for them forever.
    let app = router(state).layer(axum::Extension(event_stream::StreamShutdown(
        shutdown.clone(),
    )));
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.clone().cancelled_owned())
        .await
        .map_err(ApiRunError::Serve);
    shutdown.cancel();
    let _ = relay.await;
    let _ = webhooks.await;
    served
}

async fn healthz() -> &'static str {
    "ok"
}

/// Ready when Postgres answers and the NATS connection is up.
async fn readyz(State(app): State<AppState>) -> impl IntoResponse {
    let db_ok = sqlx::query("SELECT 1").execute(&app.db).await.is_ok();
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

async fn not_found() -> error::ApiError {
    error::ApiError::NotFound("route".to_owned())
}
