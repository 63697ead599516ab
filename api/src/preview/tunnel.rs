//! A joined upgrade (WebSocket, or any `101 Switching Protocols`): bytes both ways between the
//! client's connection and the sandbox's, until one of them closes, nothing moves for the idle
//! limit, or the grant that opened it (a preview token, or its cookie) expires.
//!
//! # Guarantees
//! - A tunnel that moves no byte either way for [`TunnelLimits::idle`] is closed, also when one
//!   side stopped reading and a write to it is stuck (a stuck write moves no byte).
//! - A tunnel opened with a token is closed at the token's expiry, busy or not: the access
//!   check only runs when the tunnel opens, so the token's lifetime must end it.
//! - Either side's end of stream is passed on (half-close), as `copy_bidirectional` does.
//! - A response body forwarded under a token (an event stream, any long download) fails at the
//!   token's expiry ([`ExpiringBody`]), as a tunnel is closed then.
//!
//! Each end is counted in `berth_preview_tunnels_closed_total{reason}` (`closed`, `idle`,
//! `expired`, `error`).

use std::sync::Mutex;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

/// Bytes read from one side before they are written to the other.
const BUFFER: usize = 16 * 1024;

/// When a tunnel is closed although both sides keep it open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TunnelLimits {
    /// No byte either way for this long closes it; `None`: never.
    pub idle: Option<Duration>,
    /// It is closed at this instant (its token's expiry); `None`: never.
    pub until: Option<Instant>,
}

impl TunnelLimits {
    /// The limits of a tunnel with idle limit `idle` (zero: none) opened by a grant that ends at
    /// Unix time `expires` (seconds; `None`: a key or a public port, which do not expire).
    pub fn new(idle: Duration, expires: Option<i64>) -> Self {
        let until = expires.map(|at| {
            let left = at.saturating_sub(chrono::Utc::now().timestamp());
            Instant::now() + Duration::from_secs(u64::try_from(left).unwrap_or(0))
        });
        Self {
            idle: Some(idle).filter(|t| !t.is_zero()),
            until,
        }
    }
}

/// Why a tunnel ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Both sides closed (or one closed and the other finished).
    Closed,
    /// No byte moved for the idle limit.
    Idle,
    /// The grant that opened it expired.
    Expired,
    /// A read or write failed.
    Error,
}

impl Ended {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Ended::Closed => "closed",
            Ended::Idle => "idle",
            Ended::Expired => "expired",
            Ended::Error => "error",
        }
    }
}

/// Copies bytes between `client` and `server` until the tunnel ends (see the module's
/// guarantees); dropping both connections on return closes them.
pub async fn join<A, B>(client: A, server: B, limits: TunnelLimits) -> Ended
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let last = Mutex::new(Instant::now());
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut server_read, mut server_write) = tokio::io::split(server);
    let pumps = async {
        tokio::try_join!(
            pump(&mut client_read, &mut server_write, &last),
            pump(&mut server_read, &mut client_write, &last),
        )
    };
    let ended = tokio::select! {
        done = pumps => if done.is_ok() { Ended::Closed } else { Ended::Error },
        why = watchdog(&last, limits) => why,
    };
    metrics::counter!("berth_preview_tunnels_closed_total", "reason" => ended.as_str())
        .increment(1);
    ended
}

/// Copies `from` to `to` until `from` ends (then shuts `to`'s writing down), stamping `last` on
/// every byte moved.
async fn pump<R, W>(from: &mut R, to: &mut W, last: &Mutex<Instant>) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; BUFFER];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return to.shutdown().await;
        }
        touch(last);
        to.write_all(&buf[..n]).await?;
        to.flush().await?;
        touch(last);
    }
}

fn touch(last: &Mutex<Instant>) {
    *last.lock().expect("never poisoned") = Instant::now();
}

/// Returns once the tunnel must end: idle for `limits.idle`, or at `limits.until`.
async fn watchdog(last: &Mutex<Instant>, limits: TunnelLimits) -> Ended {
    if limits.idle.is_none() && limits.until.is_none() {
        return std::future::pending().await;
    }
    loop {
        let idle_at = limits
            .idle
            .map(|idle| *last.lock().expect("never poisoned") + idle);
        let wake = match (idle_at, limits.until) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => unreachable!("returned above"),
        };
        tokio::time::sleep_until(wake).await;
        let now = Instant::now();
        if limits.until.is_some_and(|until| now >= until) {
            return Ended::Expired;
        }
        if let Some(idle) = limits.idle {
            if now >= *last.lock().expect("never poisoned") + idle {
                return Ended::Idle;
            }
        }
    }
}

/// A forwarded response body (an event stream, a long download: anything that is not an
/// upgrade) cut at its grant's expiry: the access check ran once, when the request came, so a
/// stream opened with a token must not outlive the token. At the deadline the body fails
/// (`berth_preview_streams_expired_total`): the client sees the response end unfinished (an
/// HTTP/1.1 connection closed mid-body, an HTTP/2 stream reset), and a reconnecting
/// `EventSource` then meets the access check again.
pub struct ExpiringBody {
    inner: axum::body::Body,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl ExpiringBody {
    /// `inner`, failing at `until`.
    pub fn new(inner: axum::body::Body, until: Instant) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep_until(until)),
        }
    }
}

impl hyper::body::Body for ExpiringBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, axum::Error>>> {
        use std::future::Future;
        use std::task::Poll;
        if self.deadline.as_mut().poll(cx).is_ready() {
            if self.inner.is_end_stream() {
                return Poll::Ready(None);
            }
            metrics::counter!("berth_preview_streams_expired_total").increment(1);
            return Poll::Ready(Some(Err(axum::Error::new(
                "the preview grant of this response expired",
            ))));
        }
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Generous: these only bound how long a test waits for an end that must come.
    const BOUND: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn a_tunnel_carries_bytes_both_ways_and_ends_when_idle() {
        let (client, mut client_far) = tokio::io::duplex(64);
        let (server, mut server_far) = tokio::io::duplex(64);
        let limits = TunnelLimits {
            idle: Some(Duration::from_millis(300)),
            until: None,
        };
        let joined = tokio::spawn(join(client, server, limits));
        client_far.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        server_far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        server_far.write_all(b"pong").await.unwrap();
        client_far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        let ended = tokio::time::timeout(BOUND, joined).await.unwrap().unwrap();
        assert_eq!(ended, Ended::Idle);
        // Both far ends see the close.
        assert_eq!(client_far.read(&mut got).await.unwrap(), 0);
        assert_eq!(server_far.read(&mut got).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_busy_tunnel_still_ends_at_its_grants_expiry() {
        let (client, mut client_far) = tokio::io::duplex(64);
        let (server, mut server_far) = tokio::io::duplex(64);
        let limits = TunnelLimits {
            idle: Some(Duration::from_secs(3600)),
            until: Some(Instant::now() + Duration::from_millis(500)),
        };
        let mut joined = tokio::spawn(join(client, server, limits));
        let mut got = [0u8; 1];
        let ended = tokio::time::timeout(BOUND, async {
            loop {
                tokio::select! {
                    ended = &mut joined => return ended.unwrap(),
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {
                        // Keep it busy; writes fail once it is closed.
                        if client_far.write_all(b"x").await.is_ok() {
                            let _ = server_far.read(&mut got).await;
                        }
                    }
                }
            }
        })
        .await
        .unwrap();
        assert_eq!(ended, Ended::Expired);
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_does_not_hold_the_tunnel_past_the_idle_limit() {
        // The server writes more than the client's side buffers; the client never reads.
        let (client, _client_far) = tokio::io::duplex(16);
        let (server, mut server_far) = tokio::io::duplex(1 << 20);
        let limits = TunnelLimits {
            idle: Some(Duration::from_millis(300)),
            until: None,
        };
        let joined = tokio::spawn(join(client, server, limits));
        server_far.write_all(&[7u8; 4096]).await.unwrap();
        let ended = tokio::time::timeout(BOUND, joined).await.unwrap().unwrap();
        assert_eq!(ended, Ended::Idle);
    }
}
