//! The HTTP/1.1 server loop (hyper, with upgrades for the preview path route's WebSockets, in
//! place of `axum::serve`, which sets no timer and so
//! enforces no header timeout): a cap on open connections, a header-read timeout that is
//! also the keep-alive idle timeout, the client's address for the rate limits, and graceful
//! shutdown.
//!
//! # Guarantees
//! - At most [`LimitsConfig::max_connections`] connections are served at once, and at most
//!   [`LimitsConfig::max_connections_per_ip`] from one client address ([`crate::admission`]);
//!   one accepted beyond that is closed at once (`berth_api_connections_refused_total{reason}`).
//! - A connection that has not sent a whole request head within
//!   [`LimitsConfig::header_read_timeout`] of its start (or of the end of the previous
//!   response) is closed: a slow-loris client holds a slot for that long at most.
//! - A request head with more than [`crate::admission::MAX_REQUEST_HEADERS`] fields or
//!   [`crate::admission::MAX_REQUEST_HEAD_BYTES`] bytes is answered `431` by hyper.
//! - A request body that pauses longer than [`LimitsConfig::body_idle_timeout`] fails (the
//!   router's [`tower_http::timeout::RequestBodyTimeoutLayer`]).
//! - On shutdown, accepting stops and open connections finish their current request (long
//!   streams end through their own shutdown token), for at most [`SHUTDOWN_GRACE`].
//!
//! [`LimitsConfig::max_connections`]: crate::limits::LimitsConfig::max_connections
//! [`LimitsConfig::max_connections_per_ip`]: crate::limits::LimitsConfig::max_connections_per_ip
//! [`LimitsConfig::header_read_timeout`]: crate::limits::LimitsConfig::header_read_timeout
//! [`LimitsConfig::body_idle_timeout`]: crate::limits::LimitsConfig::body_idle_timeout

use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;
use tower_http::timeout::TimeoutBody;

use crate::admission::{Admission, API_METRICS, MAX_REQUEST_HEADERS, MAX_REQUEST_HEAD_BYTES};
use crate::limits::LimitsConfig;

/// How long shutdown waits for open connections to finish.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Pause after a failed `accept` (out of file descriptors, say) before trying again.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Serves `app` on `listener` under `limits` until `shutdown`.
///
/// Errors: none so far: accept errors are logged and retried (they are transient: a client
/// that gave up, or descriptors that run out for a moment).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: &LimitsConfig,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let admission = Admission::new(
        limits.max_connections,
        limits.max_connections_per_ip,
        API_METRICS,
    );
    // Plain hyper HTTP/1.1, not hyper-util's auto builder: its `serve_connection_with_upgrades`
    // sniffs the protocol version before hyper's header timer runs, so a client that sends a
    // few bytes (or none) and then nothing would hold the connection forever.
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(Some(limits.header_read_timeout).filter(|timeout| !timeout.is_zero()))
        .max_headers(MAX_REQUEST_HEADERS)
        .max_header_size(MAX_REQUEST_HEAD_BYTES)
        .max_buf_size(MAX_REQUEST_HEAD_BYTES)
        .keep_alive(true);
    // Each connection's task: on shutdown it asks its connection to finish the request in
    // flight and close; the tracker waits for them (hyper's upgradeable HTTP/1.1 connection
    // has no `GracefulConnection` impl for hyper-util's `GracefulShutdown`).
    let connections = TaskTracker::new();
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            },
        };
        let Some(admitted) = admission.admit(peer.ip()) else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let body_idle = limits.body_idle_timeout;
        let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(peer));
            let request = request.map(|body| {
                if body_idle.is_zero() {
                    axum::body::Body::new(body)
                } else {
                    axum::body::Body::new(TimeoutBody::new(body_idle, body))
                }
            });
            app.clone().oneshot(request)
        });
        // Upgrades: a WebSocket through the preview path route.
        let connection = http
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades();
        let stop = shutdown.clone();
        connections.spawn(async move {
            let mut connection = std::pin::pin!(connection);
            let ended = tokio::select! {
                ended = connection.as_mut() => ended,
                _ = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, peer = %peer, "connection ended with an error");
            }
            drop(admitted);
        });
    }
    drop(listener);
    connections.close();
    if tokio::time::timeout(SHUTDOWN_GRACE, connections.wait())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?SHUTDOWN_GRACE, "connections still open at shutdown; dropped");
    }
    Ok(())
}
