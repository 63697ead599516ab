//! hostd against the real things: NATS JetStream (a unique subject prefix and streams, deleted
//! at the end), runc, overlayfs and network namespaces. Runs `berth_hostd::run` in-process with
//! the `berth` binary of this package as the in-sandbox agent.
//!
//! Needs root, runc, iproute2 and `/bin/busybox` (busybox-static), and NATS at `NATS_URL`
//! (default `nats://127.0.0.1:4222`).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use async_nats::jetstream::{self, consumer::pull, AckKind};
use berth_hostd::layout::SandboxNames;
use berth_hostd::HostdConfig;
use berth_schemas::wire::{
    self, AgentFailure, AgentOp, AgentReply, AgentRequest, Command, CommandResult, ExecSpec,
    FileKind, GuestStatus, Heartbeat, ResultOutcome, SandboxSpec, StopMode,
};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, OrgId, SandboxId, Subjects};
use futures::StreamExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long the test waits for one command result.
const RESULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the test waits for a heartbeat showing what it expects.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(20);

/// Heartbeat interval of the hostd under test.
const TEST_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);

/// NATS request timeout for exec.
const EXEC_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The id of the container the test leaves for hostd's orphan sweep.
const ORPHAN_CONTAINER: &str = "orphan";

/// Default exec timeout given to the agent.
const EXEC_TIMEOUT_MS: u64 = 10_000;

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// One hostd under test plus the NATS handles to drive it.
struct Harness {
    subjects: Subjects,
    state_dir: PathBuf,
    config: HostdConfig,
    host_id: HostId,
    nats: async_nats::Client,
    js: jetstream::Context,
    results: jetstream::consumer::pull::Stream,
    unclaimed: VecDeque<CommandResult>,
    heartbeats: async_nats::Subscriber,
    hostd: Option<(
        CancellationToken,
        JoinHandle<Result<(), berth_hostd::HostdError>>,
    )>,
    sandboxes: std::sync::Mutex<Vec<SandboxId>>,
}

impl Harness {
    async fn new() -> anyhow::Result<Self> {
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let subjects = Subjects::new(&format!("t{tag}"))?;
        let state_dir = PathBuf::from(format!("/var/tmp/berth-hostd-test-{tag}"));
        let mut config = HostdConfig::new(nats_url(), subjects.clone(), &state_dir, "test-host");
        config.agent_binary = PathBuf::from(env!("CARGO_BIN_EXE_berth"));
        config.heartbeat_interval = TEST_HEARTBEAT_INTERVAL;
        config.address_pool = unused_pool().await?;
        let host_id = berth_hostd::host_id(&state_dir)?;

        let nats = async_nats::connect(nats_url()).await?;
        let js = jetstream::new(nats.clone());
        berth_hostd::ensure_streams(&js, &subjects).await?;
        let results = js
            .get_stream(subjects.result_stream())
            .await?
            .create_consumer(pull::Config {
                filter_subject: subjects.result(host_id),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
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
        })
    }

    fn start_hostd(&mut self) {
        let token = CancellationToken::new();
        let task = tokio::spawn(berth_hostd::run(self.config.clone(), token.clone()));
        self.hostd = Some((token, task));
    }

    async fn stop_hostd(&mut self) -> anyhow::Result<()> {
        if let Some((token, task)) = self.hostd.take() {
            token.cancel();
            task.await?.context("hostd run")?;
        }
        Ok(())
    }

    fn runc_root(&self) -> PathBuf {
        self.state_dir.join("runc")
    }

    fn runsc_root(&self) -> PathBuf {
        self.state_dir.join("runsc")
    }

    fn names(&self, sandbox: SandboxId) -> SandboxNames {
        SandboxNames::derive(self.host_id, sandbox)
    }

    fn command(&self, sandbox: SandboxId, generation: i64, kind: CommandKind) -> Command {
        self.command_with_template(sandbox, generation, kind, "base")
    }

    fn command_with_template(
        &self,
        sandbox: SandboxId,
        generation: i64,
        kind: CommandKind,
        template: &str,
    ) -> Command {
        let mut tracked = self.sandboxes.lock().expect("not poisoned");
        if !tracked.contains(&sandbox) {
            tracked.push(sandbox);
        }
        Command {
            id: CommandId::new(),
            sandbox_id: sandbox,
            generation: Generation(generation),
            kind,
            spec: SandboxSpec {
                org_id: OrgId(uuid::Uuid::nil()),
                template: template.to_owned(),
                resources: berth_schemas::wire::Resources {
                    vcpus: 1,
                    memory_mib: 256,
                },
            },
        }
    }

    /// Publishes with `Nats-Msg-Id` = command id, as the outbox relay does.
    async fn publish(&self, cmd: &Command) -> anyhow::Result<()> {
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
    async fn publish_again(&self, cmd: &Command) -> anyhow::Result<()> {
        self.js
            .publish(self.subjects.cmd(self.host_id), wire::encode(cmd).into())
            .await?
            .await?;
        Ok(())
    }

    /// The next result of `command`, acking every result read on the way.
    async fn result_of(&mut self, command: CommandId) -> anyhow::Result<CommandResult> {
        if let Some(pos) = self.unclaimed.iter().position(|r| r.command_id == command) {
            return Ok(self.unclaimed.remove(pos).expect("position is valid"));
        }
        let deadline = tokio::time::Instant::now() + RESULT_TIMEOUT;
        loop {
            let next = tokio::time::timeout_at(deadline, self.results.next())
                .await
                .with_context(|| format!("no result for command {command}"))?
                .context("result stream ended")?
                .map_err(|e| anyhow::anyhow!("result stream: {e}"))?;
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

    async fn send(&mut self, cmd: &Command) -> anyhow::Result<CommandResult> {
        self.publish(cmd).await?;
        let result = self.result_of(cmd.id).await?;
        ensure!(result.sandbox_id == cmd.sandbox_id && result.host_id == self.host_id);
        ensure!(result.generation == cmd.generation && result.kind == cmd.kind);
        Ok(result)
    }

    /// A plain exec: the agent request's [`AgentOp::Exec`] (replaced `{p}.exec`).
    async fn exec(
        &self,
        sandbox: SandboxId,
        argv: &[&str],
        timeout_ms: u64,
    ) -> anyhow::Result<AgentReply> {
        self.agent(sandbox, AgentOp::Exec(exec_spec(argv, timeout_ms)))
            .await
    }

    async fn agent(&self, sandbox: SandboxId, op: AgentOp) -> anyhow::Result<AgentReply> {
        let request = AgentRequest {
            sandbox_id: sandbox,
            op,
        };
        let reply = tokio::time::timeout(
            EXEC_REQUEST_TIMEOUT,
            self.nats.request(
                self.subjects.agent(self.host_id),
                wire::encode(&request).into(),
            ),
        )
        .await
        .context("agent request timed out")??;
        Ok(wire::decode(&reply.payload)?)
    }

    /// Waits for a heartbeat in which `sandbox` has `status`.
    async fn heartbeat_with(
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
    async fn containers(&self) -> anyhow::Result<Vec<(String, String)>> {
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

    fn sandbox_dir(&self, sandbox: SandboxId) -> PathBuf {
        self.state_dir.join("sandboxes").join(sandbox.to_string())
    }

    /// Best-effort removal of everything the test may have left, then the streams.
    async fn teardown(mut self) {
        if let Err(e) = self.stop_hostd().await {
            eprintln!("teardown: hostd: {e:#}");
        }
        let root = path_str(&self.runc_root());
        let _ = run(
            "runc",
            &["--root", &root, "delete", "--force", ORPHAN_CONTAINER],
        )
        .await;
        let tracked = self.sandboxes.lock().expect("not poisoned").clone();
        for sandbox in tracked {
            let names = self.names(sandbox);
            let _ = run(
                "runc",
                &["--root", &root, "delete", "--force", &names.container_id],
            )
            .await;
            let runsc_root = path_str(&self.runsc_root());
            let _ = run(
                "runsc",
                &[
                    "--root",
                    &runsc_root,
                    "delete",
                    "--force",
                    &names.container_id,
                ],
            )
            .await;
            let rootfs = self.sandbox_dir(sandbox).join("rootfs");
            let _ = nix::mount::umount2(&rootfs, nix::mount::MntFlags::MNT_DETACH);
            let _ = run("ip", &["link", "del", &names.veth_host]).await;
            let _ = run("ip", &["netns", "del", &names.netns]).await;
        }
        let table = berth_hostd::layout::firewall_table(self.host_id);
        let _ = run("nft", &["delete", "table", "inet", &table]).await;
        let _ = self.js.delete_stream(self.subjects.cmd_stream()).await;
        let _ = self.js.delete_stream(self.subjects.result_stream()).await;
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        if mounts.contains(&path_str(&self.state_dir)) {
            eprintln!(
                "teardown: mounts remain under {}; not removing it",
                self.state_dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.state_dir);
        }
    }
}

/// A /16 under 10/8 none of whose addresses is configured on this machine.
async fn unused_pool() -> anyhow::Result<std::net::Ipv4Addr> {
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

async fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await?;
    ensure!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,async_nats=warn".into()),
        )
        .with_ansi(false)
        .with_test_writer()
        .try_init();
}

fn finished(reply: &AgentReply) -> anyhow::Result<(i32, String, bool)> {
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

fn succeeded_address(result: &CommandResult) -> anyhow::Result<String> {
    match &result.outcome {
        ResultOutcome::Succeeded {
            address: Some(address),
            last_stop: None,
        } => Ok(address.clone()),
        other => bail!("expected success with an address, got {other:?}"),
    }
}

/// A test body over the harness.
type Body = for<'a> fn(&'a mut Harness) -> futures::future::BoxFuture<'a, anyhow::Result<()>>;

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

/// Runs `body` on a harness, then tears the harness down even when `body` failed or panicked.
async fn with_harness(body: Body) -> anyhow::Result<()> {
    init_tracing();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_is_created_executed_in_stopped_started_and_deleted_with_runc(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(lifecycle(h))).await
}

async fn lifecycle(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();

    // Create → running, with an address from the pool.
    let create = h.command(sandbox, 1, CommandKind::Create);
    let created = h.send(&create).await?;
    let address = succeeded_address(&created)?;
    let ip: std::net::Ipv4Addr = address.parse()?;
    ensure!(
        berth_hostd::address::AddressPool::new(h.config.address_pool)
            .slot_of(ip)
            .is_some(),
        "{address} is not from the pool {}",
        h.config.address_pool
    );
    ensure!(h.containers().await?.len() == 1);
    assert_cgroup_limits(h, sandbox).await?;

    // Exec: output, exit codes, timeouts.
    let (code, stdout, _) = finished(&h.exec(sandbox, &["echo", "hello"], EXEC_TIMEOUT_MS).await?)?;
    ensure!(code == 0 && stdout == "hello\n", "echo: {code} {stdout:?}");
    let (code, _, _) = finished(
        &h.exec(sandbox, &["sh", "-c", "exit 3"], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(code == 3, "exit 3 gave {code}");
    // `timed_out` is set only when the deadline killed the process group.
    let (_, _, timed_out) = finished(&h.exec(sandbox, &["sleep", "5"], 300).await?)?;
    ensure!(timed_out, "sleep 5 with a 300 ms timeout did not time out");
    let (code, _, _) = finished(
        &h.exec(
            sandbox,
            &["sh", "-c", "echo data > /root/f"],
            EXEC_TIMEOUT_MS,
        )
        .await?,
    )?;
    ensure!(code == 0);
    let missing = h.exec(SandboxId::new(), &["true"], EXEC_TIMEOUT_MS).await?;
    ensure!(
        missing == AgentReply::Failed(AgentFailure::NotFound),
        "{missing:?}"
    );

    // A heartbeat lists it as running.
    let hb = h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    ensure!(
        hb.used.vcpus == 1 && hb.used.memory_mib == 256,
        "used {:?}",
        hb.used
    );
    ensure!(hb
        .runtimes
        .iter()
        .any(|r| r.name == "runc" && !r.memory_snapshot));

    // A redelivered create (same id, past the dedup window) gets the same result, no new container.
    h.publish_again(&create).await?;
    let again = h.result_of(create.id).await?;
    ensure!(again == created, "replayed {again:?} vs {created:?}");
    ensure!(h.containers().await?.len() == 1);

    // hostd restarts: the running container is adopted, not duplicated, and a container no
    // record accounts for is swept.
    h.stop_hostd().await?;
    start_orphan_container(h).await?;
    ensure!(h.containers().await?.len() == 2);
    h.start_hostd();
    h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    let containers = h.containers().await?;
    ensure!(
        containers == [(h.names(sandbox).container_id, "running".to_owned())],
        "after adoption: {containers:?}"
    );
    let (_, stdout, _) = finished(
        &h.exec(sandbox, &["cat", "/root/f"], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(stdout == "data\n");

    // A crash after the work but before the result was recorded: the record says "creating"
    // and remembers nothing. The redelivered create converges on what exists.
    h.stop_hostd().await?;
    let record_path = h.sandbox_dir(sandbox).join("record.json");
    let mut record: serde_json::Value = serde_json::from_slice(&std::fs::read(&record_path)?)?;
    record["phase"] = "Creating".into();
    record["results"] = serde_json::json!([]);
    std::fs::write(&record_path, serde_json::to_vec(&record)?)?;
    h.start_hostd();
    h.publish_again(&create).await?;
    let converged = h.result_of(create.id).await?;
    ensure!(succeeded_address(&converged)? == address, "{converged:?}");
    ensure!(h.containers().await?.len() == 1);
    let (_, stdout, _) = finished(
        &h.exec(sandbox, &["cat", "/root/f"], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(stdout == "data\n", "files after converging: {stdout:?}");

    // Stop (disk only): no container, no mount, exec refused, heartbeat says stopped.
    let cmd = h.command(sandbox, 2, CommandKind::Stop);
    let stopped = h.send(&cmd).await?;
    ensure!(
        stopped.outcome
            == ResultOutcome::Succeeded {
                address: None,
                last_stop: Some(StopMode::Disk)
            },
        "{stopped:?}"
    );
    ensure!(h.containers().await?.is_empty());
    let rootfs = path_str(&h.sandbox_dir(sandbox).join("rootfs"));
    ensure!(!std::fs::read_to_string("/proc/self/mounts")?.contains(&rootfs));
    let refused = h.exec(sandbox, &["true"], EXEC_TIMEOUT_MS).await?;
    ensure!(
        refused == AgentReply::Failed(AgentFailure::NotRunning),
        "{refused:?}"
    );
    h.heartbeat_with(sandbox, GuestStatus::Stopped).await?;
    let cmd = h.command(sandbox, 2, CommandKind::Stop);
    let again = h.send(&cmd).await?;
    ensure!(
        matches!(again.outcome, ResultOutcome::Succeeded { .. }),
        "second stop: {again:?}"
    );

    // A command older than the applied generation is refused without acting.
    let cmd = h.command(sandbox, 1, CommandKind::Start);
    let stale = h.send(&cmd).await?;
    ensure!(
        stale.outcome
            == ResultOutcome::RefusedStale {
                applied: Generation(2)
            },
        "{stale:?}"
    );
    ensure!(h.containers().await?.is_empty());

    // Start: running again at the same address, and the file survived.
    let cmd = h.command(sandbox, 3, CommandKind::Start);
    let restarted = h.send(&cmd).await?;
    ensure!(succeeded_address(&restarted)? == address);
    let (_, stdout, _) = finished(
        &h.exec(sandbox, &["cat", "/root/f"], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(stdout == "data\n", "file after restart: {stdout:?}");

    // Delete: nothing remains.
    let cmd = h.command(sandbox, 4, CommandKind::Delete);
    let deleted = h.send(&cmd).await?;
    ensure!(
        matches!(deleted.outcome, ResultOutcome::Succeeded { .. }),
        "{deleted:?}"
    );
    assert_nothing_remains(h, sandbox).await?;
    let gone = h.exec(sandbox, &["true"], EXEC_TIMEOUT_MS).await?;
    ensure!(
        gone == AgentReply::Failed(AgentFailure::NotFound),
        "{gone:?}"
    );

    // Deleting again succeeds; a late create for the deleted sandbox is refused.
    let cmd = h.command(sandbox, 4, CommandKind::Delete);
    let again = h.send(&cmd).await?;
    ensure!(
        matches!(again.outcome, ResultOutcome::Succeeded { .. }),
        "{again:?}"
    );
    let cmd = h.command(sandbox, 1, CommandKind::Create);
    let late = h.send(&cmd).await?;
    ensure!(
        matches!(late.outcome, ResultOutcome::RefusedStale { .. }),
        "{late:?}"
    );
    assert_nothing_remains(h, sandbox).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_create_leaves_nothing_and_a_later_start_creates_from_the_spec(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(failed_create(h))).await
}

async fn failed_create(h: &mut Harness) -> anyhow::Result<()> {
    // Garbage on the command subject is dropped; the consumer keeps going.
    h.js.publish(
        h.subjects.cmd(h.host_id),
        b"\xffnot a command".to_vec().into(),
    )
    .await?
    .await?;

    let sandbox = SandboxId::new();
    let create = h.command_with_template(sandbox, 1, CommandKind::Create, "no-such-template");
    let failed = h.send(&create).await?;
    match &failed.outcome {
        ResultOutcome::Failed { reason } => {
            ensure!(reason.contains("unknown template"), "reason: {reason}")
        }
        other => bail!("expected a failure, got {other:?}"),
    }
    assert_nothing_remains(h, sandbox).await?;

    // A start without a local record is a full create from the command's spec.
    let cmd = h.command(sandbox, 2, CommandKind::Start);
    let started = h.send(&cmd).await?;
    succeeded_address(&started)?;
    let (code, stdout, _) = finished(&h.exec(sandbox, &["hostname"], EXEC_TIMEOUT_MS).await?)?;
    ensure!(
        code == 0 && stdout.trim() == sandbox.to_string(),
        "hostname: {stdout:?}"
    );

    // The container dies behind hostd's back: heartbeats say so, and a start brings it back.
    let container_id = h.names(sandbox).container_id;
    let root = path_str(&h.runc_root());
    run("runc", &["--root", &root, "kill", &container_id, "KILL"]).await?;
    h.heartbeat_with(sandbox, GuestStatus::Unhealthy).await?;
    let cmd = h.command(sandbox, 3, CommandKind::Start);
    let restarted = h.send(&cmd).await?;
    succeeded_address(&restarted)?;
    h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    ensure!(h.containers().await?.len() == 1);

    let cmd = h.command(sandbox, 4, CommandKind::Delete);
    let deleted = h.send(&cmd).await?;
    ensure!(
        matches!(deleted.outcome, ResultOutcome::Succeeded { .. }),
        "{deleted:?}"
    );
    assert_nothing_remains(h, sandbox).await?;

    // Deleting a sandbox this host never had succeeds.
    let unknown = SandboxId::new();
    let cmd = h.command(unknown, 1, CommandKind::Delete);
    let deleted = h.send(&cmd).await?;
    ensure!(
        matches!(deleted.outcome, ResultOutcome::Succeeded { .. }),
        "{deleted:?}"
    );
    Ok(())
}

/// Starts a container in the hostd's runc root that no record accounts for: `sleep` on the
/// base template, read-only, in a fresh network namespace of its own.
async fn start_orphan_container(h: &Harness) -> anyhow::Result<()> {
    let bundle = h.state_dir.join("orphan-bundle");
    std::fs::create_dir_all(&bundle)?;
    run("runc", &["spec", "--bundle", &path_str(&bundle)]).await?;
    let config_path = bundle.join("config.json");
    let mut config: serde_json::Value = serde_json::from_slice(&std::fs::read(&config_path)?)?;
    config["root"] = serde_json::json!({
        "path": path_str(&h.state_dir.join("templates/base/rootfs")),
        "readonly": true,
    });
    config["process"]["terminal"] = false.into();
    config["process"]["args"] = serde_json::json!(["sleep", "600"]);
    config["linux"]["cgroupsPath"] = format!("berth-orphan-{}", h.subjects.prefix()).into();
    std::fs::write(&config_path, serde_json::to_vec(&config)?)?;
    // Detached: its stdio must not be pipes we wait on (the container would hold them open).
    let status = tokio::process::Command::new("runc")
        .args(["--root", &path_str(&h.runc_root()), "run", "--detach"])
        .args(["--bundle", &path_str(&bundle), ORPHAN_CONTAINER])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .await?;
    ensure!(status.success(), "runc run of the orphan: {status}");
    Ok(())
}

/// The container's cgroups carry the spec's limits: 256 MiB, one vCPU, the pids limit.
async fn assert_cgroup_limits(h: &Harness, sandbox: SandboxId) -> anyhow::Result<()> {
    let state = run(
        "runc",
        &[
            "--root",
            &path_str(&h.runc_root()),
            "state",
            &h.names(sandbox).container_id,
        ],
    )
    .await?;
    let pid = serde_json::from_str::<serde_json::Value>(&state)?["pid"]
        .as_u64()
        .context("no pid in runc state")?;
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let limit = |controller: &str, file: &str| -> anyhow::Result<String> {
        let path = cgroups
            .lines()
            .find_map(|l| {
                let mut parts = l.splitn(3, ':');
                let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                controllers
                    .split(',')
                    .any(|c| c == controller)
                    .then_some(path)
            })
            .with_context(|| format!("no {controller} cgroup in {cgroups}"))?;
        let file = format!("/sys/fs/cgroup/{controller}{path}/{file}");
        Ok(std::fs::read_to_string(&file)
            .with_context(|| format!("read {file}"))?
            .trim()
            .to_owned())
    };
    ensure!(limit("memory", "memory.limit_in_bytes")? == (256u64 << 20).to_string());
    ensure!(limit("pids", "pids.max")? == berth_hostd::oci::PIDS_LIMIT.to_string());
    ensure!(limit("cpu", "cpu.cfs_quota_us")? == berth_hostd::oci::CPU_PERIOD_US.to_string());
    Ok(())
}

/// No container, netns, veth, mount or sandbox dir of `sandbox` exists.
async fn assert_nothing_remains(h: &Harness, sandbox: SandboxId) -> anyhow::Result<()> {
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
    let links = run("ip", &["link"]).await?;
    ensure!(
        !links.contains(&names.veth_host),
        "veth {} remains",
        names.veth_host
    );
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    ensure!(
        !mounts.contains(&path_str(&h.sandbox_dir(sandbox))),
        "a mount under the sandbox dir remains"
    );
    ensure!(!h.sandbox_dir(sandbox).exists(), "sandbox dir remains");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_keeps_counting_across_stop_and_start_on_gvisor() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(memory_stop(h))).await
}

/// The counter process of [`memory_stop`]: increments `/root/count` every 100 ms, written then renamed so no reader sees it half-written (gVisor keeps `/tmp` in memory), detached
/// from the exec (its output goes nowhere), and prints its pid.
/// It also appends each value to `/root/log` through a descriptor opened once at its start,
/// so the log grows after a restore only if the open file survived it.
const COUNTER: &str =
    "sh -c 'exec 3>/root/log; i=0; while :; do i=$((i+1)); echo $i > /root/count.new; mv /root/count.new /root/count; echo $i >&3; sleep 0.1; done' \
    </dev/null >/dev/null 2>&1 & echo $!";

/// How long a restored sandbox gets to show its counter moving (a loaded machine runs gVisor's
/// ptrace platform slowly).
const COUNTING_TIMEOUT: Duration = Duration::from_secs(15);

/// Runs `argv` (which prints a number) until the number exceeds `floor` or
/// [`COUNTING_TIMEOUT`] passes; returns the last number read (0 while nothing parses, as
/// before the counter's first write).
async fn number_above(
    h: &Harness,
    sandbox: SandboxId,
    argv: &[&str],
    floor: u64,
) -> anyhow::Result<u64> {
    let deadline = tokio::time::Instant::now() + COUNTING_TIMEOUT;
    loop {
        let (_, out, _) = finished(&h.exec(sandbox, argv, EXEC_TIMEOUT_MS).await?)?;
        let value: u64 = out.trim().parse().unwrap_or(0);
        if value > floor || tokio::time::Instant::now() >= deadline {
            return Ok(value);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn memory_stop(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let create = h.command_with_template(sandbox, 1, CommandKind::Create, "base-gvisor");
    let created = h.send(&create).await?;
    let address = succeeded_address(&created)?;
    let hb = h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    ensure!(
        hb.runtimes
            .iter()
            .any(|r| r.name == "runsc" && r.memory_snapshot),
        "runtimes {:?}",
        hb.runtimes
    );

    let (code, pid, _) = finished(
        &h.exec(sandbox, &["sh", "-c", COUNTER], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(code == 0, "counter start: {code}");
    let pid = pid.trim().to_owned();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let before = number_above(h, sandbox, &["cat", "/root/count"], 0).await?;
    ensure!(before > 0, "the counter never wrote its count");

    // Stop keeps memory: the container is gone, the image and the disk stay.
    let cmd = h.command(sandbox, 2, CommandKind::Stop);
    let stopped = h.send(&cmd).await?;
    ensure!(
        stopped.outcome
            == ResultOutcome::Succeeded {
                address: None,
                last_stop: Some(StopMode::Memory)
            },
        "{stopped:?}"
    );
    h.heartbeat_with(sandbox, GuestStatus::Stopped).await?;
    let at_stop: u64 = std::fs::read_to_string(h.sandbox_dir(sandbox).join("upper/root/count"))?
        .trim()
        .parse()?;
    ensure!(at_stop >= before, "{at_stop} < {before}");
    ensure!(h.sandbox_dir(sandbox).join("snapshot").is_dir());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let still: u64 = std::fs::read_to_string(h.sandbox_dir(sandbox).join("upper/root/count"))?
        .trim()
        .parse()?;
    ensure!(
        still == at_stop,
        "the counter ran while stopped: {at_stop} → {still}"
    );

    // Start restores: the same process continues from where it was.
    let cmd = h.command(sandbox, 3, CommandKind::Start);
    let restarted = h.send(&cmd).await?;
    ensure!(succeeded_address(&restarted)? == address);
    let after = number_above(h, sandbox, &["cat", "/root/count"], at_stop).await?;
    ensure!(
        after > at_stop,
        "not counting after the start: {after} <= {at_stop}"
    );
    let (code, cmdline, _) = finished(
        &h.exec(
            sandbox,
            &["cat", &format!("/proc/{pid}/cmdline")],
            EXEC_TIMEOUT_MS,
        )
        .await?,
    )?;
    ensure!(
        code == 0 && cmdline.contains("while"),
        "the counter (pid {pid}) is not the process that was stopped: {code} {cmdline:?}"
    );
    ensure!(
        !h.sandbox_dir(sandbox).join("snapshot").exists(),
        "the spent image is removed"
    );
    // The descriptor opened before the stop still writes to the same file.
    let logged = number_above(h, sandbox, &["tail", "-n", "1", "/root/log"], at_stop).await?;
    ensure!(
        logged > at_stop,
        "the open file did not survive: last logged {logged}, count at stop {at_stop}"
    );

    // A second stop/start cycle works the same way.
    let cmd = h.command(sandbox, 4, CommandKind::Stop);
    let stopped = h.send(&cmd).await?;
    ensure!(
        matches!(
            stopped.outcome,
            ResultOutcome::Succeeded {
                last_stop: Some(StopMode::Memory),
                ..
            }
        ),
        "{stopped:?}"
    );
    let cmd = h.command(sandbox, 5, CommandKind::Start);
    succeeded_address(&h.send(&cmd).await?)?;
    let (code, _, _) = finished(
        &h.exec(sandbox, &["kill", "-0", &pid], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(code == 0, "the counter died in the second cycle");

    let cmd = h.command(sandbox, 6, CommandKind::Delete);
    let deleted = h.send(&cmd).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    assert_nothing_remains(h, sandbox).await?;
    let runsc = run(
        "runsc",
        &[
            "--root",
            &path_str(&h.runsc_root()),
            "list",
            "--format",
            "json",
        ],
    )
    .await?;
    ensure!(
        !runsc.contains(&sandbox.to_string()),
        "a runsc container remains: {runsc}"
    );
    Ok(())
}

fn exec_spec(argv: &[&str], timeout_ms: u64) -> ExecSpec {
    ExecSpec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: vec![],
        cwd: None,
        stdin: vec![],
        timeout_ms,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sandboxes_cannot_reach_each_other_or_the_host_but_hostd_reaches_both(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(isolation(h))).await
}

async fn isolation(h: &mut Harness) -> anyhow::Result<()> {
    let (a, b) = (SandboxId::new(), SandboxId::new());
    let addr_a = succeeded_address(&h.send(&h.command(a, 1, CommandKind::Create)).await?)?;
    let addr_b = succeeded_address(&h.send(&h.command(b, 1, CommandKind::Create)).await?)?;
    // A listener of the host, on every address (the sandbox's gateway included).
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await?;
    let port = listener.local_addr()?.port().to_string();
    let gateway_a = {
        let ip: std::net::Ipv4Addr = addr_a.parse()?;
        std::net::Ipv4Addr::from(u32::from(ip) - 1).to_string()
    };
    let nc = |target: &str, port: &str| {
        format!("nc -w 2 {target} {port} </dev/null >/dev/null 2>&1; echo $?")
    };

    // The control: a sandbox reaches its own agent.
    let (_, own, _) = finished(
        &h.exec(a, &["sh", "-c", &nc(&addr_a, "18047")], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(
        own.trim() == "0",
        "a sandbox can't reach its own agent: {own}"
    );
    // Neither sandbox reaches the other's agent; A does not reach the host's listener.
    let (_, a_to_b, _) = finished(
        &h.exec(a, &["sh", "-c", &nc(&addr_b, "18047")], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(a_to_b.trim() != "0", "sandbox A reached sandbox B");
    let (_, b_to_a, _) = finished(
        &h.exec(b, &["sh", "-c", &nc(&addr_a, "18047")], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(b_to_a.trim() != "0", "sandbox B reached sandbox A");
    let (_, to_host, _) = finished(
        &h.exec(a, &["sh", "-c", &nc(&gateway_a, &port)], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(
        to_host.trim() != "0",
        "sandbox A opened a connection to the host"
    );
    // hostd reaches both agents.
    for sandbox in [a, b] {
        let (code, out, _) = finished(&h.exec(sandbox, &["echo", "up"], EXEC_TIMEOUT_MS).await?)?;
        ensure!(code == 0 && out == "up\n");
    }
    // The rules live in this hostd's own table, one set element per sandbox.
    let table = berth_hostd::layout::firewall_table(h.host_id);
    let rules = run("nft", &["list", "table", "inet", &table]).await?;
    for addr in [&addr_a, &addr_b] {
        let network = {
            let ip: std::net::Ipv4Addr = addr.parse()?;
            std::net::Ipv4Addr::from(u32::from(ip) & !3).to_string()
        };
        ensure!(
            rules.contains(&format!("{network}/30")),
            "{network} missing: {rules}"
        );
    }

    // Delete removes the sandbox's element.
    let deleted = h.send(&h.command(a, 2, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    let rules = run("nft", &["list", "table", "inet", &table]).await?;
    let network_a = {
        let ip: std::net::Ipv4Addr = addr_a.parse()?;
        std::net::Ipv4Addr::from(u32::from(ip) & !3).to_string()
    };
    ensure!(
        !rules.contains(&format!("{network_a}/30")),
        "element of A remains: {rules}"
    );
    let deleted = h.send(&h.command(b, 2, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    drop(listener);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_requests_run_with_env_cwd_stdin_move_files_and_report_an_oom_kill(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(agent_requests(h))).await
}

async fn agent_requests(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    succeeded_address(&h.send(&h.command(sandbox, 1, CommandKind::Create)).await?)?;

    // Exec with env, cwd and stdin.
    let mut spec = exec_spec(&["sh", "-c", "echo $GREETING; pwd; cat"], EXEC_TIMEOUT_MS);
    spec.env = vec![("GREETING".into(), "hi".into())];
    spec.cwd = Some("/tmp".into());
    spec.stdin = b"from stdin".to_vec();
    match h.agent(sandbox, AgentOp::Exec(spec)).await? {
        AgentReply::Exec {
            exit_code: 0,
            stdout,
            oom_killed: false,
            ..
        } => ensure!(stdout == b"hi\n/tmp\nfrom stdin", "{stdout:?}"),
        other => bail!("exec: {other:?}"),
    }

    // Files: write in two chunks, read back, stat, list, rename; a missing path is named.
    let write = |offset: u64, data: &[u8], truncate: bool| AgentOp::Write {
        path: "/root/dir/f.part".into(),
        offset,
        data: data.to_vec(),
        truncate,
    };
    ensure!(h.agent(sandbox, write(0, b"hello ", true)).await? == AgentReply::Written { bytes: 6 });
    ensure!(h.agent(sandbox, write(6, b"world", false)).await? == AgentReply::Written { bytes: 5 });
    let renamed = h
        .agent(
            sandbox,
            AgentOp::Rename {
                from: "/root/dir/f.part".into(),
                to: "/root/dir/f".into(),
            },
        )
        .await?;
    ensure!(renamed == AgentReply::Done, "{renamed:?}");
    let read = h
        .agent(
            sandbox,
            AgentOp::Read {
                path: "/root/dir/f".into(),
                offset: 0,
                len: 1 << 20,
            },
        )
        .await?;
    ensure!(
        read == AgentReply::Data {
            data: b"hello world".to_vec(),
            eof: true
        },
        "{read:?}"
    );
    match h
        .agent(
            sandbox,
            AgentOp::List {
                path: "/root/dir".into(),
            },
        )
        .await?
    {
        AgentReply::Listing(entries) => ensure!(
            entries.len() == 1
                && entries[0].name == "f"
                && entries[0].stat.kind == FileKind::File
                && entries[0].stat.size == 11,
            "{entries:?}"
        ),
        other => bail!("list: {other:?}"),
    }
    let missing = h
        .agent(
            sandbox,
            AgentOp::Stat {
                path: "/nope".into(),
            },
        )
        .await?;
    ensure!(
        missing == AgentReply::Failed(AgentFailure::NoSuchPath),
        "{missing:?}"
    );

    // A memory hog is killed by the sandbox's memory limit (256 MiB), and the exec says so.
    let hog = exec_spec(
        &["dd", "if=/dev/zero", "of=/dev/null", "bs=400M", "count=1"],
        30_000,
    );
    match h.agent(sandbox, AgentOp::Exec(hog)).await? {
        AgentReply::Exec {
            exit_code,
            oom_killed,
            ..
        } => ensure!(
            exit_code == 137 && oom_killed,
            "memory hog: exit {exit_code}, oom_killed {oom_killed}"
        ),
        other => bail!("memory hog: {other:?}"),
    }
    // The sandbox survives it.
    let (code, _, _) = finished(&h.exec(sandbox, &["true"], EXEC_TIMEOUT_MS).await?)?;
    ensure!(code == 0);
    // An exec past its timeout is killed.
    match h
        .agent(sandbox, AgentOp::Exec(exec_spec(&["sleep", "30"], 300)))
        .await?
    {
        AgentReply::Exec {
            timed_out: true,
            exit_code: 137,
            oom_killed: false,
            ..
        } => {}
        other => bail!("timeout: {other:?}"),
    }

    // Unknown sandboxes and relative paths are refused.
    let unknown = h
        .agent(SandboxId::new(), AgentOp::Stat { path: "/".into() })
        .await?;
    ensure!(
        unknown == AgentReply::Failed(AgentFailure::NotFound),
        "{unknown:?}"
    );
    let relative = h
        .agent(sandbox, AgentOp::Stat { path: "etc".into() })
        .await?;
    ensure!(
        matches!(relative, AgentReply::Failed(AgentFailure::Agent(_))),
        "{relative:?}"
    );

    let deleted = h.send(&h.command(sandbox, 2, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_whose_agent_dies_is_reported_unhealthy() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(agent_dies(h))).await
}

async fn agent_dies(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    succeeded_address(&h.send(&h.command(sandbox, 1, CommandKind::Create)).await?)?;
    h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    // The exec's parent is the agent's server process: kill it.
    let reply = h
        .exec(sandbox, &["sh", "-c", "kill -9 $PPID"], EXEC_TIMEOUT_MS)
        .await?;
    ensure!(
        matches!(reply, AgentReply::Failed(AgentFailure::Agent(_))),
        "the exec outlived its agent: {reply:?}"
    );
    h.heartbeat_with(sandbox, GuestStatus::Unhealthy).await?;
    // A start brings it back.
    succeeded_address(&h.send(&h.command(sandbox, 2, CommandKind::Start)).await?)?;
    h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    let deleted = h.send(&h.command(sandbox, 3, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_hostd_sweeps_its_stray_network_and_keeps_other_hosts_objects(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(sweep_strays(h))).await
}

async fn sweep_strays(h: &mut Harness) -> anyhow::Result<()> {
    h.stop_hostd().await?;
    let pool = berth_hostd::address::AddressPool::new(h.config.address_pool);
    // Ours: marked with this host's id, no record.
    let ours = SandboxId::new();
    let ours_names = h.names(ours);
    h.sandboxes.lock().expect("not poisoned").push(ours);
    berth_hostd::netns::ensure(
        &ours_names,
        &pool.link(berth_hostd::address::Slot(7)),
        &berth_hostd::netns::owner_alias(h.host_id, ours),
    )
    .await?;
    // Another host's: the same shape, another host id. It must survive.
    let other_host = HostId::new();
    let theirs = SandboxId::new();
    let their_names = SandboxNames::derive(other_host, theirs);
    berth_hostd::netns::ensure(
        &their_names,
        &pool.link(berth_hostd::address::Slot(8)),
        &berth_hostd::netns::owner_alias(other_host, theirs),
    )
    .await?;
    h.start_hostd();
    // The first heartbeat follows the sweep.
    let deadline = tokio::time::Instant::now() + HEARTBEAT_TIMEOUT;
    tokio::time::timeout_at(deadline, h.heartbeats.next())
        .await
        .context("no heartbeat after the restart")?;
    let netns = run("ip", &["netns", "list"]).await?;
    let links = run("ip", &["-o", "link"]).await?;
    let theirs_kept = netns.contains(&their_names.netns) && links.contains(&their_names.veth_host);
    let _ = run("ip", &["link", "del", &their_names.veth_host]).await;
    let _ = run("ip", &["netns", "del", &their_names.netns]).await;
    ensure!(
        !netns.contains(&ours_names.netns),
        "our stray netns survived"
    );
    ensure!(
        !links.contains(&ours_names.veth_host),
        "our stray veth survived"
    );
    ensure!(theirs_kept, "another host's network was swept");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_reaches_a_server_beyond_its_host() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(egress(h))).await
}

/// Egress is forwarded (only traffic between sandboxes, and into the host, is dropped). The
/// "outside" is a network namespace this test makes, behind a veth that is not a sandbox's,
/// addressed with the pool's last /30 (which no sandbox of the test gets); nothing leaves the
/// machine, so the default-route masquerade is not exercised here.
async fn egress(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    succeeded_address(&h.send(&h.command(sandbox, 1, CommandKind::Create)).await?)?;
    let pool = berth_hostd::address::AddressPool::new(h.config.address_pool);
    let link = pool.link(berth_hostd::address::Slot(
        berth_hostd::address::SLOTS_PER_POOL - 1,
    ));
    let tag = &h.subjects.prefix()[1..9];
    let (ns, host_if) = (format!("egress-{tag}"), format!("eg{tag}"));
    let outside = async {
        run("ip", &["netns", "add", &ns]).await?;
        run(
            "ip",
            &[
                "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ],
        )
        .await?;
        run(
            "ip",
            &["addr", "add", &format!("{}/30", link.host), "dev", &host_if],
        )
        .await?;
        run("ip", &["link", "set", &host_if, "up"]).await?;
        run(
            "ip",
            &[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/30", link.sandbox),
                "dev",
                "eth0",
            ],
        )
        .await?;
        run("ip", &["-n", &ns, "link", "set", "eth0", "up"]).await?;
        run(
            "ip",
            &[
                "-n",
                &ns,
                "route",
                "add",
                "default",
                "via",
                &link.host.to_string(),
            ],
        )
        .await?;
        anyhow::Ok(())
    }
    .await;
    let server = match outside {
        Ok(()) => Some(
            tokio::process::Command::new("ip")
                .args(["netns", "exec", &ns, "busybox", "nc", "-l", "-p", "9000"])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()?,
        ),
        Err(_) => None,
    };
    let reached = async {
        outside?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let cmd = format!("echo egress | nc -w 2 {} 9000; echo $?", link.sandbox);
        let (_, out, _) = finished(
            &h.exec(sandbox, &["sh", "-c", &cmd], EXEC_TIMEOUT_MS)
                .await?,
        )?;
        let server = server.context("no server")?;
        let got = tokio::time::timeout(Duration::from_secs(5), server.wait_with_output())
            .await
            .context("the server got nothing")??;
        anyhow::Ok((out, String::from_utf8_lossy(&got.stdout).into_owned()))
    }
    .await;
    let _ = run("ip", &["link", "del", &host_if]).await;
    let _ = run("ip", &["netns", "del", &ns]).await;
    let (exit, received) = reached?;
    ensure!(
        exit.trim() == "0",
        "the sandbox's connection failed: {exit}"
    );
    ensure!(received == "egress\n", "the server received {received:?}");
    let deleted = h.send(&h.command(sandbox, 2, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_hog_on_gvisor_takes_its_sandbox_down_and_the_exec_says_oom() -> anyhow::Result<()>
{
    with_harness(|h| Box::pin(gvisor_oom(h))).await
}

/// On gVisor the guest's processes live inside one host process (the Sentry), so the memory
/// cgroup's OOM kill takes the whole sandbox down; the exec says so, the heartbeat says the
/// sandbox is unhealthy, and a start boots it again from its disk.
async fn gvisor_oom(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let create = h.command_with_template(sandbox, 1, CommandKind::Create, "base-gvisor");
    succeeded_address(&h.send(&create).await?)?;
    let (code, _, _) = finished(
        &h.exec(
            sandbox,
            &["sh", "-c", "echo kept > /root/note"],
            EXEC_TIMEOUT_MS,
        )
        .await?,
    )?;
    ensure!(code == 0);
    let hog = exec_spec(
        &["dd", "if=/dev/zero", "of=/dev/null", "bs=400M", "count=1"],
        8_000,
    );
    match h.agent(sandbox, AgentOp::Exec(hog)).await? {
        AgentReply::Exec {
            exit_code: 137,
            oom_killed: true,
            ..
        } => {}
        other => bail!("memory hog on gVisor: {other:?}"),
    }
    h.heartbeat_with(sandbox, GuestStatus::Unhealthy).await?;
    // An exec now fails instead of waiting out its timeout (which would answer `timed_out`).
    let reply = h.exec(sandbox, &["true"], EXEC_TIMEOUT_MS).await?;
    ensure!(
        matches!(reply, AgentReply::Failed(AgentFailure::Agent(_))),
        "{reply:?}"
    );
    let restarted = h
        .send(&h.command_with_template(sandbox, 2, CommandKind::Start, "base-gvisor"))
        .await?;
    succeeded_address(&restarted)?;
    let (_, note, _) = finished(
        &h.exec(sandbox, &["cat", "/root/note"], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(note == "kept\n", "{note:?}");
    let deleted = h.send(&h.command(sandbox, 3, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_exec_delivers_output_while_the_process_runs() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(streamed_exec(h))).await
}

async fn streamed_exec(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    succeeded_address(&h.send(&h.command(sandbox, 1, CommandKind::Create)).await?)?;
    let inbox = h.nats.new_inbox();
    let mut replies = h.nats.subscribe(inbox.clone()).await?;
    let request = AgentRequest {
        sandbox_id: sandbox,
        op: AgentOp::ExecStream(exec_spec(
            &["sh", "-c", "echo one; sleep 2; echo two >&2; exit 3"],
            EXEC_TIMEOUT_MS,
        )),
    };
    h.nats
        .publish_with_reply(
            h.subjects.agent(h.host_id),
            inbox,
            wire::encode(&request).into(),
        )
        .await?;
    let started = std::time::Instant::now();
    let mut chunks = Vec::new();
    let (exit, last_at) = loop {
        let message = tokio::time::timeout(EXEC_REQUEST_TIMEOUT, replies.next())
            .await
            .context("no streamed reply")?
            .context("subscription ended")?;
        match wire::decode::<AgentReply>(&message.payload)? {
            AgentReply::Output { fd, data } => chunks.push((fd, data, started.elapsed())),
            AgentReply::Exec {
                exit_code,
                stdout,
                stderr,
                ..
            } => {
                ensure!(stdout.is_empty() && stderr.is_empty(), "output came twice");
                break (exit_code, started.elapsed());
            }
            other => bail!("streamed exec: {other:?}"),
        }
    };
    ensure!(exit == 3, "exit {exit}");
    let texts: Vec<(u8, &[u8])> = chunks
        .iter()
        .map(|(fd, d, _)| (*fd, d.as_slice()))
        .collect();
    ensure!(
        texts == [(1, &b"one\n"[..]), (2, &b"two\n"[..])],
        "{texts:?}"
    );
    ensure!(
        last_at - chunks[0].2 >= Duration::from_secs(1),
        "the first chunk came only at the end: {:?} vs {last_at:?}",
        chunks[0].2
    );
    let deleted = h.send(&h.command(sandbox, 2, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    Ok(())
}
