//! Webhooks end to end: a real HTTP receiver on loopback (an axum server in the test) that
//! fails on purpose, the real API, Postgres, NATS and `berth hostd`. Backoffs are shrunk to
//! milliseconds through the API's config.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer};
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use berth_api::webhook_delivery::WebhookConfig;
use futures::StreamExt;
use hmac::{Hmac, Mac};
use reqwest::Method;
use serde_json::{json, Value};
use sha2::Sha256;
use sqlx::PgPool;

use crate::support::{inproc, Stack};

/// The secret the tests register (at least 16 bytes).
const SECRET: &str = "test-secret-0123456789";
/// How long a test waits for deliveries.
const WAIT: Duration = Duration::from_secs(30);

/// Delivery timing for tests: first retry after about 200 ms, doubling.
fn fast_webhooks(disable_after: u32) -> WebhookConfig {
    WebhookConfig {
        poll_interval: Duration::from_millis(50),
        backoff_initial: Duration::from_millis(200),
        backoff_max: Duration::from_secs(2),
        attempt_timeout: Duration::from_secs(5),
        disable_after,
        // The test receivers listen on loopback.
        allow_private_targets: true,
        ..Default::default()
    }
}

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Call {
    at: Instant,
    headers: HeaderMap,
    body: Bytes,
    answered: u16,
}

/// An HTTP receiver on 127.0.0.1 that answers `failure` to its first `fail_first` requests
/// and 204 afterwards.
struct Receiver {
    addr: SocketAddr,
    calls: Arc<Mutex<Vec<Call>>>,
    server: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start(fail_first: usize, failure: StatusCode) -> Receiver {
        let calls: Arc<Mutex<Vec<Call>>> = Arc::default();
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post({
                let calls = calls.clone();
                move |headers: HeaderMap, body: Bytes| {
                    let calls = calls.clone();
                    async move {
                        let mut calls = calls.lock().unwrap();
                        let status = if calls.len() < fail_first {
                            failure
                        } else {
                            StatusCode::NO_CONTENT
                        };
                        calls.push(Call {
                            at: Instant::now(),
                            headers,
                            body,
                            answered: status.as_u16(),
                        });
                        status
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Receiver {
            addr,
            calls,
            server,
        }
    }

    fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// Waits until at least `n` requests arrived.
    async fn wait_for(&self, n: usize) -> Vec<Call> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let calls = self.calls();
            if calls.len() >= n {
                return calls;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "only {} of {n} webhook requests arrived",
                calls.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Publishes every committed event once, as the relay does, on streams of their own (delete
/// them with `delete_streams` at the end).
async fn publish_events(db: &PgPool) -> (jetstream::Context, berth_schemas::Subjects) {
    let subjects = inproc::unique_subjects();
    let js = jetstream::new(async_nats::connect(inproc::nats_url()).await.unwrap());
    berth_schemas::streams::ensure_streams(&js, &subjects)
        .await
        .unwrap();
    berth_api::outbox::event_relay::drain(db, &js, &subjects, usize::MAX)
        .await
        .unwrap();
    (js, subjects)
}

fn header<'a>(call: &'a Call, name: &str) -> &'a str {
    call.headers
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header"))
        .to_str()
        .unwrap()
}

/// Verifies `Berth-Signature: t=<unix>,v1=<hex>` the way a receiver would: HMAC-SHA256 with
/// the secret over `<t>.<raw body>`, compared in constant time, within five minutes.
fn signature_verifies(call: &Call, secret: &str) -> bool {
    let value = header(call, "Berth-Signature");
    let mut t = None;
    let mut v1 = None;
    for part in value.split(',') {
        match part.split_once('=') {
            Some(("t", x)) => t = x.parse::<i64>().ok(),
            Some(("v1", x)) => v1 = hex::decode(x).ok(),
            _ => {}
        }
    }
    let (Some(t), Some(v1)) = (t, v1) else {
        return false;
    };
    if (chrono::Utc::now().timestamp() - t).abs() > 300 {
        return false;
    }
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{t}.").as_bytes());
    mac.update(&call.body);
    mac.verify_slice(&v1).is_ok()
}

async fn register(stack: &Stack, url: &str, event_types: Value) -> Value {
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/webhooks",
            Some(json!({"url": url, "secret": SECRET, "event_types": event_types})),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["secret"], SECRET, "the create answers the secret once");
    body
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_failing_receiver_gets_signed_retries_with_backoff_until_it_answers_and_each_attempt_is_logged(
    db: PgPool,
) {
    let config = fast_webhooks(10);
    let stack =
        Stack::start_configured(db, 1, Default::default(), |c| c.webhooks = config.clone()).await;
    let receiver = Receiver::start(3, StatusCode::INTERNAL_SERVER_ERROR).await;
    let hook = register(&stack, &receiver.url(), json!(["sandbox.running"])).await;
    let hook_id = hook["id"].as_str().unwrap();
    assert_eq!(hook["event_types"], json!(["dev.berth.sandbox.running"]));

    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let calls = receiver.wait_for(4).await;
    assert_eq!(
        calls.iter().map(|c| c.answered).collect::<Vec<_>>(),
        [500, 500, 500, 204]
    );

    // The same event, byte for byte, on every attempt; numbered attempts; valid signatures.
    let event_id: String = sqlx::query_scalar(
        "SELECT id::text FROM events WHERE sandbox_id = $1::uuid AND to_state = 'running'",
    )
    .bind(&id)
    .fetch_one(&stack.db)
    .await
    .unwrap();
    for (i, call) in calls.iter().enumerate() {
        assert_eq!(call.body, calls[0].body);
        assert_eq!(header(call, "Berth-Event-Id"), event_id);
        assert_eq!(
            header(call, "Berth-Delivery-Id"),
            header(&calls[0], "Berth-Delivery-Id")
        );
        assert_eq!(header(call, "Berth-Delivery-Attempt"), (i + 1).to_string());
        assert_eq!(header(call, "Content-Type"), "application/cloudevents+json");
        assert!(signature_verifies(call, SECRET), "attempt {}", i + 1);
        assert!(!signature_verifies(call, "another-secret-0123456"));
    }
    let ce: Value = serde_json::from_slice(&calls[0].body).unwrap();
    assert_eq!(ce["id"], event_id.as_str());
    assert_eq!(ce["type"], "dev.berth.sandbox.running");
    assert_eq!(ce["data"]["sandbox_id"], id.as_str());

    // Exponential backoff: the wait after failure n is at least half of 200 ms × 2^(n−1).
    for n in 1..calls.len() {
        let gap = calls[n].at - calls[n - 1].at;
        let floor = config.backoff_initial * 2u32.pow(n as u32 - 1) / 2;
        assert!(gap >= floor, "wait after failure {n}: {gap:?} < {floor:?}");
    }
    assert!(
        calls[3].at - calls[2].at > calls[1].at - calls[0].at,
        "waits grow"
    );

    // The delivery log shows all four attempts; the webhook is healthy again.
    let deadline = tokio::time::Instant::now() + WAIT;
    let log = loop {
        let (status, log) = stack
            .call(
                Method::GET,
                &format!("/v1/webhooks/{hook_id}/deliveries"),
                None,
            )
            .await;
        assert_eq!(status, 200, "{log}");
        if log[0]["state"] == "succeeded" {
            break log;
        }
        assert!(tokio::time::Instant::now() < deadline, "{log}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        log.as_array().unwrap().len(),
        1,
        "only running events: {log}"
    );
    let delivery = &log[0];
    assert_eq!(delivery["event_id"], event_id.as_str());
    assert_eq!(delivery["event_type"], "dev.berth.sandbox.running");
    assert!(delivery["completed_at"].is_string());
    let attempts = delivery["attempts"].as_array().unwrap();
    assert_eq!(
        attempts
            .iter()
            .map(|a| a["status_code"].as_i64().unwrap())
            .collect::<Vec<_>>(),
        [500, 500, 500, 204]
    );
    assert_eq!(
        attempts
            .iter()
            .map(|a| a["attempt"].as_i64().unwrap())
            .collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
    assert!(attempts[..3].iter().all(|a| a["error"].is_string()));
    assert_eq!(attempts[3]["error"], Value::Null);
    let (_, hook) = stack
        .call(Method::GET, &format!("/v1/webhooks/{hook_id}"), None)
        .await;
    assert_eq!(hook["consecutive_failures"], 0);
    assert_eq!(hook["disabled_at"], Value::Null);
    assert!(
        hook.get("secret").is_none(),
        "the secret is never shown again"
    );

    // A stop is not a subscribed type: nothing more is sent.
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(receiver.calls().len(), 4);

    // Another org cannot see or delete it; its owner can.
    let (_, other) = berth_api::auth::create_org(&stack.db, "other-org")
        .await
        .unwrap();
    for method in [Method::GET, Method::DELETE] {
        let (status, _) = stack
            .call_as(&other, method, &format!("/v1/webhooks/{hook_id}"), None)
            .await;
        assert_eq!(status, 404);
    }
    let (status, _) = stack
        .call(Method::DELETE, &format!("/v1/webhooks/{hook_id}"), None)
        .await;
    assert_eq!(status, 204);
    let (_, list) = stack.call(Method::GET, "/v1/webhooks", None).await;
    assert_eq!(list, json!([]));
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_webhook_that_always_fails_is_disabled_after_the_configured_run_with_an_event_saying_so(
    db: PgPool,
) {
    const RUN: u32 = 3;
    let stack = Stack::start_configured(db, 1, Default::default(), |c| {
        c.webhooks = fast_webhooks(RUN)
    })
    .await;
    let receiver = Receiver::start(usize::MAX, StatusCode::SERVICE_UNAVAILABLE).await;
    let hook = register(&stack, &receiver.url(), json!([])).await;
    let hook_id = hook["id"].as_str().unwrap().to_owned();

    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let hook = loop {
        let (_, hook) = stack
            .call(Method::GET, &format!("/v1/webhooks/{hook_id}"), None)
            .await;
        if hook["disabled_at"].is_string() {
            break hook;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never disabled: {hook}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(hook["consecutive_failures"], RUN);
    assert!(
        hook["disabled_reason"].as_str().unwrap().contains("503"),
        "{hook}"
    );
    // Exactly the configured run was attempted, and nothing after it.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let calls = receiver.calls();
    assert_eq!(calls.len(), RUN as usize);
    assert!(calls.iter().all(|c| signature_verifies(c, SECRET)));

    // The log: the first event's delivery holds the three attempts; it and any later ones were
    // abandoned when the webhook was disabled.
    let (_, log) = stack
        .call(
            Method::GET,
            &format!("/v1/webhooks/{hook_id}/deliveries"),
            None,
        )
        .await;
    let log = log.as_array().unwrap();
    assert!(!log.is_empty(), "at least the provisioning event: {log:?}");
    assert!(log.iter().all(|d| d["state"] == "abandoned"), "{log:?}");
    let first = log.last().unwrap();
    assert_eq!(first["event_type"], "dev.berth.sandbox.provisioning");
    assert_eq!(first["attempts"].as_array().unwrap().len(), RUN as usize);
    assert!(log[..log.len() - 1]
        .iter()
        .all(|d| d["attempts"].as_array().unwrap().is_empty()));

    // The event saying so: a CloudEvent on {p}.events.webhook.<org>.<webhook>.
    let org: uuid::Uuid = sqlx::query_scalar("SELECT org_id FROM webhooks WHERE id = $1::uuid")
        .bind(&hook_id)
        .fetch_one(&stack.db)
        .await
        .unwrap();
    let js = jetstream::new(stack.nats.clone());
    let stream = js.get_stream(stack.subjects.events_stream()).await.unwrap();
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            filter_subject: stack
                .subjects
                .webhook_events(org.into(), hook_id.parse().unwrap()),
            ack_policy: consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let msg = tokio::time::timeout(WAIT, messages.next())
        .await
        .expect("a webhook.disabled event")
        .unwrap()
        .unwrap();
    let ce: Value = serde_json::from_slice(&msg.payload).unwrap();
    assert_eq!(ce["specversion"], "1.0");
    assert_eq!(ce["type"], "dev.berth.webhook.disabled");
    assert_eq!(ce["subject"], format!("webhooks/{hook_id}"));
    assert_eq!(ce["data"]["webhook_id"], hook_id.as_str());
    assert_eq!(ce["data"]["consecutive_failures"], RUN);
    assert_eq!(ce["data"]["url"], receiver.url());
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn webhook_requests_with_bad_urls_secrets_or_types_are_refused_and_write_nothing(db: PgPool) {
    let stack = Stack::start(db, 0).await;
    let cases = [
        (json!({"url": "ftp://127.0.0.1/x"}), "url"),
        (json!({"url": "http://user:pw@127.0.0.1/x"}), "url"),
        (
            json!({"url": format!("http://127.0.0.1/{}", "a".repeat(3000))}),
            "url",
        ),
        (
            json!({"url": "http://127.0.0.1/x", "secret": "short"}),
            "secret",
        ),
        (
            json!({"url": "http://127.0.0.1/x", "event_types": ["sandbox.nope"]}),
            "event_types",
        ),
    ];
    for (body, field) in cases {
        let (status, resp) = stack
            .call(Method::POST, "/v1/webhooks", Some(body.clone()))
            .await;
        assert_eq!(status, 400, "{body}: {resp}");
        assert_eq!(resp["error"]["field"], field, "{body}: {resp}");
    }
    let (status, resp) = stack
        .call(
            Method::POST,
            "/v1/webhooks",
            Some(json!({"url": "http://127.0.0.1/x", "colour": "blue"})),
        )
        .await;
    assert_eq!(status, 400, "{resp}");
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM webhooks")
        .fetch_one(&stack.db)
        .await
        .unwrap();
    assert_eq!(count, 0);
    // Without a secret, one is generated and shown once.
    let (status, hook) = stack
        .call(
            Method::POST,
            "/v1/webhooks",
            Some(json!({"url": "https://example.invalid/hook"})),
        )
        .await;
    assert_eq!(status, 201, "{hook}");
    assert!(hook["secret"].as_str().unwrap().starts_with("whsec_"));
    assert_eq!(hook["event_types"], json!([]));
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_tombstone_is_kept_until_every_webhook_has_fanned_out_its_events(db: PgPool) {
    let plane = inproc::Plane::start(db.clone()).await;
    let hook = plane
        .api
        .call(
            &plane.org.key,
            axum::http::Method::POST,
            "/v1/webhooks",
            None,
            Some(r#"{"url":"http://127.0.0.1:9/hook"}"#),
        )
        .await;
    assert_eq!(hook.status, 201, "{hook:?}");
    let id = plane.create().await;
    for verb in [None, Some("delete")] {
        if let Some(verb) = verb {
            plane.request(id, verb).await;
        }
        let command = plane.latest(id).await;
        plane
            .deliver(&command, inproc::succeeded(command.kind))
            .await;
    }
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&db)
        .await
        .unwrap();

    // Every event published; no webhook worker has fanned them out yet when a pass runs.
    let (js, subjects) = publish_events(&db).await;
    let purge_at_once = berth_reconciler::pass::PassConfig {
        tombstone_retention: Duration::ZERO,
        ..inproc::eager_timeouts()
    };
    let lease = inproc::lease(&db).await;
    berth_reconciler::pass::run_pass(&db, &purge_at_once, &lease)
        .await
        .unwrap();
    berth_api::webhook_delivery::round(&db, &reqwest::Client::new(), &fast_webhooks(100))
        .await
        .unwrap();
    berth_schemas::streams::delete_streams(&js, &subjects).await;

    let fanned: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_deliveries")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(
        fanned, events,
        "every event of the sandbox reaches the webhook"
    );
}

/// Issue 11 item 6, at the door: without the operator's flag, a webhook whose URL names a
/// loopback, private, link-local or metadata address (in any spelling, or by a name that resolves
/// only there) is refused at create with a 400 naming `url`; a public one is accepted.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_webhook_pointing_at_a_private_address_is_refused_at_create(db: PgPool) {
    let org = inproc::org(&db).await;
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    let api = inproc::Api::configured(db.clone(), nats, inproc::unique_subjects(), |c| {
        c.webhooks.allow_private_targets = false;
    });
    for url in [
        "http://127.0.0.1:9/hook",
        "http://localhost:9/hook",
        "http://2130706433/hook",
        "http://0x7f.1/hook",
        "http://[::ffff:127.0.0.1]/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://10.0.0.1/hook",
        "http://[fd00::1]/hook",
        // RFC 6761: `localhost` and every name under it, with or without the trailing dot,
        // whatever this machine's resolver makes of them; literals with a trailing dot.
        "http://localhost./hook",
        "http://LOCALHOST.:9/hook",
        "http://foo.localhost:18999/hook",
        "http://foo.localhost./hook",
        "http://127.0.0.1./hook",
        "http://2130706433./hook",
        "http://0x7f.1./hook",
        "http://10.0.0.1./hook",
    ] {
        let reply = api
            .call(
                &org.key,
                axum::http::Method::POST,
                "/v1/webhooks",
                None,
                Some(&json!({ "url": url }).to_string()),
            )
            .await;
        assert_eq!(reply.status, 400, "{url}: {reply:?}");
        assert_eq!(reply.code(), "invalid_request", "{url}");
        assert!(
            reply.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("private"),
            "{url}: {reply:?}"
        );
    }
    let public = api
        .call(
            &org.key,
            axum::http::Method::POST,
            "/v1/webhooks",
            None,
            Some(&json!({ "url": "https://93.184.215.14/hook" }).to_string()),
        )
        .await;
    assert_eq!(public.status, 201, "{public:?}");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM webhooks")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(stored, 1, "only the public webhook was stored");
}

/// Issue 11 item 6: without the operator's `allow_private_targets`, a delivery never reaches a
/// loopback receiver, whether the URL names it by address (in any spelling) or by a name that
/// resolves to it; the attempt log says only that the target was refused.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn deliveries_to_loopback_are_refused_in_every_spelling_without_the_operator_flag(
    db: PgPool,
) {
    let receiver = Receiver::start(0, StatusCode::OK).await;
    let port = receiver.addr.port();
    let plane = inproc::Plane::start(db.clone()).await;
    let urls = [
        receiver.url(),
        format!("http://localhost:{port}/hook"),
        format!("http://2130706433:{port}/hook"),
        format!("http://[::ffff:127.0.0.1]:{port}/hook"),
    ];
    for url in &urls {
        let hook = plane
            .api
            .call(
                &plane.org.key,
                axum::http::Method::POST,
                "/v1/webhooks",
                None,
                Some(&json!({ "url": url }).to_string()),
            )
            .await;
        assert_eq!(hook.status, 201, "{hook:?}");
    }
    plane.create().await;
    let (js, subjects) = publish_events(&db).await;

    let refusing = WebhookConfig {
        allow_private_targets: false,
        ..fast_webhooks(100)
    };
    let http = berth_api::webhook_delivery::client(&refusing).unwrap();
    berth_api::webhook_delivery::round(&db, &http, &refusing)
        .await
        .unwrap();
    berth_schemas::streams::delete_streams(&js, &subjects).await;

    assert!(receiver.calls().is_empty(), "{:?}", receiver.calls());
    let errors: Vec<Option<String>> = sqlx::query_scalar("SELECT error FROM webhook_attempts")
        .fetch_all(&db)
        .await
        .unwrap();
    assert_eq!(errors.len(), urls.len(), "one attempt per webhook");
    assert!(
        errors
            .iter()
            .all(|e| e.as_deref() == Some(berth_api::webhooks::target::REFUSED_TARGET)),
        "{errors:?}"
    );
}
