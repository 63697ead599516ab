//! Operations artifacts are checked against the real tools and a real run: `promtool` accepts
//! `deploy/prometheus/`, and every metric the alert rules and the Grafana dashboard name is
//! exported after an end-to-end lifecycle (control-plane metrics from the API's `/metrics`,
//! hostd's from a `berth hostd --metrics-addr` process).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use axum::http::StatusCode;
use berth_reconciler::pass::PassConfig;
use reqwest::Method;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::support::{eventually, Stack};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// `promtool` from PATH. Fails (never skips) when it is missing: CI installs Debian's
/// `prometheus` package (see `.ci/run`).
fn promtool() -> PathBuf {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("promtool"))
        .find(|p| p.is_file())
        .expect(
            "promtool is not on PATH: install Debian's `prometheus` package \
             (apt-get install prometheus); .ci/run installs it",
        )
}

fn run_promtool(args: &[&str]) {
    let out = Command::new(promtool())
        .args(args)
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "promtool {}:\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn promtool_accepts_the_scrape_config_and_the_alert_rules() {
    let config = repo("deploy/prometheus/prometheus.yml");
    let rules = repo("deploy/prometheus/alerts.yml");
    run_promtool(&["check", "config", config.to_str().unwrap()]);
    run_promtool(&["check", "rules", rules.to_str().unwrap()]);
}

/// Every `berth_…` name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("berth_") {
        let preceded_by_word = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if !preceded_by_word {
            names.insert(name.clone());
        }
        rest = &rest[at + name.len().max(1)..];
    }
    names
}

/// The metric names the alert rules and the dashboard's queries use.
fn referenced_metrics() -> BTreeSet<String> {
    let mut names =
        metric_names(&std::fs::read_to_string(repo("deploy/prometheus/alerts.yml")).unwrap());
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(repo("deploy/grafana/berth.json")).unwrap())
            .expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    collect_exprs(&dashboard, &mut exprs);
    assert!(exprs.len() > 20, "the dashboard has its queries");
    for expr in exprs {
        names.extend(metric_names(&expr));
    }
    names
}

fn collect_exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr", Value::String(e)) => out.push(e.clone()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

/// The sample names of a Prometheus text exposition, and the names it declares as counters.
fn exported(scrape: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut samples = BTreeSet::new();
    let mut counters = BTreeSet::new();
    for line in scrape.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some((name, "counter")) = rest.split_once(' ') {
                counters.insert(name.to_owned());
            }
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            samples.insert(line[..end].to_owned());
        }
    }
    (samples, counters)
}

async fn scrape(http: &reqwest::Client, url: &str) -> String {
    let resp = http.get(url).send().await.unwrap();
    assert_eq!(resp.status(), 200, "{url}");
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    resp.text().await.unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn every_metric_the_alerts_and_dashboard_name_is_exported_after_an_end_to_end_run(
    db: PgPool,
) {
    // Fast passes and no tombstone retention, so the pass acts (a purge) during the run.
    let pass = PassConfig {
        interval: Duration::from_millis(300),
        tombstone_retention: Duration::ZERO,
        ..Default::default()
    };
    let mut stack = Stack::start_with(db, 0, pass).await;
    let hostd_metrics = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    stack
        .add_host_with_args(
            (None, None),
            &["--metrics-addr".to_owned(), hostd_metrics.to_string()],
        )
        .await;

    // A webhook receiver, so deliveries are attempted.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let receiver = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post(|| async { StatusCode::NO_CONTENT }),
        );
        axum::serve(listener, app).await.unwrap();
    });
    let (status, hook) = stack
        .call(
            Method::POST,
            "/v1/webhooks",
            Some(json!({"url": format!("http://{receiver}/hook")})),
        )
        .await;
    assert_eq!(status, 201, "{hook}");

    // The lifecycle: create, exec, stop, start, delete.
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    // A delivery succeeds before the delete: with zero retention the pass purges the
    // tombstone as soon as its events are published, and the purge cascades to events the
    // webhook worker may not have fanned out yet (see tests/README.md, "known gaps").
    let db = stack.db.clone();
    let hook_id = hook["id"].as_str().unwrap().to_owned();
    eventually("a webhook delivery succeeded", || {
        let db = db.clone();
        let hook_id = hook_id.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM webhook_deliveries
                  WHERE webhook_id = $1::uuid AND state = 'succeeded'",
            )
            .bind(hook_id)
            .fetch_one(&db)
            .await
            .unwrap()
                > 0
        }
    })
    .await;
    let (status, out) = stack.exec(&id, &["echo", "hello"]).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    assert_eq!(stack.request(&id, "start").await.0, 202);
    stack.wait_state(&id, "running").await;
    assert_eq!(stack.delete(&id).await.0, 202);
    // No wait for `deleted` here: with zero retention a pass may purge the tombstone before a
    // poll sees it. The purge below implies it (only `deleted` rows are purged).

    eventually("the tombstone is purged by a pass", || {
        let db = db.clone();
        let id = id.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM sandboxes WHERE id = $1::uuid")
                .bind(id)
                .fetch_one(&db)
                .await
                .unwrap()
                == 0
        }
    })
    .await;
    // The reconciler computes the fleet gauges every 15 s; the host joined after its first
    // round, so take one now rather than wait for the next.
    berth_reconciler::gauges::record_fleet(&stack.db)
        .await
        .unwrap();

    let control = scrape(&stack.http, &stack.url("/metrics")).await;
    let hostd = scrape(&stack.http, &format!("http://{hostd_metrics}/metrics")).await;
    let (control_names, control_counters) = exported(&control);
    let (hostd_names, hostd_counters) = exported(&hostd);
    let missing: Vec<String> = referenced_metrics()
        .into_iter()
        .filter(|name| {
            let from = if name.starts_with("berth_hostd_") {
                &hostd_names
            } else {
                &control_names
            };
            !from.contains(name)
        })
        .collect();
    assert!(
        missing.is_empty(),
        "named in deploy/ but not exported: {missing:?}\ncontrol plane exports: {control_names:?}\nhostd exports: {hostd_names:?}"
    );

    // Prometheus practice: counters end in _total; no sandbox id in any label.
    for name in control_counters.iter().chain(&hostd_counters) {
        assert!(
            !name.starts_with("berth_") || name.ends_with("_total"),
            "counter {name} should end in _total"
        );
    }
    for (who, text) in [("control plane", &control), ("hostd", &hostd)] {
        assert!(!text.contains(&id), "{who} exports a sandbox id in a label");
    }
    server.abort();
    stack.teardown().await;
}

#[test]
fn metric_names_are_found_in_queries_but_not_inside_other_words() {
    assert_eq!(
        metric_names("max(berth_a_total) / rate(berth_b_bucket[5m]) x_berth_c"),
        ["berth_a_total", "berth_b_bucket"]
            .into_iter()
            .map(String::from)
            .collect()
    );
}
