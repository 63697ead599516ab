//! gVisor (runsc) through hostd: a memory stop keeps a running process and its open files,
//! also with 150 processes running, and a memory hog takes only its own sandbox down; a start
//! whose memory image is damaged boots from the disk.

use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use berth_schemas::wire::{
    AgentFailure, AgentOp, AgentReply, GuestStatus, ResultOutcome, StopMode,
};
use berth_schemas::{CommandKind, SandboxId};

use crate::harness::*;
use crate::support::env::{path_str, run};

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
    stop_with_memory(h, sandbox, 2, "a counting process").await?;
    h.heartbeat_with(sandbox, GuestStatus::Stopped).await?;
    let at_stop: u64 = file_in_disk(h, sandbox, "/root/count")
        .await?
        .trim()
        .parse()?;
    ensure!(at_stop >= before, "{at_stop} < {before}");
    ensure!(h.sandbox_dir(sandbox).join("snapshot").is_dir());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let still: u64 = file_in_disk(h, sandbox, "/root/count")
        .await?
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

/// A file the sandbox wrote at `path`, read from its stopped (unmounted) disk image with
/// `debugfs` (e2fsprogs), which reads the ext4 image without mounting it.
async fn file_in_disk(h: &Harness, sandbox: SandboxId, path: &str) -> anyhow::Result<String> {
    let image = path_str(&h.sandbox_dir(sandbox).join("disk.img"));
    let request = format!("cat /upper{path}");
    run("debugfs", &["-R", &request, &image]).await
}

/// How many processes [`many_processes`] leaves running in the sandbox, one exec each: past
/// the ~140 live processes at which a memory stop used to fail (issue 12 item 4).
const LIVE_PROCESSES: usize = 150;

/// How many more short-lived processes it runs, so the sandbox has started 200 in its life.
const SHORT_PROCESSES: usize = 50;

/// The sandbox's memory for [`many_processes`]. A checkpoint needs memory of its own in the
/// sandbox's cgroup, roughly 2.5 MiB per running process and more when the Sentry's heap peaks
/// (512 MiB held 150 running processes in one run and not in the next; see the README's limits
/// of a memory stop), so this test gives it room: what it pins is the host task limit.
const MANY_PROCESSES_MEMORY_MIB: u32 = 1024;

/// Counts the sandbox's live `sleep` processes.
const COUNT_SLEEPERS: &str =
    "n=0; for c in /proc/[0-9]*/comm; do [ \"$(cat $c 2>/dev/null)\" = sleep ] && n=$((n+1)); done; echo $n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gvisor_sandbox_that_started_200_processes_stops_with_memory_and_keeps_them(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(many_processes(h))).await
}

/// A sandbox that started [`LIVE_PROCESSES`] processes still running at its stop, plus
/// [`SHORT_PROCESSES`] that ended, stops with its memory and starts with every one of the
/// running ones. Before, runc's `pids.max` of 1024 on gVisor's host cgroup (which counts the
/// Sentry's threads and a stub process with several threads per guest process) ran out near
/// 140 of them, and the checkpoint failed with `EOF`.
async fn many_processes(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let mut create = h.command_with_template(sandbox, 1, CommandKind::Create, "base-gvisor");
    if let Some(spec) = create.spec.as_mut() {
        spec.resources.memory_mib = MANY_PROCESSES_MEMORY_MIB;
    }
    succeeded_address(&h.send(&create).await?)?;
    let sleeper = "sleep 100000 </dev/null >/dev/null 2>&1 & echo $!";
    let mut first = None;
    for i in 0..LIVE_PROCESSES {
        let reply = h
            .exec(sandbox, &["sh", "-c", sleeper], EXEC_TIMEOUT_MS)
            .await?;
        let (code, pid, _) = finished(&reply).with_context(|| format!("process {i}"))?;
        ensure!(code == 0, "process {i}: {code}");
        first.get_or_insert_with(|| pid.trim().to_owned());
    }
    let first = first.context("no process started")?;
    for i in 0..SHORT_PROCESSES {
        let reply = h.exec(sandbox, &["echo", "run"], EXEC_TIMEOUT_MS).await?;
        let (code, out, _) = finished(&reply).with_context(|| format!("short process {i}"))?;
        ensure!(
            code == 0 && out == "run\n",
            "short process {i}: {code} {out:?}"
        );
    }
    ensure!(
        sleepers(h, sandbox).await? == LIVE_PROCESSES,
        "not all processes run before the stop"
    );

    stop_with_memory(
        h,
        sandbox,
        2,
        &format!("with {LIVE_PROCESSES} processes running"),
    )
    .await?;
    succeeded_address(&h.send(&h.command(sandbox, 3, CommandKind::Start)).await?)?;
    ensure!(
        sleepers(h, sandbox).await? == LIVE_PROCESSES,
        "the memory stop lost processes"
    );
    let (alive, _, _) = finished(
        &h.exec(sandbox, &["kill", "-0", &first], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(alive == 0, "the first process ({first}) is gone");
    let deleted = h.send(&h.command(sandbox, 4, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    assert_nothing_remains(h, sandbox).await
}

/// How many `sleep` processes run in `sandbox`.
async fn sleepers(h: &Harness, sandbox: SandboxId) -> anyhow::Result<usize> {
    let reply = h
        .exec(sandbox, &["sh", "-c", COUNT_SLEEPERS], EXEC_TIMEOUT_MS)
        .await?;
    let (_, out, _) = finished(&reply)?;
    Ok(out.trim().parse()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gvisor_start_whose_memory_image_is_damaged_boots_from_disk() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(damaged_image(h))).await
}

/// A restore that fails falls back to booting from the disk, which needs the network back: the
/// failed restore's runsc took `eth0`'s addresses, and without them the agent never answered
/// (a hostd killed during a checkpoint leaves such an image: the stop's redelivery calls it a
/// memory stop).
async fn damaged_image(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let create = h.command_with_template(sandbox, 1, CommandKind::Create, "base-gvisor");
    let address = succeeded_address(&h.send(&create).await?)?;
    stop_with_memory(h, sandbox, 2, "a fresh sandbox").await?;
    let image = h.sandbox_dir(sandbox).join("snapshot/checkpoint.img");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&image)
        .with_context(|| image.display().to_string())?
        .set_len(700)?;
    let started = h.send(&h.command(sandbox, 3, CommandKind::Start)).await?;
    ensure!(succeeded_address(&started)? == address, "{started:?}");
    let (code, out, _) = finished(
        &h.exec(sandbox, &["echo", "booted"], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(code == 0 && out.trim() == "booted", "{code}: {out}");
    let deleted = h.send(&h.command(sandbox, 4, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    assert_nothing_remains(h, sandbox).await
}
