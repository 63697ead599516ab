//! A sandbox's disk limit and its console log, through hostd on runc and gVisor: a write past
//! `disk_mib` gets `ENOSPC` inside the sandbox while the host holds at most the sandbox's
//! image; the disk survives stops (disk and memory), starts and a hostd restart; a create that
//! fails after its disk was mounted leaves nothing; and a console written far past its cap
//! keeps at most the cap per file, read by its tail.

use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use anyhow::{bail, ensure, Context as _};
use berth_schemas::wire::{
    self, AgentOp, AgentReply, AgentRequest, GuestStatus, ResultOutcome, StopMode,
};
use berth_schemas::{CommandKind, SandboxId};

use crate::harness::*;
use crate::support::env::{eventually, path_str, run};

/// The disk of the sandboxes these tests fill, in MiB.
const DISK_MIB: u32 = 64;

/// How long a fill may take (gVisor's ptrace platform on a loaded machine is slow).
const FILL_TIMEOUT_MS: u64 = 120_000;

/// What the image of a sandbox that deleted its big file may still take on the host: ext4's
/// metadata and the few small files the test writes.
const FREED_IMAGE_BYTES: u64 = 16 << 20;

/// The console cap of the console test, in bytes; the sandbox writes 64 times as much.
const CONSOLE_CAP: u64 = 64 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runc_sandbox_that_fills_its_disk_gets_enospc_and_keeps_its_disk_across_stop_and_restart(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(fill_the_disk(h, "base", StopMode::Disk))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gvisor_sandbox_that_fills_its_disk_gets_enospc_and_keeps_its_disk_across_a_memory_stop(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(fill_the_disk(h, "base-gvisor", StopMode::Memory))).await
}

async fn fill_the_disk(
    h: &mut Harness,
    template: &'static str,
    stop_mode: StopMode,
) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let dir = h.sandbox_dir(sandbox);
    let create = h.command_with_disk(sandbox, 1, CommandKind::Create, template, DISK_MIB);
    succeeded_address(&h.send(&create).await?)?;
    ensure!(is_mounted(&dir.join("disk"))?, "the disk is not mounted");
    ensure!(
        loop_devices_below(&dir).len() == 1,
        "one loop device backs the disk"
    );
    ensure!(
        !dir.join("upper").exists(),
        "an upper dir on the host's filesystem"
    );

    // Past the limit: ENOSPC inside, and the host holds no more than the image.
    fill_fails_with_enospc(h, sandbox).await?;
    let image = allocated(&dir.join("disk.img"))?;
    ensure!(
        image <= u64::from(DISK_MIB) << 20,
        "the image takes {image} bytes on the host, more than {DISK_MIB} MiB"
    );
    let outside = allocated_outside_the_disk(&dir)?;
    ensure!(
        outside <= 2 * berth_hostd::console::DEFAULT_CONSOLE_LOG_MAX_BYTES + (1 << 20),
        "the sandbox dir holds {outside} bytes outside its image"
    );
    // Space freed inside is writable again, and goes back to the host (`discard` punches
    // holes in the image once ext4 commits the delete).
    exec_ok(h, sandbox, "rm /big && echo kept > /root/kept").await?;
    let image_path = dir.join("disk.img");
    eventually(
        "the image to give the freed blocks back to the host",
        || {
            let small = allocated(&image_path).is_ok_and(|bytes| bytes < FREED_IMAGE_BYTES);
            async move { small }
        },
    )
    .await;

    // A stop keeps the disk and releases its mount and loop device; the start mounts it again.
    // The stop snapshot's capture mounts the disk again to read it, in the background after
    // the stop's answer: the disk is released once the stop is durable.
    let stop = h.command(sandbox, 2, CommandKind::Stop);
    let stopped = h.send(&stop).await?;
    ensure!(
        stopped.outcome
            == ResultOutcome::Succeeded {
                address: None,
                last_stop: Some(stop_mode),
            },
        "{stopped:?}"
    );
    h.durable(stop.id).await?;
    ensure!(
        !is_mounted(&dir.join("disk"))?,
        "the disk is mounted while stopped"
    );
    ensure!(
        loop_devices_below(&dir).is_empty(),
        "a loop device is attached while stopped"
    );
    ensure!(dir.join("disk.img").is_file(), "the stop removed the image");
    let started = h.send(&h.command(sandbox, 3, CommandKind::Start)).await?;
    succeeded_address(&started)?;
    ensure!(exec_ok(h, sandbox, "cat /root/kept").await? == "kept\n");

    // A restarted hostd adopts the mounted disk; the limit still holds.
    h.stop_hostd().await?;
    h.start_hostd();
    h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    // The heartbeat may be the old run's, and a request may reach the old run's subscription
    // as it goes: the new run answers once it subscribed.
    let mut kept = exec_ok(h, sandbox, "cat /root/kept").await;
    let deadline = tokio::time::Instant::now() + RESULT_TIMEOUT;
    while kept.is_err() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        kept = exec_ok(h, sandbox, "cat /root/kept").await;
    }
    ensure!(kept? == "kept\n");
    fill_fails_with_enospc(h, sandbox).await?;

    // Delete: no mount, no loop device, no image, no console writer.
    let deleted = h.send(&h.command(sandbox, 4, CommandKind::Delete)).await?;
    ensure!(
        matches!(deleted.outcome, ResultOutcome::Succeeded { .. }),
        "{deleted:?}"
    );
    assert_nothing_remains(h, sandbox).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_that_fails_after_its_disk_is_mounted_leaves_no_mount_loop_device_or_image(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(failed_after_the_disk(h))).await
}

async fn failed_after_the_disk(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let mut create = h.command_with_disk(sandbox, 1, CommandKind::Create, "base", DISK_MIB);
    // A memory limit too small for the runtime's own init: `run` fails after the disk and the
    // overlay are mounted.
    create
        .spec
        .as_mut()
        .context("the command has a spec")?
        .resources
        .memory_mib = 1;
    let failed = h.send(&create).await?;
    let ResultOutcome::Failed { reason } = &failed.outcome else {
        bail!("expected a failure: {failed:?}");
    };
    // Failed at the runtime, after the disk: no step before `run` names runc.
    ensure!(
        reason.contains("runc"),
        "failed before the runtime: {reason}"
    );
    assert_nothing_remains(h, sandbox).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_written_far_past_its_cap_keeps_at_most_the_cap_per_file_on_runc(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(console_cap(h, "base", ConsoleWriter::HostSide))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_written_far_past_its_cap_keeps_at_most_the_cap_per_file_on_gvisor(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(console_cap(h, "base-gvisor", ConsoleWriter::Inside))).await
}

/// Who floods a sandbox's console.
#[derive(Clone, Copy)]
enum ConsoleWriter {
    /// An exec inside the sandbox, through `/proc/1/fd/1` (gVisor lets its root reach it).
    Inside,
    /// The test, from the host, through the container init's `/proc/<pid>/fd/1`: inside a
    /// runc sandbox the agent is not dumpable and its user namespace not the host's, so
    /// `/proc/1/fd` is refused there; what the agent itself writes takes the same pipe.
    HostSide,
}

async fn console_cap(
    h: &mut Harness,
    template: &'static str,
    writer: ConsoleWriter,
) -> anyhow::Result<()> {
    h.stop_hostd().await?;
    h.config.console_log_max_bytes = CONSOLE_CAP;
    h.start_hostd();
    let sandbox = SandboxId::new();
    let create = h.command_with_template(sandbox, 1, CommandKind::Create, template);
    succeeded_address(&h.send(&create).await?)?;

    // 4 MiB into the agent's stdout (the console), then a last line on its stderr.
    let flood = |fd: &str| {
        format!(
            "dd if=/dev/zero bs=1024 count=4096 2>/dev/null | tr '\\0' x > {fd}/1 \
             && echo console-end > {fd}/2"
        )
    };
    match writer {
        ConsoleWriter::Inside => {
            exec_ok(h, sandbox, &flood("/proc/1/fd")).await?;
        }
        ConsoleWriter::HostSide => {
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
                .as_i64()
                .context("the container's init pid")?;
            run("sh", &["-c", &flood(&format!("/proc/{pid}/fd"))]).await?;
        }
    }
    let log = h.sandbox_dir(sandbox).join("console.log");
    let end = log.clone();
    eventually("the console's last line to reach the log", || {
        let tail = berth_hostd::console::tail(&end, 12);
        async move { tail == b"console-end\n" }
    })
    .await;
    let current = std::fs::metadata(&log)?.len();
    let rotated = std::fs::metadata(berth_hostd::console::rotated(&log))
        .context("a rotated console log")?
        .len();
    ensure!(
        current <= CONSOLE_CAP && rotated <= CONSOLE_CAP,
        "console files of {current} and {rotated} bytes, cap {CONSOLE_CAP}"
    );
    let quoted = berth_hostd::runtime::cli::console_tail(&log);
    ensure!(
        quoted.len() <= berth_hostd::runtime::cli::CONSOLE_TAIL_BYTES
            && quoted.ends_with("xxxxconsole-end"),
        "the quoted tail: {} bytes ending {:?}",
        quoted.len(),
        &quoted[quoted.len().saturating_sub(20)..]
    );
    // The sandbox is unharmed.
    ensure!(exec_ok(h, sandbox, "echo alive").await? == "alive\n");

    let deleted = h.send(&h.command(sandbox, 2, CommandKind::Delete)).await?;
    ensure!(
        matches!(deleted.outcome, ResultOutcome::Succeeded { .. }),
        "{deleted:?}"
    );
    assert_nothing_remains(h, sandbox).await
}

/// `dd` of `DISK_MIB + 50` MiB into `/big` fails with "No space left on device".
async fn fill_fails_with_enospc(h: &Harness, sandbox: SandboxId) -> anyhow::Result<()> {
    let count = format!("count={}", DISK_MIB + 50);
    let reply = long_exec(
        h,
        sandbox,
        &["dd", "if=/dev/zero", "of=/big", "bs=1M", &count],
    )
    .await?;
    let AgentReply::Exec {
        exit_code, stderr, ..
    } = &reply
    else {
        bail!("dd: {reply:?}");
    };
    let stderr = String::from_utf8_lossy(stderr);
    ensure!(
        *exit_code != 0 && stderr.contains("No space left"),
        "dd past the limit: exit {exit_code}, {stderr:?}"
    );
    Ok(())
}

/// Runs `sh -c script`; its stdout when it exits 0.
async fn exec_ok(h: &Harness, sandbox: SandboxId, script: &str) -> anyhow::Result<String> {
    let reply = h
        .exec(sandbox, &["sh", "-c", script], EXEC_TIMEOUT_MS)
        .await?;
    let (code, stdout, _) = finished(&reply)?;
    ensure!(code == 0, "{script}: exit {code}: {reply:?}");
    Ok(stdout)
}

/// An exec of `argv` that may take up to [`FILL_TIMEOUT_MS`] (the NATS client's own request
/// timeout is shorter than a fill on gVisor on a loaded machine).
async fn long_exec(h: &Harness, sandbox: SandboxId, argv: &[&str]) -> anyhow::Result<AgentReply> {
    let request = AgentRequest {
        sandbox_id: sandbox,
        op: AgentOp::Exec(exec_spec(argv, FILL_TIMEOUT_MS)),
    };
    let timeout = std::time::Duration::from_millis(FILL_TIMEOUT_MS + 10_000);
    let reply = h
        .nats
        .send_request(
            h.subjects.agent(h.host_id),
            async_nats::Request::new()
                .payload(wire::encode(&request).into())
                .timeout(Some(timeout)),
        )
        .await
        .with_context(|| format!("exec {argv:?}"))?;
    Ok(wire::decode(&reply.payload)?)
}

fn is_mounted(path: &Path) -> anyhow::Result<bool> {
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    let path = path_str(path);
    Ok(mounts
        .lines()
        .any(|l| l.split(' ').nth(1) == Some(path.as_str())))
}

/// Bytes the host's filesystem allocated to `path` (its blocks, not its apparent size).
fn allocated(path: &Path) -> anyhow::Result<u64> {
    Ok(std::fs::metadata(path)?.blocks() * 512)
}

/// Bytes allocated to the files of a sandbox dir on the host's filesystem, without the disk
/// image and what is mounted below the dir (the disk, the overlay).
fn allocated_outside_the_disk(dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    let mut pending = vec![dir.to_path_buf()];
    let dev = std::fs::metadata(dir)?.dev();
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d)? {
            let entry = entry?;
            let meta = std::fs::symlink_metadata(entry.path())?;
            if meta.dev() != dev || entry.path() == dir.join("disk.img") {
                continue;
            }
            if meta.is_dir() {
                pending.push(entry.path());
            } else {
                total += meta.blocks() * 512;
            }
        }
    }
    Ok(total)
}
