//! The end-to-end stack: the in-process control plane of `berth::stack` on the real Postgres
//! (a fresh database per test from `#[sqlx::test]`) and the real NATS (a unique subject
//! prefix and streams per test), with real `berth hostd` child processes running runc.
//!
//! Hosts are processes, not tasks, so a test can freeze, kill and restart them. Everything a
//! stack started is removed when it drops, also when its test panics: the hostd processes
//! are killed, their containers, networks, mounts and nftables tables removed
//! ([`super::cleanup`]), the streams deleted and the state dir removed.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use berth::hostd_child::{HostdChild, StateDir};
use berth_schemas::{HostId, Subjects};
use nix::sys::signal::Signal;
use sqlx::PgPool;
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use super::cleanup::{self, delete_streams_blocking, remove_dir_unless_mounted};
use super::env::{init_tracing, nats_url, unique, HTTP_TIMEOUT, SETTLE_TIMEOUT};

/// A `berth hostd` child process ([`HostdChild`]: signals and stop by the PID started; on
/// drop, killed and what it left removed) and how to start it again. It reads as the
/// [`HostdChild`] it holds (`host.child`, `host.host_id`, `host.state_dir`).
pub struct HostProcess {
    pub process: HostdChild,
    /// `--vcpus` / `--memory-mib` given to the process, if any.
    pub capacity: (Option<u32>, Option<u32>),
    /// Extra `berth hostd` flags, given again on a restart.
    pub extra_args: Vec<String>,
    /// Its NATS credentials file (`--nats-creds`), on a NATS with auth on.
    pub creds_file: Option<PathBuf>,
    /// Extra environment of the process (`PATH` with a fault-injecting `runc` wrapper first),
    /// given again on a restart.
    pub env: Vec<(String, String)>,
}

impl std::ops::Deref for HostProcess {
    type Target = HostdChild;

    fn deref(&self) -> &HostdChild {
        &self.process
    }
}

impl std::ops::DerefMut for HostProcess {
    fn deref_mut(&mut self) -> &mut HostdChild {
        &mut self.process
    }
}

impl HostProcess {
    /// The lines of this host's log that contain `needle`, without terminal colours: what a
    /// failed assertion prints, since CI removes the logs of a run that left nothing behind.
    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        let log = std::fs::read_to_string(self.state_dir.with_extension("log")).unwrap_or_default();
        log.lines()
            .filter(|l| l.contains(needle))
            .map(|l| {
                let mut plain = String::with_capacity(l.len());
                let mut chars = l.chars();
                while let Some(c) = chars.next() {
                    if c == '\u{1b}' {
                        // Skip an escape sequence up to its final letter.
                        for e in chars.by_ref() {
                            if e.is_ascii_alphabetic() {
                                break;
                            }
                        }
                    } else {
                        plain.push(c);
                    }
                }
                plain
            })
            .collect()
    }

    /// The runc root of this host (where its containers are listed).
    pub fn runc_root(&self) -> PathBuf {
        self.state_dir.join("runc")
    }

    /// Freezes the process (SIGSTOP): it neither consumes commands nor heartbeats.
    pub fn freeze(&self) {
        self.process
            .signal(Signal::SIGSTOP)
            .expect("freeze the host");
    }

    /// Sends SIGCONT if the process runs (harmless when it is not frozen).
    pub fn thaw_if_frozen(&self) {
        if self.pid().is_some() {
            self.thaw();
        }
    }

    /// Thaws a frozen process (SIGCONT).
    pub fn thaw(&self) {
        self.process.signal(Signal::SIGCONT).expect("thaw the host");
    }

    /// Stops it with SIGTERM (or SIGKILL when `kill`), by the PID we started.
    pub async fn stop(&mut self, kill: bool) {
        let signal = if kill {
            Signal::SIGKILL
        } else {
            Signal::SIGTERM
        };
        self.process.stop(signal).await;
    }
}

/// A running stack: the control plane in-process, hostd as children.
pub struct Stack {
    pub base: String,
    pub key: String,
    pub db: PgPool,
    pub subjects: Subjects,
    pub nats: async_nats::Client,
    pub http: reqwest::Client,
    pub hosts: Vec<HostProcess>,
    pub root: PathBuf,
    /// The NATS the stack and its hosts use.
    pub nats_target: NatsTarget,
    /// Where the preview proxy listens (`{port}-{id}.`[`PREVIEW_DOMAIN`] by Host header).
    pub proxy_addr: std::net::SocketAddr,
    control_plane: Option<berth::stack::Stack>,
    /// The test's own heartbeat consumer, when it stands in for the scheduler's.
    ingest: Option<tokio::task::JoinHandle<()>>,
}

/// The preview secret of every test stack (its hosts' forwarder keys derive from it).
pub const PREVIEW_SECRET: &[u8] = b"the preview secret of the test stacks, 32+ bytes";
/// The preview domain of every test stack.
pub const PREVIEW_DOMAIN: &str = "preview.test";

/// Which NATS a stack runs on: the shared open one ([`NatsTarget::shared`]), or one the test
/// started with auth on (the control plane's credentials; hosts get theirs one by one).
#[derive(Debug, Clone)]
pub struct NatsTarget {
    pub url: String,
    pub control_plane: Option<berth_schemas::nats_auth::Creds>,
}

impl NatsTarget {
    /// The shared NATS at `NATS_URL`, open.
    pub fn shared() -> Self {
        Self {
            url: nats_url(),
            control_plane: None,
        }
    }
}

impl Stack {
    /// Starts a stack with `hosts` hostd processes on the fresh database `db`, and creates an
    /// org whose key is `self.key`. Returns once every host has sent a heartbeat.
    pub async fn start(db: PgPool, hosts: usize) -> Stack {
        Self::start_with(db, hosts, berth_reconciler::pass::PassConfig::default()).await
    }

    /// Like [`Stack::start`], with the reconciler's pass timing given.
    pub async fn start_with(
        db: PgPool,
        hosts: usize,
        pass: berth_reconciler::pass::PassConfig,
    ) -> Stack {
        Self::start_configured(db, hosts, pass, |_| {}).await
    }

    /// Like [`Stack::start_with`], with `configure` adjusting the API's config (webhook and
    /// event stream timing) before it starts.
    pub async fn start_configured(
        db: PgPool,
        hosts: usize,
        pass: berth_reconciler::pass::PassConfig,
        configure: impl FnOnce(&mut berth_api::ApiConfig),
    ) -> Stack {
        Self::start_on(db, NatsTarget::shared(), hosts, pass, configure).await
    }

    /// Like [`Stack::start_configured`], on the NATS `target` (its prefix: `t<tag>`, see
    /// [`Stack::subjects`]; pass `subjects` of its own to match a server's permissions).
    pub async fn start_on(
        db: PgPool,
        target: NatsTarget,
        hosts: usize,
        pass: berth_reconciler::pass::PassConfig,
        configure: impl FnOnce(&mut berth_api::ApiConfig),
    ) -> Stack {
        let subjects = Subjects::new(&format!("t{}", unique())).unwrap();
        Self::start_full(db, target, subjects, hosts, pass, configure).await
    }

    /// [`Stack::start_on`] with the subject prefix given.
    pub async fn start_full(
        db: PgPool,
        target: NatsTarget,
        subjects: Subjects,
        hosts: usize,
        pass: berth_reconciler::pass::PassConfig,
        configure: impl FnOnce(&mut berth_api::ApiConfig),
    ) -> Stack {
        Self::start_inner(db, target, subjects, hosts, pass, configure, None).await
    }

    /// A stack without hosts (add them with [`Stack::add_host_with_args`]) whose heartbeats
    /// are applied `delay` after they arrive, each alone and in arrival order, by the
    /// scheduler's own apply ([`berth_scheduler::heartbeat::apply_batch`]): a heartbeat
    /// consumer that is backlogged by `delay`.
    pub async fn start_with_delayed_heartbeats(
        db: PgPool,
        pass: berth_reconciler::pass::PassConfig,
        delay: Duration,
    ) -> Stack {
        let subjects = Subjects::new(&format!("t{}", unique())).unwrap();
        Self::start_inner(
            db,
            NatsTarget::shared(),
            subjects,
            0,
            pass,
            |_| {},
            Some(delay),
        )
        .await
    }

    async fn start_inner(
        db: PgPool,
        target: NatsTarget,
        subjects: Subjects,
        hosts: usize,
        pass: berth_reconciler::pass::PassConfig,
        configure: impl FnOnce(&mut berth_api::ApiConfig),
        heartbeat_delay: Option<Duration>,
    ) -> Stack {
        init_tracing("warn");
        let tag = unique();
        let root = cleanup::fresh_dir("stack");
        let listen = "127.0.0.1:0".parse().unwrap();
        let mut config =
            berth::stack::StackConfig::new(target.url.clone(), subjects.clone(), listen);
        config.nats_creds = target.control_plane.clone();
        // The tests' webhook receivers listen on loopback.
        config.api.webhooks.allow_private_targets = true;
        // Tests poll one key from one address much faster than a client should; the tests
        // of the limits set them in `configure`.
        config.api.limits = berth_api::limits::LimitsConfig::without_rate_limits();
        // The tests' egress targets are private networks they make.
        config.api.sandbox_egress_private = true;
        // The tests read the in-process API's metrics from its own listener (`berth api` serves
        // them only on `--metrics-addr` unless told otherwise).
        config.api.metrics_on_api = true;
        config.api.preview.secret = Some(std::sync::Arc::new(PREVIEW_SECRET.to_vec()));
        config.api.preview.domain = PREVIEW_DOMAIN.to_owned();
        // A wake on a loaded machine is slow; a held request must still end before the
        // client's own timeout.
        config.api.preview.wake_timeout = HTTP_TIMEOUT - Duration::from_secs(15);
        config.proxy_listen = Some(listen);
        // Every host of the stack and the API share one local object store (a hostd gets it
        // as BERTH_OBJECT_STORE unless the test gives it another).
        config.api.object_store = Some(berth_storage::StoreSettings::new(
            berth_storage::Location::Local(root.join("objects")),
        ));
        configure(&mut config.api);
        let mut reconciler = berth_reconciler::ReconcilerConfig::new(subjects.clone());
        reconciler.pass = pass;
        config.reconciler = berth::stack::Reconciler::Leader(Box::new(reconciler));
        config.heartbeat_consumer = heartbeat_delay.is_none();
        let control_plane = berth::stack::Stack::start(
            config,
            berth::stack::Pools::shared(db.clone()),
            &CancellationToken::new(),
        )
        .await
        .expect("start the control plane");
        let (_, key) = berth_api::auth::create_org(&db, &format!("org-{tag}"))
            .await
            .unwrap();
        let mut stack = Stack {
            base: control_plane.api_url(),
            proxy_addr: control_plane
                .proxy_addr
                .expect("the test stack runs a proxy"),
            key,
            db,
            subjects,
            nats: control_plane.nats.clone(),
            // A route that never answers fails its test instead of hanging the run.
            http: reqwest::Client::builder()
                .timeout(HTTP_TIMEOUT)
                .build()
                .unwrap(),
            hosts: Vec::new(),
            root,
            nats_target: target,
            control_plane: Some(control_plane),
            ingest: None,
        };
        if let Some(delay) = heartbeat_delay {
            stack.ingest = Some(delayed_ingest(&stack, delay).await);
        }
        for _ in 0..hosts {
            stack.add_host().await;
        }
        stack
    }

    /// Starts one more `berth hostd` and waits for its first heartbeat.
    pub async fn add_host(&mut self) -> usize {
        self.add_host_with((None, None)).await
    }

    /// Like [`Stack::add_host`], offering `(vcpus, memory_mib)` instead of the machine's size.
    pub async fn add_host_with(&mut self, capacity: (Option<u32>, Option<u32>)) -> usize {
        self.add_host_with_args(capacity, &[]).await
    }

    /// Like [`Stack::add_host_with`], with extra `berth hostd` flags (e.g. `--metrics-addr`).
    pub async fn add_host_with_args(
        &mut self,
        capacity: (Option<u32>, Option<u32>),
        extra_args: &[String],
    ) -> usize {
        self.add_host_full(capacity, extra_args, None).await
    }

    /// Like [`Stack::add_host_with_args`], with the host's NATS credentials file (its host id
    /// is theirs).
    pub async fn add_host_full(
        &mut self,
        capacity: (Option<u32>, Option<u32>),
        extra_args: &[String],
        creds_file: Option<PathBuf>,
    ) -> usize {
        self.add_host_env(capacity, extra_args, creds_file, Vec::new())
            .await
    }

    /// Like [`Stack::add_host_full`], with extra environment for the process (e.g. a `PATH`
    /// whose first `runc` is a wrapper that injects faults).
    pub async fn add_host_env(
        &mut self,
        capacity: (Option<u32>, Option<u32>),
        extra_args: &[String],
        creds_file: Option<PathBuf>,
        env: Vec<(String, String)>,
    ) -> usize {
        let index = self.hosts.len();
        let state_dir = self.root.join(format!("host{index}"));
        let mut env = env;
        if !env
            .iter()
            .any(|(k, _)| k == berth_storage::store::OBJECT_STORE_ENV)
        {
            env.push((
                berth_storage::store::OBJECT_STORE_ENV.to_owned(),
                self.object_store_dir().display().to_string(),
            ));
        }
        std::fs::create_dir_all(&state_dir).unwrap();
        let address_pool =
            berth::host_leftovers::free_address_pool().expect("a free /16 in 10.64.0.0/10");
        let mut host = HostProcess {
            process: HostdChild::new(HostId::new(), state_dir, address_pool, StateDir::Keep),
            capacity,
            extra_args: extra_args.to_vec(),
            creds_file,
            env,
        };
        self.spawn_host(&mut host).await;
        self.hosts.push(host);
        index
    }

    /// Restarts the process of host `index` (after [`HostProcess::stop`]).
    pub async fn restart_host(&mut self, index: usize) {
        let (db, subjects, url) = (
            self.db.clone(),
            self.subjects.clone(),
            self.nats_target.url.clone(),
        );
        spawn_hostd(&db, &subjects, &url, &mut self.hosts[index]).await;
    }

    /// (Re)starts the hostd process of `host` and waits until its heartbeat is in `hosts`.
    pub async fn spawn_host(&self, host: &mut HostProcess) {
        spawn_hostd(&self.db, &self.subjects, &self.nats_target.url, host).await
    }

    /// The local object store every host of this stack shares (unless a test gave one another
    /// `BERTH_OBJECT_STORE`).
    pub fn object_store_dir(&self) -> PathBuf {
        self.root.join("objects")
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Stops everything this stack started, hosts first and gracefully; then what `Drop`
    /// removes (leftovers, streams, files).
    pub async fn teardown(mut self) {
        if let Some(ingest) = self.ingest.take() {
            ingest.abort();
        }
        for host in &mut self.hosts {
            host.stop(false).await;
        }
        if let Some(control_plane) = self.control_plane.take() {
            control_plane.stop().await;
        }
    }
}

/// Subscribes to every heartbeat of `stack` and applies each `delay` after it arrived, in
/// arrival order (see [`Stack::start_with_delayed_heartbeats`]).
async fn delayed_ingest(stack: &Stack, delay: Duration) -> tokio::task::JoinHandle<()> {
    use futures::StreamExt;
    let mut sub = stack
        .nats
        .subscribe(stack.subjects.heartbeat_all())
        .await
        .unwrap();
    let db = stack.db.clone();
    tokio::spawn(async move {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let receive = async move {
            while let Some(msg) = sub.next().await {
                let _ = tx.send((tokio::time::Instant::now(), msg.payload));
            }
        };
        let apply = async move {
            while let Some((arrived, payload)) = rx.recv().await {
                tokio::time::sleep_until(arrived + delay).await;
                let hb: berth_schemas::wire::Heartbeat =
                    berth_schemas::wire::decode(&payload).unwrap();
                berth_scheduler::heartbeat::apply_batch(&db, &[hb])
                    .await
                    .unwrap();
            }
        };
        tokio::join!(receive, apply);
    })
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Some(ingest) = self.ingest.take() {
            ingest.abort();
        }
        // Hosts first (each removes what it left), then the control plane, streams, files.
        self.hosts.clear();
        drop(self.control_plane.take());
        delete_streams_blocking(&self.subjects);
        if std::thread::panicking() {
            if let Some(name) = self.db.connect_options().get_database() {
                cleanup::drop_database_blocking(name);
            }
            // The hostd logs are there.
            eprintln!(
                "test failed: its hosts' state and logs are in {}",
                self.root.display()
            );
        } else {
            remove_dir_unless_mounted(&self.root);
        }
    }
}

/// (Re)starts the hostd process of `host` and waits until its heartbeat is in `hosts`. The
/// host is registered first (its id made in its state dir now, or taken from its credentials,
/// which `berth admin add-host` registered), so the scheduler accepts its heartbeats.
async fn spawn_hostd(db: &PgPool, subjects: &Subjects, url: &str, host: &mut HostProcess) {
    let id = match &host.creds_file {
        Some(file) => {
            let creds = berth::nats_access::load(file).unwrap();
            let berth_schemas::nats_auth::Role::Host(id) = creds.role else {
                panic!("{} holds no host credentials", file.display());
            };
            berth_hostd::adopt_host_id(&host.state_dir, id).unwrap()
        }
        None => {
            let id = berth_hostd::host_id(&host.state_dir).unwrap();
            berth_store::hosts::register(db, id, None).await.unwrap();
            id
        }
    };
    host.host_id = id;
    cleanup::register_host(id, &host.state_dir);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(host.state_dir.with_extension("log"))
        .unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_berth"));
    command.arg("hostd");
    if let Some(v) = host.capacity.0 {
        command.arg("--vcpus").arg(v.to_string());
    }
    if let Some(m) = host.capacity.1 {
        command.arg("--memory-mib").arg(m.to_string());
    }
    let child = command
        .arg("--state-dir")
        .arg(&host.state_dir)
        .arg("--address-pool")
        .arg(host.address_pool.to_string())
        .arg("--name")
        .arg(host.state_dir.file_name().unwrap())
        .args(&host.extra_args)
        // Every test host runs a preview forwarder on loopback.
        .arg("--forwarder-listen")
        .arg("127.0.0.1:0")
        .arg("--forwarder-key")
        .arg(hex::encode(berth_schemas::preview::forwarder_key(
            PREVIEW_SECRET,
            id,
        )))
        .args(
            host.creds_file
                .iter()
                .flat_map(|f| [std::ffi::OsStr::new("--nats-creds"), f.as_os_str()]),
        )
        .envs(host.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("NATS_URL", url)
        .env("BERTH_SUBJECT_PREFIX", subjects.prefix())
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn berth hostd");
    host.child = Some(child);
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    loop {
        let seen: Option<i64> =
            sqlx::query_scalar("SELECT 1::int8 FROM hosts WHERE id = $1 AND state = 'ready'")
                .bind(id)
                .fetch_optional(db)
                .await
                .unwrap();
        if seen.is_some() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "hostd in {} sent no heartbeat; see its log",
            host.state_dir.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
