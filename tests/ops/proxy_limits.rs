//! `berth proxy`'s listener under attack (issue 15): the API's connection caps hold there too
//! (per client address and in all), a client that sends nothing is closed, and an idle HTTP/2
//! connection is shut down with a GOAWAY instead of holding its slot forever. No hostd: the
//! proxy's own `/healthz` answers without a sandbox.

use std::time::Duration;

use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{eventually, Stack};

/// The longest a test waits for the proxy to close a connection; a proxy without the limit
/// under test never does (or only after its 50 s HTTP/2 PING timeout), and the test fails here.
const CLOSE_BOUND: Duration = Duration::from_secs(40);

/// Reads until the proxy closes the connection; what it sent. Panics after [`CLOSE_BOUND`].
async fn until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut seen = Vec::new();
    let read = tokio::time::timeout(CLOSE_BOUND, async {
        loop {
            let mut buf = [0u8; 4096];
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the proxy kept the connection open");
    seen
}

/// A connection to the proxy from `ip` (a loopback address).
async fn connect_from(stack: &Stack, ip: &str) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
    socket.connect(stack.proxy_addr).await.unwrap()
}

/// Whether a fresh connection from `ip` gets `200 ok` for the proxy's `GET /healthz`.
async fn healthz_from(stack: &Stack, ip: &str) -> bool {
    let mut stream = connect_from(stack, ip).await;
    let request = "GET /healthz HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n";
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    until_closed(&mut stream).await.starts_with(b"HTTP/1.1 200")
}

/// The HTTP/2 frame types in `bytes`, a server's side of a connection (frames only: the server
/// sends no preface).
fn h2_frame_types(bytes: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    let mut at = 0;
    while at + 9 <= bytes.len() {
        let len = usize::from(bytes[at]) << 16
            | usize::from(bytes[at + 1]) << 8
            | usize::from(bytes[at + 2]);
        types.push(bytes[at + 3]);
        at += 9 + len;
    }
    types
}

const H2_GOAWAY: u8 = 0x7;

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_proxy_caps_connections_per_client_address_and_in_all(db: PgPool) {
    let stack = Stack::start_configured(db, 0, Default::default(), |config| {
        config.limits.max_connections = 3;
        config.limits.max_connections_per_ip = 2;
        config.limits.header_read_timeout = Duration::from_secs(600);
    })
    .await;
    // One address holds its two slots with idle connections the header timeout would keep
    // for 10 minutes: its third is closed without an answer.
    let first = connect_from(&stack, "127.0.0.1").await;
    let _second = connect_from(&stack, "127.0.0.1").await;
    let mut third = connect_from(&stack, "127.0.0.1").await;
    let _ = third
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n")
        .await;
    assert_eq!(
        until_closed(&mut third).await,
        b"",
        "a third connection from one address was served"
    );
    // Another address is still served, and holds the last slot.
    assert!(healthz_from(&stack, "127.0.0.2").await);
    let _held = connect_from(&stack, "127.0.0.2").await;
    // Every slot is taken now: a third address is closed too.
    let mut fourth = connect_from(&stack, "127.0.0.3").await;
    let _ = fourth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n")
        .await;
    assert_eq!(
        until_closed(&mut fourth).await,
        b"",
        "a connection past the total cap was served"
    );
    drop(first);
    eventually("a freed slot serves a new connection", || {
        healthz_from(&stack, "127.0.0.3")
    })
    .await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn silent_and_idle_http2_connections_to_the_proxy_are_closed(db: PgPool) {
    let stack = Stack::start_configured(db, 0, Default::default(), |config| {
        config.limits.header_read_timeout = Duration::from_secs(1);
    })
    .await;
    // A client that sends nothing at all (the HTTP/1.1-or-2 sniff would wait forever).
    let mut silent = connect_from(&stack, "127.0.0.1").await;
    assert_eq!(until_closed(&mut silent).await, b"");
    // Half the HTTP/2 preface, then nothing.
    let mut half = connect_from(&stack, "127.0.0.1").await;
    half.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    assert_eq!(until_closed(&mut half).await, b"");
    // A whole HTTP/2 connection that then sends no request: the proxy answers its SETTINGS,
    // then, idle for the timeout, says GOAWAY and closes (without the idle timeout only its
    // PINGs, 30 s apart with 20 s to answer, would end it).
    let mut idle = connect_from(&stack, "127.0.0.1").await;
    idle.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    // An empty SETTINGS frame.
    idle.write_all(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0])
        .await
        .unwrap();
    let frames = h2_frame_types(&until_closed(&mut idle).await);
    assert!(
        frames.contains(&H2_GOAWAY),
        "the proxy closed an idle HTTP/2 connection without GOAWAY: frames {frames:?}"
    );
    // The proxy still serves.
    assert!(healthz_from(&stack, "127.0.0.1").await);
    stack.teardown().await;
}

/// A GET of `/healthz` over h2c to `addr` with `extra` headers (`x-pad-N: v`); its status.
async fn h2c_healthz_with_headers(addr: std::net::SocketAddr, extra: usize) -> u16 {
    use bytes::Bytes;
    use http_body_util::Empty;

    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let mut req = hyper::Request::builder().uri(format!("http://{addr}/healthz"));
    for n in 0..extra {
        req = req.header(format!("x-pad-{n}"), "v");
    }
    let req = req.body(Empty::<Bytes>::new()).unwrap();
    let resp = tokio::time::timeout(crate::support::env::HTTP_TIMEOUT, sender.send_request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.version(), hyper::Version::HTTP_2);
    resp.status().as_u16()
}

/// The status line an HTTP/1.1 `GET /healthz` to `addr` with `extra` headers (and a `Cookie`
/// of `cookie_bytes` bytes) gets.
async fn h1_healthz_with_headers(
    addr: std::net::SocketAddr,
    extra: usize,
    cookie_bytes: usize,
) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut request = String::from("GET /healthz HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n");
    for n in 0..extra {
        request.push_str(&format!("x-pad-{n}: v\r\n"));
    }
    if cookie_bytes > 0 {
        request.push_str(&format!("Cookie: a={}\r\n", "c".repeat(cookie_bytes)));
    }
    request.push_str("\r\n");
    // The server may answer and close before it read all of a refused head.
    let _ = stream.write_all(request.as_bytes()).await;
    let seen = until_closed(&mut stream).await;
    String::from_utf8_lossy(&seen)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// Found by an attack run: h2c through the proxy forwarded a request with 150 headers (HTTP/2
/// bounds only the head's bytes, HTTP/1.1's parser the count). Both listeners now refuse a
/// head with more than `MAX_REQUEST_HEADERS` fields or `MAX_REQUEST_HEAD_BYTES` bytes with 431,
/// on HTTP/1.1 and (the proxy) h2c, and serve one just under.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn request_heads_with_too_many_or_too_large_headers_are_refused_with_431(db: PgPool) {
    use berth_api::admission::{MAX_REQUEST_HEADERS, MAX_REQUEST_HEAD_BYTES};

    let stack = Stack::start_configured(db, 0, Default::default(), |_| {}).await;
    let proxy = stack.proxy_addr;
    let api: std::net::SocketAddr = stack.url("").trim_start_matches("http://").parse().unwrap();
    // h2c to the proxy: 150 headers refused, a few under the cap served.
    assert_eq!(h2c_healthz_with_headers(proxy, 150).await, 431);
    assert_eq!(
        h2c_healthz_with_headers(proxy, MAX_REQUEST_HEADERS - 5).await,
        200
    );
    for (which, addr) in [("proxy", proxy), ("api", api)] {
        let refused = h1_healthz_with_headers(addr, 150, 0).await;
        assert!(refused.starts_with("HTTP/1.1 431"), "{which}: {refused}");
        let big = h1_healthz_with_headers(addr, 0, MAX_REQUEST_HEAD_BYTES + 1024).await;
        assert!(big.starts_with("HTTP/1.1 431"), "{which}: {big}");
        let served = h1_healthz_with_headers(addr, MAX_REQUEST_HEADERS - 5, 4096).await;
        assert!(served.starts_with("HTTP/1.1 200"), "{which}: {served}");
    }
    stack.teardown().await;
}
