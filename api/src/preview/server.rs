//! `berth proxy`'s listener: HTTP/1.1 and HTTP/2 over cleartext (h2c, prior knowledge) on one
//! port, with upgrades (WebSocket). A request is routed by its host name
//! (`{port}-{id}.{domain}`), else by its path (`/v1/sandboxes/{id}/ports/{port}/…`);
//! `GET /healthz` on any other host answers `ok`; everything else is a 404 page.
//!
//! # Guarantees
//! - At most [`LimitsConfig::max_connections`] connections are open at once, and at most
//!   [`LimitsConfig::max_connections_per_ip`] from one client address ([`crate::admission`]);
//!   one beyond is closed at once (`berth_proxy_connections_refused_total{reason}`). The
//!   limits are the API's (`berth proxy` takes the same flags).
//! - A connection that sends no request head within [`LimitsConfig::header_read_timeout`]
//!   is closed (the HTTP/1.1-or-2 sniff included); on HTTP/1.1 that is also the keep-alive idle
//!   timeout.
//! - A connection (HTTP/1.1 or HTTP/2) with no request in flight and no response body still
//!   being sent for [`LimitsConfig::header_read_timeout`] is shut down gracefully (HTTP/2:
//!   GOAWAY), and dropped [`IDLE_CLOSE_GRACE`] later if it has not closed by then, so idle
//!   HTTP/2 connections cannot hold slots forever; an HTTP/2 peer that stops
//!   answering PINGs ([`H2_KEEP_ALIVE_INTERVAL`], [`H2_KEEP_ALIVE_TIMEOUT`]) is dropped even
//!   while a stream is open, and one connection carries at most [`H2_MAX_CONCURRENT_STREAMS`]
//!   streams at once.
//! - A request head with more than [`MAX_REQUEST_HEADERS`] fields or [`MAX_REQUEST_HEAD_BYTES`]
//!   bytes is answered `431`, on HTTP/1.1 and h2c, and never forwarded.
//! - Every request but the proxy's own `GET /healthz` counts against its client address's rate
//!   ([`LimitsConfig::per_ip`], the API's, per [`crate::limits::client_of`]); one over it is
//!   `429` with `Retry-After`, as a page, before any lookup. The rate state is swept every
//!   [`crate::limits::RATE_STATE_SWEEP`].
//! - On shutdown, accepting stops and open connections get [`crate::server::SHUTDOWN_GRACE`]
//!   to finish.
//!
//! [`LimitsConfig::max_connections`]: crate::limits::LimitsConfig::max_connections
//! [`LimitsConfig::max_connections_per_ip`]: crate::limits::LimitsConfig::max_connections_per_ip
//! [`LimitsConfig::header_read_timeout`]: crate::limits::LimitsConfig::header_read_timeout
//! [`LimitsConfig::per_ip`]: crate::limits::LimitsConfig::per_ip

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::page::Page;
use super::{target, Preview};
use crate::admission::{
    too_many_headers, Admission, MAX_REQUEST_HEADERS, MAX_REQUEST_HEAD_BYTES, PROXY_METRICS,
};

/// How often an HTTP/2 connection's peer is sent a PING.
pub const H2_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long an HTTP/2 PING may go unanswered before the connection is dropped.
pub const H2_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// How long an idle connection told to close (HTTP/2: GOAWAY) may take to do so before it is
/// dropped.
pub const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(5);
/// Most streams one HTTP/2 connection carries at once.
pub const H2_MAX_CONCURRENT_STREAMS: u32 = 100;

/// Serves previews on `listener` until `shutdown`, under the limits of the preview's
/// [`crate::limits::Guards`].
pub async fn serve(
    listener: TcpListener,
    preview: Arc<Preview>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    tracing::info!(addr = ?listener.local_addr().ok(), domain = %preview.config.domain, "preview proxy listening");
    let limits = preview.guards.config().clone();
    let admission = Admission::new(
        limits.max_connections,
        limits.max_connections_per_ip,
        PROXY_METRICS,
    );
    let idle_timeout = Some(limits.header_read_timeout).filter(|t| !t.is_zero());
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(idle_timeout)
        .max_headers(MAX_REQUEST_HEADERS)
        .max_buf_size(MAX_REQUEST_HEAD_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_REQUEST_HEAD_BYTES as u32)
        .keep_alive_interval(Some(H2_KEEP_ALIVE_INTERVAL))
        .keep_alive_timeout(H2_KEEP_ALIVE_TIMEOUT)
        .max_concurrent_streams(H2_MAX_CONCURRENT_STREAMS);
    let connections = TaskTracker::new();
    // A key revoked anywhere is refused here at once (the proxy caches keys too).
    let revocations = tokio::spawn(crate::revocations::forget_revoked_keys(
        preview.db.clone(),
        preview.guards.clone(),
        shutdown.clone(),
    ));
    let sweeper = tokio::spawn({
        let (guards, stop) = (preview.guards.clone(), shutdown.clone());
        async move {
            let mut every = tokio::time::interval(crate::limits::RATE_STATE_SWEEP);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = every.tick() => guards.sweep(),
                }
            }
        }
    });
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "proxy accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Some(admitted) = admission.admit(peer.ip()) else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let activity = Arc::new(Activity::new());
        let preview = preview.clone();
        let tracked = activity.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let preview = preview.clone();
            let busy = Busy::new(tracked.clone());
            async move {
                // HTTP/2 bounds only the head's bytes; its field count is checked here
                // (HTTP/1.1's parser refuses more itself).
                let response = if too_many_headers(req.headers()) {
                    Page::new(
                        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                        format!("A request may carry at most {MAX_REQUEST_HEADERS} headers."),
                    )
                    .into_response()
                } else {
                    route(&preview, req.map(Body::new), peer).await
                };
                // The connection counts as busy until the response body is sent (or dropped).
                Ok::<_, Infallible>(response.map(|inner| Body::new(Tracked { inner, _busy: busy })))
            }
        });
        let builder = builder.clone();
        let stop = shutdown.clone();
        connections.spawn(async move {
            // hyper-util sniffs the version before hyper's header timer runs: bound that part.
            let decided = tokio::select! {
                decided = version_decidable(&stream, idle_timeout) => decided,
                _ = stop.cancelled() => false,
            };
            if !decided {
                return;
            }
            let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            let mut connection = std::pin::pin!(connection);
            let ended = tokio::select! {
                ended = connection.as_mut() => ended,
                _ = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
                _ = activity.idle_for(idle_timeout) => {
                    // HTTP/2's graceful shutdown waits for the peer to answer a PING after its
                    // GOAWAY; a peer that never does is dropped after a short grace.
                    connection.as_mut().graceful_shutdown();
                    tokio::time::timeout(IDLE_CLOSE_GRACE, connection)
                        .await
                        .unwrap_or(Ok(()))
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, %peer, "proxy connection ended with an error");
            }
            drop(admitted);
        });
    }
    drop(listener);
    sweeper.abort();
    revocations.abort();
    connections.close();
    if tokio::time::timeout(crate::server::SHUTDOWN_GRACE, connections.wait())
        .await
        .is_err()
    {
        tracing::warn!("proxy connections still open at shutdown; dropped");
    }
    Ok(())
}

/// One connection's requests in flight and when that last changed.
#[derive(Debug)]
struct Activity {
    active: AtomicUsize,
    last: Mutex<Instant>,
}

impl Activity {
    fn new() -> Self {
        Self {
            active: AtomicUsize::new(0),
            last: Mutex::new(Instant::now()),
        }
    }

    fn touch(&self) {
        *self.last.lock().expect("never poisoned") = Instant::now();
    }

    /// Returns once nothing has been in flight for `timeout` (never when `None`).
    async fn idle_for(&self, timeout: Option<Duration>) {
        let Some(timeout) = timeout else {
            return std::future::pending().await;
        };
        loop {
            let due = *self.last.lock().expect("never poisoned") + timeout;
            if self.active.load(Ordering::Acquire) == 0 && Instant::now() >= due {
                return;
            }
            // Busy, or idle for less than `timeout`: look again when it could have run out.
            tokio::time::sleep_until(due.max(Instant::now() + Duration::from_millis(10))).await;
        }
    }
}

/// One request in flight on a connection, from its head to the end of its response body.
#[derive(Debug)]
struct Busy(Arc<Activity>);

impl Busy {
    fn new(activity: Arc<Activity>) -> Self {
        activity.active.fetch_add(1, Ordering::AcqRel);
        activity.touch();
        Self(activity)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in flight until it is sent or dropped.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The HTTP/2 connection preface a client of h2c with prior knowledge opens with.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Waits (at most `timeout`, when set) until the bytes the client sent tell HTTP/1.1 from
/// HTTP/2, without consuming them: true once they do, false when the client closed or took too
/// long (the connection is then dropped). A client that sends nothing, or a prefix of the
/// preface and then nothing, would otherwise hold the connection forever.
async fn version_decidable(stream: &tokio::net::TcpStream, timeout: Option<Duration>) -> bool {
    let mut buf = [0u8; H2_PREFACE.len()];
    // No timeout configured: a day stands for "unbounded" (the operator turned it off).
    let deadline = Instant::now() + timeout.unwrap_or(Duration::from_secs(86_400));
    loop {
        // `timeout_at` polls the peek first, and a peek of buffered bytes is always ready: the
        // deadline must be checked here too, or a partial preface is waited for forever.
        if Instant::now() >= deadline {
            return false;
        }
        match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return false,
            Ok(Ok(n)) if n == H2_PREFACE.len() || buf[..n] != H2_PREFACE[..n] => return true,
            // A prefix of the preface so far: wait for more (peek returns at once while bytes
            // are buffered, so pause before looking again).
            Ok(Ok(_)) => tokio::time::sleep(PEEK_AGAIN).await,
        }
    }
}

/// How long [`version_decidable`] waits before looking at a partial preface again.
const PEEK_AGAIN: Duration = Duration::from_millis(20);

/// Routes one request by host name, then by path, once its client address's rate allows it.
pub async fn route(preview: &Preview, req: Request<Body>, peer: SocketAddr) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_owned()));
    let target = match host
        .as_deref()
        .and_then(|h| target::from_host(h, &preview.config.domain))
    {
        Some((sandbox, port)) => Some(target::by_host(sandbox, port, req.uri())),
        None => target::from_path(req.uri()),
    };
    // The proxy's own health check is free; everything else (a preview of any path, a 404
    // page) counts against the client's rate.
    if target.is_none() && req.uri().path() == "/healthz" {
        let mut ok = Response::new(Body::from("ok"));
        *ok.status_mut() = StatusCode::OK;
        return ok;
    }
    let client = crate::limits::client_of(peer.ip());
    if let Err(e) = preview.guards.check_ip(client) {
        metrics::counter!("berth_preview_requests_total", "status" => "429").increment(1);
        return super::access::refusal(e).into_response();
    }
    match target {
        Some(target) => preview.handle(req, target, Some(client)).await,
        None => Page::new(
            StatusCode::NOT_FOUND,
            "This is a Berth preview server: open a sandbox's preview URL.",
        )
        .into_response(),
    }
}

/// Binds `addr` and serves; the proxy's entry point (`berth proxy`, `berth dev`).
///
/// Errors: the bind's.
pub async fn run(
    addr: SocketAddr,
    preview: Arc<Preview>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    serve(listener, preview, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_is_idle_only_once_nothing_is_in_flight_for_the_timeout() {
        let activity = Arc::new(Activity::new());
        let timeout = Some(Duration::from_millis(100));
        let busy = Busy::new(activity.clone());
        // A request in flight (a long response body) keeps the connection from being idle,
        // however long it takes.
        tokio::select! {
            _ = activity.idle_for(timeout) => panic!("idle while a request was in flight"),
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        drop(busy);
        tokio::time::timeout(Duration::from_secs(30), activity.idle_for(timeout))
            .await
            .expect("idle once the request ended");
        // No timeout configured: never idle.
        tokio::select! {
            _ = activity.idle_for(None) => panic!("idle without a timeout"),
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}
