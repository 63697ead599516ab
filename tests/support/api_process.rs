//! A `berth api` child process beside a test's [`Stack`]: the same database, NATS and subject
//! prefix, its own listener, flags and metrics. Tests that measure the API process (its
//! resident memory, its own `/metrics`) use one, since the in-process API shares the test
//! binary's memory and metrics recorder with every other test.

use std::process::Stdio;

use tokio::process::{Child, Command};

use super::env::{eventually, nats_url};
use super::stack::Stack;

/// A running `berth api`; killed (by the PID we started) when dropped.
pub struct ApiProcess {
    pub child: Child,
    pub pid: u32,
    pub base: String,
}

impl ApiProcess {
    /// Starts `berth api` for `stack` with `args` and waits until it answers `/healthz`; its
    /// public listener serves `/metrics` too ([`ApiProcess::metric`] reads them there) unless
    /// `args` name a `--metrics-addr`.
    pub async fn spawn(stack: &Stack, args: &[&str]) -> ApiProcess {
        Self::spawn_with_env(stack, args, &[]).await
    }

    /// [`ApiProcess::spawn`] with extra environment (e.g. `BERTH_OBJECT_STORE`).
    pub async fn spawn_with_env(stack: &Stack, args: &[&str], env: &[(&str, &str)]) -> ApiProcess {
        let mut args = args.to_vec();
        if !args.contains(&"--metrics-addr") {
            args.push("--metrics-on-api");
        }
        Self::spawn_exact_env(stack, &args, env).await
    }

    /// Starts `berth api` for `stack` with exactly `args` (its defaults otherwise) and waits
    /// until it answers `/healthz`.
    pub async fn spawn_exact(stack: &Stack, args: &[&str]) -> ApiProcess {
        Self::spawn_exact_env(stack, args, &[]).await
    }

    async fn spawn_exact_env(stack: &Stack, args: &[&str], env: &[(&str, &str)]) -> ApiProcess {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        };
        let listen = format!("127.0.0.1:{port}");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(stack.root.join(format!("api-{port}.log")))
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_berth"))
            .arg("api")
            .arg("--listen")
            .arg(&listen)
            .args(args)
            .env("DATABASE_URL", database_url(stack))
            .env("NATS_URL", nats_url())
            .env("BERTH_SUBJECT_PREFIX", stack.subjects.prefix())
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn berth api");
        let pid = child.id().expect("a pid");
        let base = format!("http://{listen}");
        let health = format!("{base}/healthz");
        eventually("the berth api process answers /healthz", || {
            let health = health.clone();
            async move {
                reqwest::get(&health)
                    .await
                    .is_ok_and(|r| r.status().is_success())
            }
        })
        .await;
        ApiProcess { child, pid, base }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The process's resident memory, in bytes (`VmRSS` of `/proc/<pid>/status`).
    pub fn rss_bytes(&self) -> u64 {
        rss_bytes(self.pid)
    }

    /// The value of the Prometheus sample whose line starts with `prefix` (0 when absent).
    pub async fn metric(&self, prefix: &str) -> f64 {
        let text = reqwest::get(self.url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find(|line| line.starts_with(prefix))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }
}

/// The resident memory of process `pid`, in bytes.
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/<pid>/status");
    kib * 1024
}

/// The URL of the stack's database (the test's own, on the server of `DATABASE_URL`).
pub fn database_url(stack: &Stack) -> String {
    let server = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let name = stack
        .db
        .connect_options()
        .get_database()
        .expect("a database name")
        .to_owned();
    let (prefix, _) = server.rsplit_once('/').expect("a database URL");
    format!("{prefix}/{name}")
}

impl Drop for ApiProcess {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}
