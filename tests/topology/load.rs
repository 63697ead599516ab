//! Load on a [`Topology`] while a fault runs, as a careful client sends it: each sandbox is
//! created, stopped, started and deleted (four requests), each POST with its own
//! `Idempotency-Key`, a refused or cut request retried with the same key on the other API;
//! then the checks every fault test ends with.
//!
//! A request is *accepted* when an API answers it 2xx; *refused* answers (5xx, 429, a cut
//! connection) are tallied by what came back and retried. A 409 is the API's verdict on the
//! sandbox's state (no retry): the worker reads the state and goes on to delete it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::kit::Topology;
use crate::support::env::SETTLE_TIMEOUT;

/// Pause between two looks at a sandbox, and before retrying a refused request.
const POLL: Duration = Duration::from_millis(250);
/// How long one accepted request may take to converge, faults included (a host cut past the
/// failover threshold, a JetStream leader election, a Postgres restart).
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(2 * SETTLE_TIMEOUT.as_secs());

/// What one run of the load saw.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Requests answered 2xx.
    pub accepted: usize,
    /// Refused or cut requests, by `"<request> <status> <code>"` (`<status>` 0: no answer).
    pub refused: BTreeMap<String, usize>,
    /// Every sandbox created.
    pub ids: Vec<String>,
    /// Sandboxes that ended `failed-start` instead of `running` (a lost host's).
    pub failed_start: usize,
    /// When the last refusal came.
    pub last_refusal: Option<Instant>,
}

/// A running load.
pub struct Load {
    tally: Arc<Mutex<Tally>>,
    workers: tokio::task::JoinSet<()>,
}

/// The HTTP side of the load: both APIs, one key.
#[derive(Clone)]
struct Client {
    urls: Vec<String>,
    key: String,
    http: reqwest::Client,
    tally: Arc<Mutex<Tally>>,
}

impl Load {
    /// Starts `sandboxes` lifecycles (4 requests each), `concurrency` at a time.
    pub fn start(topo: &Topology, sandboxes: usize, concurrency: usize) -> Load {
        let tally = Arc::new(Mutex::new(Tally::default()));
        let client = Client {
            urls: topo.api_urls.clone(),
            key: topo.key.clone(),
            http: topo.http.clone(),
            tally: tally.clone(),
        };
        let next = Arc::new(AtomicUsize::new(0));
        let run = crate::support::unique();
        let mut workers = tokio::task::JoinSet::new();
        for _ in 0..concurrency {
            let (client, next, run) = (client.clone(), next.clone(), run.clone());
            workers.spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= sandboxes {
                        return;
                    }
                    client.lifecycle(&format!("{run}-{i}")).await;
                }
            });
        }
        Load { tally, workers }
    }

    /// What it saw so far.
    pub fn tally(&self) -> Tally {
        self.tally.lock().unwrap().clone()
    }

    /// How many sandboxes were created so far.
    pub fn created(&self) -> usize {
        self.tally.lock().unwrap().ids.len()
    }

    /// Waits until every lifecycle ended (each accepted request converged; a worker panics
    /// naming the sandbox that did not).
    pub async fn finish(mut self) -> Tally {
        while let Some(joined) = self.workers.join_next().await {
            if let Err(e) = joined {
                std::panic::resume_unwind(e.into_panic());
            }
        }
        self.tally()
    }
}

impl Client {
    /// create → running → stop → stopped → start → running → delete → deleted.
    async fn lifecycle(&self, key: &str) {
        let body = json!({"template": "base", "vcpus": 1, "memory_mib": 128});
        let (_, created) = self
            .accepted(
                "create",
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(body),
                key,
            )
            .await;
        let id = created["id"]
            .as_str()
            .expect("a created sandbox has an id")
            .to_owned();
        self.tally.lock().unwrap().ids.push(id.clone());
        if self.settle(&id, "running").await {
            for (what, target) in [("stop", "stopped"), ("start", "running")] {
                let path = format!("/v1/sandboxes/{id}/{what}");
                let (status, _) = self
                    .accepted(
                        what,
                        reqwest::Method::POST,
                        &path,
                        None,
                        &format!("{key}-{what}"),
                    )
                    .await;
                if status == 409 || !self.settle(&id, target).await {
                    break;
                }
            }
        }
        let path = format!("/v1/sandboxes/{id}");
        self.accepted(
            "delete",
            reqwest::Method::DELETE,
            &path,
            None,
            &format!("{key}-delete"),
        )
        .await;
        self.settle(&id, "deleted").await;
    }

    /// Sends the request until an API accepts it (or answers 409 or 404), retrying what was
    /// refused or cut with the same `Idempotency-Key` on the next API. Returns the answer.
    async fn accepted(
        &self,
        what: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        key: &str,
    ) -> (u16, Value) {
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        let mut api = rand::random::<u32>() as usize % self.urls.len();
        loop {
            let url = format!("{}{path}", self.urls[api]);
            let mut req = self
                .http
                .request(method.clone(), url)
                .bearer_auth(&self.key)
                .header("Idempotency-Key", key);
            if let Some(b) = &body {
                req = req.json(b);
            }
            let refusal = match req.send().await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let value: Value = resp.json().await.unwrap_or(Value::Null);
                    if (200..300).contains(&status) {
                        self.tally.lock().unwrap().accepted += 1;
                        return (status, value);
                    }
                    let code = value["error"]["code"].as_str().unwrap_or("-").to_owned();
                    if status == 409 || status == 404 {
                        self.refuse(format!("{what} {status} {code}"));
                        return (status, value);
                    }
                    format!("{what} {status} {code}")
                }
                Err(e) if e.is_timeout() => format!("{what} 0 timeout"),
                Err(_) => format!("{what} 0 connection"),
            };
            self.refuse(refusal);
            assert!(
                Instant::now() < deadline,
                "{what} {path} was never accepted"
            );
            api = (api + 1) % self.urls.len();
            tokio::time::sleep(POLL).await;
        }
    }

    fn refuse(&self, what: String) {
        let mut tally = self.tally.lock().unwrap();
        *tally.refused.entry(what).or_default() += 1;
        tally.last_refusal = Some(Instant::now());
    }

    /// Polls the sandbox (any API that answers) until it is `target` (`deleted`: also once
    /// it is gone). `false` when it settled as `failed-start` instead.
    async fn settle(&self, id: &str, target: &str) -> bool {
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        let mut last = Value::Null;
        let mut api = 0;
        loop {
            let url = format!("{}/v1/sandboxes/{id}", self.urls[api]);
            api = (api + 1) % self.urls.len();
            if let Ok(resp) = self.http.get(url).bearer_auth(&self.key).send().await {
                let status = resp.status().as_u16();
                let value: Value = resp.json().await.unwrap_or(Value::Null);
                if status == 404 && target == "deleted" {
                    return true;
                }
                if status == 200 {
                    if value["state"] == target {
                        return true;
                    }
                    if value["state"] == "failed-start" && target != "deleted" {
                        self.tally.lock().unwrap().failed_start += 1;
                        return false;
                    }
                    last = value;
                }
            }
            assert!(
                Instant::now() < deadline,
                "sandbox {id} never reached {target}; last seen {last}"
            );
            tokio::time::sleep(POLL).await;
        }
    }
}

/// The checks every fault test ends with, once the load finished:
/// - no sandbox lost and none made twice: one row per created sandbox, every one `deleted`;
/// - no container without a row: no host keeps a container (every row is deleted);
/// - no command applied twice: the hosts applied (or refused as stale) exactly as many
///   commands as were published (a redelivery is answered from the stored result, counted
///   as `replayed`, never applied again);
/// - capacity drift 0.
pub async fn assert_converged(topo: &Topology, tally: &Tally) {
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT id::text, state FROM sandboxes ORDER BY id")
            .fetch_all(&topo.db)
            .await
            .unwrap();
    assert_eq!(
        rows.len(),
        tally.ids.len(),
        "one row per created sandbox: {rows:?}"
    );
    for id in &tally.ids {
        let state = rows.iter().find(|(r, _)| r == id).map(|(_, s)| s.as_str());
        assert_eq!(state, Some("deleted"), "sandbox {id}");
    }
    crate::support::eventually("no host keeps a container", || async {
        (1..=topo.hosts).all(|n| containers(&topo.runc_root(n)).is_empty())
    })
    .await;
    crate::support::eventually("every published command was applied once", || async {
        let published: i64 =
            sqlx::query_scalar("SELECT count(*) FROM commands WHERE published_at IS NOT NULL")
                .fetch_one(&topo.db)
                .await
                .unwrap();
        let applied: f64 = (1..=topo.hosts)
            .map(|n| {
                let c = topo.host_commands(n);
                ["succeeded", "failed", "refused_stale"]
                    .iter()
                    .map(|o| c.get(*o).copied().unwrap_or(0.0))
                    .sum::<f64>()
            })
            .sum();
        assert!(
            applied <= published as f64,
            "hosts applied {applied} commands but only {published} were published"
        );
        applied == published as f64
    })
    .await;
    let drift = berth_reconciler::pass::capacity_drift(&topo.db)
        .await
        .unwrap();
    assert_eq!(drift, (0, 0), "capacity drift (vcpus, memory_mib)");
}

/// Prints one fault's figures (the table in tests/bench/RESULTS.md is made of these lines).
pub fn report(fault: &str, converged_after: Duration, tally: &Tally) {
    let refused: Vec<String> = tally
        .refused
        .iter()
        .map(|(what, n)| format!("{what} ×{n}"))
        .collect();
    println!(
        "TOPOLOGY FAULT | {fault} | converged {:.1} s after it | {} accepted, {} sandboxes, {} failed-start | refused: {}",
        converged_after.as_secs_f64(),
        tally.accepted,
        tally.ids.len(),
        tally.failed_start,
        if refused.is_empty() { "none".to_owned() } else { refused.join(", ") }
    );
}

/// The container ids `runc --root <root> list -q` shows.
pub fn containers(root: &std::path::Path) -> Vec<String> {
    if !root.exists() {
        return Vec::new();
    }
    let out = std::process::Command::new("runc")
        .arg("--root")
        .arg(root)
        .args(["list", "-q"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}
