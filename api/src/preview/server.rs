//! `berth proxy`'s listener: HTTP/1.1 and HTTP/2 over cleartext (h2c, prior knowledge) on one
//! port, with upgrades (WebSocket). A request is routed by its host name
//! (`{port}-{id}.{domain}`), else by its path (`/v1/sandboxes/{id}/ports/{port}/…`);
//! `GET /healthz` on any other host answers `ok`; everything else is a 404 page.
//!
//! # Guarantees
//! - On shutdown, accepting stops and open connections get [`crate::server::SHUTDOWN_GRACE`]
//!   to finish.
//! - A connection that sends no request head within [`HEADER_READ_TIMEOUT`] is closed.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::response::Response;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::page::Page;
use super::{target, Preview};

/// How long a connection may take to send a request head.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves previews on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    preview: Arc<Preview>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    tracing::info!(addr = ?listener.local_addr().ok(), domain = %preview.config.domain, "preview proxy listening");
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let graceful = GracefulShutdown::new();
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
        let _ = stream.set_nodelay(true);
        let preview = preview.clone();
        let sniffed = shutdown.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let preview = preview.clone();
            async move { Ok::<_, Infallible>(route(&preview, req.map(Body::new), peer).await) }
        });
        let builder = builder.clone();
        let graceful_watch = graceful.watcher();
        tokio::spawn(async move {
            // hyper-util sniffs the version before hyper's header timer runs: bound that part.
            if !tokio::select! {
                decided = version_decidable(&stream) => decided,
                _ = sniffed.cancelled() => false,
            } {
                return;
            }
            let connection = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .into_owned();
            if let Err(e) = graceful_watch.watch(connection).await {
                tracing::debug!(error = %e, %peer, "proxy connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(crate::server::SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("proxy connections still open at shutdown; dropped");
    }
    Ok(())
}

/// The HTTP/2 connection preface a client of h2c with prior knowledge opens with.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Waits (at most [`HEADER_READ_TIMEOUT`]) until the bytes the client sent tell HTTP/1.1 from
/// HTTP/2, without consuming them: true once they do, false when the client closed or took too
/// long (the connection is then dropped). A client that sends nothing, or a prefix of the
/// preface and then nothing, would otherwise hold the connection forever.
async fn version_decidable(stream: &tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; H2_PREFACE.len()];
    let deadline = tokio::time::Instant::now() + HEADER_READ_TIMEOUT;
    loop {
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

/// Routes one request by host name, then by path.
pub async fn route(preview: &Preview, req: Request<Body>, peer: SocketAddr) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_owned()));
    let peer_ip = Some(crate::limits::client_of(peer.ip()));
    if let Some((sandbox, port)) = host
        .as_deref()
        .and_then(|h| target::from_host(h, &preview.config.domain))
    {
        let target = target::by_host(sandbox, port, req.uri());
        return preview.handle(req, target, peer_ip).await;
    }
    if let Some(target) = target::from_path(req.uri()) {
        return preview.handle(req, target, peer_ip).await;
    }
    if req.uri().path() == "/healthz" {
        let mut ok = Response::new(Body::from("ok"));
        *ok.status_mut() = StatusCode::OK;
        return ok;
    }
    Page::new(
        StatusCode::NOT_FOUND,
        "This is a Berth preview server: open a sandbox's preview URL.",
    )
    .into_response()
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
