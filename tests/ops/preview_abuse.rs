//! The preview proxy under attack (issue 15, the findings of its review): a flood of made-up
//! sandbox ids from one address, tunnels and requests that never end, a sandbox woken after its
//! owner's expiry stopped it, a Berth key smuggled into another org's sandbox, and a shared
//! link whose page could not load its own images. Servers inside a runc sandbox are busybox
//! `nc` scripts that answer exactly what each case needs (an echo after `101`, silence, the
//! request's own head).

use std::time::Duration;

use berth_api::limits::Rate;
use berth_reconciler::pass::PassConfig;
use berth_schemas::preview::{self, PreviewToken};
use berth_schemas::SandboxId;
use reqwest::header::{COOKIE, HOST};
use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::preview_kit::*;
use crate::support::env::{eventually, HTTP_TIMEOUT};
use crate::support::stack::{Stack, PREVIEW_SECRET};

/// The longest a test waits for the proxy to close a tunnel that must close; a proxy without
/// the limit under test never closes it, and the test fails here.
const CLOSE_BOUND: Duration = Duration::from_secs(90);

/// Scripts for busybox `nc -ll -e` inside the sandbox: `up.sh` answers `101` and echoes bytes,
/// `mute.sh` reads and never answers, `dump.sh` answers `200` with the request's own head.
const SERVERS: &str = r#"mkdir -p /srv
cat > /srv/up.sh <<'EOF'
#!/bin/sh
while IFS= read -r line; do
  case "$line" in ''|$(printf '\r')) break ;; esac
done
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n'
exec cat
EOF
cat > /srv/mute.sh <<'EOF'
#!/bin/sh
exec sleep 3600
EOF
cat > /srv/dump.sh <<'EOF'
#!/bin/sh
req=''
while IFS= read -r line; do
  line="${line%$(printf '\r')}"
  [ -z "$line" ] && break
  req="$req$line
"
done
printf 'HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\nContent-Length: %s\r\n\r\n%s' "${#req}" "$req"
EOF
chmod +x /srv/up.sh /srv/mute.sh /srv/dump.sh"#;

/// Starts `script` (one of [`SERVERS`]) on each of `ports` and waits until they listen.
async fn serve(stack: &Stack, id: &str, script: &str, ports: &[u16]) {
    for port in ports {
        sh(
            stack,
            id,
            &format!("busybox nc -ll -p {port} -e /srv/{script} </dev/null >/dev/null 2>&1 &"),
        )
        .await;
    }
    for port in ports {
        wait_listening(stack, id, *port).await;
    }
}

/// A base (runc) sandbox with [`SERVERS`] written; its id.
async fn sandbox_with_servers(stack: &Stack, extra: serde_json::Value) -> String {
    let mut body = json!({"template": "base", "vcpus": 1, "memory_mib": 256});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    let id = create_running(stack, body).await;
    sh(stack, &id, SERVERS).await;
    id
}

/// Opens an upgrade to `port` of `id` by host name with `credential` (a header line); returns
/// the connection after the `101` head, or panics with what came instead.
async fn open_tunnel(stack: &Stack, id: &str, port: u16, credential: &str) -> BufReader<TcpStream> {
    let mut stream = TcpStream::connect(stack.proxy_addr).await.unwrap();
    let request = format!(
        "GET /tunnel HTTP/1.1\r\nHost: {}\r\n{credential}\r\nConnection: Upgrade\r\n\
         Upgrade: echo\r\n\r\n",
        preview_host(id, port)
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reader = BufReader::new(stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        tokio::time::timeout(HTTP_TIMEOUT, reader.read_line(&mut line))
            .await
            .unwrap()
            .unwrap();
        head.push_str(&line);
        if line == "\r\n" || line.is_empty() {
            break;
        }
    }
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    reader
}

/// One line through the tunnel and its echo back.
async fn echo(tunnel: &mut BufReader<TcpStream>, line: &str) -> std::io::Result<String> {
    tunnel.get_mut().write_all(line.as_bytes()).await?;
    let mut back = String::new();
    let n = tokio::time::timeout(HTTP_TIMEOUT, tunnel.read_line(&mut back))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    if n == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(back)
}

/// Reads until the proxy closes the tunnel; panics after [`CLOSE_BOUND`].
async fn until_closed(tunnel: &mut BufReader<TcpStream>) {
    let closed = tokio::time::timeout(CLOSE_BOUND, async {
        let mut buf = [0u8; 1024];
        loop {
            match tunnel.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the proxy kept the tunnel open");
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_proxy_rate_limits_each_client_address_and_remembers_unknown_sandboxes(db: PgPool) {
    let stack = Stack::start_configured(db, 0, PassConfig::default(), |config| {
        config.limits.per_ip = Rate {
            per_second: 1,
            burst: 30,
        };
    })
    .await;

    // An unknown sandbox is remembered: asked again while the sandboxes table is locked, the
    // proxy answers 404 without a query (a proxy that asks Postgres hangs until the lock goes).
    let mut tries = 0;
    loop {
        let id = SandboxId::new().to_string();
        let (status, page, _) = get_by_host(&stack, &id, 80, "/", None).await;
        assert_eq!(status, 404, "{page}");
        let looked_at = tokio::time::Instant::now();
        let mut tx = stack.db.begin().await.unwrap();
        sqlx::query("LOCK TABLE sandboxes IN ACCESS EXCLUSIVE MODE")
            .execute(&mut *tx)
            .await
            .unwrap();
        // Only a request sent well within the miss's lifetime must find it remembered.
        let in_time = looked_at.elapsed() < berth_api::preview::routes::MISS_TTL / 2;
        let again = stack
            .http
            .get(format!("http://{}/", stack.proxy_addr))
            .header(HOST, preview_host(&id, 80))
            .timeout(Duration::from_secs(20))
            .send()
            .await;
        tx.rollback().await.unwrap();
        if in_time {
            let again = again.expect("a remembered unknown sandbox is answered without Postgres");
            assert_eq!(again.status(), 404);
            break;
        }
        tries += 1;
        assert!(tries < 5, "never asked again within the miss's lifetime");
    }

    // A flood of made-up ids from one address: past its burst it gets 429 pages with
    // Retry-After (each would have been a query before).
    let mut refused = None;
    let mut answered = 0;
    for _ in 0..60 {
        let id = SandboxId::new().to_string();
        let (status, page, headers) = get_by_host(&stack, &id, 80, "/", None).await;
        match status {
            404 => answered += 1,
            429 => refused = Some((page, headers)),
            other => panic!("unexpected {other}: {page}"),
        }
    }
    let (page, headers) = refused.expect("the flood was never refused");
    assert!(answered < 60, "{answered}");
    assert!(headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry >= 1, "{retry}");
    assert!(page.contains("429"), "{page}");
    // By path on the proxy too.
    let path = format!(
        "http://{}/v1/sandboxes/{}/ports/80/",
        stack.proxy_addr,
        SandboxId::new()
    );
    assert_eq!(get(&stack, &path, None).await.0, 429);
    // The proxy's health check is not counted; another address has its own budget.
    let health = stack
        .http
        .get(format!("http://{}/healthz", stack.proxy_addr))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let elsewhere = reqwest::Client::builder()
        .local_address("127.0.0.2".parse::<std::net::IpAddr>().unwrap())
        .timeout(HTTP_TIMEOUT)
        .build()
        .unwrap();
    let other = elsewhere
        .get(format!("http://{}/", stack.proxy_addr))
        .header(HOST, preview_host(&SandboxId::new().to_string(), 80))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 404);
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn tunnels_end_when_idle_or_when_their_token_expires_and_a_silent_server_gets_504(
    db: PgPool,
) {
    let stack = Stack::start_configured(db, 1, PassConfig::default(), |config| {
        config.preview.tunnel_idle_timeout = Duration::from_secs(10);
        config.preview.response_timeout = Duration::from_secs(5);
    })
    .await;
    let id = sandbox_with_servers(&stack, json!({})).await;
    serve(&stack, &id, "up.sh", &[8002]).await;
    serve(&stack, &id, "mute.sh", &[8003]).await;

    // A server that accepts and never answers: 504 after the response deadline.
    let (status, page, _) = get_by_host(&stack, &id, 8003, "/", Some(&stack.key)).await;
    assert_eq!(status, 504, "{page}");
    assert!(page.contains("did not answer"), "{page}");

    // A tunnel opened with a key carries bytes, then, idle, is closed.
    let auth = format!("Authorization: Bearer {}", stack.key);
    let mut tunnel = open_tunnel(&stack, &id, 8002, &auth).await;
    assert_eq!(echo(&mut tunnel, "hello\n").await.unwrap(), "hello\n");
    until_closed(&mut tunnel).await;

    // A tunnel opened with a token is closed at the token's expiry, however busy.
    let expires = chrono::Utc::now().timestamp() + 20;
    let token = PreviewToken {
        sandbox: id.parse().unwrap(),
        port: 8002,
        expires,
    }
    .sign(&preview::token_key(PREVIEW_SECRET));
    let mut tunnel = open_tunnel(
        &stack,
        &id,
        8002,
        &format!("X-Berth-Preview-Token: {token}"),
    )
    .await;
    let busy = tokio::time::timeout(CLOSE_BOUND, async {
        loop {
            match echo(&mut tunnel, "still here\n").await {
                Ok(back) => assert_eq!(back, "still here\n"),
                Err(_) => return,
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    assert!(busy.is_ok(), "the proxy kept a tunnel open past its token");
    assert!(
        chrono::Utc::now().timestamp() >= expires,
        "closed before the token expired"
    );

    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

/// Standard base64 with padding (a `Basic` credential).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The request head the dump server (port `port`) received through the proxy by host name,
/// with `headers` added; (status, head lowercased).
async fn dumped(
    stack: &Stack,
    id: &str,
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let mut req = stack
        .http
        .get(format!("http://{}{path}", stack.proxy_addr))
        .header(HOST, preview_host(id, port));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap().to_ascii_lowercase())
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn no_berth_key_reaches_a_sandbox_in_any_spelling(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = sandbox_with_servers(&stack, json!({"public_ports": [8004]})).await;
    serve(&stack, &id, "dump.sh", &[8004, 8005]).await;
    let (_, other_key) = berth_api::auth::create_org(&stack.db, "preview-smuggler")
        .await
        .unwrap();
    let own = format!("Bearer {}", stack.key);
    assert_eq!(base64(b"user:pw"), "dXNlcjpwdw==");

    // The sandbox's own Basic credentials first, the org's key second: the key authenticates
    // (a private port opens) and is removed; the Basic header passes.
    let (status, head) = dumped(
        &stack,
        &id,
        8005,
        "/",
        &[
            ("authorization", "Basic dXNlcjpwdw=="),
            ("authorization", own.as_str()),
        ],
    )
    .await;
    assert_eq!(status, 200, "{head}");
    assert!(
        head.contains("authorization: basic dxnlcjpwdw==\n"),
        "{head}"
    );
    assert!(!head.contains("berth_"), "{head}");

    // Another org's key, hidden behind a Basic header or a tab, on a public port: refused as
    // every other org's key is, never forwarded.
    let foreign = format!("Bearer {other_key}");
    let tabbed = format!("Bearer\t{other_key}");
    for headers in [
        vec![
            ("authorization", "Basic dXNlcjpwdw=="),
            ("authorization", foreign.as_str()),
        ],
        vec![("authorization", tabbed.as_str())],
    ] {
        let (status, head) = dumped(&stack, &id, 8004, "/", &headers).await;
        assert_eq!(status, 404, "{headers:?}: {head}");
        assert!(!head.contains("berth_"), "{head}");
    }
    // Spellings that are no bearer key at all still carry one: removed before forwarding.
    let basic = format!("Basic {}", base64(format!("{other_key}:").as_bytes()));
    let token_scheme = format!("Token {other_key}");
    for value in [basic.as_str(), token_scheme.as_str(), other_key.as_str()] {
        let (status, head) = dumped(&stack, &id, 8004, "/", &[("authorization", value)]).await;
        assert_eq!(status, 200, "{value}: {head}");
        assert!(!head.contains("authorization:"), "{value}: {head}");
        assert!(!head.contains("berth_"), "{value}: {head}");
    }
    let (status, head) = dumped(
        &stack,
        &id,
        8004,
        "/",
        &[("proxy-authorization", foreign.as_str())],
    )
    .await;
    assert_eq!(status, 200, "{head}");
    assert!(!head.contains("berth_"), "{head}");

    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_preview_link_leaves_a_cookie_that_opens_the_rest_of_its_page(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = sandbox_with_servers(&stack, json!({})).await;
    serve(&stack, &id, "dump.sh", &[8005]).await;
    let granted = token_of(&stack, &id, 8005, Some(600)).await;
    let token = granted["token"].as_str().unwrap().to_owned();
    let manual = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(HTTP_TIMEOUT)
        .build()
        .unwrap();

    // By host name: the link answers 303 to itself without the token, and sets the cookie
    // for that host only.
    let link = manual
        .get(format!(
            "http://{}/page?x=1&berth_preview_token={token}",
            stack.proxy_addr
        ))
        .header(HOST, preview_host(&id, 8005))
        .send()
        .await
        .unwrap();
    assert_eq!(link.status(), 303);
    assert_eq!(link.headers()["location"], "/page?x=1");
    let cookie = link.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        cookie.starts_with(&format!("berth_preview_token={token};")),
        "{cookie}"
    );
    for attribute in ["; Path=/;", "; HttpOnly", "; SameSite=Lax", "; Max-Age="] {
        assert!(cookie.contains(attribute), "{attribute}: {cookie}");
    }
    assert!(!cookie.contains("Domain="), "{cookie}");
    let max_age: i64 = cookie
        .split("Max-Age=")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|age| age.parse().ok())
        .unwrap();
    assert!((1..=600).contains(&max_age), "{cookie}");

    // The page's images and scripts come with the cookie: let in, and the cookie (not the
    // page's own ones) removed before the sandbox sees the request.
    let with_cookie = format!("a=1; berth_preview_token={token}; b=2");
    let (status, head) = dumped(
        &stack,
        &id,
        8005,
        "/img.png",
        &[("cookie", with_cookie.as_str())],
    )
    .await;
    assert_eq!(status, 200, "{head}");
    assert!(head.contains("cookie: a=1; b=2\n"), "{head}");
    assert!(!head.contains("berth_preview"), "{head}");
    // Without it: private. Another port of the sandbox: the cookie does not open it.
    assert_eq!(dumped(&stack, &id, 8005, "/img.png", &[]).await.0, 401);
    let only_cookie = format!("berth_preview_token={token}");
    assert_eq!(
        dumped(&stack, &id, 8006, "/", &[("cookie", only_cookie.as_str())])
            .await
            .0,
        401
    );
    // An expired cookie says so.
    let expired = PreviewToken {
        sandbox: id.parse().unwrap(),
        port: 8005,
        expires: chrono::Utc::now().timestamp() - 5,
    }
    .sign(&preview::token_key(PREVIEW_SECRET));
    let resp = stack
        .http
        .get(format!("http://{}/", stack.proxy_addr))
        .header(HOST, preview_host(&id, 8005))
        .header(COOKIE, format!("berth_preview_token={expired}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    assert!(resp.text().await.unwrap().contains("expired"));
    // A token in the header is forwarded as before (an API client, not a browser).
    let (status, head) = dumped(
        &stack,
        &id,
        8005,
        "/api",
        &[("x-berth-preview-token", token.as_str())],
    )
    .await;
    assert_eq!(status, 200, "{head}");
    assert!(!head.contains("berth_preview"), "{head}");

    // By path on the API: the cookie is scoped to the port's path.
    let base = format!("/v1/sandboxes/{id}/ports/8005/");
    let link = manual
        .get(stack.url(&format!("{base}?berth_preview_token={token}")))
        .send()
        .await
        .unwrap();
    assert_eq!(link.status(), 303);
    assert_eq!(link.headers()["location"], base.as_str());
    let cookie = link.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(cookie.contains(&format!("; Path={base};")), "{cookie}");
    let via_path = stack
        .http
        .get(stack.url(&format!("{base}style.css")))
        .header(COOKIE, format!("berth_preview_token={token}"))
        .send()
        .await
        .unwrap();
    assert_eq!(via_path.status(), 200);
    let head = via_path.text().await.unwrap().to_ascii_lowercase();
    assert!(head.starts_with("get /style.css "), "{head}");
    assert!(!head.contains("berth_preview"), "{head}");

    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_sandbox_its_expiry_stopped_is_not_woken_by_a_preview_but_its_owner_may_start_it(
    db: PgPool,
) {
    let quick = PassConfig {
        interval: Duration::from_millis(100),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db, 1, quick).await;
    let (status, created) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(
                json!({"template": "base", "memory_mib": 256, "timeout_seconds": 3,
                        "public_ports": [8000]}),
            ),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    assert_eq!(created["auto_resume"], true);
    let id = created["id"].as_str().unwrap().to_owned();
    let stopped = stack.wait_state(&id, "stopped").await;
    assert_eq!(stopped["auto_resume"], false, "{stopped}");
    // The event says why, with the real reason (the expiry), not a user's request.
    let updated: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT type, reason, message FROM events
          WHERE sandbox_id = $1::uuid AND type = 'sandbox.updated'",
    )
    .bind(&id)
    .fetch_all(&stack.db)
    .await
    .unwrap();
    assert_eq!(
        updated,
        [(
            "sandbox.updated".to_owned(),
            "expired".to_owned(),
            Some(berth_reconciler::pass::EXPIRY_RESUME_OFF.to_owned())
        )]
    );

    // Anyone (a public port) and the owner's own key: 409 with the state, nothing started.
    let before = start_commands(&stack, &id).await;
    for key in [None, Some(stack.key.as_str())] {
        let (status, page, headers) = get_by_host(&stack, &id, 8000, "/", key).await;
        assert_eq!(status, 409, "{page}");
        assert_eq!(headers["x-berth-sandbox-state"], "stopped");
    }
    assert_eq!(stack.state_of(&id).await, "stopped");
    assert_eq!(start_commands(&stack, &id).await, before);

    // The owner's start works; the sandbox then runs (no expiry left) and is reached.
    assert_eq!(stack.request(&id, "start").await.0, 202);
    stack.wait_state(&id, "running").await;
    let (status, page, _) = get_by_host(&stack, &id, 9, "/", Some(&stack.key)).await;
    assert_eq!(status, 502, "forwarded (nothing listens there): {page}");

    // An expiry that passes while the sandbox is already stopped keeps it asleep too.
    let (status, body) = stack
        .call(
            Method::PATCH,
            &format!("/v1/sandboxes/{id}"),
            Some(json!({"auto_resume": true})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    sqlx::query("UPDATE sandboxes SET expires_at = now() WHERE id = $1::uuid")
        .bind(&id)
        .execute(&stack.db)
        .await
        .unwrap();
    eventually("the passed expiry turns auto_resume off", || async {
        let (_, body) = stack
            .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await;
        body["auto_resume"] == false && body["expires_at"].is_null()
    })
    .await;
    assert_eq!(get_by_host(&stack, &id, 8000, "/", None).await.0, 409);
    assert_eq!(stack.state_of(&id).await, "stopped");

    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}
