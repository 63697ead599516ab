//! `berth bench --runtime sim`: the control plane at fleet size on one machine.
//!
//! Starts a private stack in this process — a fresh database (created here on `DATABASE_URL`,
//! or on a private Postgres), NATS (`NATS_URL` or a private `nats-server`) with a subject
//! prefix of its own, the API with its relay, the scheduler's heartbeat consumer, the
//! reconciler's result consumer, and `--hosts` hostd on the `sim` runtime — then measures:
//!
//! - heartbeat ingest: heartbeats applied per second (the scheduler's
//!   `berth_heartbeats_total{outcome="applied"}`), idle and while creating;
//! - placement under load: `POST /v1/sandboxes` latency while creating `--sandboxes` at
//!   `--rate` per second (the request commits row, placement, command and event);
//! - the reconciler pass ([`berth_reconciler::pass::run_pass`] under the real lease) at that
//!   size, `--passes` times, while heartbeats keep arriving;
//! - what the reconciler did to a loaded fleet: its periodic pass also runs (every default
//!   interval) while the creates and the lifecycle commands load the control plane, and the
//!   bench prints how many guests all passes failed, how many of those were alive (false
//!   failures, witnessed by the sim runtime), and how many containers they compensated as
//!   orphans ([`super::verdict`]);
//! - `GET /v1/sandboxes` latency: a page of 50, a page filtered by state, the next page;
//! - sustained lifecycle commands per second: stop, start and delete of
//!   `--lifecycle-sandboxes` sandboxes, each phase as fast as the API accepts, timed until the
//!   database shows every sandbox in the target state.
//!
//! The reconciler's own leader loop is not run: the bench runs the passes itself, under the
//! reconciler's lease, so it can read their reports.
//! The sim hosts' state dirs live on tmpfs (`--sim-hosts-dir`): one disk shared by hundreds of
//! simulated hosts would measure that disk's fsync rate, not the control plane.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use berth_schemas::wire::Resources;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use berth::stack::{Pools, Reconciler, Stack, StackConfig};

use super::verdict::{verdict, PassLoop};

/// The share of the heartbeats sent that applied ones must reach to count as keeping up (the
/// two rates are counted over slightly different windows).
const HEARTBEAT_KEEPS_UP: f64 = 0.95;
use super::private::Private;
use super::{ms, Client, Samples};

/// What every sim host offers: far more than the sandboxes placed on it need, so placement
/// measures its query and not a capacity refusal.
const SIM_HOST_CAPACITY: Resources = Resources {
    vcpus: 4096,
    memory_mib: 4 * 1024 * 1024,
};
/// How long the bench waits for every host's first heartbeat.
const HOSTS_READY_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a phase may take to settle before the bench gives up.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(1800);
/// How often the database is polled while a phase settles.
const SETTLE_POLL: Duration = Duration::from_millis(100);
/// The idle window over which heartbeat ingest is measured before any load.
const IDLE_HEARTBEAT_WINDOW: Duration = Duration::from_secs(10);
/// Samples of each `GET /v1/sandboxes` variant and of sim exec.
const READ_SAMPLES: usize = 200;
/// Sandbox size in the scale bench.
const SANDBOX_VCPUS: u32 = 1;
const SANDBOX_MEMORY_MIB: u32 = 128;

/// Settings of one scale run (from `berth bench` flags).
pub struct ScaleArgs {
    pub hosts: usize,
    pub sandboxes: usize,
    pub rate: f64,
    pub concurrency: usize,
    pub sim_boot: Duration,
    pub heartbeat_interval: Duration,
    pub lifecycle_sandboxes: usize,
    pub result_concurrency: usize,
    pub passes: usize,
    pub state_dir: PathBuf,
    pub sim_hosts_dir: PathBuf,
    pub database_url: Option<String>,
    pub nats_url: Option<String>,
    pub keep_database: bool,
}

/// Runs the scale bench and prints its table.
pub async fn run(args: ScaleArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.state_dir)?;
    let state_dir = std::path::absolute(&args.state_dir)?;
    let shutdown = crate::shutdown_on_signal();
    let result = async {
        let private = Private::open(
            "bench",
            &state_dir,
            args.database_url.as_deref(),
            args.nats_url.as_deref(),
            &shutdown,
        )
        .await?;
        let (url, nats) = (&private.database_url, &private.nats_url);
        let outcome = measure(&args, url, nats, &private.subjects, &shutdown).await;
        private.close(args.keep_database).await;
        outcome
    }
    .await;
    let _ = std::fs::remove_dir_all(&args.sim_hosts_dir);
    result
}

/// Histograms printed after the table (mean per observation, summed over labels): where the
/// time of each figure went.
const PROFILE_HISTOGRAMS: &[&str] = &[
    "berth_http_request_duration_seconds",
    "berth_outbox_publish_duration_seconds",
    "berth_result_apply_duration_seconds",
    "berth_command_latency_seconds",
    "berth_hostd_runtime_operation_duration_seconds",
    "berth_reconciler_pass_duration_seconds",
    "berth_event_publish_duration_seconds",
];

/// `(count, mean seconds)` of each histogram in [`PROFILE_HISTOGRAMS`] with observations.
fn profile(prometheus: &metrics_exporter_prometheus::PrometheusHandle) -> Vec<(String, f64, f64)> {
    let text = prometheus.render();
    let total = |name: &str, suffix: &str| -> f64 {
        text.lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .and_then(|r| r.strip_prefix(suffix))
                    .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    PROFILE_HISTOGRAMS
        .iter()
        .filter_map(|name| {
            let count = total(name, "_count");
            (count > 0.0).then(|| (name.to_string(), count, total(name, "_sum") / count))
        })
        .collect()
}

/// `(observations, seconds)` of each step of the reconciler's pass so far, by step name
/// (`berth_reconciler_step_duration_seconds{step}`, read from the process's recorder).
fn pass_steps(
    prometheus: &metrics_exporter_prometheus::PrometheusHandle,
) -> std::collections::BTreeMap<String, (f64, f64)> {
    let mut steps = std::collections::BTreeMap::<String, (f64, f64)>::new();
    for line in prometheus.render().lines() {
        let Some(rest) = line.strip_prefix("berth_reconciler_step_duration_seconds_") else {
            continue;
        };
        let (series, value) = rest.rsplit_once(' ').unwrap_or_default();
        let (Some((kind, labels)), Ok(value)) = (series.split_once('{'), value.parse::<f64>())
        else {
            continue;
        };
        let Some(step) = labels
            .split(',')
            .find_map(|l| l.strip_prefix("step=\""))
            .and_then(|l| l.split('"').next())
        else {
            continue;
        };
        let entry = steps.entry(step.to_owned()).or_default();
        match kind {
            "count" => entry.0 += value,
            "sum" => entry.1 += value,
            _ => {}
        }
    }
    steps
}

/// The scheduler's applied-heartbeat counter, read from the process's recorder.
fn heartbeats_applied(prometheus: &metrics_exporter_prometheus::PrometheusHandle) -> f64 {
    prometheus
        .render()
        .lines()
        .find(|l| l.starts_with("berth_heartbeats_total{") && l.contains("outcome=\"applied\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

async fn count_in_state(db: &sqlx::PgPool, state: &str) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE state = $1")
            .bind(state)
            .fetch_one(db)
            .await?,
    )
}

/// Waits until at least `n` sandboxes are in `state`; returns when that was seen.
async fn settle(db: &sqlx::PgPool, state: &str, n: i64) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        let have = count_in_state(db, state).await?;
        if have >= n {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            bail!("only {have} of {n} sandboxes reached {state}");
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
}

/// Sends one request per path with at most `concurrency` in flight, each at most `rate` per
/// second after `started` (unlimited when `rate` is infinite); returns request latencies and
/// the response bodies.
async fn fire(
    client: &Arc<Client>,
    method: reqwest::Method,
    paths: Vec<String>,
    body: Option<serde_json::Value>,
    rate: f64,
    concurrency: usize,
) -> anyhow::Result<(Samples, Vec<serde_json::Value>, usize)> {
    let limit = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let started = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, path) in paths.into_iter().enumerate() {
        if rate.is_finite() {
            tokio::time::sleep_until(started + Duration::from_secs_f64(i as f64 / rate)).await;
        }
        let permit = limit.clone().acquire_owned().await?;
        let (client, method, body) = (client.clone(), method.clone(), body.clone());
        tasks.spawn(async move {
            let t = Instant::now();
            let sent = client.send(method, &path, body).await;
            drop(permit);
            (t.elapsed(), sent)
        });
    }
    let mut latency = Samples::default();
    let mut bodies = Vec::new();
    let mut failed = 0;
    while let Some(joined) = tasks.join_next().await {
        let (d, sent) = joined?;
        match sent {
            Ok((status, body)) if (200..300).contains(&status) => {
                latency.push(d);
                bodies.push(body);
            }
            Ok((status, body)) => {
                if failed < 3 {
                    eprintln!("request failed: {status} {body}");
                }
                failed += 1;
            }
            Err(e) => {
                if failed < 3 {
                    eprintln!("request failed: {e:#}");
                }
                failed += 1;
            }
        }
    }
    Ok((latency, bodies, failed))
}

async fn measure(
    args: &ScaleArgs,
    database_url: &str,
    nats_url: &str,
    subjects: &berth_schemas::Subjects,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let prometheus = berth_api::metrics::handle();
    // One pool per component, as when each runs as its own process.
    let pools = Pools {
        api: crate::connect_db(database_url).await?,
        scheduler: crate::connect_db(database_url).await?,
        reconciler: crate::connect_db_with(
            database_url,
            16.max(u32::try_from(args.result_concurrency)? + 8),
        )
        .await?,
    };
    let db = pools.api.clone();
    // Heartbeats rewrite every host row every few seconds: without autovacuum the `hosts`
    // table bloats (726 MB for 1,000 rows after 30 min here) and every placement scan with it.
    let autovacuum: String = sqlx::query_scalar("SHOW autovacuum").fetch_one(&db).await?;
    if autovacuum != "on" {
        eprintln!(
            "warning: this Postgres runs with autovacuum {autovacuum}: the hosts table bloats \
             under heartbeats and placement slows with it; figures are not comparable"
        );
    }
    let listen = "127.0.0.1:0".parse().expect("a socket address");
    let mut config = StackConfig::new(nats_url, subjects.clone(), listen);
    // No leader loop: the bench runs the passes (periodic while loading, then measured).
    config.reconciler = Reconciler::ResultsOnly(args.result_concurrency);
    // One key from one address drives the whole fleet: no request rate limits.
    config.api.limits = berth_api::limits::LimitsConfig::without_rate_limits();
    for i in 0..args.hosts {
        let mut host = berth_hostd::HostdConfig::new(
            nats_url.to_owned(),
            subjects.clone(),
            args.sim_hosts_dir.join(i.to_string()),
            format!("sim-{i}"),
        );
        host.runtimes = vec![berth_hostd::runtime::sim::SIM.to_owned()];
        host.sim_boot = args.sim_boot;
        host.capacity = SIM_HOST_CAPACITY;
        host.heartbeat_interval = args.heartbeat_interval;
        config.hosts.push(host);
    }
    let setup_started = Instant::now();
    let mut stack = Stack::start(config, pools, shutdown).await?;
    let (_, key) = berth_api::auth::create_org(&db, "bench").await?;
    let client = Arc::new(Client::new(stack.api_url(), key, "scale".into()));

    let outcome = async {
        // Every host heard from.
        stack
            .wait_for_hosts(args.hosts, HOSTS_READY_TIMEOUT, shutdown)
            .await?;
        let setup = setup_started.elapsed();
        eprintln!("{} sim hosts up in {:.1} s", args.hosts, setup.as_secs_f64());

        // Heartbeat ingest, idle.
        let hb0 = heartbeats_applied(&prometheus);
        tokio::time::sleep(IDLE_HEARTBEAT_WINDOW).await;
        let hb_idle = (heartbeats_applied(&prometheus) - hb0) / IDLE_HEARTBEAT_WINDOW.as_secs_f64();

        // The reconciler's lease for the whole run: its periodic pass runs while the fleet is
        // loaded, as a leader's would.
        let lease = berth_store::leases::acquire(
            &db,
            berth_reconciler::LEASE_NAME,
            uuid::Uuid::now_v7(),
            super::verdict::LEASE_TTL,
        )
        .await?
        .context("reconciler lease taken by someone else")?;
        let pass_config = berth_reconciler::pass::PassConfig::default();
        let reports = Arc::new(std::sync::Mutex::new(Vec::new()));
        let periodic = PassLoop::start(db.clone(), pass_config.clone(), lease, reports.clone());

        // Creates at the controlled rate.
        let hb0 = heartbeats_applied(&prometheus);
        let create_started = Instant::now();
        let body = json!({"template": "base", "vcpus": SANDBOX_VCPUS, "memory_mib": SANDBOX_MEMORY_MIB});
        let (create_latency, created, create_failed) = fire(
            &client,
            reqwest::Method::POST,
            vec!["/v1/sandboxes".to_owned(); args.sandboxes],
            Some(body),
            args.rate,
            args.concurrency,
        )
        .await?;
        let sent = create_started.elapsed();
        let hb_load = (heartbeats_applied(&prometheus) - hb0) / sent.as_secs_f64();
        let all_running = settle(&db, "running", created.len() as i64).await?;
        let create_total = all_running - create_started;
        eprintln!(
            "{} creates sent in {:.1} s, all running after {:.1} s",
            created.len(),
            sent.as_secs_f64(),
            create_total.as_secs_f64()
        );
        let ids: Vec<String> = created
            .iter()
            .filter_map(|b| b["id"].as_str().map(str::to_owned))
            .collect();

        // Let every host report its full inventory before the passes.
        periodic.stop().await?;
        tokio::time::sleep(args.heartbeat_interval * 2).await;
        let lease = super::verdict::renew(&db, lease).await?;
        let mut pass = Samples::default();
        let mut pass_actions = Vec::new();
        let steps_before = pass_steps(&prometheus);
        for _ in 0..args.passes {
            let t = Instant::now();
            let report = berth_reconciler::pass::run_pass(&db, &pass_config, &lease).await?;
            pass.push(t.elapsed());
            reports.lock().unwrap_or_else(|e| e.into_inner()).push(report.clone());
            pass_actions.push(
                report
                    .actions
                    .iter()
                    .filter(|(_, n)| *n > 0)
                    .map(|(a, n)| format!("{}={n}", a.as_str()))
                    .collect::<Vec<_>>()
                    .join(","),
            );
        }

        let steps: Vec<(String, f64)> = pass_steps(&prometheus)
            .into_iter()
            .map(|(step, (n, secs))| {
                let (n0, secs0) = steps_before.get(&step).copied().unwrap_or_default();
                let mean_ms = if n > n0 { (secs - secs0) / (n - n0) * 1000.0 } else { 0.0 };
                (step, mean_ms)
            })
            .collect();

        // Reads.
        let mut list_page = Samples::default();
        let mut list_filtered = Samples::default();
        let mut list_next = Samples::default();
        let (_, first) = client
            .send(reqwest::Method::GET, "/v1/sandboxes?limit=50", None)
            .await?;
        // With 50 sandboxes or fewer there is no second page to time.
        let cursor = first["next_cursor"].as_str().map(str::to_owned);
        for _ in 0..READ_SAMPLES {
            let mut reads = vec![
                (&mut list_page, "/v1/sandboxes?limit=50".to_owned()),
                (
                    &mut list_filtered,
                    "/v1/sandboxes?state=running&limit=50".to_owned(),
                ),
            ];
            if let Some(cursor) = &cursor {
                reads.push((
                    &mut list_next,
                    format!("/v1/sandboxes?limit=50&cursor={cursor}"),
                ));
            }
            for (samples, path) in reads {
                let t = Instant::now();
                let (status, page) = client.send(reqwest::Method::GET, &path, None).await?;
                if status != 200 {
                    bail!("{path}: {status} {page}");
                }
                samples.push(t.elapsed());
            }
        }
        let mut exec = Samples::default();
        for id in ids.iter().take(READ_SAMPLES) {
            let t = Instant::now();
            let (status, out) = client
                .send(
                    reqwest::Method::POST,
                    &format!("/v1/sandboxes/{id}/exec"),
                    Some(json!({"cmd": ["echo", "hi"]})),
                )
                .await?;
            if status != 200 || out["stdout"] != "hi\n" {
                bail!("sim exec failed: {status} {out}");
            }
            exec.push(t.elapsed());
        }

        // Sustained lifecycle commands: stop, start, delete of a slice, each phase unthrottled,
        // with the periodic pass running.
        let periodic = PassLoop::start(db.clone(), pass_config.clone(), lease, reports.clone());
        let slice: Vec<&String> = ids.iter().take(args.lifecycle_sandboxes).collect();
        let mut phases = Vec::new();
        for (name, method, suffix, state) in [
            ("stop", reqwest::Method::POST, "/stop", "stopped"),
            ("start", reqwest::Method::POST, "/start", "running"),
            ("delete", reqwest::Method::DELETE, "", "deleted"),
        ] {
            let baseline = if state == "running" {
                count_in_state(&db, "running").await?
            } else {
                0
            };
            let paths = slice
                .iter()
                .map(|id| format!("/v1/sandboxes/{id}{suffix}"))
                .collect();
            let t = Instant::now();
            let (latency, accepted, failed) = fire(
                &client,
                method,
                paths,
                None,
                f64::INFINITY,
                args.concurrency,
            )
            .await?;
            let done = settle(&db, state, baseline + accepted.len() as i64).await?;
            let elapsed = done - t;
            phases.push((name, latency, accepted.len(), failed, elapsed));
        }
        periodic.stop().await?;
        berth_store::leases::release(&db, &lease).await?;
        let reports = std::mem::take(&mut *reports.lock().unwrap_or_else(|e| e.into_inner()));
        let judged = verdict(&db, &reports).await?;
        let lifecycle_total: Duration = phases.iter().map(|p| p.4).sum();
        let lifecycle_commands: usize = phases.iter().map(|p| p.2).sum();

        let total: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes")
            .fetch_one(&db)
            .await?;
        println!(
            "sim scale: {} hosts, {} sandboxes created ({} failed) at {:.0}/s offered, {} in flight, sim boot {} ms, heartbeat every {} ms; {} sandbox rows at the end",
            args.hosts,
            created.len(),
            create_failed,
            args.rate,
            args.concurrency,
            args.sim_boot.as_millis(),
            args.heartbeat_interval.as_millis(),
            total
        );
        println!();
        println!("| measure | n | p50 ms | p95 ms | p99 ms | max ms | rate /s |");
        println!("|---|---|---|---|---|---|---|");
        let row = |name: &str, s: &Samples, rate: Option<f64>| {
            println!(
                "| {name} | {} | {} | {} | {} | {} | {} |",
                s.0.len(),
                ms(s.quantile(0.5)),
                ms(s.quantile(0.95)),
                ms(s.quantile(0.99)),
                ms(s.quantile(1.0)),
                rate.map(|r| format!("{r:.0}")).unwrap_or_else(|| "—".into())
            );
        };
        let none = Samples::default();
        let expected = args.hosts as f64 / args.heartbeat_interval.as_secs_f64();
        println!("| heartbeats applied, idle (sent: {expected:.0}/s) | — | — | — | — | — | {hb_idle:.0} |");
        println!("| heartbeats applied, while creating | — | — | — | — | — | {hb_load:.0} |");
        row(
            "create request (placement tx) under load",
            &create_latency,
            Some(created.len() as f64 / create_total.as_secs_f64()),
        );
        row("reconciler pass (run_pass)", &pass, None);
        row("GET /v1/sandboxes?limit=50", &list_page, None);
        row("GET /v1/sandboxes?state=running&limit=50", &list_filtered, None);
        row("GET /v1/sandboxes?limit=50&cursor=… (page 2)", &list_next, None);
        row("exec round trip (sim echo)", &exec, None);
        for (name, latency, accepted, failed, elapsed) in &phases {
            row(
                &format!("{name} ×{accepted} ({failed} refused): request, and all settled"),
                latency,
                Some(*accepted as f64 / elapsed.as_secs_f64()),
            );
        }
        row(
            "lifecycle commands sustained (stop+start+delete)",
            &none,
            Some(lifecycle_commands as f64 / lifecycle_total.as_secs_f64()),
        );
        println!();
        println!("pass actions: {}", pass_actions.join(" | "));
        println!();
        println!("| reconciler under load ({} passes: periodic while creating and in the lifecycle phases, and the measured ones) | n |", judged.passes);
        println!("|---|---|");
        println!("| guests failed | {} |", judged.guest_failures);
        println!("| false failures (failed while the sim guest was alive) | {} |", judged.false_failures);
        println!("| creates and starts timed out | {} |", judged.boot_timeouts);
        println!("| false timeouts (timed out while the sim guest was alive) | {} |", judged.false_timeouts);
        println!("| orphans stopped | {} |", judged.orphans_stopped);
        println!("| orphans destroyed | {} |", judged.orphans_destroyed);
        println!("| most hosts one pass left alone (evidence too old) | {} |", judged.most_stale_hosts);
        println!("| most guest failures one pass's circuit breaker held | {} |", judged.most_held);
        let sustained = lifecycle_commands as f64 / lifecycle_total.as_secs_f64();
        let p50 = |s: &Samples| super::targets::in_ms(s.quantile(0.5));
        use super::targets::{Goal, Target};
        super::targets::print(
            "target (issue 16, sim)",
            &[
                Target::new("lifecycle commands/s sustained", Goal::MinPerSec(1000.0), Some(sustained), format!("{} false failures, {} false timeouts (target: none)", judged.false_failures, judged.false_timeouts)),
                Target::new("reconciler pass p50", Goal::MaxMs(500.0), p50(&pass), format!("{} hosts, {} sandbox rows", args.hosts, total)),
                Target::new("heartbeats applied while creating", Goal::MinPerSec(expected * HEARTBEAT_KEEPS_UP), Some(hb_load), format!("{expected:.0}/s sent; within 5% keeps up")),
                Target::new("GET /v1/sandboxes?state=running p50", Goal::MaxMs(10.0), p50(&list_filtered), ""),
            ],
        );
        println!();
        println!("| step of the measured passes (`berth_reconciler_step_duration_seconds`) | mean ms |");
        println!("|---|---|");
        for (step, mean_ms) in &steps {
            println!("| {step} | {mean_ms:.1} |");
        }
        println!();
        println!("| profile (whole run) | observations | mean ms |");
        println!("|---|---|---|");
        for (name, count, mean) in profile(&prometheus) {
            println!("| {name} | {count:.0} | {:.2} |", mean * 1000.0);
        }
        Ok(())
    }
    .await;
    stack.stop().await;
    outcome
}
