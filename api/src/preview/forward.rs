//! One forwarded request: a connection to the host's forwarder opened with a signed preamble,
//! then HTTP/1.1 to the sandbox's port over it (hyper's client). A `101 Switching Protocols`
//! answer (WebSocket) joins the client's upgraded connection to the sandbox's, byte for byte.
//! Response bodies stream (Server-Sent Events pass as they come). The response head must come
//! within [`Bounds::response`] (else `504`); a tunnel ends as [`super::tunnel`] says, and a
//! response body opened by a token fails at the token's expiry ([`tunnel::ExpiringBody`]).
//! The response's cookies and, by path, its origin are confined by [`super::confine`].
//!
//! Each request opens its own connection through the forwarder (no pooling yet): simple, and
//! no connection is ever shared between two clients.

use std::net::IpAddr;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderName, HeaderValue, Request, StatusCode, Uri, Version};
use axum::response::Response;
use berth_schemas::preview::{Key, Preamble, Reply, PREAMBLE_TTL_SECS};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::page::Page;
use super::tunnel::{self, TunnelLimits};
use super::Target;

/// How long connecting to a host's forwarder and reading its answer may take.
pub const FORWARDER_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest reply line a forwarder writes.
const MAX_REPLY_LEN: usize = 64;

/// Headers that describe one hop, never forwarded (RFC 9110 §7.6.1), except `Connection` and
/// `Upgrade` on an upgrade.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Why a request was not forwarded.
#[derive(Debug)]
pub enum Failure {
    /// The forwarder could not be reached.
    Unreachable(std::io::Error),
    /// The forwarder refused the preamble (the proxy's secret and the host's key differ).
    Unauthorized,
    /// The forwarder does not hold the sandbox running (it moved, or stopped just now).
    NotHere,
    /// Nothing listens on the port.
    NothingListens,
    /// The sandbox's server broke the HTTP exchange.
    Upstream(hyper::Error),
    /// The sandbox's server switched protocols although the client did not ask to.
    UnaskedUpgrade,
    /// The sandbox's server sent no response head within the bound.
    NoAnswer(Duration),
}

impl Failure {
    /// Whether the cached route may be wrong (ask Postgres again next time).
    pub fn stale_route(&self) -> bool {
        matches!(self, Failure::Unreachable(_) | Failure::NotHere)
    }

    /// The page a browser user gets.
    pub fn page(&self, port: u16) -> Page {
        match self {
            Failure::NothingListens => Page::new(
                StatusCode::BAD_GATEWAY,
                format!("Nothing is listening on port {port} in this sandbox."),
            ),
            Failure::NotHere => Page::waking(1),
            Failure::Unreachable(e) => {
                tracing::warn!(error = %e, "preview: forwarder unreachable");
                Page::new(
                    StatusCode::BAD_GATEWAY,
                    "The sandbox's host cannot be reached.",
                )
            }
            Failure::Unauthorized => {
                tracing::error!("preview: a forwarder refused this proxy's preamble (preview secret and forwarder key differ)");
                Page::new(
                    StatusCode::BAD_GATEWAY,
                    "The sandbox's host refused the proxy.",
                )
            }
            Failure::UnaskedUpgrade => Page::new(
                StatusCode::BAD_GATEWAY,
                format!("The server on port {port} switched protocols unasked."),
            ),
            Failure::NoAnswer(after) => Page::new(
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "The server on port {port} did not answer within {} s.",
                    after.as_secs()
                ),
            ),
            Failure::Upstream(e) => Page::new(
                StatusCode::BAD_GATEWAY,
                format!("The server on port {port} did not answer properly: {e}."),
            ),
        }
    }
}

/// Opens a connection to `target` through the forwarder at `forwarder` (signed with the
/// host's `key`).
///
/// Errors: [`Failure::Unreachable`], [`Failure::Unauthorized`], [`Failure::NotHere`],
/// [`Failure::NothingListens`].
pub async fn connect(forwarder: &str, key: &Key, target: &Target) -> Result<TcpStream, Failure> {
    let opened = tokio::time::timeout(FORWARDER_TIMEOUT, async {
        let mut stream = TcpStream::connect(forwarder).await?;
        stream.set_nodelay(true)?;
        let preamble = Preamble {
            sandbox: target.sandbox,
            port: target.port,
            expires: chrono::Utc::now().timestamp() + PREAMBLE_TTL_SECS,
        };
        stream.write_all(preamble.encode(key).as_bytes()).await?;
        // Byte by byte: nothing after the newline may be taken from the stream.
        let mut line = Vec::with_capacity(MAX_REPLY_LEN);
        while line.last() != Some(&b'\n') && line.len() < MAX_REPLY_LEN {
            let b = stream.read_u8().await?;
            line.push(b);
        }
        Ok::<_, std::io::Error>((stream, String::from_utf8_lossy(&line).into_owned()))
    })
    .await
    .map_err(|_| Failure::Unreachable(std::io::ErrorKind::TimedOut.into()))?
    .map_err(Failure::Unreachable)?;
    let (stream, line) = opened;
    match Reply::parse(&line) {
        Some(Reply::Ok) => Ok(stream),
        Some(Reply::Refused) => Err(Failure::NothingListens),
        Some(Reply::NotFound | Reply::NotRunning) => Err(Failure::NotHere),
        Some(Reply::Unauthorized) | None => Err(Failure::Unauthorized),
    }
}

/// How long a forwarded exchange may last.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// The wait for the response head; `None`: unbounded.
    pub response: Option<Duration>,
    /// When a tunnel (an upgrade) is closed.
    pub tunnel: TunnelLimits,
}

/// Forwards `req` (for `target`) through the forwarder and answers with the sandbox's
/// response; `peer` becomes `X-Forwarded-For`.
///
/// Errors: [`Failure`].
pub async fn forward(
    forwarder: &str,
    key: &Key,
    target: &Target,
    mut req: Request<Body>,
    peer: Option<IpAddr>,
    bounds: Bounds,
) -> Result<Response, Failure> {
    let stream = connect(forwarder, key, target).await?;
    let downstream_upgrade = req.extensions_mut().remove::<OnUpgrade>();
    let upgrading = is_upgrade(&req);
    prepare(&mut req, target, peer, upgrading);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(Failure::Upstream)?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "preview upstream connection ended with an error");
        }
    });
    let sent = sender.send_request(req);
    let mut response = match bounds.response {
        // Dropping the exchange (and with it the connection task's sender) closes the
        // connection to the sandbox.
        Some(limit) => tokio::time::timeout(limit, sent)
            .await
            .map_err(|_| Failure::NoAnswer(limit))?,
        None => sent.await,
    }
    .map_err(Failure::Upstream)?;
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        match downstream_upgrade {
            Some(downstream) if upgrading => {
                let upstream = hyper::upgrade::on(&mut response);
                tokio::spawn(async move {
                    match tokio::try_join!(downstream, upstream) {
                        Ok((client, server)) => {
                            let ended = tunnel::join(
                                TokioIo::new(client),
                                TokioIo::new(server),
                                bounds.tunnel,
                            )
                            .await;
                            tracing::debug!(reason = ended.as_str(), "preview tunnel ended");
                        }
                        Err(e) => tracing::debug!(error = %e, "preview upgrade failed"),
                    }
                });
                return Ok(response.map(Body::new));
            }
            // An upgrade the client did not ask for (or cannot make over HTTP/2).
            _ => return Err(Failure::UnaskedUpgrade),
        }
    }
    strip_hop_by_hop(response.headers_mut(), false);
    super::confine::response_headers(response.headers_mut(), target);
    Ok(match bounds.tunnel.until {
        // A grant that expires (a token) ends the body with it: an event stream opened with a
        // token would otherwise outlive the token for as long as the server keeps writing.
        Some(until) => {
            response.map(|body| Body::new(tunnel::ExpiringBody::new(Body::new(body), until)))
        }
        None => response.map(Body::new),
    })
}

/// Whether the request asks for a protocol upgrade (`Connection: upgrade` and `Upgrade`).
pub(crate) fn is_upgrade(req: &Request<Body>) -> bool {
    req.version() == Version::HTTP_11
        && req.headers().contains_key(header::UPGRADE)
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| {
                v.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
}

/// Makes `req` an HTTP/1.1 request for the sandbox: origin-form URI, a Host header (HTTP/2
/// carries it as `:authority`), no hop-by-hop headers (but those of an upgrade), and the
/// `X-Forwarded-*` headers.
fn prepare(req: &mut Request<Body>, target: &Target, peer: Option<IpAddr>, upgrading: bool) {
    let authority = req.uri().authority().map(|a| a.as_str().to_owned());
    let proto = if req.uri().scheme_str() == Some("https") {
        "https"
    } else {
        "http"
    };
    *req.uri_mut() = target
        .path_and_query
        .parse::<Uri>()
        .unwrap_or_else(|_| Uri::from_static("/"));
    *req.version_mut() = Version::HTTP_11;
    let headers = req.headers_mut();
    if !headers.contains_key(header::HOST) {
        if let Some(v) = authority.and_then(|a| HeaderValue::from_str(&a).ok()) {
            headers.insert(header::HOST, v);
        }
    }
    strip_hop_by_hop(headers, upgrading);
    if let Some(host) = headers.get(header::HOST).cloned() {
        headers.insert(HeaderName::from_static("x-forwarded-host"), host);
    }
    headers.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static(proto),
    );
    if let Some(ip) = peer {
        if let Ok(v) = HeaderValue::from_str(&ip.to_string()) {
            headers.insert(HeaderName::from_static("x-forwarded-for"), v);
        }
    }
}

/// Removes hop-by-hop headers, and those `Connection` names; an upgrade keeps `Connection`
/// and `Upgrade`.
fn strip_hop_by_hop(headers: &mut axum::http::HeaderMap, upgrading: bool) {
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|t| t.trim().to_ascii_lowercase()))
        .filter(|t| !t.is_empty() && t != "upgrade")
        .collect();
    for name in HOP_BY_HOP.iter().copied().map(str::to_owned).chain(named) {
        if upgrading && (name == "connection" || name == "upgrade") {
            continue;
        }
        headers.remove(name.as_str());
    }
}
