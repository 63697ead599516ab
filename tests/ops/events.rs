//! Lifecycle events as consumers see them: CloudEvents on the `{P}_EVENTS` JetStream stream
//! (replayable, deduplicated by id) and the `GET /v1/events` Server-Sent Events stream
//! (resumable with `Last-Event-ID`), against the real Postgres, NATS and `berth hostd`.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use berth_schemas::{OrgId, SandboxId};
use futures::StreamExt;
use serde_json::Value;
use sqlx::PgPool;

use crate::support::Stack;

/// How long a test waits for an event to arrive.
const EVENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a test listens to be sure nothing more arrives (several SSE poll intervals).
const QUIET: Duration = Duration::from_millis(1500);

/// One event row as the database has it, once published.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    id: String,
    sandbox_id: String,
    to: String,
    seq: i64,
}

/// Waits until every event of the stack's org is published and there are `count` of them;
/// returns them in publish order.
async fn published_events(stack: &Stack, org: OrgId, count: usize) -> Vec<Row> {
    let deadline = tokio::time::Instant::now() + EVENT_TIMEOUT;
    loop {
        let rows: Vec<(uuid::Uuid, uuid::Uuid, String, Option<i64>)> = sqlx::query_as(
            "SELECT id, sandbox_id, to_state, seq FROM events WHERE org_id = $1
              ORDER BY seq NULLS LAST, at",
        )
        .bind(org)
        .fetch_all(&stack.db)
        .await
        .unwrap();
        if rows.len() == count && rows.iter().all(|r| r.3.is_some()) {
            return rows
                .into_iter()
                .map(|(id, sandbox, to, seq)| Row {
                    id: id.to_string(),
                    sandbox_id: sandbox.to_string(),
                    to,
                    seq: seq.unwrap(),
                })
                .collect();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "expected {count} published events, have {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn org_of(stack: &Stack, sandbox: &str) -> OrgId {
    sqlx::query_scalar("SELECT org_id FROM sandboxes WHERE id = $1::uuid")
        .bind(sandbox)
        .fetch_one(&stack.db)
        .await
        .unwrap()
}

/// Reads every message of `stream` on `subject` from `start` (a stream sequence; 1 = the
/// beginning), until none arrives for [`QUIET`].
async fn read_stream(
    js: &jetstream::Context,
    stream: &str,
    subject: String,
    start: u64,
) -> Vec<jetstream::Message> {
    let stream = js.get_stream(stream).await.unwrap();
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            filter_subject: subject,
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            ack_policy: consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = Vec::new();
    while let Ok(Some(msg)) = tokio::time::timeout(QUIET, messages.next()).await {
        out.push(msg.unwrap());
    }
    out
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn lifecycle_events_are_on_the_event_stream_as_cloudevents_with_stable_ids(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let mut commands = stack
        .nats
        .subscribe(stack.subjects.cmd_all())
        .await
        .unwrap();
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;

    // Commands carry W3C trace context whose trace id is the command id.
    let create = tokio::time::timeout(EVENT_TIMEOUT, commands.next())
        .await
        .unwrap()
        .unwrap();
    let create_id: uuid::Uuid = sqlx::query_scalar(
        "SELECT id FROM commands WHERE sandbox_id = $1::uuid AND kind = 'sandbox.create'",
    )
    .bind(&id)
    .fetch_one(&stack.db)
    .await
    .unwrap();
    let traceparent = create.headers.as_ref().unwrap().get("traceparent").unwrap();
    let trace = berth_schemas::trace::TraceParent::parse(traceparent.as_str()).unwrap();
    assert_eq!(trace.trace_id_hex(), create_id.simple().to_string());
    drop(commands);

    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    let org = org_of(&stack, &id).await;
    let rows = published_events(&stack, org, 6).await;
    assert_eq!(
        rows.iter().map(|r| r.to.as_str()).collect::<Vec<_>>(),
        [
            "provisioning",
            "running",
            "stopping",
            "stopped",
            "stopping",
            "deleted"
        ]
    );

    let js = jetstream::new(stack.nats.clone());
    let sandbox: SandboxId = id.parse().unwrap();
    let subject = stack.subjects.sandbox_events(org, sandbox);
    let messages = read_stream(&js, &stack.subjects.events_stream(), subject.clone(), 1).await;
    assert_eq!(messages.len(), rows.len(), "one message per event");
    let mut last_generation = 0;
    for (msg, row) in messages.iter().zip(&rows) {
        assert_eq!(msg.subject.as_str(), subject);
        let headers = msg.headers.as_ref().expect("headers");
        assert_eq!(
            headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .map(|v| v.as_str()),
            Some(row.id.as_str()),
            "the message id is the event id"
        );
        assert_eq!(
            headers.get("Content-Type").map(|v| v.as_str()),
            Some("application/cloudevents+json")
        );
        let ce: Value = serde_json::from_slice(&msg.payload).unwrap();
        assert_eq!(ce["specversion"], "1.0");
        assert_eq!(ce["id"], row.id.as_str());
        assert_eq!(ce["type"], format!("dev.berth.sandbox.{}", row.to));
        assert_eq!(ce["source"], format!("/berth/orgs/{org}"));
        assert_eq!(ce["subject"], format!("sandboxes/{id}"));
        assert_eq!(ce["datacontenttype"], "application/json");
        assert!(ce["time"].as_str().unwrap().ends_with('Z'), "{ce}");
        assert_eq!(ce["data"]["sandbox_id"], id.as_str());
        assert_eq!(ce["data"]["org_id"], org.to_string());
        assert_eq!(ce["data"]["to"], row.to.as_str());
        let generation = ce["data"]["generation"].as_i64().unwrap();
        assert!(generation >= last_generation, "{ce}");
        last_generation = generation;
    }
    let first: Value = serde_json::from_slice(&messages[0].payload).unwrap();
    assert_eq!(
        first["data"]["from"],
        Value::Null,
        "the first event has no from"
    );

    // The per-sandbox listing names the same ids.
    let (status, listed) = stack
        .call(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{id}/events"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{listed}");
    let mut listed_ids: Vec<String> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect();
    let mut row_ids: Vec<String> = rows.iter().map(|r| r.id.clone()).collect();
    listed_ids.sort();
    row_ids.sort();
    assert_eq!(listed_ids, row_ids);

    // A re-publish of an event (a relay that crashed between the ack and the mark) is
    // dropped by the stream: the id is stable, so deduplication holds.
    let mut stream = js.get_stream(stack.subjects.events_stream()).await.unwrap();
    let before = stream.info().await.unwrap().state.messages;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, rows[1].id.as_str());
    let ack = js
        .publish_with_headers(subject.clone(), headers, messages[1].payload.clone())
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(
        ack.duplicate,
        "a second publish with the same id is a duplicate"
    );
    assert_eq!(stream.info().await.unwrap().state.messages, before);

    // A consumer can replay from any point: start at the third event's stream sequence.
    let third = messages[2].info().unwrap().stream_sequence;
    let replayed = read_stream(&js, &stack.subjects.events_stream(), subject, third).await;
    let replayed_ids: Vec<String> = replayed
        .iter()
        .map(|m| {
            serde_json::from_slice::<Value>(&m.payload).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(
        replayed_ids,
        rows[2..].iter().map(|r| r.id.clone()).collect::<Vec<_>>()
    );
    stack.teardown().await;
}

/// A minimal Server-Sent Events client over one streaming response.
struct SseClient {
    resp: reqwest::Response,
    buf: String,
}

impl SseClient {
    /// Opens `GET /v1/events<query>`, with `Last-Event-ID` when given.
    async fn open(stack: &Stack, query: &str, last_event_id: Option<&str>) -> SseClient {
        let mut req = stack
            .http
            .get(stack.url(&format!("/v1/events{query}")))
            .bearer_auth(&stack.key);
        if let Some(last) = last_event_id {
            req = req.header("Last-Event-ID", last);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 200);
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        SseClient {
            resp,
            buf: String::new(),
        }
    }

    /// The next message's `(id, data)`, skipping keep-alive comments; `None` when nothing
    /// arrives within `wait`.
    async fn next(&mut self, wait: Duration) -> Option<(String, Value)> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let message: String = self.buf.drain(..end + 2).collect();
                let mut id = None;
                let mut data = String::new();
                for line in message.lines() {
                    if let Some(v) = line.strip_prefix("id:") {
                        id = Some(v.trim().to_owned());
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push_str(v.trim_start());
                    }
                }
                match id {
                    Some(id) => return Some((id, serde_json::from_str(&data).unwrap())),
                    None => continue,
                }
            }
            let chunk = tokio::time::timeout_at(deadline, self.resp.chunk()).await;
            match chunk {
                Ok(Ok(Some(bytes))) => self.buf.push_str(std::str::from_utf8(&bytes).unwrap()),
                Ok(Ok(None)) => panic!("the event stream ended"),
                Ok(Err(e)) => panic!("event stream error: {e}"),
                Err(_) => return None,
            }
        }
    }

    /// The next `n` messages, failing the test if they do not come.
    async fn take(&mut self, n: usize) -> Vec<(String, Value)> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let got = self.next(EVENT_TIMEOUT).await;
            out.push(got.unwrap_or_else(|| panic!("only {} of {n} events arrived", out.len())));
        }
        out
    }
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_sse_client_that_reconnects_with_last_event_id_misses_no_event_and_sees_none_twice(
    db: PgPool,
) {
    let stack = Stack::start(db, 1).await;
    let mut sse = SseClient::open(&stack, "", None).await;
    let a = stack.create().await;
    stack.wait_state(&a, "running").await;
    let mut seen = sse.take(2).await;
    assert_eq!(
        seen.iter()
            .map(|(_, ce)| ce["type"].as_str().unwrap())
            .collect::<Vec<_>>(),
        [
            "dev.berth.sandbox.provisioning",
            "dev.berth.sandbox.running"
        ]
    );
    for (id, ce) in &seen {
        assert_eq!(&ce["id"], id.as_str(), "the SSE id is the CloudEvent id");
    }

    // Disconnect; events happen while nobody listens.
    drop(sse);
    assert_eq!(stack.request(&a, "stop").await.0, 202);
    stack.wait_state(&a, "stopped").await;
    let b = stack.create().await;
    stack.wait_state(&b, "running").await;

    // Reconnect after the last event seen: the four missed ones, nothing else.
    let last = seen.last().unwrap().0.clone();
    let mut sse = SseClient::open(&stack, "", Some(&last)).await;
    seen.extend(sse.take(4).await);
    // Then live: deleting b while connected.
    assert_eq!(stack.delete(&b).await.0, 202);
    stack.wait_state(&b, "deleted").await;
    seen.extend(sse.take(2).await);
    assert_eq!(
        sse.next(QUIET).await,
        None,
        "no event beyond those that happened"
    );

    let org = org_of(&stack, &a).await;
    let rows = published_events(&stack, org, 8).await;
    let seen_ids: Vec<&str> = seen.iter().map(|(id, _)| id.as_str()).collect();
    let row_ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(
        seen_ids, row_ids,
        "every event once, in publish order, across the reconnect"
    );

    // Resuming at the newest event yields nothing old.
    let mut caught_up = SseClient::open(&stack, "", Some(row_ids[7])).await;
    assert_eq!(caught_up.next(QUIET).await, None);

    // Filters: one sandbox, one type.
    let mut only_b = SseClient::open(&stack, &format!("?sandbox_id={b}"), None).await;
    let got = only_b.take(4).await;
    assert!(got
        .iter()
        .all(|(_, ce)| ce["data"]["sandbox_id"] == b.as_str()));
    assert_eq!(only_b.next(QUIET).await, None);
    let mut running = SseClient::open(&stack, "?type=sandbox.running", None).await;
    let got = running.take(2).await;
    assert!(got
        .iter()
        .all(|(_, ce)| ce["type"] == "dev.berth.sandbox.running"));
    assert_eq!(
        got.iter()
            .map(|(_, ce)| ce["data"]["sandbox_id"].as_str().unwrap())
            .collect::<Vec<_>>(),
        [a.as_str(), b.as_str()]
    );
    assert_eq!(running.next(QUIET).await, None);

    // Bad requests are refused up front.
    for (query, last) in [
        ("", Some(uuid::Uuid::now_v7().to_string())),
        ("", Some("not-an-id".to_owned())),
        ("?type=sandbox.exploded", None),
        ("?sandbox_id=nope", None),
    ] {
        let mut req = stack
            .http
            .get(stack.url(&format!("/v1/events{query}")))
            .bearer_auth(&stack.key);
        if let Some(last) = &last {
            req = req.header("Last-Event-ID", last);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 400, "{query} {last:?}");
    }
    // Another org sees none of these events, and cannot resume from one of them.
    let (_, other_key) = berth_api::auth::create_org(&stack.db, "someone-else")
        .await
        .unwrap();
    let resp = stack
        .http
        .get(stack.url("/v1/events"))
        .bearer_auth(&other_key)
        .header("Last-Event-ID", row_ids[0])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let resp = stack
        .http
        .get(stack.url("/v1/events"))
        .bearer_auth(&other_key)
        .send()
        .await
        .unwrap();
    let mut other = SseClient {
        resp,
        buf: String::new(),
    };
    assert_eq!(other.next(QUIET).await, None);
    drop((other, only_b, running, caught_up, sse));
    stack.teardown().await;
}
