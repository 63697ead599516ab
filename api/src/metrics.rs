//! Prometheus metrics: one process-wide recorder, and the HTTP middleware that counts requests
//! by route template (never by sandbox id).

use std::sync::OnceLock;
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Latency buckets in seconds, from 1 ms to 60 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The process's recorder, installed on first call; every component records into it and
/// `/metrics` renders it.
pub fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .expect("the bucket list is not empty")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (an embedding program); then ours
            // still renders what is recorded through it directly, which is nothing.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// Counts and times every request: `berth_http_requests_total{method,route,status}` and
/// `berth_http_request_duration_seconds{method,route}`. `route` is the matched route's pattern
/// (or `unmatched`) and `method` one of [`method_label`]'s, so no request, however made up,
/// adds a label value: the series stay bounded.
pub async fn track(req: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = method_label(req.method());
    let response = next.run(req).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!("berth_http_requests_total", "method" => method, "route" => route.clone(), "status" => status)
        .increment(1);
    metrics::histogram!("berth_http_request_duration_seconds", "method" => method, "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}

/// The `method` label of a request: the methods of RFC 9110 (and PATCH) by name, any other
/// (a client may send any token) as `other`.
pub fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "other",
    }
}

/// Errors of [`serve`].
#[derive(Debug, thiserror::Error)]
pub enum MetricsServeError {
    /// The metrics address could not be bound (in use, or not permitted).
    #[error("bind the metrics address {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The metrics server stopped with an I/O error.
    #[error("serve metrics: {0}")]
    Serve(std::io::Error),
}

/// Serves `GET /metrics` (Prometheus text format, from this process's recorder, see
/// [`handle`]) on `addr` until `shutdown` fires: the metrics endpoint of the scheduler,
/// reconciler and hostd processes (the API serves `/metrics` on its own port).
///
/// Errors: [`MetricsServeError::Bind`] when the address is taken.
pub async fn serve(
    addr: std::net::SocketAddr,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), MetricsServeError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsServeError::Bind { addr, source })?;
    serve_on(listener, shutdown).await
}

/// [`serve`] on a listener the caller bound.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), MetricsServeError> {
    let prometheus = handle();
    tracing::info!(addr = ?listener.local_addr().ok(), "metrics listening");
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let prometheus = prometheus.clone();
            async move {
                (
                    [(axum::http::header::CONTENT_TYPE, CONTENT_TYPE)],
                    prometheus.render(),
                )
            }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .map_err(MetricsServeError::Serve)
}

/// The Prometheus text exposition format's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_up_methods_share_one_label() {
        for (method, label) in [("GET", "GET"), ("PATCH", "PATCH"), ("ATKM0", "other")] {
            let method = axum::http::Method::from_bytes(method.as_bytes()).unwrap();
            assert_eq!(method_label(&method), label);
        }
        let long = axum::http::Method::from_bytes("Z".repeat(4000).as_bytes()).unwrap();
        assert_eq!(method_label(&long), "other");
    }
}
