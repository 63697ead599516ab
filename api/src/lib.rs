//! Berth's HTTP API (axum), its auth, its OpenAPI document, and the outbox relay.
//!
//! Layout: [`http`] parses requests and renders answers (no SQL); [`service`] runs one
//! transaction per use case (no axum); [`outbox`] publishes committed commands and events;
//! [`webhooks`] delivers events to webhooks; [`config`] holds [`ApiConfig`].
//!
//! # Guarantees
//! - A create commits placement, the sandbox row, its `sandbox.create` command and its event in
//!   one transaction, or writes nothing (guarantee 1). Bad input writes nothing.
//! - Every sandbox query is scoped by the caller's org: another org's sandbox is `404`
//!   (guarantee 7).
//! - Errors are `{"error":{"code","message"}}` with the status of [`error::ApiError`].

pub mod admission;
pub mod auth;
pub mod collector;
pub mod compat;
pub mod config;
pub mod error;
pub mod http;
pub mod limits;
pub mod metrics;
pub mod model;
pub mod openapi;
pub mod outbox;
pub mod preview;
pub mod revocations;
pub mod server;
pub mod service;
pub mod sweep;
pub mod watch;
pub mod webhooks;

// The paths other crates, `src/` and `tests/` use, kept where they were.
pub use config::{ApiConfig, DEFAULT_LISTEN};
pub use http::router;
pub use outbox::relay;
pub use service::{quota, templates};
pub use webhooks::delivery as webhook_delivery;
// utoipa names an operation's tag after the module path it is listed under in the OpenAPI
// derive; the streamed exec keeps the tag the published document has always given it.
pub(crate) use http::exec_stream;

use std::net::SocketAddr;

use berth_schemas::Subjects;
use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::info;

/// Shared state of every route.
#[derive(Clone)]
pub struct AppState {
    /// The Postgres pool every use case runs its transaction on.
    pub db: PgPool,
    /// The NATS client: agent requests (exec, files), the relays started by [`run`], readiness.
    pub nats: async_nats::Client,
    /// Subject and stream names under this deployment's prefix.
    pub subjects: Subjects,
    /// Limits and defaults of the API.
    pub config: ApiConfig,
    /// Renders this process's metrics for `GET /metrics`.
    pub prometheus: PrometheusHandle,
    /// Rate limiters, the key cache and per-org concurrency counts, built from
    /// `config.limits`.
    pub guards: std::sync::Arc<limits::Guards>,
    /// The preview proxy of the path route (`/v1/sandboxes/{id}/ports/{port}/…`), sharing
    /// `guards`.
    pub preview: std::sync::Arc<preview::Preview>,
    /// Wakes waiting requests when a sandbox's state changes (its events on NATS, subscribed
    /// by the first wait).
    pub watch: watch::SandboxWatch,
    /// Pulls OCI images for templates (`POST /v1/templates`); `None`: this process cannot
    /// (the route answers 503 `not_configured`). Set with [`AppState::with_images`].
    pub images: Option<std::sync::Arc<dyn service::templates::ImagePuller>>,
}

impl AppState {
    /// The state of an API process: its guards are built from `config.limits`.
    pub fn new(
        db: PgPool,
        nats: async_nats::Client,
        subjects: Subjects,
        config: ApiConfig,
        prometheus: PrometheusHandle,
    ) -> Self {
        let guards = limits::Guards::new(config.limits.clone());
        Self {
            preview: preview::Preview::new(
                db.clone(),
                guards.clone(),
                config.preview.clone(),
                config.overcommit,
            ),
            guards,
            watch: watch::SandboxWatch::new(nats.clone(), subjects.clone()),
            db,
            nats,
            subjects,
            config,
            prometheus,
            images: None,
        }
    }

    /// This state, pulling template images through `puller`.
    pub fn with_images(
        mut self,
        puller: std::sync::Arc<dyn service::templates::ImagePuller>,
    ) -> Self {
        self.images = Some(puller);
        self
    }
}

/// Errors of [`run`].
#[derive(Debug, thiserror::Error)]
pub enum ApiRunError {
    /// The listen address could not be bound (in use, or not permitted).
    #[error("bind {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The HTTP server stopped with an I/O error.
    #[error("serve: {0}")]
    Serve(std::io::Error),
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
    let relay_db = outbox::own_pool(&state.db);
    let relay = tokio::spawn(outbox::run(
        relay_db.clone(),
        state.nats.clone(),
        state.subjects.clone(),
        state.config.max_concurrent_starts,
        shutdown.clone(),
    ));
    http::events::describe_metrics();
    let preview_routes = tokio::spawn(preview::routes::evict_on_events(
        state.preview.clone(),
        state.nats.clone(),
        state.subjects.clone(),
        shutdown.clone(),
    ));
    let webhooks = tokio::spawn(webhooks::delivery::run(
        state.db.clone(),
        state.config.webhooks.clone(),
        shutdown.clone(),
    ));
    let revocations = tokio::spawn(revocations::forget_revoked_keys(
        state.db.clone(),
        state.guards.clone(),
        shutdown.clone(),
    ));
    // Issue 14: the durable stops of sandboxes deleted by anything but a user's request.
    let collector = match &state.config.object_store {
        Some(settings) => match berth_storage::Objects::open(settings) {
            Ok(objects) => Some(tokio::spawn(collector::run(
                state.db.clone(),
                objects,
                state.config.sweep,
                shutdown.clone(),
            ))),
            Err(error) => {
                tracing::warn!(%error, "object store not opened; deleted sandboxes' durable stops kept");
                None
            }
        },
        None => None,
    };
    let (limits, state_guards) = (state.config.limits.clone(), state.guards.clone());
    let watch = state.watch.clone();
    // Long-lived responses (the SSE stream) end on shutdown, or graceful shutdown would wait
    // for them forever.
    let app = router(state).layer(axum::Extension(http::events::StreamShutdown(
        shutdown.clone(),
    )));
    let sweeper = tokio::spawn({
        let (guards, shutdown) = (state_guards, shutdown.clone());
        async move {
            let mut every = tokio::time::interval(limits::RATE_STATE_SWEEP);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = every.tick() => guards.sweep(),
                }
            }
        }
    });
    let served = server::serve(listener, app, &limits, shutdown.clone())
        .await
        .map_err(ApiRunError::Serve);
    let _ = sweeper.await;
    shutdown.cancel();
    watch.stop();
    let _ = relay.await;
    relay_db.close().await;
    let _ = webhooks.await;
    let _ = preview_routes.await;
    let _ = revocations.await;
    if let Some(collector) = collector {
        let _ = collector.await;
    }
    served
}
