//! A slow link for a test: a TCP relay on a loopback port that forwards each connection to a
//! loopback upstream, passing what the client sends at a bounded rate (what the upstream
//! answers passes unthrottled). Put in front of the S3 server, it makes an upload of a few
//! tens of MiB last seconds instead of milliseconds, so a test can act on the server while the
//! upload is surely in progress.
//!
//! When the upstream cannot be reached (it was killed), or one side closes, the relay closes
//! both: the client sees its connection end, as it would without the relay.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Bytes read from the client at a time.
const SLICE: usize = 16 * 1024;

/// A running relay; stops (and drops its connections) on drop.
pub struct Throttle {
    /// The loopback port clients connect to.
    pub port: u16,
    task: JoinHandle<()>,
}

impl Throttle {
    /// Starts a relay to `127.0.0.1:upstream` passing each connection's client bytes at
    /// `bytes_per_sec` at most.
    pub async fn start(upstream: u16, bytes_per_sec: u64) -> Throttle {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                connections.spawn(relay(client, upstream, bytes_per_sec));
            }
        });
        Throttle { port, task }
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(client: TcpStream, upstream: u16, bytes_per_sec: u64) {
    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
        return; // the client's connection is dropped: closed
    };
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let upload = async move {
        let started = tokio::time::Instant::now();
        let mut passed = 0u64;
        let mut buf = vec![0u8; SLICE];
        loop {
            let n = match from_client.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if to_server.write_all(&buf[..n]).await.is_err() {
                return;
            }
            passed += n as u64;
            // The rate: the next slice may pass once the bytes so far are due.
            let due = Duration::from_secs_f64(passed as f64 / bytes_per_sec as f64);
            tokio::time::sleep_until(started + due).await;
        }
    };
    let download = async move {
        let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
    };
    // Whichever side ends first ends the connection: both halves drop here.
    tokio::select! {
        () = upload => {}
        () = download => {}
    }
}
