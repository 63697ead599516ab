//! A delaying TCP relay: the delay half of a slow link where the kernel has no `sch_netem`
//! (`impair.rs` says when). One listener per upstream; each accepted connection is joined to a
//! new connection to that upstream, and each direction is a delay line: a chunk read from one
//! side is written to the other [`Jitter::sample`] after it was read.
//!
//! What it emulates and what it does not:
//! - The delay is per chunk (one `read`, at most [`CHUNK`] bytes), not per packet: a chunk
//!   is what the sending side's socket had buffered when the relay read it, so a burst of
//!   small packets may travel as one chunk with one delay, where netem would give each its own.
//! - Order is kept within a direction: a chunk never overtakes the one before (its delay is
//!   stretched to the previous chunk's instead), as a TCP stream cannot reorder; netem with
//!   jitter reorders packets and TCP then reassembles them, which this does not reproduce.
//! - The TCP handshake is not delayed (the kernel answers it before the relay accepts), so a
//!   connection opens at once and its first bytes come one delay later; netem delays the
//!   handshake by a round trip too.
//! - It only delays what it carries: the DNAT rule of `impair.rs` sends it the host's
//!   connections to the NATS servers, which is all the host's link carries in the topology.
//! - Loss is not its business: the nftables rules of `impair.rs` drop packets on the link
//!   itself, between the host and the relay, and TCP's retransmissions of those add their own
//!   delays on top of this one, as they do under netem.
//!
//! Everything runs on the test's runtime; dropping the [`DelayRelay`] aborts its listeners and
//! every connection (both sockets close).

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// The most one read takes from a socket: one chunk.
pub const CHUNK: usize = 64 * 1024;
/// How many chunks a direction holds in flight before it stops reading (its sender then
/// feels TCP's back-pressure, as from a full link).
const IN_FLIGHT: usize = 1024;

/// A delay drawn from a normal distribution of mean `mean` and standard deviation `jitter`,
/// clamped at zero: netem's `delay <mean> <jitter> distribution normal`.
#[derive(Clone, Copy, Debug)]
pub struct Jitter {
    /// The mean delay.
    pub mean: Duration,
    /// The standard deviation.
    pub jitter: Duration,
}

impl Jitter {
    /// One delay (Box–Muller on two uniform draws).
    pub fn sample(&self) -> Duration {
        let u1 = 1.0 - rand::random::<f64>(); // (0, 1]: ln is finite
        let u2 = rand::random::<f64>();
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        let secs = self.mean.as_secs_f64() + self.jitter.as_secs_f64() * z;
        Duration::from_secs_f64(secs.max(0.0))
    }
}

/// A direction of a relayed connection.
#[derive(Clone, Copy, Debug)]
pub enum Direction {
    /// From the connecting side (the host) to the upstream (a NATS server).
    Up = 0,
    /// From the upstream to the connecting side.
    Down = 1,
}

/// What the relay carried, counted as it goes.
#[derive(Default)]
struct Stats {
    connections: AtomicU64,
    chunks: [AtomicU64; 2],
    bytes: [AtomicU64; 2],
    /// The sum of each chunk's time from read to written, µs.
    delay_us: [AtomicU64; 2],
}

/// A snapshot of [`Stats`], per [`Direction`] where indexed.
#[derive(Clone, Copy, Debug)]
pub struct Carried {
    /// Connections joined to their upstream.
    pub connections: u64,
    /// Chunks written, `[up, down]`.
    pub chunks: [u64; 2],
    /// Bytes written, `[up, down]`.
    pub bytes: [u64; 2],
    /// The mean time from a chunk's read to its write (the delay it got, including waiting
    /// behind the chunk before it and the runtime's lateness), `[up, down]`.
    pub mean_delay: [Duration; 2],
}

impl std::fmt::Display for Carried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} connections, {} chunks ({} KiB) up / {} ({} KiB) down, mean delay {:.0} ms up / {:.0} ms down",
            self.connections,
            self.chunks[0],
            self.bytes[0] / 1024,
            self.chunks[1],
            self.bytes[1] / 1024,
            self.mean_delay[0].as_secs_f64() * 1e3,
            self.mean_delay[1].as_secs_f64() * 1e3
        )
    }
}

/// A running relay.
pub struct DelayRelay {
    /// `(upstream, listener)`: where a connection meant for `upstream` must go instead.
    pub routes: Vec<(SocketAddr, SocketAddr)>,
    stats: Arc<Stats>,
    /// The listeners' tasks; each owns its connections' tasks, so dropping this aborts all.
    _tasks: JoinSet<()>,
}

impl DelayRelay {
    /// Listens on `bind` (a port the system picks) for each of `upstreams`, delaying both
    /// directions of every connection by `delay`. Panics when it cannot bind.
    pub async fn start(bind: IpAddr, upstreams: &[SocketAddr], delay: Jitter) -> DelayRelay {
        let stats = Arc::new(Stats::default());
        let mut tasks = JoinSet::new();
        let mut routes = Vec::new();
        for &upstream in upstreams {
            let listener = TcpListener::bind((bind, 0))
                .await
                .unwrap_or_else(|e| panic!("bind the delay relay on {bind}: {e}"));
            routes.push((upstream, listener.local_addr().unwrap()));
            tasks.spawn(accept(listener, upstream, delay, stats.clone()));
        }
        DelayRelay {
            routes,
            stats,
            _tasks: tasks,
        }
    }

    /// What it carried so far.
    pub fn carried(&self) -> Carried {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mean = |d: usize| {
            let chunks = get(&self.stats.chunks[d]);
            Duration::from_micros(
                get(&self.stats.delay_us[d])
                    .checked_div(chunks)
                    .unwrap_or(0),
            )
        };
        Carried {
            connections: get(&self.stats.connections),
            chunks: [get(&self.stats.chunks[0]), get(&self.stats.chunks[1])],
            bytes: [get(&self.stats.bytes[0]), get(&self.stats.bytes[1])],
            mean_delay: [mean(0), mean(1)],
        }
    }
}

/// Accepts connections for `upstream` until aborted.
async fn accept(listener: TcpListener, upstream: SocketAddr, delay: Jitter, stats: Arc<Stats>) {
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let Ok((host_side, _)) = listener.accept().await else {
            continue;
        };
        connections.spawn(relay(host_side, upstream, delay, stats.clone()));
    }
}

/// One connection: joined to a new one to `upstream` (refused: the host's side is closed, as
/// the upstream would have refused it), then both directions delayed until each ends.
async fn relay(host_side: TcpStream, upstream: SocketAddr, delay: Jitter, stats: Arc<Stats>) {
    let Ok(upstream_side) = TcpStream::connect(upstream).await else {
        return;
    };
    stats.connections.fetch_add(1, Ordering::Relaxed);
    let _ = host_side.set_nodelay(true);
    let _ = upstream_side.set_nodelay(true);
    let (host_read, host_write) = host_side.into_split();
    let (upstream_read, upstream_write) = upstream_side.into_split();
    tokio::join!(
        delay_line(host_read, upstream_write, Direction::Up, delay, &stats),
        delay_line(upstream_read, host_write, Direction::Down, delay, &stats),
    );
}

/// Copies `from` to `to`, each chunk written one delay after it was read and never before the
/// chunk ahead of it; at `from`'s end (or error) the rest is written and `to` shut down. A
/// failed write ends the direction (the read side then stops at its next chunk).
async fn delay_line(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    direction: Direction,
    delay: Jitter,
    stats: &Stats,
) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(IN_FLIGHT);
    let read = async move {
        let mut buf = vec![0; CHUNK];
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            if tx.send((Instant::now(), buf[..n].to_vec())).await.is_err() {
                break;
            }
        }
    };
    let d = direction as usize;
    let write = async move {
        let mut previous = Instant::now();
        while let Some((read_at, chunk)) = rx.recv().await {
            let due = (read_at + delay.sample()).max(previous);
            previous = due;
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
            let took = u64::try_from(read_at.elapsed().as_micros()).unwrap_or(u64::MAX);
            stats.chunks[d].fetch_add(1, Ordering::Relaxed);
            stats.bytes[d].fetch_add(chunk.len() as u64, Ordering::Relaxed);
            stats.delay_us[d].fetch_add(took, Ordering::Relaxed);
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}

/// The relay carries both directions byte for byte and in order, however the writes were cut,
/// and passes each side's end on to the other.
#[tokio::test]
async fn the_relay_carries_both_ways_in_order_and_passes_the_end_on() {
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up_addr = upstream.local_addr().unwrap();
    let relay = DelayRelay::start(
        IpAddr::from([127, 0, 0, 1]),
        &[up_addr],
        Jitter {
            mean: Duration::from_millis(5),
            jitter: Duration::from_millis(5),
        },
    )
    .await;
    assert_eq!(relay.routes[0].0, up_addr);
    let sent: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let server = tokio::spawn(async move {
        let (mut conn, _) = upstream.accept().await.unwrap();
        let mut got = Vec::new();
        conn.read_to_end(&mut got).await.unwrap();
        conn.write_all(b"bye").await.unwrap();
        got
    });
    let mut client = TcpStream::connect(relay.routes[0].1).await.unwrap();
    for piece in sent.chunks(777) {
        client.write_all(piece).await.unwrap();
    }
    client.shutdown().await.unwrap();
    let mut reply = Vec::new();
    client.read_to_end(&mut reply).await.unwrap();
    assert!(server.await.unwrap() == sent, "the bytes up differ");
    assert_eq!(reply, b"bye");
    let carried = relay.carried();
    assert_eq!(carried.connections, 1);
    assert_eq!(carried.bytes, [sent.len() as u64, 3]);
}
