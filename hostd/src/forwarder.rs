//! The host-side preview port forwarder: the only way the preview proxy reaches a sandbox.
//!
//! It listens on a TCP address of the host (`--forwarder-listen`). Each connection starts
//! with one signed [`Preamble`] line (see `berth_schemas::preview`): the proxy names a sandbox
//! and a port, signed with this host's forwarder key. The forwarder checks the signature and
//! expiry, finds the sandbox among this host's live records (running, with a link), connects
//! from the root network namespace to the sandbox's own address through its veth — the same
//! path hostd's agent connections take, which the firewall admits (`firewall`: nothing else
//! opens a connection into a sandbox) — answers one [`Reply`] line, and then copies bytes both
//! ways until either side closes. It knows nothing of HTTP: HTTP/1.1, h2c, WebSocket and
//! Server-Sent Events all pass as bytes.
//!
//! The same works for gVisor: runsc's netstack owns the sandbox's `eth0` inside the same
//! network namespace, and answers on the same address.
//!
//! # Guarantees
//! - A connection whose first line is not a valid preamble under this host's key gets
//!   `ERR unauthorized` and is closed; nothing is connected on its behalf. A first line that
//!   does not come within [`PREAMBLE_TIMEOUT`], or is longer than [`MAX_PREAMBLE_LEN`], is
//!   closed the same way.
//! - A sandbox this host does not hold is `ERR not-found`; one that is not running
//!   `ERR not-running`; a port nothing listens on (refused, or no answer within
//!   [`CONNECT_TIMEOUT`]) `ERR refused`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use berth_schemas::preview::{Key, Preamble, Reply, MAX_PREAMBLE_LEN};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::error::HostdError;
use crate::host::Host;
use crate::record::Phase;

/// How long a new connection has to send its preamble line.
pub const PREAMBLE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting to the sandbox's port may take before it counts as refused.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The default listen address of the forwarder (`--forwarder-listen`).
pub const DEFAULT_FORWARDER_LISTEN: &str = "0.0.0.0:18048";

/// What the forwarder needs: its listener's address and this host's key.
#[derive(Clone)]
pub struct ForwarderConfig {
    /// Where it listens (`0.0.0.0:18048`; port 0 takes a free port).
    pub listen: SocketAddr,
    /// The address heartbeats advertise to the proxy; `None`: the bound address, or when that
    /// is unspecified (`0.0.0.0`), the address of the default-route interface.
    pub advertise: Option<SocketAddr>,
    /// This host's forwarder key (`berth admin forwarder-key`).
    pub key: Key,
}

impl std::fmt::Debug for ForwarderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwarderConfig")
            .field("listen", &self.listen)
            .field("advertise", &self.advertise)
            .field("key", &"<redacted>")
            .finish()
    }
}

/// Binds the forwarder's listener and says which address to advertise.
///
/// Errors: [`HostdError::Io`] when the address can't be bound.
pub async fn bind(config: &ForwarderConfig) -> Result<(TcpListener, SocketAddr), HostdError> {
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(HostdError::io(format!(
            "bind the forwarder on {}",
            config.listen
        )))?;
    let bound = listener
        .local_addr()
        .map_err(HostdError::io("forwarder address"))?;
    let advertise = match config.advertise {
        Some(a) => a,
        None if bound.ip().is_unspecified() => {
            let ip = default_route_address()
                .await
                .unwrap_or(std::net::Ipv4Addr::LOCALHOST);
            SocketAddr::new(ip.into(), bound.port())
        }
        None => bound,
    };
    Ok((listener, advertise))
}

/// The first IPv4 address of the default-route interface, if there is one.
async fn default_route_address() -> Option<std::net::Ipv4Addr> {
    let dev = crate::firewall::default_route_interface().await.ok()??;
    let out = crate::tool::run("ip", &["-o", "-4", "addr", "show", "dev", &dev])
        .await
        .ok()?;
    crate::address::parse_ip_addr_output(&out.stdout)
        .into_iter()
        .next()
}

/// Serves forwarded connections on `listener` until `shutdown`.
pub async fn serve(host: Arc<Host>, listener: TcpListener, key: Key, shutdown: CancellationToken) {
    tracing::info!(addr = ?listener.local_addr().ok(), "port forwarder listening");
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "forwarder accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let (host, shutdown) = (host.clone(), shutdown.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = forward(&host, stream, &key, peer) => {}
            }
        });
    }
}

/// One forwarded connection: preamble, reply, then bytes both ways.
async fn forward(host: &Host, stream: TcpStream, key: &Key, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    let mut reader = BufReader::with_capacity(MAX_PREAMBLE_LEN, stream);
    let line = match tokio::time::timeout(PREAMBLE_TIMEOUT, read_line(&mut reader)).await {
        Ok(Some(line)) => line,
        _ => {
            let _ = reader
                .get_mut()
                .write_all(Reply::Unauthorized.line().as_bytes())
                .await;
            metrics::counter!("berth_forwarder_refused_total", "reason" => "preamble").increment(1);
            return;
        }
    };
    let now = chrono::Utc::now().timestamp();
    let mut sandbox = None;
    let (reply, upstream) = match Preamble::verify(&line, key, now) {
        Err(e) => {
            tracing::info!(%peer, error = %e, "forwarder refused a preamble");
            (Reply::Unauthorized, None)
        }
        Ok(p) => {
            sandbox = Some(p.sandbox);
            match target(host, p) {
                Err(reply) => (reply, None),
                Ok(addr) => {
                    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
                        Ok(Ok(s)) => (Reply::Ok, Some(s)),
                        _ => (Reply::Refused, None),
                    }
                }
            }
        }
    };
    metrics::counter!("berth_forwarder_connections_total", "reply" => reply.line().trim_end().to_owned())
        .increment(1);
    let client = reader.get_mut();
    if client.write_all(reply.line().as_bytes()).await.is_err() {
        return;
    }
    let (Some(mut upstream), Some(sandbox)) = (upstream, sandbox) else {
        return;
    };
    let _ = upstream.set_nodelay(true);
    // Bytes the client sent right after its preamble are in the reader's buffer: pass them on.
    let buffered = reader.buffer().to_vec();
    let mut client = reader.into_inner();
    if !buffered.is_empty() && upstream.write_all(&buffered).await.is_err() {
        return;
    }
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
        () = host.gates.closed(sandbox) => cut(&upstream),
    }
}

/// Ends a forwarded connection whose sandbox is stopping: its upstream end is reset (no
/// FIN-and-wait: a gVisor checkpoint refuses any endpoint still connected or closing, and a
/// stream the sandbox keeps writing would never finish closing), and the client's closes
/// with it. The client reconnects, and its next request wakes the sandbox.
fn cut(upstream: &TcpStream) {
    tracing::debug!("the sandbox is stopping: its forwarded connection is cut");
    // SO_LINGER 0: the close sends a reset and keeps nothing of the connection.
    let _ = socket2::SockRef::from(upstream).set_linger(Some(std::time::Duration::ZERO));
    metrics::counter!("berth_forwarder_cut_total").increment(1);
}

/// Reads one line of at most [`MAX_PREAMBLE_LEN`] bytes; `None` on EOF, overflow or non-UTF-8.
async fn read_line(reader: &mut BufReader<TcpStream>) -> Option<String> {
    let mut line = Vec::with_capacity(MAX_PREAMBLE_LEN);
    loop {
        let available = reader.fill_buf().await.ok()?;
        if available.is_empty() {
            return None;
        }
        if let Some(end) = available.iter().position(|b| *b == b'\n') {
            line.extend_from_slice(&available[..=end]);
            reader.consume(end + 1);
            break;
        }
        let n = available.len();
        line.extend_from_slice(available);
        reader.consume(n);
        if line.len() > MAX_PREAMBLE_LEN {
            return None;
        }
    }
    if line.len() > MAX_PREAMBLE_LEN {
        return None;
    }
    String::from_utf8(line).ok()
}

/// The sandbox's own address and the port, when this host holds it running.
fn target(host: &Host, p: Preamble) -> Result<SocketAddr, Reply> {
    let record = host.live(p.sandbox).ok_or(Reply::NotFound)?;
    match (record.phase, record.link) {
        (Phase::Running, Some(link)) => Ok(SocketAddr::new(link.sandbox.into(), p.port)),
        _ => Err(Reply::NotRunning),
    }
}
