//! One hostd under test, in-process (`berth_hostd::run`, with the `berth` binary of this
//! package as the in-sandbox agent), against the real NATS JetStream (a unique subject prefix
//! and streams), runc/runsc, overlayfs and network namespaces, plus the NATS handles to drive
//! it. Everything the hostd made is removed when the harness drops, also after a panic.
//!
//! Needs root, runc, iproute2 and `/bin/busybox` (busybox-static), and NATS at `NATS_URL`
//! (default `nats://127.0.0.1:4222`).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use async_nats::jetstream::{self, consumer::pull, AckKind};
use berth_hostd::layout::SandboxNames;
use berth_hostd::HostdConfig;
use berth_schemas::wire::{
    self, AgentOp, AgentReply, AgentRequest, Command, CommandResult, ExecSpec, GuestStatus,
    Heartbeat, ResultOutcome, SandboxSpec,
};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, OrgId, SandboxId, Subjects};
use futures::StreamExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::support::cleanup;
use crate::support::env::{init_tracing, is_root, nats_url, path_str, run, run_quietly};

/// How long the test waits for one command result.
pub(crate) const RESULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the test waits for a heartbeat showing what it expects.
pub(crate) const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(20);

/// Heartbeat interval of the hostd under test.
pub(crate) const TEST_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);

/// NATS request timeout for exec.
pub(crate) const EXEC_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The id of the container the test leaves for hostd's orphan sweep.
pub(crate) const ORPHAN_CONTAINER: &str = "orphan";

/// Default exec timeout given to the agent.
pub(crate) const EXEC_TIMEOUT_MS: u64 = 10_000;

/// The writable disk of the harness's sandboxes, in MiB.
pub(crate) const HARNESS_DISK_MIB: u32 = 256;

/// One hostd under test plus the NATS handles to drive it.
pub(crate) struct Harness {
    pub(crate) subjects: Subjects,
    pub(crate) state_dir: PathBuf,
    pub(crate) config: HostdConfig,
    pub(crate) host_id: HostId,
    pub(crate) nats: async_nats::Client,
    pub(crate) js: jetstream::Context,
    pub(crate) results: jetstream::consumer::pull::Stream,
    pub(crate) unclaimed: VecDeque<CommandResult>,
    pub(crate) heartbeats: async_nats::Subscriber,
    pub(crate) hostd: Option<(
        CancellationToken,
        JoinHandle<Result<(), berth_hostd::HostdError>>,
    )>,
    pub(crate) sandboxes: std::sync::Mutex<Vec<SandboxId>>,
    /// hostd as a `berth hostd` child process instead of a task (so it can be killed).
    pub(crate) process: Option<tokio::process::Child>,
}

impl Harness {
    pub(crate) async fn new() -> anyhow::Result<Self> {
        let subjects = crate::support::unique_subjects();
        let state_dir = cleanup::fresh_dir("hostd");
        let mut config = HostdConfig::new(nats_url(), subjects.clone(), &state_dir, "test-host");
        config.agent_binary = PathBuf::from(env!("CARGO_BIN_EXE_berth"));
        config.heartbeat_interval = TEST_HEARTBEAT_INTERVAL;
        config.address_pool = unused_pool().await?;
        let host_id = berth_hostd::host_id(&state_dir)?;
        cleanup::register_host(host_id, &state_dir);

        let nats = async_nats::connect(nats_url()).await?;
        let js = jetstream::new(nats.clone());
        berth_hostd::ensure_streams(&js, &subjects).await?;
        let results = js
            .get_stream(subjects.result_stream())
            .await?
            .create_consumer(pull::Config {
                filter_subject: subjects.result(host_id),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                // An ephemeral consumer no pull reaches for this long is deleted by the
                // server; a test busy elsewhere (probing sandboxes) must still find it.
                inactive_threshold: Duration::from_secs(600),
                ..Default::default()
            })
            .await?
            .messages()
            .await?;
        let heartbeats = nats.subscribe(subjects.heartbeat(host_id)).await?;
        Ok(Self {
            subjects,
            state_dir,
            config,
            host_id,
            nats,
            js,
            results,
            unclaimed: VecDeque::new(),
            heartbeats,
            hostd: None,
            sandboxes: std::sync::Mutex::new(Vec::new()),
            process: None,
        })
    }

    pub(crate) fn start_hostd(&mut self) {
        let token = CancellationToken::new();
        let task = tokio::spawn(berth_hostd::run(self.config.clone(), token.clone()));
        self.hostd = Some((token, task));
    }

    pub(crate) async fn stop_hostd(&mut self) -> anyhow::Result<()> {
        if let Some((token, task)) = self.hostd.take() {
            token.cancel();
            task.await?.context("hostd run")?;
        }
        Ok(())
    }

    /// Starts hostd as a `berth hostd` child process on this harness's state dir, NATS
    /// subjects and address pool (so the same host id), logging to `hostd.log` in the state
    /// dir. `crash_at` is its fault-injection crash point (`berth_hostd::fault`), if any.
    pub(crate) fn spawn_hostd_process(&mut self, crash_at: Option<&str>) -> anyhow::Result<()> {
        ensure!(
            self.hostd.is_none() && self.process.is_none(),
            "hostd already runs"
        );
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state_dir.join("hostd.log"))?;
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_berth"));
        command
            .arg("hostd")
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--address-pool")
            .arg(self.config.address_pool.to_string())
            .arg("--name")
            .arg(&self.config.name)
            .arg("--heartbeat-interval")
            .arg(humantime::format_duration(self.config.heartbeat_interval).to_string())
            .env("NATS_URL", &self.config.nats_url)
            .env("BERTH_SUBJECT_PREFIX", self.subjects.prefix())
            .env("BERTH_WARM_POOL", self.config.warm_pool.to_string())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env_remove(berth_hostd::fault::CRASH_AT_ENV)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        if let Some(point) = crash_at {
            command.env(berth_hostd::fault::CRASH_AT_ENV, point);
        }
        self.process = Some(command.spawn().context("spawn berth hostd")?);
        Ok(())
    }

    /// Waits until the hostd child process has died of SIGKILL: its crash point fired.
    pub(crate) async fn await_crash(&mut self) -> anyhow::Result<()> {
        let mut child = self.process.take().context("no hostd process")?;
        let status = tokio::time::timeout(RESULT_TIMEOUT, child.wait())
            .await
            .context("hostd did not crash at its crash point")??;
        use std::os::unix::process::ExitStatusExt;
        ensure!(
            status.signal() == Some(nix::sys::signal::Signal::SIGKILL as i32),
            "hostd ended otherwise than by its crash point: {status}"
        );
        Ok(())
    }

    /// Stops the hostd child process with SIGTERM and waits for it to exit cleanly.
    pub(crate) async fn stop_hostd_process(&mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.process.take() else {
            return Ok(());
        };
        let pid = child.id().context("hostd already reaped")?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        let status = tokio::time::timeout(RESULT_TIMEOUT, child.wait())
            .await
            .context("hostd did not stop after SIGTERM")??;
        ensure!(status.success(), "hostd exited with {status}");
        Ok(())
    }

    pub(crate) fn runc_root(&self) -> PathBuf {
        self.state_dir.join("runc")
    }

    pub(crate) fn runsc_root(&self) -> PathBuf {
        self.state_dir.join("runsc")
    }

    pub(crate) fn names(&self, sandbox: SandboxId) -> SandboxNames {
        SandboxNames::derive(self.host_id, sandbox)
    }

    pub(crate) fn command(
        &self,
        sandbox: SandboxId,
        generation: i64,
        kind: CommandKind,
    ) -> Command {
        self.command_with_template(sandbox, generation, kind, "base")
    }

    pub(crate) fn command_with_template(
        &self,
        sandbox: SandboxId,
        generation: i64,
        kind: CommandKind,
        template: &str,
    ) -> Command {
        self.command_with_disk(sandbox, generation, kind, template, HARNESS_DISK_MIB)
    }

    /// A command for `sandbox` from `template` whose writable disk is `disk_mib` MiB.
    pub(crate) fn command_with_disk(
        &self,
        sandbox: SandboxId,
        generation: i64,
        kind: CommandKind,
        template: &str,
        disk_mib: u32,
    ) -> Command {
        let mut tracked = self.sandboxes.lock().expect("not poisoned");
        if !tracked.contains(&sandbox) {
            tracked.push(sandbox);
        }
        Command {
            snapshot: None,
            id: CommandId::new(),
            sandbox_id: sandbox,
            generation: Generation(generation),
            kind,
            spec: Some(SandboxSpec {
                org_id: OrgId::new(),
                template: template.to_owned(),
                resources: berth_schemas::wire::Resources {
                    vcpus: 1,
                    memory_mib: 256,
                },
                // What Postgres names for the built-in template (the API copies it from
                // `templates.runtime` at create).
                runtime: berth_hostd::template::lookup(template)
                    .map_or("runc", |def| def.runtime)
                    .parse()
                    .expect("a built-in template names a known runtime"),
                disk_mib,
                network: Default::default(),
                env: Vec::new(),
                entrypoint: Vec::new(),
                image: None,
            }),
        }
    }

    /// Publishes with `Nats-Msg-Id` = command id, as the outbox relay does.
    pub(crate) async fn publish(&self, cmd: &Command) -> anyhow::Result<()> {
        let publish = jetstream::context::Publish::build()
            .payload(wire::encode(cmd).into())
            .message_id(cmd.id.to_string());
        self.js
            .send_publish(self.subjects.cmd(self.host_id), publish)
            .await?
            .await?;
        Ok(())
    }

    /// Publishes without a message id: a redelivery the stream's dedup window can't catch.
    pub(crate) async fn publish_again(&self, cmd: &Command) -> anyhow::Result<()> {
        self.js
            .publish(self.subjects.cmd(self.host_id), wire::encode(cmd).into())
            .await?
            .await?;
        Ok(())
    }

    /// The next result of `command`, acking every result read on the way.
    /// Waits for the durability report of the stop `command` (its second result: the stop
    /// snapshot stored, and the disk the upload mounted to read released again), skipping any
    /// repeat of its first. A test that looks at a stopped sandbox's mounts or disk image waits
    /// for this first: the upload runs in the background after the stop's answer.
    pub(crate) async fn durable(&mut self, command: CommandId) -> anyhow::Result<()> {
        loop {
            if let ResultOutcome::Durable(_) = self.result_of(command).await?.outcome {
                return Ok(());
            }
        }
    }

    pub(crate) async fn result_of(&mut self, command: CommandId) -> anyhow::Result<CommandResult> {
        if let Some(pos) = self.unclaimed.iter().position(|r| r.command_id == command) {
            return Ok(self.unclaimed.remove(pos).expect("position is valid"));
        }
        let deadline = tokio::time::Instant::now() + RESULT_TIMEOUT;
        loop {
            let next = match tokio::time::timeout_at(deadline, self.results.next())
                .await
                .with_context(|| format!("no result for command {command}"))?
                .context("result stream ended")?
            {
                // A stream left unpolled for longer than twice its idle heartbeat (a test busy
                // with probes) reports that once on the next poll, then goes on.
                Err(e) if e.kind() == pull::MessagesErrorKind::MissingHeartbeat => continue,
                other => other.map_err(|e| anyhow::anyhow!("result stream: {e}"))?,
            };
            next.ack_with(AckKind::Ack)
                .await
                .map_err(|e| anyhow::anyhow!("ack: {e}"))?;
            let result: CommandResult = wire::decode(&next.payload)?;
            if result.command_id == command {
                return Ok(result);
            }
            self.unclaimed.push_back(result);
        }
    }

    pub(crate) async fn send(&mut self, cmd: &Command) -> anyhow::Result<CommandResult> {
        self.publish(cmd).await?;
        let result = self.result_of(cmd.id).await?;
        ensure!(result.sandbox_id == cmd.sandbox_id && result.host_id == self.host_id);
        ensure!(result.generation == cmd.generation && result.kind == cmd.kind);
        Ok(result)
    }

    /// A plain exec: the agent request's [`AgentOp::Exec`] (it replaced `{p}.exec`).
    pub(crate) async fn exec(
        &self,
        sandbox: SandboxId,
        argv: &[&str],
        timeout_ms: u64,
    ) -> anyhow::Result<AgentReply> {
        self.agent(sandbox, AgentOp::Exec(exec_spec(argv, timeout_ms)))
            .await
    }

    pub(crate) async fn agent(
        &self,
        sandbox: SandboxId,
        op: AgentOp,
    ) -> anyhow::Result<AgentReply> {
        let request = AgentRequest {
            sandbox_id: sandbox,
            op,
        };
        let payload: bytes::Bytes = wire::encode(&request).into();
        let deadline = tokio::time::Instant::now() + EXEC_REQUEST_TIMEOUT;
        loop {
            let reply = tokio::time::timeout_at(
                deadline,
                self.nats
                    .request(self.subjects.agent(self.host_id), payload.clone()),
            )
            .await
            .context("agent request timed out")?;
            match reply {
                Ok(reply) => return Ok(wire::decode(&reply.payload)?),
                // A hostd just (re)started answers heartbeats and adopts its sandboxes before its
                // agent subscription reaches the server: asked in between, the server answers
                // at once that nobody listens. Asked again until the deadline, as a client would.
                Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Waits for a heartbeat in which `sandbox` has `status`.
    pub(crate) async fn heartbeat_with(
        &mut self,
        sandbox: SandboxId,
        status: GuestStatus,
    ) -> anyhow::Result<Heartbeat> {
        let deadline = tokio::time::Instant::now() + HEARTBEAT_TIMEOUT;
        loop {
            let msg = tokio::time::timeout_at(deadline, self.heartbeats.next())
                .await
                .with_context(|| format!("no heartbeat with {sandbox} {status:?}"))?
                .context("heartbeat subscription ended")?;
            let hb: Heartbeat = wire::decode(&msg.payload)?;
            if hb
                .inventory
                .iter()
                .any(|i| i.sandbox_id == sandbox && i.status == status)
            {
                return Ok(hb);
            }
        }
    }

    /// Container ids in this hostd's runc root.
    pub(crate) async fn containers(&self) -> anyhow::Result<Vec<(String, String)>> {
        let out = run(
            "runc",
            &[
                "--root",
                &path_str(&self.runc_root()),
                "list",
                "--format",
                "json",
            ],
        )
        .await?;
        let list: Option<Vec<serde_json::Value>> = serde_json::from_str(&out)?;
        Ok(list
            .unwrap_or_default()
            .into_iter()
            .map(|c| {
                (
                    c["id"].as_str().unwrap_or("").to_owned(),
                    c["status"].as_str().unwrap_or("").to_owned(),
                )
            })
            .collect())
    }

    pub(crate) fn sandbox_dir(&self, sandbox: SandboxId) -> PathBuf {
        self.state_dir.join("sandboxes").join(sandbox.to_string())
    }

    /// Stops hostd gracefully; dropping the harness then removes the rest.
    pub(crate) async fn teardown(mut self) {
        if let Err(e) = self.stop_hostd().await {
            eprintln!("teardown: hostd: {e:#}");
        }
        if let Err(e) = self.stop_hostd_process().await {
            eprintln!("teardown: hostd process: {e:#}");
        }
    }
}

impl Drop for Harness {
    /// Stops hostd if it still runs, then removes everything the test may have left (the
    /// containers, networks, mounts and nftables table of this host, including those of the
    /// sandboxes the test tracked), the streams and the state dir.
    fn drop(&mut self) {
        if let Some((token, task)) = self.hostd.take() {
            token.cancel();
            task.abort();
        }
        if let Some(mut child) = self.process.take() {
            let _ = child.start_kill();
            if let Some(pid) = child.id() {
                // Reap it, so its runtime children are not mid-create while we clean up.
                let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid as i32), None);
            }
        }
        let tracked = self.sandboxes.lock().map(|s| s.clone()).unwrap_or_default();
        for sandbox in tracked {
            let names = self.names(sandbox);
            run_quietly("ip", &["link", "del", &names.veth_host]);
            run_quietly("ip", &["netns", "del", &names.netns]);
        }
        for what in cleanup::remove_host_leftovers(self.host_id, &self.state_dir) {
            eprintln!("cleanup: removed {what}");
        }
        cleanup::delete_streams_blocking(&self.subjects);
        if std::thread::panicking() {
            eprintln!(
                "test failed: hostd's state is in {}",
                self.state_dir.display()
            );
        } else {
            cleanup::remove_dir_unless_mounted(&self.state_dir);
        }
    }
}

/// A /16 under 10/8 none of whose addresses is configured on this machine.
pub(crate) async fn unused_pool() -> anyhow::Result<std::net::Ipv4Addr> {
    let used = run("ip", &["-o", "-4", "addr", "show"]).await?;
    for _ in 0..64 {
        let second: u8 = rand::random_range(64..=250);
        let prefix = format!(" 10.{second}.");
        if !used.contains(&prefix) {
            return Ok(std::net::Ipv4Addr::new(10, second, 0, 0));
        }
    }
    bail!("no unused 10.x.0.0/16 found")
}

pub(crate) fn finished(reply: &AgentReply) -> anyhow::Result<(i32, String, bool)> {
    match reply {
        AgentReply::Exec {
            exit_code,
            stdout,
            timed_out,
            ..
        } => Ok((
            *exit_code,
            String::from_utf8_lossy(stdout).into_owned(),
            *timed_out,
        )),
        other => bail!("exec failed: {other:?}"),
    }
}

pub(crate) fn succeeded_address(result: &CommandResult) -> anyhow::Result<String> {
    match &result.outcome {
        ResultOutcome::Succeeded {
            address: Some(address),
            last_stop: None,
        } => Ok(address.clone()),
        other => bail!("expected success with an address, got {other:?}"),
    }
}

pub(crate) fn exec_spec(argv: &[&str], timeout_ms: u64) -> ExecSpec {
    ExecSpec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: vec![],
        cwd: None,
        stdin: vec![],
        timeout_ms,
    }
}

/// The loop devices whose backing file lies below `dir` (from `/sys/block/loop*/loop`).
pub(crate) fn loop_devices_below(dir: &std::path::Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            let backing = backing.trim().trim_end_matches(" (deleted)");
            std::path::Path::new(backing)
                .starts_with(dir)
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect()
}

/// The pids of processes whose command line names a path below `dir` (a console writer of a
/// sandbox in `dir`, say).
pub(crate) fn processes_naming(dir: &std::path::Path) -> Vec<u32> {
    let needle = path_str(dir);
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            cmdline.contains(&needle).then_some(pid)
        })
        .collect()
}

/// Sends the sandbox's stop at `generation` and checks it kept memory (a gVisor sandbox);
/// `what` says what the sandbox holds, for the failure.
pub(crate) async fn stop_with_memory(
    h: &mut Harness,
    sandbox: SandboxId,
    generation: i64,
    what: &str,
) -> anyhow::Result<()> {
    let stopped = h
        .send(&h.command(sandbox, generation, CommandKind::Stop))
        .await?;
    ensure!(
        stopped.outcome
            == ResultOutcome::Succeeded {
                address: None,
                last_stop: Some(wire::StopMode::Memory),
            },
        "{what}: {stopped:?}"
    );
    Ok(())
}

/// The pid the runtime wrote at boot (`init.pid`, which hostd finds the sandbox's OOM counter
/// by without asking the runtime) is a process in the sandbox's own cgroup.
pub(crate) fn assert_booted_pid_in_own_cgroup(
    h: &Harness,
    sandbox: SandboxId,
) -> anyhow::Result<()> {
    let pid_file = h.sandbox_dir(sandbox).join("init.pid");
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .with_context(|| format!("read {}", pid_file.display()))?
        .trim()
        .parse()?;
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let own = h.names(sandbox).cgroup;
    ensure!(
        cgroups.lines().any(|l| l.ends_with(&format!("/{own}"))),
        "process {pid} of init.pid is not in the sandbox's cgroup {own}: {cgroups}"
    );
    Ok(())
}

/// No container, netns, veth, mount, loop device, console writer or sandbox dir of `sandbox`
/// exists.
pub(crate) async fn assert_nothing_remains(h: &Harness, sandbox: SandboxId) -> anyhow::Result<()> {
    let names = h.names(sandbox);
    let containers = h.containers().await?;
    ensure!(
        !containers.iter().any(|(id, _)| *id == names.container_id),
        "container remains: {containers:?}"
    );
    let netns = run("ip", &["netns", "list"]).await?;
    ensure!(
        !netns.contains(&names.netns),
        "netns {} remains",
        names.netns
    );
    // The kernel removes the veth pair with the namespace, after the delete answered.
    let veth = names.veth_host.clone();
    crate::support::env::eventually(&format!("veth {veth} is gone"), || {
        let gone = !berth_hostd::netns::host_link_exists(&veth);
        async move { gone }
    })
    .await;
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    ensure!(
        !mounts.contains(&path_str(&h.sandbox_dir(sandbox))),
        "a mount under the sandbox dir remains"
    );
    let loops = loop_devices_below(&h.sandbox_dir(sandbox));
    ensure!(loops.is_empty(), "loop devices remain: {loops:?}");
    // A console writer ends once the last holder of its pipe (the container) is gone.
    let dir = h.sandbox_dir(sandbox);
    crate::support::env::eventually(
        "no process names the sandbox dir (its console writer)",
        || {
            let none = processes_naming(&dir).is_empty();
            async move { none }
        },
    )
    .await;
    ensure!(!h.sandbox_dir(sandbox).exists(), "sandbox dir remains");
    Ok(())
}

/// A test body over the harness.
pub(crate) type Body =
    for<'a> fn(&'a mut Harness) -> futures::future::BoxFuture<'a, anyhow::Result<()>>;

/// Runs `body` on a harness, then tears the harness down even when `body` failed or panicked.
pub(crate) async fn with_harness(body: Body) -> anyhow::Result<()> {
    init_tracing("info,async_nats=warn");
    ensure!(is_root(), "this test needs root");
    let mut harness = Harness::new().await?;
    harness.start_hostd();
    let outcome = {
        let harness_ref = &mut harness;
        // Catch panics so the teardown below always runs.
        futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(body(harness_ref))).await
    };
    harness.teardown().await;
    match outcome {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}
