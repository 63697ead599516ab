//! The API's operator limits (issue 11 item 7): a header-read timeout that closes slow-loris
//! connections, a connection cap, request rates per address and per key (429 with
//! `Retry-After`), a bad-key flood that stops reaching Postgres, and the default quota of new
//! orgs. No hostd: the control plane runs in-process (its real server loop) or as a spawned
//! `berth api`.

use std::time::Duration;

use berth_schemas::wire::Resources;
use berth_schemas::HostId;
use reqwest::Method;
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::api_process::{database_url, ApiProcess};
use crate::support::{eventually, inproc, Stack};

/// The longest a test waits for the server to close a connection; a server without the
/// timeout under test never does, and the test fails here instead of hanging.
const CLOSE_BOUND: Duration = Duration::from_secs(60);

fn address(stack: &Stack) -> String {
    stack.base.trim_start_matches("http://").to_owned()
}

/// Reads until the server closes the connection; what it sent. Panics after [`CLOSE_BOUND`].
async fn until_closed(stream: &mut TcpStream) -> String {
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
    assert!(read.is_ok(), "the server kept the connection open");
    String::from_utf8_lossy(&seen).into_owned()
}

/// Whether a fresh connection gets `200` for `GET /healthz`.
async fn healthz_answers(address: &str) -> bool {
    let Ok(mut stream) = TcpStream::connect(address).await else {
        return false;
    };
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    until_closed(&mut stream).await.starts_with("HTTP/1.1 200")
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_slow_loris_connection_is_closed_after_the_header_timeout(db: PgPool) {
    let stack = Stack::start_configured(db, 0, Default::default(), |config| {
        config.limits.header_read_timeout = Duration::from_secs(1);
        config.limits.body_idle_timeout = Duration::from_secs(1);
    })
    .await;
    let address = address(&stack);
    // Half a request head, then nothing.
    let mut slow = TcpStream::connect(&address).await.unwrap();
    slow.write_all(format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\nX-A: ").as_bytes())
        .await
        .unwrap();
    let answer = until_closed(&mut slow).await;
    assert!(!answer.starts_with("HTTP/1.1 200"), "{answer}");
    // A connection that sends nothing at all is closed too (the keep-alive idle case).
    let mut idle = TcpStream::connect(&address).await.unwrap();
    until_closed(&mut idle).await;
    // A body that stops halfway fails the request and the connection is closed.
    let mut stalled_body = TcpStream::connect(&address).await.unwrap();
    stalled_body
        .write_all(
            format!(
                "POST /v1/sandboxes HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {}\r\n\
                 Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"templ",
                stack.key
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let answer = until_closed(&mut stalled_body).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    // A whole request is served.
    assert!(healthz_answers(&address).await);
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn connections_past_the_cap_are_closed_and_a_freed_slot_serves_again(db: PgPool) {
    let stack = Stack::start_configured(db, 0, Default::default(), |config| {
        config.limits.max_connections = 2;
        config.limits.header_read_timeout = Duration::from_secs(600);
    })
    .await;
    let address = address(&stack);
    let first = TcpStream::connect(&address).await.unwrap();
    let _second = TcpStream::connect(&address).await.unwrap();
    // Both slots are held (by idle connections the header timeout would keep for 10 min):
    // a third is closed without an answer.
    let mut third = TcpStream::connect(&address).await.unwrap();
    let _ = third
        .write_all(format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\n\r\n").as_bytes())
        .await;
    let answer = until_closed(&mut third).await;
    assert_eq!(answer, "", "a connection past the cap was served");
    drop(first);
    eventually("a freed slot serves a new connection", || {
        healthz_answers(&address)
    })
    .await;
    stack.teardown().await;
}

/// An attacker's idle connections from one address cannot take every slot: past the per-address
/// cap its connections are closed, while another address is still served.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn one_address_cannot_hold_every_connection_slot(db: PgPool) {
    let stack = Stack::start_configured(db, 0, Default::default(), |config| {
        config.limits.max_connections = 10;
        config.limits.max_connections_per_ip = 2;
        config.limits.header_read_timeout = Duration::from_secs(600);
    })
    .await;
    let address = address(&stack);
    let from = |ip: &'static str| {
        let address = address.clone();
        async move {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
            socket.connect(address.parse().unwrap()).await.unwrap()
        }
    };
    let _first = from("127.0.0.1").await;
    let _second = from("127.0.0.1").await;
    let mut third = from("127.0.0.1").await;
    let _ = third
        .write_all(format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\n\r\n").as_bytes())
        .await;
    assert_eq!(
        until_closed(&mut third).await,
        "",
        "a third connection from one address was served"
    );
    let mut other = from("127.0.0.2").await;
    other
        .write_all(
            format!("GET /healthz HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
    let answer = until_closed(&mut other).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn requests_over_the_key_or_address_rate_get_429_with_retry_after(db: PgPool) {
    let stack = Stack::start_configured(db, 0, Default::default(), |config| {
        config.limits.per_key = berth_api::limits::Rate {
            per_second: 1,
            burst: 3,
        };
        config.limits.per_ip = berth_api::limits::Rate {
            per_second: 1,
            burst: 20,
        };
    })
    .await;
    // The key's burst goes first: requests as fast as a loop sends them meet a 429.
    let mut refused = None;
    for _ in 0..1000 {
        let response = stack
            .http
            .get(stack.url("/v1/templates"))
            .bearer_auth(&stack.key)
            .send()
            .await
            .unwrap();
        if response.status() == 429 {
            refused = Some(response);
            break;
        }
        assert_eq!(response.status(), 200);
    }
    let refused = refused.expect("a key over its rate was never refused");
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_after >= 1, "Retry-After: {retry_after}");
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limited", "{body}");
    assert_eq!(body["error"]["limit"], "per_key", "{body}");
    // Unauthenticated requests from the same address spend the address's rate.
    let mut limit = None;
    for _ in 0..1000 {
        let response = stack
            .http
            .get(stack.url("/v1/templates"))
            .send()
            .await
            .unwrap();
        if response.status() == 429 {
            let body: serde_json::Value = response.json().await.unwrap();
            limit = Some(body["error"]["limit"].clone());
            break;
        }
        assert_eq!(response.status(), 401);
    }
    assert_eq!(limit.expect("never limited per address"), "per_ip");
    // Health and metrics are not counted.
    assert!(healthz_answers(&address(&stack)).await);
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_bad_key_flood_stops_reaching_postgres_and_good_keys_are_cached(db: PgPool) {
    let stack = Stack::start(db, 0).await;
    let api = ApiProcess::spawn(
        &stack,
        &[
            "--key-lookups-per-ip",
            "1",
            "--key-lookups-per-ip-burst",
            "5",
        ],
    )
    .await;
    const LOOKUPS: &str = "berth_db_query_duration_seconds_count{op=\"api_key_find\"}";
    let before = api.metric(LOOKUPS).await;
    let (mut unauthorized, mut limited) = (0, 0);
    for i in 0..200 {
        let response = stack
            .http
            .get(api.url("/v1/sandboxes"))
            .bearer_auth(format!("berth_not-a-real-key-{i}"))
            .send()
            .await
            .unwrap();
        match response.status().as_u16() {
            401 => unauthorized += 1,
            429 => {
                assert!(response.headers().contains_key("retry-after"));
                limited += 1;
            }
            other => panic!("a bad key got {other}"),
        }
    }
    let lookups = api.metric(LOOKUPS).await - before;
    eprintln!("200 bad keys: {unauthorized} looked up (401), {limited} refused before Postgres");
    assert!(limited > 0, "no bad key was refused before Postgres");
    assert_eq!(
        lookups, unauthorized as f64,
        "only the keys answered 401 were looked up"
    );
    // The address's lookup budget is spent for good keys too, until it refills; then a good
    // key is looked up once and served from the cache (its own rate is far from spent).
    eventually(
        "the address's lookup budget refills for a good key",
        || async {
            stack
                .http
                .get(api.url("/v1/sandboxes"))
                .bearer_auth(&stack.key)
                .send()
                .await
                .unwrap()
                .status()
                == 200
        },
    )
    .await;
    let before = api.metric(LOOKUPS).await;
    let mut served = 0;
    for _ in 0..20 {
        let response = stack
            .http
            .get(api.url("/v1/sandboxes"))
            .bearer_auth(&stack.key)
            .send()
            .await
            .unwrap();
        if response.status() == 200 {
            served += 1;
        }
    }
    let lookups = api.metric(LOOKUPS).await - before;
    assert_eq!(
        served, 20,
        "a cached good key is not limited by the lookup budget"
    );
    assert!(
        lookups < served as f64,
        "{lookups} lookups for {served} requests with one good key: no cache"
    );
    drop(api);
    stack.teardown().await;
}

/// `berth admin create-org NAME` with `env`; the new org's key.
async fn admin_create_org(stack: &Stack, name: &str, env: &[(&str, &str)]) -> String {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_berth"));
    command
        .args(["admin", "create-org", name])
        .env("DATABASE_URL", database_url(stack))
        .env_remove("BERTH_DEFAULT_ORG_MAX_RUNNING")
        .env_remove("BERTH_DEFAULT_ORG_MAX_VCPUS")
        .env_remove("BERTH_DEFAULT_ORG_MAX_MEMORY_MIB");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

async fn quota_of(db: &PgPool, name: &str) -> (Option<i32>, Option<i32>, Option<i64>) {
    sqlx::query_as("SELECT max_running, max_vcpus, max_memory_mib FROM orgs WHERE name = $1")
        .bind(name)
        .fetch_one(db)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_new_org_gets_the_default_quota(db: PgPool) {
    let stack = Stack::start(db.clone(), 0).await;
    let name = format!("defaults-{}", crate::support::unique());
    admin_create_org(&stack, &name, &[]).await;
    assert_eq!(
        quota_of(&db, &name).await,
        (Some(10), Some(20), Some(20_480)),
        "the documented defaults"
    );
    let unlimited = format!("unlimited-{}", crate::support::unique());
    admin_create_org(
        &stack,
        &unlimited,
        &[
            ("BERTH_DEFAULT_ORG_MAX_RUNNING", "0"),
            ("BERTH_DEFAULT_ORG_MAX_VCPUS", "0"),
            ("BERTH_DEFAULT_ORG_MAX_MEMORY_MIB", "0"),
        ],
    )
    .await;
    assert_eq!(quota_of(&db, &unlimited).await, (None, None, None));

    // An operator's default applies to the org's creates.
    let small = format!("small-{}", crate::support::unique());
    let key = admin_create_org(&stack, &small, &[("BERTH_DEFAULT_ORG_MAX_RUNNING", "1")]).await;
    assert_eq!(
        quota_of(&db, &small).await,
        (Some(1), Some(20), Some(20_480))
    );
    inproc::heartbeat(
        &db,
        HostId::new(),
        Resources {
            vcpus: 8,
            memory_mib: 8192,
        },
    )
    .await;
    let api = inproc::Api::new(db.clone(), stack.nats.clone(), stack.subjects.clone());
    let body = r#"{"template":"base","vcpus":1,"memory_mib":256}"#;
    api.create(&key, body).await;
    let second = api
        .call(&key, Method::POST, "/v1/sandboxes", None, Some(body))
        .await;
    assert_eq!(second.status, 429, "{}", second.body);
    assert_eq!(second.code(), "quota_exceeded");
    assert_eq!(second.body["error"]["limit"], "max_running");
    stack.teardown().await;
}

/// Issue 11 item 8, and an attack run's finding (`/metrics` was served on the public listener
/// by default, telling any tenant the fleet's size and every route's traffic): `berth api`
/// serves `/metrics` only on `--metrics-addr`; the public listener answers 404 there, like any
/// unknown path, unless the operator asks for it (`--metrics-on-api`).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn metrics_are_off_the_public_listener_by_default_and_served_on_their_own_address(
    db: PgPool,
) {
    let stack = Stack::start(db, 0).await;
    let bare = ApiProcess::spawn_exact(&stack, &[]).await;
    let public = reqwest::get(bare.url("/metrics")).await.unwrap();
    assert_eq!(
        public.status(),
        404,
        "metrics on the public listener by default"
    );
    drop(bare);
    let opted_in = ApiProcess::spawn_exact(&stack, &["--metrics-on-api"]).await;
    let public = reqwest::get(opted_in.url("/metrics")).await.unwrap();
    assert_eq!(public.status(), 200);
    assert!(public.text().await.unwrap().contains("# TYPE"));
    drop(opted_in);
    let metrics_addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let api = ApiProcess::spawn(&stack, &["--metrics-addr", &metrics_addr.to_string()]).await;
    let public = reqwest::get(api.url("/metrics")).await.unwrap();
    assert_eq!(public.status(), 404);
    let body: serde_json::Value = public.json().await.unwrap();
    assert_eq!(body["error"]["code"], "not_found", "{body}");
    let url = format!("http://{metrics_addr}/metrics");
    let scrape = || async {
        match reqwest::get(&url).await {
            Ok(r) if r.status().is_success() => r.text().await.unwrap_or_default(),
            _ => String::new(),
        }
    };
    // The request counter appears once the API has answered a request (the 404 above).
    eventually(
        "the separate metrics address serves the API's metrics",
        || async { scrape().await.contains("berth_http_requests_total") },
    )
    .await;
    assert!(scrape().await.contains("# TYPE"));
}
