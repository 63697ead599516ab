//! What the preview tests need besides the stack: requests to the proxy by host name, the
//! servers they start inside sandboxes, a hand-made WebSocket client, an h2c request, and
//! reading the forwarder and the commands table.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use reqwest::header::{AUTHORIZATION, HOST};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::support::env::{HTTP_TIMEOUT, SETTLE_TIMEOUT};
use crate::support::stack::{Stack, PREVIEW_DOMAIN};

/// The Host header of a sandbox port's preview.
pub fn preview_host(id: &str, port: u16) -> String {
    format!("{port}-{id}.{PREVIEW_DOMAIN}")
}

/// A GET to the proxy by host name, with `key` as a bearer key when given; (status, body,
/// headers).
pub async fn get_by_host(
    stack: &Stack,
    id: &str,
    port: u16,
    path: &str,
    key: Option<&str>,
) -> (u16, String, reqwest::header::HeaderMap) {
    let mut req = stack
        .http
        .get(format!("http://{}{path}", stack.proxy_addr))
        .header(HOST, preview_host(id, port));
    if let Some(key) = key {
        req = req.header(AUTHORIZATION, format!("Bearer {key}"));
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, resp.text().await.unwrap(), headers)
}

/// A GET of `url` with `key` as a bearer key when given; (status, body).
pub async fn get(stack: &Stack, url: &str, key: Option<&str>) -> (u16, String) {
    let mut req = stack.http.get(url);
    if let Some(key) = key {
        req = req.header(AUTHORIZATION, format!("Bearer {key}"));
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

/// Runs a shell script in the sandbox; panics unless it exits 0.
pub async fn sh(stack: &Stack, id: &str, script: &str) -> String {
    let (status, out) = stack.exec(id, &["sh", "-c", script]).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["exit_code"], 0, "{script}: {out}");
    out["stdout"].as_str().unwrap_or("").to_owned()
}

/// Waits until a socket inside the sandbox listens on `port` (its `/proc/net/tcp`), without
/// connecting to it.
pub async fn wait_listening(stack: &Stack, id: &str, port: u16) {
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    let local = format!(":{port:04X}");
    loop {
        let table = sh(
            stack,
            id,
            "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null || true",
        )
        .await;
        if table.lines().any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() > 3 && fields[1].ends_with(&local) && fields[3] == "0A"
        }) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "nothing listens on port {port} in {id}: {table}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Busybox's httpd on port 8000 serving `/srv`: `index.html` (`text`), a CGI script
/// `/cgi-bin/env` that prints what it received (query, `Authorization`, the preview token
/// header), and `/cgi-bin/stream`, an event stream that writes `data: one`, waits until
/// `/tmp/go` exists, then writes `data: two`.
pub async fn start_busybox_httpd(stack: &Stack, id: &str, text: &str) {
    let script = format!(
        r#"mkdir -p /srv/cgi-bin
printf '%s' '{text}' > /srv/index.html
cat > /srv/cgi-bin/env <<'EOF'
#!/bin/sh
printf 'Content-Type: text/plain\r\n\r\n'
echo "query=$QUERY_STRING"
echo "authorization=$HTTP_AUTHORIZATION"
echo "token=$HTTP_X_BERTH_PREVIEW_TOKEN"
echo "host=$HTTP_HOST"
EOF
cat > /srv/cgi-bin/stream <<'EOF'
#!/bin/sh
printf 'Content-Type: text/event-stream\r\n\r\n'
printf 'data: one\n\n'
while [ ! -e /tmp/go ]; do sleep 0.1; done
printf 'data: two\n\n'
EOF
chmod +x /srv/cgi-bin/env /srv/cgi-bin/stream
busybox httpd -p 8000 -h /srv </dev/null >/dev/null 2>&1"#
    );
    sh(stack, id, &script).await;
}

/// Opens `/cgi-bin/stream` of [`start_busybox_httpd`] through the proxy by host name, with
/// the stack's key; checks it answers 200 as an event stream.
pub async fn open_stream(stack: &Stack, id: &str) -> reqwest::Response {
    let resp = stack
        .http
        .get(format!("http://{}/cgi-bin/stream", stack.proxy_addr))
        .header(HOST, preview_host(id, 8000))
        .bearer_auth(&stack.key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    resp
}

/// Waits until the sandbox's port answers 200 through the proxy (its server is up).
pub async fn wait_served(stack: &Stack, id: &str, port: u16) {
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    loop {
        let (status, body, _) = get_by_host(stack, id, port, "/", Some(&stack.key)).await;
        if status == 200 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "port {port} of {id} never answered: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Reads an event stream by host name until it holds `want`; the body so far.
pub async fn read_stream_until(
    resp: &mut reqwest::Response,
    seen: &mut String,
    want: &str,
) -> String {
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    while !seen.contains(want) {
        let chunk = tokio::time::timeout_at(deadline, resp.chunk())
            .await
            .unwrap_or_else(|_| panic!("no {want:?} in the stream; got {seen:?}"))
            .unwrap();
        match chunk {
            Some(bytes) => seen.push_str(&String::from_utf8_lossy(&bytes)),
            None => panic!("the stream ended before {want:?}: {seen:?}"),
        }
    }
    seen.clone()
}

/// The python server of the gVisor test, on port 8000: `GET /` answers `text`, `GET /ws` is
/// a WebSocket echo (text frames), `GET /events` an event stream like busybox's above.
pub const PYTHON_SERVER: &str = r#"
import base64, hashlib, http.server, os, socketserver, struct, sys, time
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path == "/ws":
            key = self.headers["Sec-WebSocket-Key"]
            acc = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", acc)
            self.end_headers()
            self.wfile.flush()
            r, w = self.rfile, self.wfile
            while True:
                h = r.read(2)
                if len(h) < 2: return
                op, n = h[0] & 15, h[1] & 127
                if n == 126: n = struct.unpack(">H", r.read(2))[0]
                elif n == 127: n = struct.unpack(">Q", r.read(8))[0]
                mask = r.read(4) if h[1] & 128 else b"\0\0\0\0"
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(r.read(n)))
                if op == 8: return
                out = b"echo: " + data
                w.write(bytes([0x81, len(out)]) + out); w.flush()
        elif self.path == "/events":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"data: one\n\n"); self.wfile.flush()
            while not os.path.exists("/tmp/go"): time.sleep(0.1)
            self.wfile.write(b"data: two\n\n"); self.wfile.flush()
            self.close_connection = True
        else:
            body = TEXT.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
TEXT = sys.argv[1]
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
S(("0.0.0.0", 8000), H).serve_forever()
"#;

/// A WebSocket round trip through the proxy by host name: the upgrade, one masked text
/// frame out, the echo back. Returns the status line and the echoed text.
pub async fn websocket_echo(
    proxy: SocketAddr,
    host: &str,
    key: &str,
    message: &str,
) -> (String, String) {
    let mut stream = TcpStream::connect(proxy).await.unwrap();
    let request = format!(
        "GET /ws HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n\
         Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reader = BufReader::new(stream);
    let mut status = String::new();
    tokio::time::timeout(HTTP_TIMEOUT, reader.read_line(&mut status))
        .await
        .unwrap()
        .unwrap();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).await.unwrap();
        if line == "\r\n" || line.is_empty() {
            break;
        }
    }
    if !status.contains(" 101 ") {
        return (status, String::new());
    }
    let mask = [1u8, 2, 3, 4];
    let payload: Vec<u8> = message
        .bytes()
        .enumerate()
        .map(|(i, b)| b ^ mask[i % 4])
        .collect();
    let mut frame = vec![0x81, 0x80 | payload.len() as u8];
    frame.extend_from_slice(&mask);
    frame.extend_from_slice(&payload);
    reader.get_mut().write_all(&frame).await.unwrap();
    let mut head = [0u8; 2];
    tokio::time::timeout(HTTP_TIMEOUT, reader.read_exact(&mut head))
        .await
        .unwrap()
        .unwrap();
    let mut data = vec![0u8; usize::from(head[1] & 127)];
    reader.read_exact(&mut data).await.unwrap();
    (status, String::from_utf8_lossy(&data).into_owned())
}

/// A GET over HTTP/2 with prior knowledge (h2c) to the proxy by host name; (status, body).
pub async fn h2c_get(proxy: SocketAddr, host: &str, key: &str) -> (u16, String) {
    let stream = TcpStream::connect(proxy).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .uri(format!("http://{host}/"))
        .header("authorization", format!("Bearer {key}"))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = tokio::time::timeout(HTTP_TIMEOUT, sender.send_request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.version(), hyper::Version::HTTP_2);
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Where the sandbox's host's forwarder listens (from the hosts table).
pub async fn forwarder_of(stack: &Stack, id: &str) -> String {
    sqlx::query_scalar(
        "SELECT h.forwarder FROM hosts h JOIN sandboxes s ON s.host_id = h.id WHERE s.id = $1::uuid",
    )
    .bind(id)
    .fetch_one(&stack.db)
    .await
    .unwrap()
}

/// Sends `line` to a forwarder and returns its one-line answer.
pub async fn forwarder_reply(forwarder: &str, line: &str) -> String {
    let mut stream = TcpStream::connect(forwarder).await.unwrap();
    stream.write_all(line.as_bytes()).await.unwrap();
    let mut reply = String::new();
    tokio::time::timeout(HTTP_TIMEOUT, BufReader::new(stream).read_line(&mut reply))
        .await
        .unwrap()
        .unwrap();
    reply
}

/// How many start commands the sandbox was sent.
pub async fn start_commands(stack: &Stack, id: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM commands WHERE sandbox_id = $1::uuid AND kind = 'sandbox.start'",
    )
    .bind(id)
    .fetch_one(&stack.db)
    .await
    .unwrap()
}

/// Creates a sandbox with `body` and waits until it runs; its id.
pub async fn create_running(stack: &Stack, body: Value) -> String {
    let (status, created) = stack
        .call(reqwest::Method::POST, "/v1/sandboxes", Some(body))
        .await;
    assert_eq!(status, 202, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    id
}

/// A preview token of `id`'s `port` from the token route.
pub async fn token_of(stack: &Stack, id: &str, port: u16, ttl: Option<u64>) -> Value {
    let (status, body) = stack
        .call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/ports/{port}/token"),
            Some(ttl.map_or(json!({}), |t| json!({ "ttl_seconds": t }))),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    body
}
