//! `berth bench --failover`: how long a host-loss failover takes (issue 14), on a private stack
//! of this process with two real `berth hostd` child processes on runc.
//!
//! Self-contained like the scale mode: a database of its own (created on `DATABASE_URL`'s
//! server, or on a private Postgres), NATS (`NATS_URL`, or a private `nats-server`) with a
//! subject prefix of its own ([`super::private`]), the control plane started here with
//! [`berth::stack::Stack::start`] and no in-process hosts, and two hostd children
//! (`<this binary> hostd`, each with its own state dir and /16 of sandbox addresses below
//! `--failover-dir/<tag>`) sharing one object store (`BERTH_OBJECT_STORE`, else the run dir's
//! `objects`), so a backup taken on one host is restored on the other.
//!
//! The reconciler keeps the production pass interval (`--failover-pass-interval`, default
//! [`berth_reconciler::pass::DEFAULT_INTERVAL`]) but a host is `lost` after
//! `--failover-host-lost-after` of silence and its sandboxes fail over
//! `--failover-after` later (seconds, where production waits 5 + 10 minutes). Every figure is
//! taken from the moment the failover is **due** — the host's last heartbeat
//! (`hosts.last_seen`) plus both delays — so the shortened delays only move that moment
//! earlier; what is measured is the control plane's and the other host's work after it.
//!
//! Per sample (`--sandboxes`, one after another, the silenced host alternating): a runc
//! sandbox (`--template`) is created with the other host cordoned, so it lands on the host to
//! silence; it writes a file; a backup is taken (`POST …/backup` → `ready`); after a random
//! fraction of a pass interval (a host is lost at any moment between two passes; without it
//! the bench's rhythm locks onto the pass's) that host's hostd is frozen (SIGSTOP), and the
//! bench waits until the sandbox runs on the other host. From the
//! `events` table and `hosts.last_seen` (one clock, the database's), in milliseconds:
//!
//! - due → `restoring` (event reason `host_lost`): up to one pass interval (half of one on
//!   average) of waiting for the next pass, plus the pass;
//! - `restoring` → `running` on the other host: the backup's download and the cold boot;
//! - due → `running`: the two together.
//!
//! The file must be there after (else the run fails: a failover that lost the backup is not a
//! figure). Then the frozen hostd is thawed (SIGCONT) and the bench times SIGCONT → its stale
//! copy destroyed (fenced: the generation moved on) and the host `ready` again; the sandbox is
//! deleted. Floor: a raw `runc run` of a busybox bundle ([`super::floors::runc_run`]), taken
//! `--sandboxes` times in the same run. Rows give n, p50, and p90 from 10 samples on.
//!
//! Everything is removed afterwards, also when a step fails: the hostd children are killed
//! (on drop too), what they left on the machine (containers, networks, mounts, nftables
//! tables: [`berth::hostd_child`], [`berth::host_leftovers`]) and their state dirs removed, the
//! streams deleted and the database dropped, and the run dir removed — also on SIGINT or
//! SIGTERM, which end the run as [`super::Interrupted`]. After a failure only the hostd logs
//! stay in the run dir (printed): they say why.
//!
//! Errors: a service or a hostd that does not start, a sandbox that does not land on the host
//! to silence, fails over to nowhere (`failed-start`) or without its file, a host that does
//! not come back, any step past its timeout.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use berth::host_leftovers::{free_address_pool, remove_dir_unless_mounted};
use berth::hostd_child::{HostdChild, StateDir};
use berth::stack::{Pools, Reconciler, Stack, StackConfig};
use berth_reconciler::pass::PassConfig;
use berth_schemas::HostId;
use berth_storage::{Location, StoreSettings};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::private::Private;
use super::snapshots::{exec, take};
use super::storage::{cordoned, running};
use super::{floors, Client, Row, Samples, TRANSITION_TIMEOUT};

/// The hostd children of a run.
const HOSTS: usize = 2;
/// How long the bench waits for every hostd's first heartbeat.
const HOSTS_READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How often the database and the hosts' state dirs are looked at while waiting. The figures
/// come from the database's timestamps, not from when a poll saw them.
const POLL: Duration = Duration::from_millis(100);
/// What the sandbox writes before its backup, and must read after the failover.
const KEPT: &str = "failed-over";

/// Settings of one failover run (from `berth bench` flags).
pub(super) struct FailoverArgs {
    pub sandboxes: usize,
    pub template: String,
    pub pass_interval: Duration,
    pub host_lost_after: Duration,
    pub failover_after: Duration,
    /// Below it, `<tag>/` holds the hosts' state dirs, their logs and the local object store.
    pub dir: PathBuf,
    /// Where a private Postgres or NATS keeps its data.
    pub state_dir: PathBuf,
    pub database_url: Option<String>,
    pub nats_url: Option<String>,
}

/// Runs the failover bench and prints its table.
pub(super) async fn run(args: FailoverArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.state_dir)?;
    let state_dir = std::path::absolute(&args.state_dir)?;
    let shutdown = crate::shutdown_on_signal();
    let private = Private::open(
        "benchfail",
        &state_dir,
        args.database_url.as_deref(),
        args.nats_url.as_deref(),
        &shutdown,
    )
    .await;
    let private = match private {
        Err(_) if shutdown.is_cancelled() => return Err(super::Interrupted.into()),
        private => private?,
    };
    let run_dir = std::path::absolute(args.dir.join(&private.tag))?;
    let outcome = measure(&args, &private, &run_dir, &shutdown).await;
    private.close(false).await;
    // A step that failed because of the signal is an interruption, not a failure to explain.
    let outcome = match outcome {
        Err(_) if shutdown.is_cancelled() => Err(super::Interrupted.into()),
        outcome => outcome,
    };
    let failed = outcome
        .as_ref()
        .is_err_and(|e| !e.chain().any(|c| c.is::<super::Interrupted>()));
    if failed {
        // The hostd logs explain the failure: they stay, the rest (the object store) goes.
        for entry in std::fs::read_dir(&run_dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "log") {
                continue;
            }
            if path.is_dir() {
                remove_dir_unless_mounted(&path);
            } else {
                let _ = std::fs::remove_file(&path);
            }
        }
        eprintln!("bench: the hostd logs are in {}", run_dir.display());
    } else {
        remove_dir_unless_mounted(&run_dir);
        // The parent only when this run was its last user.
        let _ = std::fs::remove_dir(&args.dir);
    }
    outcome
}

/// The figures of every sample, in seconds.
#[derive(Default)]
struct Figures {
    to_restoring: Samples,
    to_running: Samples,
    due_to_running: Samples,
    comeback: Samples,
}

async fn measure(
    args: &FailoverArgs,
    private: &Private,
    run_dir: &Path,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let n = args.sandboxes.max(1);
    std::fs::create_dir_all(run_dir)?;
    let location = Location::from_env_or_default(run_dir)?;
    let db = crate::connect_db(&private.database_url).await?;
    let listen = "127.0.0.1:0".parse().expect("a socket address");
    let mut config = StackConfig::new(private.nats_url.clone(), private.subjects.clone(), listen);
    config.api.object_store = Some(StoreSettings::new(location.clone()));
    // The bench polls with one key from one address.
    config.api.limits = berth_api::limits::LimitsConfig::without_rate_limits();
    let pass = PassConfig {
        interval: args.pass_interval,
        host_lost_after: args.host_lost_after,
        failover_after: args.failover_after,
        ..PassConfig::default()
    };
    let due_after = pass.host_lost_after + pass.failover_after;
    let mut reconciler = berth_reconciler::ReconcilerConfig::new(private.subjects.clone());
    reconciler.pass = pass;
    config.reconciler = Reconciler::Leader(Box::new(reconciler));
    let mut stack = Stack::start(config, Pools::shared(db.clone()), shutdown).await?;
    let mut hosts = Vec::new();
    let outcome = async {
        for index in 0..HOSTS {
            hosts.push(Host::spawn(&db, private, run_dir, index, &location).await?);
        }
        stack
            .wait_for_hosts(HOSTS, HOSTS_READY_TIMEOUT, shutdown)
            .await?;
        let (_, key) = berth_api::auth::create_org(&db, "bench").await?;
        let client = Client::new(stack.api_url(), key, "failover".into());
        let operator = client.with_key(berth_api::auth::create_admin_key(&db).await?);
        eprintln!("bench: raw runc run, {n} times");
        let floor = floors::runc_run(n).await?;
        let mut figures = Figures::default();
        for i in 0..n {
            let silenced = i % HOSTS;
            eprintln!(
                "bench: failover {} of {n} (host {silenced} silenced)",
                i + 1
            );
            let step = Sample {
                client: &client,
                operator: &operator,
                db: &db,
                template: &args.template,
                due_after,
                pass_interval: args.pass_interval,
                shutdown,
                // Lost, failed over at the next pass, then restored.
                timeout: due_after + args.pass_interval * 3 + TRANSITION_TIMEOUT,
            };
            step.run(&hosts[silenced], &hosts[HOSTS - 1 - silenced], &mut figures)
                .await?;
        }
        for host in &mut hosts {
            host.stop().await;
        }
        print(args, due_after, &figures, &floor);
        anyhow::Ok(())
    }
    .await;
    // Killed if still running, and whatever they left removed, before the control plane goes.
    drop(hosts);
    stack.stop().await;
    db.close().await;
    outcome
}

fn print(args: &FailoverArgs, due_after: Duration, figures: &Figures, floor: &Samples) {
    let secs = |d: Duration| humantime::format_duration(d).to_string();
    println!(
        "failover: {HOSTS} hostd processes (runc), a reconciler pass every {}; a host is lost \
         after {} of silence and fails over {} later (production: 5m + 10m). Figures run from \
         the moment the failover is due (the host's last heartbeat + {}): the shorter delays \
         only move that moment.",
        secs(args.pass_interval),
        secs(args.host_lost_after),
        secs(args.failover_after),
        secs(due_after),
    );
    println!();
    let runc = "raw runc run";
    let none = Samples::default();
    let rows = [
        Row::new(
            format!(
                "failover: due → restoring (waits for the next pass, every {})",
                secs(args.pass_interval)
            ),
            &figures.to_restoring,
            "—",
            &none,
        ),
        Row::new(
            "failover: restoring → running on the other host (backup download + boot)".into(),
            &figures.to_running,
            runc,
            floor,
        ),
        Row::new(
            "failover: due → running on the other host".into(),
            &figures.due_to_running,
            runc,
            floor,
        ),
        Row::new(
            "returning host: SIGCONT → stale copy destroyed, host ready".into(),
            &figures.comeback,
            "—",
            &none,
        ),
        Row::new(runc.into(), floor, "—", &none),
    ];
    Row::print(&rows);
}

/// What one failover sample needs.
struct Sample<'a> {
    client: &'a Client,
    operator: &'a Client,
    db: &'a PgPool,
    template: &'a str,
    /// The lost and failover delays together.
    due_after: Duration,
    /// The reconciler's pass interval.
    pass_interval: Duration,
    /// Cancelled by SIGINT or SIGTERM: every wait gives up.
    shutdown: &'a CancellationToken,
    /// How long the sandbox may take to run on the other host after the freeze.
    timeout: Duration,
}

impl Sample<'_> {
    /// One failover of a sandbox from `silenced` to `other`, and `silenced`'s return.
    async fn run(
        &self,
        silenced: &Host,
        other: &Host,
        figures: &mut Figures,
    ) -> anyhow::Result<()> {
        let (client, db) = (self.client, self.db);
        let id = cordoned(
            self.operator,
            &other.id().to_string(),
            running(client, self.template),
        )
        .await?;
        if host_of(db, &id).await? != Some(silenced.id().as_uuid()) {
            bail!("sandbox {id} did not land on host {}", silenced.id());
        }
        exec(client, &id, &format!("echo {KEPT} > /root/kept")).await?;
        take(client, &id, "backup").await?;

        // A real host is lost at any moment between two passes; the bench's own rhythm (each
        // sample starts right after a pass restored the last one) would lock onto the pass's
        // and make the wait for the next pass read almost a whole interval every time.
        tokio::select! {
            _ = tokio::time::sleep(self.pass_interval.mul_f64(rand::random::<f64>())) => {}
            _ = self.shutdown.cancelled() => return Err(super::Interrupted.into()),
        }
        silenced.signal(nix::sys::signal::Signal::SIGSTOP)?;
        let deadline = Instant::now() + self.timeout;
        loop {
            let (state, host): (String, Option<Uuid>) =
                sqlx::query_as("SELECT state, host_id FROM sandboxes WHERE id = $1::uuid")
                    .bind(&id)
                    .fetch_one(db)
                    .await?;
            if state == "running" && host == Some(other.id().as_uuid()) {
                break;
            }
            if state == "failed-start" || state == "deleted" || Instant::now() > deadline {
                bail!(
                    "sandbox {id} did not fail over to host {}: {state}",
                    other.id()
                );
            }
            self.pause().await?;
        }
        let (to_restoring, to_running): (f64, f64) = sqlx::query_as(
            "SELECT extract(epoch FROM r.at - h.last_seen)::float8 - $3,
                    extract(epoch FROM n.at - r.at)::float8
               FROM hosts h, events r, events n
              WHERE h.id = $1 AND r.sandbox_id = $2::uuid AND r.to_state = 'restoring'
                AND r.reason = 'host_lost' AND r.snapshot_id IS NULL
                AND n.sandbox_id = r.sandbox_id AND n.to_state = 'running' AND n.id > r.id
                AND n.snapshot_id IS NULL
              ORDER BY r.id DESC, n.id LIMIT 1",
        )
        .bind(silenced.id().as_uuid())
        .bind(&id)
        .bind(self.due_after.as_secs_f64())
        .fetch_optional(db)
        .await?
        .with_context(|| format!("no host_lost restoring → running events of {id}"))?;
        let kept = exec(client, &id, "cat /root/kept").await?;
        if kept.trim() != KEPT {
            bail!("sandbox {id} failed over without its backup's file: {kept:?}");
        }
        eprintln!(
            "bench: due → restoring {:.0} ms, restoring → running {:.0} ms",
            to_restoring * 1000.0,
            to_running * 1000.0
        );
        figures.to_restoring.0.push(to_restoring);
        figures.to_running.0.push(to_running);
        figures.due_to_running.0.push(to_restoring + to_running);

        let thawed = Instant::now();
        silenced.signal(nix::sys::signal::Signal::SIGCONT)?;
        let since: chrono::DateTime<chrono::Utc> =
            sqlx::query_scalar("SELECT now()").fetch_one(db).await?;
        let deadline = thawed + TRANSITION_TIMEOUT;
        while silenced.holds(&id) || !ready_since(db, silenced.id(), since).await? {
            if Instant::now() > deadline {
                bail!(
                    "host {} did not destroy its copy of {id} and come back",
                    silenced.id()
                );
            }
            self.pause().await?;
        }
        figures.comeback.push(thawed.elapsed());
        client.delete(&id).await?;
        let deadline = Instant::now() + TRANSITION_TIMEOUT;
        while other.holds(&id) {
            if Instant::now() > deadline {
                bail!("host {} kept its copy of the deleted {id}", other.id());
            }
            self.pause().await?;
        }
        Ok(())
    }
}

impl Sample<'_> {
    /// Waits [`POLL`]; an error once the bench is interrupted.
    async fn pause(&self) -> anyhow::Result<()> {
        tokio::select! {
            _ = tokio::time::sleep(POLL) => Ok(()),
            _ = self.shutdown.cancelled() => Err(super::Interrupted.into()),
        }
    }
}

/// The host the row of `id` names.
async fn host_of(db: &PgPool, id: &str) -> anyhow::Result<Option<Uuid>> {
    Ok(
        sqlx::query_scalar("SELECT host_id FROM sandboxes WHERE id = $1::uuid")
            .bind(id)
            .fetch_one(db)
            .await?,
    )
}

/// Whether `host` is `ready` with a heartbeat applied after `since`.
async fn ready_since(
    db: &PgPool,
    host: HostId,
    since: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<bool> {
    let ready: Option<bool> =
        sqlx::query_scalar("SELECT state = 'ready' AND last_seen > $2 FROM hosts WHERE id = $1")
            .bind(host.as_uuid())
            .bind(since)
            .fetch_optional(db)
            .await?;
    Ok(ready == Some(true))
}

/// A `berth hostd` child process of the bench. Dropping it kills the process and removes what
/// it left on the machine and its state dir ([`HostdChild`]).
struct Host(HostdChild);

impl Host {
    /// Registers host `index` in `hosts` (its id made in its state dir, `<run dir>/host<index>`)
    /// and starts its hostd, logging to `<run dir>/host<index>.log`, on the bench's NATS
    /// prefix and the object store at `location`.
    async fn spawn(
        db: &PgPool,
        private: &Private,
        run_dir: &Path,
        index: usize,
        location: &Location,
    ) -> anyhow::Result<Host> {
        let state_dir = run_dir.join(format!("host{index}"));
        std::fs::create_dir_all(&state_dir)?;
        let address_pool = free_address_pool().context("no free /16 in 10.64.0.0/10")?;
        // Made before anything can fail, so the pool is given back on every path.
        let mut host = Host(HostdChild::new(
            HostId::new(),
            state_dir,
            address_pool,
            StateDir::Remove,
        ));
        host.0.host_id = berth_hostd::host_id(&host.0.state_dir)?;
        berth_store::hosts::register(db, host.id(), None).await?;
        let log = std::fs::File::create(run_dir.join(format!("host{index}.log")))?;
        let mut command = tokio::process::Command::new(std::env::current_exe()?);
        command
            .arg("hostd")
            .arg("--state-dir")
            .arg(&host.0.state_dir)
            .arg("--address-pool")
            .arg(host.0.address_pool.to_string())
            .arg("--name")
            .arg(format!("bench-failover-{index}"))
            .env("NATS_URL", &private.nats_url)
            .env("BERTH_SUBJECT_PREFIX", private.subjects.prefix())
            .env_remove("BERTH_METRICS_ADDR");
        if let Location::Local(dir) = location {
            command.env(berth_storage::store::OBJECT_STORE_ENV, dir);
        }
        host.0.child = Some(
            command
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .context("spawn berth hostd")?,
        );
        Ok(host)
    }

    /// The host it runs as.
    fn id(&self) -> HostId {
        self.0.host_id
    }

    /// Sends `signal` to the process.
    fn signal(&self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        Ok(self.0.signal(signal)?)
    }

    /// Whether the host still holds a directory of sandbox `id`.
    fn holds(&self, id: &str) -> bool {
        self.0.state_dir.join("sandboxes").join(id).exists()
    }

    /// Stops the process with SIGTERM (thawed first), SIGKILL after
    /// [`berth::hostd_child::HOSTD_STOP_TIMEOUT`].
    async fn stop(&mut self) {
        self.0.stop(nix::sys::signal::Signal::SIGTERM).await;
    }
}
