//! `berth bench`: lifecycle latency and throughput of a running stack, measured against floors
//! taken in the same run (a raw `runc run`, a raw Postgres commit, a raw JetStream publish with
//! ack), printed as one markdown table.
//!
//! Latencies are observed from the client without polling: a request is sent, then
//! `GET /v1/sandboxes/{id}/wait?state=…` answers when the database notifies the state change.
//! Time to interactive is a create with `?wait=running`, then the first exec, answered. The
//! bench is a well-behaved client of the API's rate limits: a `429` is retried after its
//! `Retry-After`, and the count of such waits is printed (a figure that waited is then not a
//! latency of the stack).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Value};

mod cleanup;
mod failover;
mod floors;
mod podman;
mod preview;
mod private;
mod real;
mod scale;
mod snapshots;
mod storage;
mod targets;
mod verdict;
mod warm;

/// How many times one request is retried after a `429`.
const THROTTLE_RETRIES: usize = 20;
/// How long one transition may take before the bench gives up.
const TRANSITION_TIMEOUT: Duration = Duration::from_secs(120);
/// Raw floor samples per kind.
const FLOOR_SAMPLES: usize = 20;
/// Postgres and JetStream floor samples (cheap, so more).
const CHEAP_FLOOR_SAMPLES: usize = 200;
/// The longest wait the API grants, in seconds (`berth_api::service::wait::MAX_WAIT_TIMEOUT`).
const MAX_WAIT_SECS: u64 = berth_api::service::wait::MAX_WAIT_TIMEOUT.as_secs();

/// Flags of `berth bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The state dir of a `berth dev` stack (for its `api-key` and `stack.env`).
    #[arg(long, env = "BERTH_STATE_DIR", default_value = ".berth")]
    state_dir: PathBuf,
    /// API base URL; default from `<state dir>/stack.env`.
    #[arg(long, env = "BERTH_API")]
    api: Option<String>,
    /// API key; default from `<state dir>/api-key`.
    #[arg(long, env = "BERTH_API_KEY")]
    key: Option<String>,
    /// Sandboxes to take through the whole lifecycle, one after another (samples per figure
    /// in the `--snapshots` and `--storage` modes, sandboxes in the scale mode, failovers in
    /// the `--failover` mode). Default: 20, and 3 with `--failover`.
    #[arg(long)]
    sandboxes: Option<usize>,
    /// Sandboxes created at once in the throughput phase. The default fits `deploy/up`'s stack
    /// on a 2-core machine (two hosts of 2 vCPUs, 4× overcommitted: 16 slots, two taken by its
    /// hello and python sandboxes); more than the stack's free slots fails with `no_capacity`.
    #[arg(long, default_value_t = 12)]
    burst: usize,
    /// The template the bench's sandboxes are created from.
    #[arg(long, default_value = "base")]
    template: String,
    /// Postgres for the commit floor; default from `stack.env`.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// NATS for the publish floor; default from `stack.env`.
    #[arg(long, env = "NATS_URL")]
    nats_url: Option<String>,
    /// `sim`: the scale mode — a private stack in this process with `--hosts` sim hosts and
    /// `--sandboxes` sandboxes (see `bench/scale.rs`); unset: measure the running stack.
    #[arg(long)]
    runtime: Option<String>,
    /// Scale mode: sim hosts to run in this process.
    #[arg(long, default_value_t = 100)]
    hosts: usize,
    /// Scale mode: creates offered per second.
    #[arg(long, default_value_t = 500.0)]
    rate: f64,
    /// Scale mode: requests in flight at most.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Scale mode: simulated boot time of a sandbox, in milliseconds.
    #[arg(long, default_value_t = 10)]
    sim_boot_ms: u64,
    /// Scale mode: heartbeat interval of each sim host, in milliseconds (hostd's default).
    #[arg(long, default_value_t = berth_hostd::DEFAULT_HEARTBEAT_INTERVAL.as_millis() as u64)]
    heartbeat_ms: u64,
    /// Scale mode: sandboxes taken through stop, start and delete for the throughput figure.
    #[arg(long, default_value_t = 5000)]
    lifecycle_sandboxes: usize,
    /// Scale mode: host results the reconciler applies at once (its `--result-concurrency`).
    #[arg(long, default_value_t = berth_reconciler::results::APPLY_CONCURRENCY)]
    result_concurrency: usize,
    /// Scale mode: reconciler passes to time.
    #[arg(long, default_value_t = 5)]
    passes: usize,
    /// Scale mode: where the sim hosts keep their state (tmpfs, see `bench/scale.rs`).
    #[arg(long, default_value = "/dev/shm/berth-bench-sim")]
    sim_hosts_dir: PathBuf,
    /// Scale mode: keep the bench database afterwards (to `EXPLAIN ANALYZE` at that size).
    #[arg(long)]
    keep_database: bool,
    /// Measure only snapshots, forks and clones (`bench/snapshots.rs`), `--sandboxes` samples
    /// of each, on the running stack (its hosts need runc and runsc).
    #[arg(long)]
    snapshots: bool,
    /// Measure only archive, unarchive, backups and the migration of a gVisor sandbox
    /// (`bench/storage.rs`), `--sandboxes` samples of each, on the running stack (two hosts or
    /// more, runc and runsc, the object store at `BERTH_OBJECT_STORE`, else `<state dir>/objects`).
    #[arg(long)]
    storage: bool,
    /// Storage mode: MiB of random bytes each sandbox writes before it is archived or backed up.
    #[arg(long, default_value_t = 100)]
    storage_mib: u64,
    /// Storage mode: an operator key (to cordon and uncordon hosts); default: a new one made in
    /// the stack's database (`DATABASE_URL`, else `stack.env`).
    #[arg(long, env = "BERTH_ADMIN_KEY")]
    admin_key: Option<String>,
    /// The gVisor template taken through the lifecycle (memory stop and restore); empty: skip.
    #[arg(long, default_value = berth_hostd::template::BASE_GVISOR_TEMPLATE)]
    gvisor_template: String,
    /// Sandboxes of `--gvisor-template` taken through the lifecycle, one after another.
    #[arg(long, default_value_t = 5)]
    gvisor_sandboxes: usize,
    /// Berth-vs-Podman pairs (each a Berth create→running→exec→delete→deleted, then a Podman
    /// run → exec → rm of the same busybox rootfs); 0 skips the Podman column.
    #[arg(long, default_value_t = 10)]
    podman_pairs: usize,
    /// Samples of each raw runsc floor (run, run -d, checkpoint, restore).
    #[arg(long, default_value_t = 5)]
    runsc_floor_samples: usize,
    /// Measure only the host-loss failover (`bench/failover.rs`): a private stack in this
    /// process with two `berth hostd` children on runc; per sample a backed-up sandbox's host
    /// is frozen (SIGSTOP) until the sandbox runs on the other host. Needs root and runc; uses
    /// `DATABASE_URL` and `NATS_URL` (else private ones), like the scale mode.
    #[arg(long)]
    failover: bool,
    /// Failover mode: time between two reconciler passes (production's default).
    #[arg(long, default_value_t = berth_reconciler::pass::DEFAULT_INTERVAL.into())]
    failover_pass_interval: humantime::Duration,
    /// Failover mode: a host silent this long is `lost` (production: 5m). Shorter only moves
    /// the moment the failover is due, from which every figure is taken.
    #[arg(long, default_value = "5s")]
    failover_host_lost_after: humantime::Duration,
    /// Failover mode: a lost host's sandboxes fail over this much later (production: 10m).
    #[arg(long, default_value = "5s")]
    failover_after: humantime::Duration,
    /// Failover mode: below it, a dir per run holds the hostd children's state dirs, their
    /// logs and the local object store; removed afterwards (also when interrupted), but for
    /// the hostd logs after a failure (they say why).
    #[arg(long, default_value = "/var/tmp/berth-bench-failover")]
    failover_dir: PathBuf,
    /// The PID of the stack's process, for its CPU per create; default `BERTH_DEV_PID` from
    /// `stack.env` (written by `berth dev`).
    #[arg(long)]
    stack_pid: Option<u32>,
}

impl BenchArgs {
    /// `--sandboxes`, else [`DEFAULT_SANDBOXES`] (the failover mode has its own default).
    fn sandboxes(&self) -> usize {
        self.sandboxes.unwrap_or(DEFAULT_SANDBOXES)
    }
}

fn stack_env(state_dir: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(state_dir.join("stack.env"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect()
}

/// Latency samples of one operation, in seconds.
#[derive(Default)]
struct Samples(Vec<f64>);

impl Samples {
    fn push(&mut self, d: Duration) {
        self.0.push(d.as_secs_f64());
    }

    fn quantile(&self, q: f64) -> Option<f64> {
        if self.0.is_empty() {
            return None;
        }
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        let idx = ((v.len() - 1) as f64 * q).round() as usize;
        Some(v[idx])
    }
}

/// From this many samples on, a [`Row`] shows p90.
const P90_FROM: usize = 10;

/// One line of the table: a figure beside its floor.
struct Row<'a> {
    name: String,
    samples: &'a Samples,
    floor_name: &'a str,
    floor: &'a Samples,
}

impl<'a> Row<'a> {
    fn new(name: String, samples: &'a Samples, floor_name: &'a str, floor: &'a Samples) -> Self {
        Row {
            name,
            samples,
            floor_name,
            floor,
        }
    }

    /// The table of `rows` under its header, on stdout.
    fn print(rows: &[Row]) {
        println!(
            "| operation | n | p50 ms | p90 ms | floor | floor n | floor p50 ms | ratio p50 |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for row in rows {
            println!("{}", row.line());
        }
    }

    /// `| name | n | p50 | p90 | floor | floor n | floor p50 | ratio |`; p90 is `—` below
    /// [`P90_FROM`] samples, a floor without samples `n/a`.
    fn line(&self) -> String {
        let (s, f) = (self.samples, self.floor);
        let p90 = if s.0.len() >= P90_FROM {
            ms(s.quantile(0.9))
        } else {
            "—".into()
        };
        let ratio = ratio_p50(s, f);
        format!(
            "| {} | {} | {} | {p90} | {} | {} | {} | {ratio} |",
            self.name,
            s.0.len(),
            ms(s.quantile(0.5)),
            self.floor_name,
            f.0.len(),
            ms(f.quantile(0.5)),
        )
    }
}

/// `samples`' p50 over `floor`'s, as `3.2x`; `n/a` when either has none (or the floor is 0).
fn ratio_p50(samples: &Samples, floor: &Samples) -> String {
    targets::ratio(samples.quantile(0.5), floor.quantile(0.5))
        .map(|r| format!("{r:.1}x"))
        .unwrap_or_else(|| "n/a".into())
}

fn ms(v: Option<f64>) -> String {
    v.map(|s| format!("{:.1}", s * 1000.0))
        .unwrap_or_else(|| "n/a".into())
}

struct Client {
    http: reqwest::Client,
    api: String,
    key: String,
    /// Requests answered `429` and retried after their `Retry-After`.
    throttled: std::sync::atomic::AtomicU64,
    /// Every sandbox this run creates carries the metadata `berth-bench: <run_tag>`, so the run
    /// deletes what it made however it ends ([`Client::clean_up`]).
    run_tag: String,
    /// What this run made that [`Client::clean_up`] must undo (hosts cordoned, sandboxes made
    /// by clones and forks), shared by every client of the run.
    made: cleanup::RunMade,
}

/// The metadata key that marks a bench run's sandboxes.
const RUN_TAG_KEY: &str = "berth-bench";

/// The error of a bench stopped by SIGINT or SIGTERM (after its clean-up): `main` prints it as
/// one line, without a backtrace, and exits with 130.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted (SIGINT or SIGTERM)")
    }
}

impl std::error::Error for Interrupted {}

/// The exit code of an interrupted bench (128 + SIGINT, as a shell reports one).
pub const INTERRUPTED_EXIT: i32 = 130;

impl Client {
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<(u16, Value)> {
        let is_create = method == reqwest::Method::POST
            && (path == "/v1/sandboxes" || path.starts_with("/v1/sandboxes?"));
        let body = match body {
            Some(Value::Object(mut fields)) if is_create => {
                let metadata = fields.entry("metadata").or_insert_with(|| json!({}));
                if let Some(m) = metadata.as_object_mut() {
                    m.insert(RUN_TAG_KEY.into(), json!(self.run_tag));
                }
                Some(Value::Object(fields))
            }
            other => other,
        };
        for _ in 0..THROTTLE_RETRIES {
            let mut req = self
                .http
                .request(method.clone(), format!("{}{path}", self.api))
                .bearer_auth(&self.key);
            if let Some(b) = &body {
                req = req.json(b);
            }
            let resp = req.send().await?;
            let status = resp.status().as_u16();
            let retry_after = resp
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            let value = resp.json().await.unwrap_or(Value::Null);
            if method == reqwest::Method::POST && (200..300).contains(&status) {
                self.record_made(path, &value);
            }
            match (status, retry_after) {
                (429, Some(secs)) => {
                    self.throttled
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_secs(secs.max(1))).await;
                }
                _ => return Ok((status, value)),
            }
        }
        bail!("{path}: still 429 after {THROTTLE_RETRIES} retries")
    }

    /// Time to interactive: `POST /v1/sandboxes?wait=running` (the API answers once it runs,
    /// without polling), then the first exec answered. Returns (create→running as the wait
    /// answered it, create→first exec answered, the id).
    async fn interactive(&self, body: &Value) -> anyhow::Result<(Duration, Duration, String)> {
        let started = Instant::now();
        let path = format!(
            "/v1/sandboxes?wait=running&timeout={}s",
            TRANSITION_TIMEOUT.as_secs().min(MAX_WAIT_SECS)
        );
        let (status, created) = self
            .send(reqwest::Method::POST, &path, Some(body.clone()))
            .await?;
        if status != 200 || created["state"] != "running" {
            bail!("create with wait: {status} {created}");
        }
        let running = started.elapsed();
        let id = created["id"].as_str().unwrap_or_default().to_owned();
        let (status, out) = self
            .send(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(json!({"cmd": ["echo", "hi"]})),
            )
            .await?;
        if status != 200 || out["stdout"] != "hi\n" {
            bail!("first exec failed: {status} {out}");
        }
        Ok((running, started.elapsed(), id))
    }

    /// Waits for `state` with `GET …/wait` (one request, answered when the database notifies
    /// the state change).
    async fn wait(&self, id: &str, state: &str) -> anyhow::Result<()> {
        let path = format!(
            "/v1/sandboxes/{id}/wait?state={state}&timeout={}s",
            TRANSITION_TIMEOUT.as_secs().min(MAX_WAIT_SECS)
        );
        let (status, s) = self.send(reqwest::Method::GET, &path, None).await?;
        if status != 200 {
            bail!("sandbox {id} never reached {state}: {status} {s}");
        }
        Ok(())
    }

    /// Deletes a sandbox and waits until it is `deleted`.
    async fn delete(&self, id: &str) -> anyhow::Result<()> {
        self.transition(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{id}"),
            None,
            Some(id),
            "deleted",
        )
        .await
        .map(|_| ())
    }

    /// Sends `method path` (expecting 2xx) and waits for `state`; returns the elapsed time.
    async fn transition(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        id: Option<&str>,
        state: &str,
    ) -> anyhow::Result<(Duration, String)> {
        let started = Instant::now();
        let (status, resp) = self.send(method, path, body).await?;
        if !(200..300).contains(&status) {
            bail!("{path}: {status} {resp}");
        }
        let id = id
            .map(str::to_owned)
            .unwrap_or_else(|| resp["id"].as_str().unwrap_or_default().to_owned());
        self.wait(&id, state).await?;
        Ok((started.elapsed(), id))
    }
}

/// `--sandboxes` when not given.
const DEFAULT_SANDBOXES: usize = 20;
/// `--sandboxes` of the failover mode when not given: each sample waits out the lost and
/// failover delays and up to a pass interval.
const DEFAULT_FAILOVERS: usize = 3;

/// Runs the bench and prints the table.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.failover {
        return failover::run(failover::FailoverArgs {
            sandboxes: args.sandboxes.unwrap_or(DEFAULT_FAILOVERS),
            template: args.template,
            pass_interval: args.failover_pass_interval.into(),
            host_lost_after: args.failover_host_lost_after.into(),
            failover_after: args.failover_after.into(),
            dir: args.failover_dir,
            state_dir: args.state_dir,
            database_url: args.database_url,
            nats_url: args.nats_url,
        })
        .await;
    }
    match args.runtime.as_deref() {
        None => {}
        Some(berth_hostd::runtime::sim::SIM) => {
            return scale::run(scale::ScaleArgs {
                hosts: args.hosts,
                sandboxes: args.sandboxes(),
                rate: args.rate,
                concurrency: args.concurrency,
                sim_boot: Duration::from_millis(args.sim_boot_ms),
                heartbeat_interval: Duration::from_millis(args.heartbeat_ms),
                lifecycle_sandboxes: args.lifecycle_sandboxes,
                result_concurrency: args.result_concurrency,
                passes: args.passes,
                state_dir: args.state_dir,
                sim_hosts_dir: args.sim_hosts_dir,
                database_url: args.database_url,
                nats_url: args.nats_url,
                keep_database: args.keep_database,
            })
            .await
        }
        Some(other) => bail!("--runtime {other}: only `sim` (the scale mode) is supported"),
    }
    let env = stack_env(&args.state_dir);
    let lookup = |k: &str| env.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    let api = args
        .api
        .clone()
        .or_else(|| lookup("BERTH_API"))
        .unwrap_or_else(|| "http://127.0.0.1:8080".into());
    let key = match &args.key {
        Some(k) => k.clone(),
        None => std::fs::read_to_string(args.state_dir.join("api-key"))
            .context("no --key and no <state dir>/api-key")?
            .trim()
            .to_owned(),
    };
    let run_tag = format!("{}-{}", std::process::id(), chrono::Utc::now().timestamp());
    let client = Client::new(api, key, run_tag);
    let shutdown = crate::shutdown_on_signal();
    let measured = async {
        if args.snapshots {
            snapshots::run(&client, args.sandboxes()).await
        } else if args.storage {
            storage::run(&client, &args, &lookup).await
        } else {
            real::measure(&args, &client, &lookup).await
        }
    };
    // On a signal the measuring stops where it is: dropping it removes its bundle and scratch
    // dirs and the raw containers it made (their guards' `Drop`), and kills its commands.
    let outcome = tokio::select! {
        outcome = measured => outcome,
        _ = shutdown.cancelled() => {
            eprintln!("bench: interrupted, deleting this run's sandboxes…");
            Err(Interrupted.into())
        }
    };
    client.clean_up().await;
    outcome
}
