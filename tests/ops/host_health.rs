//! Hosts that fail and a control plane that fell behind (issue 12 items 2 and 5), against real
//! `berth hostd` processes and runc:
//!
//! - A host whose runtime fails every `run` while its heartbeats stay healthy: a wrapper
//!   script named `runc`, first on that hostd's `PATH`, fails `runc run` while a fault file
//!   exists and hands every other call (and every call once the file is gone) to the real
//!   runc. Its failed creates are retried once on the other host and run there; after
//!   `degrade_after` of them it is `degraded` (in `/v1/hosts`, the gauge, the counters) and
//!   placement avoids it; a request's own failure (a template no host has) is neither
//!   retried nor counted; a failed probe backs off (doubled), a good one makes it healthy.
//! - Hosts whose heartbeats are stale because the control plane could not write them (their
//!   hostd frozen, their `last_seen` aged by the store's drill function): a create gets 503
//!   `unavailable` with `Retry-After`, never `no_capacity`, and works once heartbeats land;
//!   a fleet that is really full says `no_capacity`, stale or not.

use std::path::Path;
use std::time::Duration;

use berth_reconciler::health::HealthConfig;
use berth_reconciler::pass::PassConfig;
use berth_schemas::host_state::HealthPolicy;
use berth_schemas::HostId;
use berth_store::host_health;
use berth_store::templates::{self, TemplateRow};
use reqwest::Method;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::http::host_of;
use crate::support::{eventually, Stack};

/// What the wrapper writes when it fails a `runc run`.
const INJECTED: &str = "injected runc run failure";

/// Writes `<dir>/runc`: fails `run` while `<dir>/fail-run` exists, else runs the real runc.
fn runc_wrapper(dir: &Path) -> String {
    std::fs::create_dir_all(dir).unwrap();
    let real = ["/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("runc is installed");
    let script = format!(
        "#!/bin/sh\n\
         if [ -e '{fault}' ]; then\n\
         \x20 for arg in \"$@\"; do\n\
         \x20   if [ \"$arg\" = run ]; then echo '{INJECTED}' >&2; exit 1; fi\n\
         \x20 done\n\
         fi\n\
         exec {real} \"$@\"\n",
        fault = dir.join("fail-run").display(),
    );
    let path = dir.join("runc");
    std::fs::write(&path, script).unwrap();
    let mut perms = std::fs::metadata(&path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&path, perms).unwrap();
    format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

async fn health_of(stack: &Stack, admin: &str, host: HostId) -> Value {
    let (status, hosts) = stack.call_as(admin, Method::GET, "/v1/hosts", None).await;
    assert_eq!(status, 200, "{hosts}");
    hosts
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["id"] == host.to_string())
        .unwrap_or_else(|| panic!("host {host} listed: {hosts}"))["health"]
        .clone()
}

async fn create(stack: &Stack, template: &str, memory_mib: u32) -> (u16, Value) {
    stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": template, "vcpus": 1, "memory_mib": memory_mib})),
        )
        .await
}

async fn created(stack: &Stack) -> String {
    let (status, body) = create(stack, "base", 256).await;
    assert_eq!(status, 202, "{body}");
    body["id"].as_str().unwrap().to_owned()
}

/// (create commands issued, `retried_elsewhere` events) of a sandbox.
async fn tries(db: &PgPool, id: &str) -> (i64, i64) {
    let creates = sqlx::query_scalar(
        "SELECT count(*) FROM commands WHERE sandbox_id = $1::uuid AND kind = $2",
    )
    .bind(id)
    .bind(berth_schemas::CommandKind::Create.as_str())
    .fetch_one(db)
    .await
    .unwrap();
    let retries = sqlx::query_scalar(
        "SELECT count(*) FROM events WHERE sandbox_id = $1::uuid AND reason = 'retried_elsewhere'",
    )
    .bind(id)
    .fetch_one(db)
    .await
    .unwrap();
    (creates, retries)
}

/// Creates a sandbox that placement puts on the failing host `bad` (the emptiest, or due its
/// probe), and checks that its failed create was retried once on `good`, where it runs. A
/// create placement put straight on `good` because `bad`'s row was busy at that instant (a
/// heartbeat being written: placement passes a busy healthy host over) is set aside and the
/// create made again. Returns the retried sandbox and those set aside.
async fn create_retried_onto(stack: &Stack, bad: HostId, good: HostId) -> (String, Vec<String>) {
    let mut aside = Vec::new();
    loop {
        let id = created(stack).await;
        stack.wait_state(&id, "running").await;
        assert_eq!(host_of(stack, &id).await, good.as_uuid());
        match tries(&stack.db, &id).await {
            (1, 0) if aside.len() < BUSY_RETRIES => aside.push(id),
            tried => {
                assert_eq!(tried, (2, 1), "first {bad}, then {good}");
                let message: Option<String> = sqlx::query_scalar(
                    "SELECT message FROM events
                      WHERE sandbox_id = $1::uuid AND reason = 'retried_elsewhere'",
                )
                .bind(&id)
                .fetch_one(&stack.db)
                .await
                .unwrap();
                let message = message.unwrap_or_default();
                assert!(
                    message.contains(INJECTED)
                        && message.contains(&format!("host {bad}"))
                        && message.contains(&format!("retried on {good}")),
                    "{message}"
                );
                return (id, aside);
            }
        }
    }
}

/// How many creates [`create_retried_onto`] sets aside before it fails.
const BUSY_RETRIES: usize = 3;

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_host_whose_runtime_fails_every_run_is_degraded_avoided_retried_around_and_probed_back(
    db: PgPool,
) {
    // A long back-off: the probe comes only when the test makes it due (the store's drill),
    // so no step races a timer on a loaded machine.
    let pass = PassConfig {
        health: HealthConfig {
            policy: HealthPolicy {
                degrade_after: 2,
                initial_backoff: Duration::from_secs(600),
                max_backoff: Duration::from_secs(3600),
                ..HealthPolicy::default()
            },
            ..HealthConfig::default()
        },
        ..PassConfig::default()
    };
    let mut stack = Stack::start_with(db, 0, pass).await;
    let admin = berth_api::auth::create_admin_key(&stack.db).await.unwrap();
    // The failing host offers far more than the other, so it is always the emptiest: every
    // create is placed there first unless placement avoids it.
    let wrapper = stack.root.join("faulty-runc");
    let path = runc_wrapper(&wrapper);
    std::fs::write(wrapper.join("fail-run"), b"").unwrap();
    let bad = stack
        .add_host_env(
            (Some(64), Some(65536)),
            &[],
            None,
            vec![("PATH".to_owned(), path)],
        )
        .await;
    let good = stack.add_host_with((Some(8), Some(8192))).await;
    let (bad, good) = (stack.hosts[bad].host_id, stack.hosts[good].host_id);

    // A request's own fault (a template registered but that no host has): failed-start at
    // once, never retried, and not held against the host.
    templates::upsert(
        &stack.db,
        &TemplateRow {
            name: "ghost".into(),
            description: "registered, but on no host".into(),
            runtime: "runc".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let (status, body) = create(&stack, "ghost", 256).await;
    assert_eq!(status, 202, "{body}");
    let ghost = body["id"].as_str().unwrap().to_owned();
    let failed = stack.wait_state(&ghost, "failed-start").await;
    assert!(
        failed["state_reason"]
            .as_str()
            .unwrap_or_default()
            .contains("unknown template"),
        "{failed}"
    );
    assert_eq!(host_of(&stack, &ghost).await, bad.as_uuid());
    assert_eq!(tries(&stack.db, &ghost).await, (1, 0), "not retried");
    let health = health_of(&stack, &admin, bad).await;
    assert_eq!(
        (&health["condition"], &health["consecutive_failures"]),
        (&json!("healthy"), &json!(0)),
        "{health}"
    );

    // The host's own failures: each create is retried once on the other host and runs there;
    // the second in a row degrades the host.
    let (first, mut aside) = create_retried_onto(&stack, bad, good).await;
    assert_eq!(
        health_of(&stack, &admin, bad).await["consecutive_failures"],
        1
    );
    let (second, more) = create_retried_onto(&stack, bad, good).await;
    aside.extend(more);
    let health = health_of(&stack, &admin, bad).await;
    assert_eq!(health["condition"], "degraded", "{health}");
    assert_eq!(health["consecutive_failures"], 2, "{health}");
    assert!(health["probe_at"].is_string(), "{health}");
    assert!(
        health["reason"]
            .as_str()
            .unwrap_or_default()
            .contains(INJECTED),
        "{health}"
    );
    assert_eq!(
        health_of(&stack, &admin, good).await["condition"],
        "healthy"
    );

    // Degraded: the next create goes straight to the healthy host.
    let third = created(&stack).await;
    stack.wait_state(&third, "running").await;
    assert_eq!(host_of(&stack, &third).await, good.as_uuid());
    assert_eq!(
        tries(&stack.db, &third).await,
        (1, 0),
        "placed on the good host"
    );

    // Its probe comes due while the runtime still fails: the probe create goes to it first,
    // fails, is retried on the good host, and the back-off doubles.
    let probe_was = health_of(&stack, &admin, bad).await["probe_at"].clone();
    assert!(host_health::make_probe_due(&stack.db, bad).await.unwrap());
    // A probe is never passed over as busy: it is the first create after the back-off.
    let (probe, none) = create_retried_onto(&stack, bad, good).await;
    assert!(none.is_empty(), "the probe went to the degraded host first");
    let health = health_of(&stack, &admin, bad).await;
    assert_eq!(health["condition"], "degraded", "{health}");
    assert_ne!(health["probe_at"], probe_was, "a later probe: {health}");
    let backoff_ms: i64 = sqlx::query_scalar("SELECT health_backoff_ms FROM hosts WHERE id = $1")
        .bind(bad)
        .fetch_one(&stack.db)
        .await
        .unwrap();
    assert_eq!(backoff_ms, 1_200_000, "600 s doubled");

    // The runtime is repaired; the next probe runs there and the host is healthy again.
    std::fs::remove_file(wrapper.join("fail-run")).unwrap();
    assert!(host_health::make_probe_due(&stack.db, bad).await.unwrap());
    let healed = created(&stack).await;
    stack.wait_state(&healed, "running").await;
    assert_eq!(host_of(&stack, &healed).await, bad.as_uuid());
    let health = health_of(&stack, &admin, bad).await;
    assert_eq!(
        (&health["condition"], &health["consecutive_failures"]),
        (&json!("healthy"), &json!(0)),
        "{health}"
    );
    assert!(health["probe_at"].is_null(), "{health}");

    // The gauge and the counters the alert and dashboards read (the recorder is the test
    // process's: other tests' stacks add to counters and set gauges too, so counters are
    // read as lower bounds and the gauge by name).
    berth_reconciler::gauges::record_fleet(&stack.db)
        .await
        .unwrap();
    let metrics = stack
        .http
        .get(stack.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |series: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{series} in\n{metrics}"))
    };
    assert!(value("berth_create_retries_total{result=\"moved\"}") >= 3.0);
    assert!(value("berth_host_condition_changes_total{to=\"degraded\"}") >= 1.0);
    assert!(value("berth_host_condition_changes_total{to=\"healthy\"}") >= 1.0);
    assert!(value("berth_host_boot_outcomes_total{outcome=\"failed\"}") >= 3.0);
    value("berth_hosts_by_condition{condition=\"degraded\"}");

    let all: Vec<&String> = [&first, &second, &third, &probe, &healed, &ghost]
        .into_iter()
        .chain(&aside)
        .collect();
    for id in &all {
        assert_eq!(stack.delete(id).await.0, 202);
    }
    for id in all {
        stack.wait_state(id, "deleted").await;
        // The failing host buries its failed create's record on the delete the retry sent it.
        eventually("nothing of the sandbox is left on either host", || async {
            stack.leftovers(id).is_empty()
        })
        .await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// Freezes every hostd, waits until no heartbeat of theirs can still land, then ages their
/// `last_seen` by a minute (past the 15 s placement window, short of the lost threshold): what
/// a control-plane outage leaves.
async fn stale_hosts(stack: &Stack) {
    for host in &stack.hosts {
        host.freeze();
    }
    let ids: Vec<HostId> = stack.hosts.iter().map(|h| h.host_id).collect();
    // A heartbeat sent just before the freeze lands within a moment; wait until every row is
    // older than a few heartbeat intervals.
    let quiet = berth_hostd::DEFAULT_HEARTBEAT_INTERVAL * 3;
    eventually("every frozen host's last heartbeat is old", || {
        let (db, ids) = (stack.db.clone(), ids.clone());
        async move {
            let ages: Vec<f64> = sqlx::query_scalar(
                "SELECT EXTRACT(EPOCH FROM now() - last_seen)::float8 FROM hosts
                  WHERE id = ANY($1)",
            )
            .bind(ids.iter().map(|h| h.as_uuid()).collect::<Vec<Uuid>>())
            .fetch_all(&db)
            .await
            .unwrap();
            ages.iter().all(|a| *a > quiet.as_secs_f64())
        }
    })
    .await;
    let aged = host_health::backdate_heartbeats(&stack.db, &ids, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(aged, ids.len() as u64);
}

async fn thaw_and_wait_fresh(stack: &Stack) {
    for host in &stack.hosts {
        host.thaw();
    }
    let ids: Vec<Uuid> = stack.hosts.iter().map(|h| h.host_id.as_uuid()).collect();
    eventually("every host's heartbeat is fresh again", || {
        let (db, ids) = (stack.db.clone(), ids.clone());
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM hosts WHERE id = ANY($1) AND last_seen > now() - interval '5 s'",
            )
            .bind(ids)
            .fetch_one(&db)
            .await
            .unwrap()
                == 2
        }
    })
    .await;
}

async fn sandbox_count(db: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM sandboxes")
        .fetch_one(db)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn stale_heartbeats_get_unavailable_with_retry_after_and_only_a_full_fleet_no_capacity(
    db: PgPool,
) {
    // Two hosts of 512 MiB each: room for one 512 MiB sandbox apiece.
    let mut stack = Stack::start(db, 0).await;
    stack.add_host_with((Some(2), Some(512))).await;
    stack.add_host_with((Some(2), Some(512))).await;

    // Hosts with room whose heartbeats the control plane could not write: 503 `unavailable`
    // with Retry-After, nothing written.
    stale_hosts(&stack).await;
    let before = sandbox_count(&stack.db).await;
    let resp = stack
        .http
        .post(stack.url("/v1/sandboxes"))
        .bearer_auth(&stack.key)
        .json(&json!({"template": "base", "vcpus": 1, "memory_mib": 512}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    let retry_after: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_after >= 1, "{retry_after}");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    assert_eq!(sandbox_count(&stack.db).await, before, "nothing written");

    // Heartbeats land again: the same create is placed and runs.
    thaw_and_wait_fresh(&stack).await;
    let mut full = Vec::new();
    for _ in 0..2 {
        let (status, body) = create(&stack, "base", 512).await;
        assert_eq!(status, 202, "{body}");
        full.push(body["id"].as_str().unwrap().to_owned());
    }
    for id in &full {
        stack.wait_state(id, "running").await;
    }

    // A fleet that really is full says `no_capacity`, with fresh data and with stale.
    let (status, body) = create(&stack, "base", 512).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (503, &json!("no_capacity")),
        "{body}"
    );
    stale_hosts(&stack).await;
    let (status, body) = create(&stack, "base", 512).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (503, &json!("no_capacity")),
        "{body}"
    );
    thaw_and_wait_fresh(&stack).await;

    for id in &full {
        assert_eq!(stack.delete(id).await.0, 202);
    }
    for id in &full {
        stack.wait_state(id, "deleted").await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}
