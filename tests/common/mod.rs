//! The end-to-end harness: a whole Berth stack on the real Postgres (a fresh database per test
//! from `#[sqlx::test]`), the real NATS (a unique subject prefix and streams per test, deleted
//! at teardown) and real `berth hostd` processes running runc.
#![allow(dead_code)]

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use berth_schemas::{HostId, Subjects};
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

/// NATS the tests use.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// The longest any single HTTP request of a test may take.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(90);

/// How long a test waits for a sandbox to settle.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Polls `check` until it holds; panics naming `what` after [`SETTLE_TIMEOUT`].
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never happened: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A `berth hostd` child process.
pub struct HostProcess {
    pub state_dir: PathBuf,
    pub child: Option<Child>,
    pub host_id: HostId,
    pub address_pool: Ipv4Addr,
    /// `--vcpus` / `--memory-mib` given to the process, if any.
    pub capacity: (Option<u32>, Option<u32>),
}

impl HostProcess {
    /// The runc root of this host (where its containers are listed).
    pub fn runc_root(&self) -> PathBuf {
        self.state_dir.join("runc")
    }

    /// Freezes the process (SIGSTOP): it neither consumes commands nor heartbeats.
    pub fn freeze(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    /// Sends SIGCONT if the process runs (harmless when it is not frozen).
    pub fn thaw_if_frozen(&self) {
        if self.child.as_ref().and_then(|c| c.id()).is_some() {
            self.thaw();
        }
    }

    /// Thaws a frozen process (SIGCONT).
    pub fn thaw(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = self
            .child
            .as_ref()
            .and_then(|c| c.id())
            .expect("host is running");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).unwrap();
    }

    /// Stops it with SIGTERM (or SIGKILL when `kill`), by the PID we started.
    pub async fn stop(&mut self, kill: bool) {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = child.id() {
                let sig = if kill {
                    nix::sys::signal::Signal::SIGKILL
                } else {
                    nix::sys::signal::Signal::SIGTERM
                };
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
            }
            if tokio::time::timeout(Duration::from_secs(15), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
    }
}

/// A running stack: API (with relay), scheduler and reconciler in-process, hostd as children.
pub struct Stack {
    pub base: String,
    pub key: String,
    pub db: PgPool,
    pub subjects: Subjects,
    pub nats: async_nats::Client,
    pub http: reqwest::Client,
    pub hosts: Vec<HostProcess>,
    pub root: PathBuf,
    shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
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
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn".into()),
            )
            .with_test_writer()
            .try_init();
        let tag = unique();
        let subjects = Subjects::new(&format!("t{tag}")).unwrap();
        let root = PathBuf::from(format!("/var/tmp/berth-test-{tag}"));
        std::fs::create_dir_all(&root).unwrap();
        let nats = async_nats::connect(nats_url()).await.unwrap();
        let js = async_nats::jetstream::new(nats.clone());
        berth_schemas::streams::ensure_streams(&js, &subjects)
            .await
            .unwrap();
        let shutdown = CancellationToken::new();
        let mut tasks = Vec::new();
        {
            let (db, nats, subjects, stop) =
                (db.clone(), nats.clone(), subjects.clone(), shutdown.clone());
            tasks.push(tokio::spawn(async move {
                berth_scheduler::run(
                    berth_scheduler::SchedulerConfig { subjects },
                    db,
                    nats,
                    stop,
                )
                .await
                .unwrap()
            }));
        }
        {
            let (db, nats, subjects, stop) =
                (db.clone(), nats.clone(), subjects.clone(), shutdown.clone());
            tasks.push(tokio::spawn(async move {
                let mut config = berth_reconciler::ReconcilerConfig::new(subjects);
                config.pass = pass;
                berth_reconciler::run(config, db, nats, stop).await.unwrap()
            }));
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = berth_api::AppState {
            db: db.clone(),
            nats: nats.clone(),
            subjects: subjects.clone(),
            config: {
                let mut config = berth_api::ApiConfig::new(addr, subjects.clone());
                configure(&mut config);
                config
            },
            prometheus: berth_api::metrics::handle(),
        };
        {
            let stop = shutdown.clone();
            tasks.push(tokio::spawn(async move {
                berth_api::serve(listener, state, stop).await.unwrap()
            }));
        }
        let (_, key) = berth_api::auth::create_org(&db, &format!("org-{tag}"))
            .await
            .unwrap();
        let mut stack = Stack {
            base: format!("http://{addr}"),
            key,
            db,
            subjects,
            nats,
            // A route that never answers fails its test instead of hanging the run.
            http: reqwest::Client::builder()
                .timeout(HTTP_TIMEOUT)
                .build()
                .unwrap(),
            hosts: Vec::new(),
            root,
            shutdown,
            tasks,
        };
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
        let index = self.hosts.len();
        let state_dir = self.root.join(format!("host{index}"));
        std::fs::create_dir_all(&state_dir).unwrap();
        // A random /16 in 10.64.0.0/10, unlikely to meet another test's.
        let address_pool = Ipv4Addr::new(10, 64 + rand::random::<u8>() % 64, 0, 0);
        let mut host = HostProcess {
            state_dir,
            child: None,
            host_id: HostId::new(),
            address_pool,
            capacity,
        };
        self.spawn_host_with(&mut host, extra_args).await;
        self.hosts.push(host);
        index
    }

    /// Restarts the process of host `index` (after [`HostProcess::stop`]).
    pub async fn restart_host(&mut self, index: usize) {
        let mut host = std::mem::replace(
            &mut self.hosts[index],
            HostProcess {
                state_dir: Default::default(),
                child: None,
                host_id: HostId::new(),
                address_pool: Ipv4Addr::UNSPECIFIED,
                capacity: (None, None),
            },
        );
        self.spawn_host(&mut host).await;
        self.hosts[index] = host;
    }

    /// (Re)starts the hostd process of `host` and waits until its heartbeat is in `hosts`.
    pub async fn spawn_host(&self, host: &mut HostProcess) {
        self.spawn_host_with(host, &[]).await
    }

    /// Like [`Stack::spawn_host`], with extra `berth hostd` flags.
    pub async fn spawn_host_with(&self, host: &mut HostProcess, extra_args: &[String]) {
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
            .args(extra_args)
            .env("NATS_URL", nats_url())
            .env("BERTH_SUBJECT_PREFIX", self.subjects.prefix())
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
            if let Ok(id) = berth_hostd::host_id(&host.state_dir) {
                host.host_id = id;
                let seen: Option<i64> = sqlx::query_scalar(
                    "SELECT 1::int8 FROM hosts WHERE id = $1 AND state = 'ready'",
                )
                .bind(id)
                .fetch_optional(&self.db)
                .await
                .unwrap();
                if seen.is_some() {
                    return;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "hostd in {} sent no heartbeat; see its log",
                host.state_dir.display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// An authenticated request with this stack's key.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        self.call_as(&self.key, method, path, body).await
    }

    /// An authenticated request with `key`.
    pub async fn call_as(
        &self,
        key: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut req = self.http.request(method, self.url(path)).bearer_auth(key);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, value)
    }

    /// Creates a sandbox of the base template and returns its id.
    pub async fn create(&self) -> String {
        let (status, body) = self
            .call(
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "base", "vcpus": 1, "memory_mib": 256})),
            )
            .await;
        assert_eq!(status, 202, "{body}");
        body["id"].as_str().unwrap().to_owned()
    }

    /// Polls until the sandbox is in `state`; panics with its last view after the timeout.
    pub async fn wait_state(&self, id: &str, state: &str) -> Value {
        let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
        loop {
            let (status, body) = self
                .call(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
                .await;
            assert_eq!(status, 200, "{body}");
            if body["state"] == state {
                return body;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "sandbox {id} never reached {state}; last seen {body}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs `cmd` in the sandbox and returns the response body.
    pub async fn exec(&self, id: &str, cmd: &[&str]) -> (u16, Value) {
        self.call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({ "cmd": cmd, "timeout_ms": 10_000 })),
        )
        .await
    }

    /// The state of a sandbox, read from its row.
    pub async fn state_of(&self, id: &str) -> String {
        sqlx::query_scalar("SELECT state FROM sandboxes WHERE id = $1::uuid")
            .bind(id)
            .fetch_one(&self.db)
            .await
            .unwrap()
    }

    /// Sends a lifecycle request (`stop`, `start`, `pause`, `resume`) and returns the status.
    pub async fn request(&self, id: &str, what: &str) -> (u16, Value) {
        self.call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/{what}"),
            None,
        )
        .await
    }

    /// Deletes a sandbox and returns the status.
    pub async fn delete(&self, id: &str) -> (u16, Value) {
        self.call(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{id}"),
            None,
        )
        .await
    }

    /// Whether any host still runs a container of `id` (by `runc list`).
    pub fn container_exists(&self, id: &str) -> bool {
        self.hosts.iter().any(|h| {
            let out = std::process::Command::new("runc")
                .arg("--root")
                .arg(h.runc_root())
                .args(["list", "-q"])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).contains(&id.replace('-', "")[..12])
                || String::from_utf8_lossy(&out.stdout).contains(id)
        })
    }

    /// What any host left of a sandbox: its container, netns, host veth, mounts and directory,
    /// looked up by the names hostd derives for it.
    pub fn leftovers(&self, id: &str) -> Vec<String> {
        let sandbox: berth_schemas::SandboxId = id.parse().unwrap();
        let netns = std::process::Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap();
        let netns = String::from_utf8_lossy(&netns.stdout).into_owned();
        let links = std::process::Command::new("ip")
            .args(["-o", "link"])
            .output()
            .unwrap();
        let links = String::from_utf8_lossy(&links.stdout).into_owned();
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
        let mut found = Vec::new();
        if self.container_exists(id) {
            found.push("a runc container".to_owned());
        }
        for host in &self.hosts {
            let names = berth_hostd::layout::SandboxNames::derive(host.host_id, sandbox);
            if netns
                .lines()
                .any(|l| l.split_whitespace().next() == Some(names.netns.as_str()))
            {
                found.push(format!("netns {}", names.netns));
            }
            if links.contains(&format!(" {}@", names.veth_host))
                || links.contains(&format!(" {}:", names.veth_host))
            {
                found.push(format!("veth {}", names.veth_host));
            }
            let dir = host.state_dir.join("sandboxes").join(id);
            if dir.exists() {
                found.push(format!("dir {}", dir.display()));
            }
        }
        found.extend(
            mounts
                .lines()
                .filter(|l| l.contains(id))
                .map(|l| format!("mount {l}")),
        );
        found
    }

    /// Guarantee 4: every host's reservation equals what its capacity-holding sandboxes need.
    pub async fn assert_no_capacity_drift(&self) {
        let drift = berth_reconciler::pass::capacity_drift(&self.db)
            .await
            .unwrap();
        assert_eq!(drift, (0, 0), "capacity drift (vcpus, memory_mib)");
    }

    /// Stops everything this stack started and deletes its streams and files.
    pub async fn teardown(mut self) {
        for host in &mut self.hosts {
            host.thaw_if_frozen();
            host.stop(false).await;
            // A hostd that still held sandboxes kept its nftables table.
            let table = berth_hostd::layout::firewall_table(host.host_id);
            let _ = std::process::Command::new("nft")
                .args(["delete", "table", "inet", &table])
                .stderr(Stdio::null())
                .status();
        }
        self.shutdown.cancel();
        for task in self.tasks.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
        let js = async_nats::jetstream::new(self.nats.clone());
        berth_schemas::streams::delete_streams(&js, &self.subjects).await;
        // Never recurse through a live mount (a leaked overlay would delete through it).
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        let root = self.root.to_string_lossy().into_owned();
        if mounts
            .lines()
            .any(|l| l.split(' ').nth(1).is_some_and(|m| m.starts_with(&root)))
        {
            eprintln!("leaving {root} in place: something is still mounted below it");
        } else {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}
