//! A sandbox's life on runc through hostd: create, exec, stop, start, delete, cgroup limits,
//! a failed create that leaves nothing, a start that finds its container dying, and the
//! orphan a restarted hostd sweeps.

use anyhow::{bail, ensure, Context as _};
use berth_schemas::wire::{AgentFailure, AgentReply, GuestStatus, ResultOutcome, StopMode};
use berth_schemas::{CommandKind, Generation, SandboxId};

use crate::harness::*;
use crate::support::env::{path_str, run};

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
    assert_cgroup_limits(h, sandbox, 256).await?;
    assert_booted_pid_in_own_cgroup(h, sandbox)?;

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
    // The replay carries the host's heartbeat sequence of now, not of the first answer: the
    // command was applied before either, so both are true evidence for the reconciler.
    ensure!(
        again.heartbeat_seq >= created.heartbeat_seq,
        "a replay's sequence went back: {again:?} vs {created:?}"
    );
    // ... and the replay's own apply time.
    let same_but_seq = berth_schemas::wire::CommandResult {
        heartbeat_seq: created.heartbeat_seq,
        apply_ms: created.apply_ms,
        ..again.clone()
    };
    ensure!(same_but_seq == created, "replayed {again:?} vs {created:?}");
    ensure!(h.containers().await?.len() == 1);

    // hostd restarts: the running container is adopted, not duplicated, and a container no
    // record accounts for is swept.
    h.stop_hostd().await?;
    start_orphan_container(h).await?;
    ensure!(h.containers().await?.len() == 2);
    h.start_hostd();
    h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    // The heartbeat subscription still holds heartbeats of the hostd that stopped, so the one
    // just taken may predate this run's adoption: wait for adoption to have swept the orphan.
    let adopted = [(h.names(sandbox).container_id, "running".to_owned())];
    let deadline = tokio::time::Instant::now() + RESULT_TIMEOUT;
    let mut containers = h.containers().await?;
    while containers != adopted && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        containers = h.containers().await?;
    }
    ensure!(containers == adopted, "after adoption: {containers:?}");
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
        // The request's fault, not the host's: no host has that template (issue 12 item 2).
        ResultOutcome::Rejected { reason } => {
            ensure!(reason.contains("unknown template"), "reason: {reason}")
        }
        other => bail!("expected a rejection, got {other:?}"),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_finds_its_container_dying_boots_it_anew() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(dying_container(h))).await
}

/// A start that looks while a killed container's init has not finished exiting sees it
/// "running", adopts it, and waits for an agent that never answers; when the container is
/// then gone, the start boots it anew rather than fail (seen once in CI under load, in
/// `failed_create` above: the restart after `runc kill` failed "exited while booting"). The
/// dying is held open here: the container's processes are stopped (SIGSTOP) before the start
/// and killed while the start waits on them. Should hostd look only after the kill (a slow machine), the start
/// goes the ordinary way and the test still holds.
async fn dying_container(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let created = h.send(&h.command(sandbox, 1, CommandKind::Create)).await?;
    succeeded_address(&created)?;
    let container_id = h.names(sandbox).container_id;
    let root = path_str(&h.runc_root());
    // Every process of it (the agent forks: its init alone stopped would leave it answering),
    // each still "running" to runc.
    let pids: Vec<i64> = serde_json::from_str(
        &run(
            "runc",
            &["--root", &root, "ps", "--format", "json", &container_id],
        )
        .await?,
    )?;
    ensure!(pids.len() >= 2, "the agent and its init: {pids:?}");
    let pids: Vec<String> = pids.iter().map(i64::to_string).collect();
    let stop: Vec<&str> = ["-STOP"]
        .into_iter()
        .chain(pids.iter().map(String::as_str))
        .collect();
    run("kill", &stop).await?;

    let start = h.command(sandbox, 2, CommandKind::Start);
    h.publish(&start).await?;
    // Longer than hostd takes to see the container run and begin waiting for its agent.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    run("runc", &["--root", &root, "kill", &container_id, "KILL"]).await?;
    let started = h.result_of(start.id).await?;
    succeeded_address(&started)?;
    let (code, stdout, _) = finished(&h.exec(sandbox, &["hostname"], EXEC_TIMEOUT_MS).await?)?;
    ensure!(
        code == 0 && stdout.trim() == sandbox.to_string(),
        "hostname: {code} {stdout:?}"
    );
    ensure!(h.containers().await?.len() == 1);

    let deleted = h.send(&h.command(sandbox, 3, CommandKind::Delete)).await?;
    ensure!(
        matches!(deleted.outcome, ResultOutcome::Succeeded { .. }),
        "{deleted:?}"
    );
    assert_nothing_remains(h, sandbox).await
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

/// The sandbox's init runs in cgroups of `memory_mib` MiB, Berth's pids limit and one vCPU.
pub(crate) async fn assert_cgroup_limits(
    h: &Harness,
    sandbox: SandboxId,
    memory_mib: u64,
) -> anyhow::Result<()> {
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
    ensure!(limit("memory", "memory.limit_in_bytes")? == (memory_mib << 20).to_string());
    ensure!(limit("pids", "pids.max")? == berth_hostd::oci::PIDS_LIMIT.to_string());
    ensure!(limit("cpu", "cpu.cfs_quota_us")? == berth_hostd::oci::CPU_PERIOD_US.to_string());
    Ok(())
}
