//! The multi-host topology of `deploy/topology`, driven from a test: brought up on the test's
//! own database (three clustered nats-server, two APIs, two reconcilers, a scheduler, hostd in
//! network namespaces), its parts killed and restarted by the PIDs the script recorded, and
//! brought down — everything it made removed — when the [`Topology`] drops, also after a panic.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sqlx::PgPool;

use crate::support::cleanup;
use crate::support::env::{HTTP_TIMEOUT, SETTLE_TIMEOUT};

/// The script every topology comes from.
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/topology");
/// A poll of a condition the topology reaches on its own.
const POLL: Duration = Duration::from_millis(200);

/// One running topology.
pub struct Topology {
    /// Its directory (state, logs, PIDs, `topology.env`).
    pub dir: PathBuf,
    /// The test's database, which the topology runs on.
    pub db: PgPool,
    /// The two APIs' base URLs.
    pub api_urls: Vec<String>,
    /// The org's API key.
    pub key: String,
    /// The three NATS servers' monitoring URLs, in node order.
    pub nats_monitor: Vec<String>,
    /// The two reconcilers' metrics URLs, in process order.
    pub reconciler_metrics: Vec<String>,
    /// The network-name prefix (netns `<prefix>-hN`, veth `<prefix>vN`, bridge `<prefix>br`,
    /// the firewall's nftables table `inet <prefix>`).
    pub prefix: String,
    /// The bridge's /24, as its first three octets (`10.249.7`): the bridge is `.1`, host N
    /// `.(10 + N)`.
    pub net: String,
    /// The three NATS servers' client addresses on the bridge, in node order.
    pub nats_addrs: Vec<SocketAddr>,
    /// How many hosts.
    pub hosts: usize,
    /// The port each hostd serves metrics on, inside its namespace.
    pub host_metrics_port: u16,
    /// An HTTP client whose requests end after [`HTTP_TIMEOUT`].
    pub http: reqwest::Client,
}

impl Topology {
    /// Runs `deploy/topology up` with `hosts` hosts on `db`, with `env` (e.g. the reconciler's
    /// short thresholds) given to every part; returns once every host is ready.
    pub async fn up(db: PgPool, hosts: usize, env: &[(&str, &str)]) -> Topology {
        let dir = cleanup::fresh_dir("topology");
        let tag: u16 = rand::random();
        let net = format!("10.249.{}", tag % 250);
        // Below the kernel's ephemeral range (32768 and up here): a port in it may be taken by
        // any outgoing connection on the machine, and api2 once failed to bind 53732.
        let port_base = 20_000 + u32::from(tag % 120) * 100;
        let prefix = format!("bt{tag:04x}");
        let out = Command::new(SCRIPT)
            .args(["up", "--dir"])
            .arg(&dir)
            .args(["--hosts", &hosts.to_string(), "--net", &net])
            .args(["--port-base", &port_base.to_string(), "--prefix", &prefix])
            .env("DATABASE_URL", database_url(&db))
            .env("BERTH_BIN", env!("CARGO_BIN_EXE_berth"))
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(env.iter().copied())
            .output()
            .expect("run deploy/topology");
        assert!(
            out.status.success(),
            "deploy/topology up failed:\n{}\n{}\nlogs in {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            dir.display()
        );
        let vars = read_env(&dir.join("topology.env"));
        let list = |k: &str| -> Vec<String> { vars[k].split(',').map(str::to_owned).collect() };
        Topology {
            api_urls: list("TOPOLOGY_API_URLS"),
            key: vars["TOPOLOGY_API_KEY"].clone(),
            nats_monitor: list("TOPOLOGY_NATS_MONITOR"),
            reconciler_metrics: list("TOPOLOGY_RECONCILER_METRICS"),
            nats_addrs: list("TOPOLOGY_NATS_URLS")
                .iter()
                .map(|u| u.trim_start_matches("nats://").parse().unwrap())
                .collect(),
            prefix,
            net,
            hosts,
            host_metrics_port: vars["TOPOLOGY_HOST_METRICS_PORT"].parse().unwrap(),
            http: reqwest::Client::builder()
                .timeout(HTTP_TIMEOUT)
                .build()
                .unwrap(),
            dir,
            db,
        }
    }

    /// `deploy/topology <verb> <part>`: `start`, `stop` (SIGTERM) or `kill` (SIGKILL), by the
    /// recorded PID; `stop` and `kill` return once the process is gone.
    pub fn part(&self, verb: &str, name: &str) {
        let status = Command::new(SCRIPT)
            .args([verb, name, "--dir"])
            .arg(&self.dir)
            .status()
            .expect("run deploy/topology");
        assert!(status.success(), "deploy/topology {verb} {name} failed");
    }

    /// Whether part `name` (e.g. `api1`) runs, and the last `lines` lines of its log: what a
    /// failed assertion about that part prints.
    pub fn part_state(&self, name: &str, lines: usize) -> String {
        let pid =
            std::fs::read_to_string(self.dir.join(format!("pids/{name}"))).unwrap_or_default();
        let pid = pid.trim();
        let alive = !pid.is_empty() && std::path::Path::new(&format!("/proc/{pid}")).exists();
        let log =
            std::fs::read_to_string(self.dir.join(format!("logs/{name}.log"))).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(lines).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        format!(
            "{name}: pid {pid:?}, alive {alive}; its log's last lines:\n{}",
            tail.join("\n")
        )
    }

    /// Every part (`pids/*`) in name order, each with whether it runs and its log's last
    /// `lines` lines: what a test that saw the topology stall prints.
    pub fn diagnosis(&self, lines: usize) -> String {
        let mut names: Vec<String> = std::fs::read_dir(self.dir.join("pids"))
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
            .iter()
            .map(|name| self.part_state(name, lines))
            .collect::<Vec<_>>()
            .join("\n\n")
    }

    /// The network namespace of host `n` (1-based).
    pub fn netns(&self, n: usize) -> String {
        format!("{}-h{n}", self.prefix)
    }

    /// The bridge side of host `n`'s link (1-based): what a cut or `tc netem` acts on (its peer
    /// is `eth0` in the host's namespace).
    pub fn veth(&self, n: usize) -> String {
        format!("{}v{n}", self.prefix)
    }

    /// The bridge's address: where the NATS servers listen, the hosts' gateway.
    pub fn bridge_ip(&self) -> Ipv4Addr {
        format!("{}.1", self.net).parse().unwrap()
    }

    /// Host `n`'s address on the bridge (1-based).
    pub fn host_ip(&self, n: usize) -> Ipv4Addr {
        format!("{}.{}", self.net, 10 + n).parse().unwrap()
    }

    /// Host `n`'s id (1-based), from its state dir.
    pub fn host_id(&self, n: usize) -> uuid::Uuid {
        let id = std::fs::read_to_string(self.dir.join(format!("hosts/host{n}/host-id")))
            .expect("a started host has an id");
        id.trim().parse().unwrap()
    }

    /// Host `n`'s runc root (1-based).
    pub fn runc_root(&self, n: usize) -> PathBuf {
        self.dir.join(format!("hosts/host{n}/runc"))
    }

    /// The 1-based node whose server is the JetStream meta leader now, asked of any node that
    /// answers.
    pub async fn meta_leader(&self) -> usize {
        let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
        loop {
            for url in &self.nats_monitor {
                let Ok(resp) = self.http.get(format!("{url}/jsz")).send().await else {
                    continue;
                };
                let Ok(body) = resp.json::<serde_json::Value>().await else {
                    continue;
                };
                let leader = body["meta_cluster"]["leader"].as_str().unwrap_or("");
                if let Some(n) = leader
                    .rsplit_once("-n")
                    .and_then(|(_, n)| n.parse::<usize>().ok())
                {
                    return n;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no JetStream meta leader"
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// The 1-based NATS node that leads consumer `consumer` of the stream whose name ends
    /// with `stream_suffix` (e.g. `_RESULT`), as the servers' `/jsz` report it; `None` while
    /// none does.
    pub async fn consumer_leader(&self, stream_suffix: &str, consumer: &str) -> Option<usize> {
        for url in &self.nats_monitor {
            let url = format!("{url}/jsz?accounts=true&streams=true&consumers=true");
            let Ok(resp) = self.http.get(url).send().await else {
                continue;
            };
            let Ok(body) = resp.json::<serde_json::Value>().await else {
                continue;
            };
            let accounts = body["account_details"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            for account in &accounts {
                let streams = account["stream_detail"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                for stream in streams.iter().filter(|s| {
                    s["name"]
                        .as_str()
                        .is_some_and(|n| n.ends_with(stream_suffix))
                }) {
                    let consumers = stream["consumer_detail"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default();
                    for c in consumers.iter().filter(|c| c["name"] == consumer) {
                        let leader = c["cluster"]["leader"].as_str().unwrap_or("");
                        if let Some(n) = leader
                            .rsplit_once("-n")
                            .and_then(|(_, n)| n.parse::<usize>().ok())
                        {
                            return Some(n);
                        }
                    }
                }
            }
        }
        None
    }

    /// The 1-based reconciler that says it leads (`berth_reconciler_is_leader 1`), once one
    /// does.
    pub async fn leader_reconciler(&self) -> usize {
        let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
        loop {
            for (i, url) in self.reconciler_metrics.iter().enumerate() {
                let leads = self
                    .metric(&format!("{url}/metrics"), "berth_reconciler_is_leader")
                    .await
                    .is_some_and(|v| v >= 1.0);
                if leads {
                    return i + 1;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no reconciler leads"
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// The sum of every series of `name` at `url` (Prometheus text), `None` when unreachable
    /// or absent.
    async fn metric(&self, url: &str, name: &str) -> Option<f64> {
        let text = self.http.get(url).send().await.ok()?.text().await.ok()?;
        sum_series(&text, name, |_| true)
    }

    /// hostd `n`'s `berth_hostd_commands_total`, by outcome (read inside its namespace).
    pub fn host_commands(&self, n: usize) -> HashMap<String, f64> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.netns(n), "curl", "-sf"])
            .arg(format!(
                "http://127.0.0.1:{}/metrics",
                self.host_metrics_port
            ))
            .output()
            .expect("run curl in the host's namespace");
        let text = String::from_utf8_lossy(&out.stdout);
        let mut by_outcome = HashMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("berth_hostd_commands_total{") else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once("} ") else {
                continue;
            };
            let outcome = labels
                .split(',')
                .find_map(|l| l.strip_prefix("outcome=\""))
                .map(|o| o.trim_end_matches('"').to_owned())
                .unwrap_or_default();
            *by_outcome.entry(outcome).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
        }
        by_outcome
    }

    /// Runs `program args` and panics with its stderr when it fails (network faults).
    pub fn sh(&self, program: &str, args: &[&str]) {
        let out = Command::new(program).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        let _ = Command::new(SCRIPT)
            .args(["down", "--dir"])
            .arg(&self.dir)
            .status();
        if std::thread::panicking() || std::env::var_os("BERTH_KEEP_TOPOLOGY").is_some() {
            eprintln!(
                "the topology's logs are in {} (kept: a test failed or BERTH_KEEP_TOPOLOGY is set)",
                self.dir.join("logs").display()
            );
        } else {
            cleanup::remove_dir_unless_mounted(&self.dir);
        }
    }
}

/// The URL of the database `db` is connected to, on the server of `DATABASE_URL`.
fn database_url(db: &PgPool) -> String {
    let name = db
        .connect_options()
        .get_database()
        .expect("a test pool names its database")
        .to_owned();
    let mut url: reqwest::Url = std::env::var("DATABASE_URL")
        .expect("DATABASE_URL")
        .parse()
        .unwrap();
    url.set_path(&name);
    url.to_string()
}

/// `KEY=value` lines of a file.
fn read_env(path: &Path) -> HashMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The sum of the series of `name` whose labels pass `keep`, in Prometheus text.
pub fn sum_series(text: &str, name: &str, keep: impl Fn(&str) -> bool) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => match r.rsplit_once("} ") {
                Some(p) => p,
                None => continue,
            },
            None => match rest.strip_prefix(' ') {
                Some(v) => ("", v),
                None => continue,
            },
        };
        if keep(labels) {
            *sum.get_or_insert(0.0) += value.trim().parse::<f64>().unwrap_or(0.0);
        }
    }
    sum
}
