//! hostd killed (SIGKILL) at each step of a create, a stop and a start, on runc and on gVisor
//! (issue 12 item 3): after a restart the redelivered command finishes, the sandbox ends in
//! the state the command asked for — running with its address, stopped with its memory
//! (gVisor) or disk (runc), running again with its processes (gVisor) or files (runc) — and
//! nothing is left twice or orphaned (containers in both runtime roots, the network namespace
//! and veth, nftables elements, mounts, loop devices).
//!
//! The crash points are `berth_hostd::fault`'s, compiled into the test build of `berth` only.
//! hostd runs as a child process (`Harness::spawn_hostd_process`) so it can die; each chain
//! creates, stops, starts and deletes one sandbox, crashing once in each of the first three
//! commands, so every step of every command is crashed at once per runtime in a few chains.

use anyhow::{ensure, Context as _};
use berth_hostd::fault::{crash_at, Step};
use berth_schemas::wire::{Command, CommandResult, GuestStatus, ResultOutcome, StopMode};
use berth_schemas::{CommandKind, SandboxId};

use crate::harness::*;
use crate::support::env::{init_tracing, is_root, path_str, run};

/// The steps of a bring-up (create and start), in order.
const BRING_UP: [Step; 6] = [
    Step::Address,
    Step::Network,
    Step::Mounted,
    Step::Container,
    Step::Agent,
    Step::Recorded,
];

/// The steps of a stop on runc (no checkpoint), in order.
const STOP_RUNC: [Step; 4] = [
    Step::Stopping,
    Step::Destroyed,
    Step::Unmounted,
    Step::Recorded,
];

/// The steps of a stop on gVisor, in order.
const STOP_GVISOR: [Step; 5] = [
    Step::Stopping,
    Step::Checkpointed,
    Step::Destroyed,
    Step::Unmounted,
    Step::Recorded,
];

/// A process left running in the sandbox: a memory stop and start must keep it (on runc a
/// disk stop ends it, and its pid may be taken again after the start, so it is not looked at).
const SLEEPER: &str = "sleep 100000 </dev/null >/dev/null 2>&1 & echo $!";

/// One sandbox's life with a crash in each of its first three commands (`None`: no crash).
#[derive(Debug, Clone, Copy)]
struct Chain {
    create: Option<Step>,
    stop: Option<Step>,
    start: Option<Step>,
}

/// Chains that crash at every step of every command once: chain `i` crashes the create and the
/// start at their `i`th step and the stop at its `i`th, where it has one.
fn chains(stop_steps: &[Step]) -> Vec<Chain> {
    (0..BRING_UP.len().max(stop_steps.len()))
        .map(|i| Chain {
            create: BRING_UP.get(i).copied(),
            stop: stop_steps.get(i).copied(),
            start: BRING_UP.get(i).copied(),
        })
        .collect()
}

/// Which runtime a chain runs on, with what that changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Runtime {
    Runc,
    Gvisor,
}

impl Runtime {
    fn template(self) -> &'static str {
        match self {
            Runtime::Runc => "base",
            Runtime::Gvisor => "base-gvisor",
        }
    }

    fn stop_steps(self) -> &'static [Step] {
        match self {
            Runtime::Runc => &STOP_RUNC,
            Runtime::Gvisor => &STOP_GVISOR,
        }
    }

    /// How a stop keeps the sandbox: memory where the runtime can.
    fn last_stop(self) -> StopMode {
        match self {
            Runtime::Runc => StopMode::Disk,
            Runtime::Gvisor => StopMode::Memory,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostd_killed_at_each_step_of_create_stop_and_start_converges_on_runc(
) -> anyhow::Result<()> {
    every_chain(Runtime::Runc).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostd_killed_at_each_step_of_create_stop_and_start_converges_on_gvisor(
) -> anyhow::Result<()> {
    every_chain(Runtime::Gvisor).await
}

/// Runs every chain of `runtime` on one harness (a fresh sandbox each), hostd as a process.
async fn every_chain(runtime: Runtime) -> anyhow::Result<()> {
    init_tracing("info,async_nats=warn");
    ensure!(is_root(), "this test needs root");
    let mut h = Harness::new().await?;
    let mut outcome = Ok(());
    for chain in chains(runtime.stop_steps()) {
        let started = std::time::Instant::now();
        let done = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(run_chain(
            &mut h, runtime, chain,
        )))
        .await;
        match done {
            Ok(Ok(())) => eprintln!(
                "{runtime:?} {chain:?}: converged in {:?}",
                started.elapsed()
            ),
            Ok(Err(e)) => {
                outcome = Err(e.context(format!("{runtime:?} {chain:?}")));
                break;
            }
            Err(panic) => {
                h.teardown().await;
                std::panic::resume_unwind(panic);
            }
        }
    }
    h.teardown().await;
    outcome
}

/// Creates, stops, starts and deletes one sandbox, crashing hostd where `chain` says, and
/// checks the state and the leftovers after each command converged.
async fn run_chain(h: &mut Harness, runtime: Runtime, chain: Chain) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let template = runtime.template();
    // Each hostd run is armed with the next crash of the chain; it passes the commands
    // before it (another kind) untouched.
    let mut points: std::collections::VecDeque<String> = [
        (CommandKind::Create, chain.create),
        (CommandKind::Stop, chain.stop),
        (CommandKind::Start, chain.start),
    ]
    .into_iter()
    .filter_map(|(kind, step)| Some(crash_at(kind, step?)))
    .collect();
    h.stop_hostd_process().await?;
    h.spawn_hostd_process(points.pop_front().as_deref())?;

    let create = h.command_with_template(sandbox, 1, CommandKind::Create, template);
    let created = through_crash(h, &create, chain.create, &mut points).await?;
    let address = succeeded_address(&created).context("create")?;
    h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    let (code, pid, _) = finished(
        &h.exec(
            sandbox,
            &["sh", "-c", &format!("echo kept > /root/kept; {SLEEPER}")],
            EXEC_TIMEOUT_MS,
        )
        .await?,
    )?;
    ensure!(code == 0, "exec after the create: {code}");
    let pid = pid.trim().to_owned();
    assert_one_sandbox(h, sandbox, true)
        .await
        .context("after the create")?;

    let stop = h.command_with_template(sandbox, 2, CommandKind::Stop, template);
    let stopped = through_crash(h, &stop, chain.stop, &mut points).await?;
    ensure!(
        stopped.outcome
            == ResultOutcome::Succeeded {
                address: None,
                last_stop: Some(runtime.last_stop()),
            },
        "stop: {stopped:?}"
    );
    h.heartbeat_with(sandbox, GuestStatus::Stopped).await?;
    // The stop snapshot's upload mounts the disk again for a moment in the background.
    h.durable(stop.id)
        .await
        .context("the stop's durability report")?;
    assert_one_sandbox(h, sandbox, false)
        .await
        .context("after the stop")?;

    let start = h.command_with_template(sandbox, 3, CommandKind::Start, template);
    let started = through_crash(h, &start, chain.start, &mut points).await?;
    ensure!(
        succeeded_address(&started).context("start")? == address,
        "the address changed"
    );
    h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    let (_, kept, _) = finished(
        &h.exec(sandbox, &["cat", "/root/kept"], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(kept == "kept\n", "the disk was not kept: {kept:?}");
    if runtime == Runtime::Gvisor {
        let (alive, _, _) = finished(
            &h.exec(sandbox, &["kill", "-0", &pid], EXEC_TIMEOUT_MS)
                .await?,
        )?;
        ensure!(alive == 0, "the memory stop lost process {pid}");
    }
    assert_one_sandbox(h, sandbox, true)
        .await
        .context("after the start")?;
    ensure!(
        !h.sandbox_dir(sandbox).join("snapshot").exists(),
        "the spent memory image is left"
    );

    let delete = h.command_with_template(sandbox, 4, CommandKind::Delete, template);
    let deleted = h.send(&delete).await?;
    ensure!(
        matches!(deleted.outcome, ResultOutcome::Succeeded { .. }),
        "delete: {deleted:?}"
    );
    assert_nothing_remains(h, sandbox).await?;
    ensure!(
        firewall_mentions(h, sandbox).await? == 0,
        "firewall elements of the deleted sandbox remain"
    );
    ensure!(all_containers(h).await?.is_empty(), "a container remains");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostd_killed_before_its_checkpoint_image_is_in_place_stops_on_disk() -> anyhow::Result<()>
{
    init_tracing("info,async_nats=warn");
    ensure!(is_root(), "this test needs root");
    let mut h = Harness::new().await?;
    let done = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
        image_never_in_place(&mut h),
    ))
    .await;
    h.teardown().await;
    match done {
        Ok(outcome) => outcome,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// A memory stop's checkpoint writes its image beside its place and renames it there once
/// whole. hostd killed in between (as a kill during `runsc checkpoint` leaves a cut image) must
/// not report a memory stop or restore from that image: the redelivered stop finds the
/// checkpointed container stopped and no image in place, and stops on disk, truthfully; the
/// start boots from the disk with its files.
async fn image_never_in_place(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let template = Runtime::Gvisor.template();
    let mut points = std::collections::VecDeque::new();
    h.stop_hostd_process().await?;
    h.spawn_hostd_process(Some(&crash_at(CommandKind::Stop, Step::ImageWritten)))?;
    let create = h.command_with_template(sandbox, 1, CommandKind::Create, template);
    succeeded_address(&through_crash(h, &create, None, &mut points).await?)?;
    let (code, _, _) = finished(
        &h.exec(
            sandbox,
            &["sh", "-c", "echo kept > /root/kept"],
            EXEC_TIMEOUT_MS,
        )
        .await?,
    )?;
    ensure!(code == 0, "exec after the create: {code}");

    let stop = h.command_with_template(sandbox, 2, CommandKind::Stop, template);
    let stopped = through_crash(h, &stop, Some(Step::ImageWritten), &mut points).await?;
    ensure!(
        stopped.outcome
            == ResultOutcome::Succeeded {
                address: None,
                last_stop: Some(StopMode::Disk),
            },
        "stop: {stopped:?}"
    );
    ensure!(
        !h.sandbox_dir(sandbox).join("snapshot").exists(),
        "an image that was never put in place is a memory snapshot"
    );
    h.durable(stop.id)
        .await
        .context("the stop's durability report")?;

    let start = h.command_with_template(sandbox, 3, CommandKind::Start, template);
    succeeded_address(&h.send(&start).await?).context("start")?;
    let (_, kept, _) = finished(
        &h.exec(sandbox, &["cat", "/root/kept"], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(kept == "kept\n", "the disk was not kept: {kept:?}");
    let delete = h.command_with_template(sandbox, 4, CommandKind::Delete, template);
    let deleted = h.send(&delete).await?;
    ensure!(
        matches!(deleted.outcome, ResultOutcome::Succeeded { .. }),
        "delete: {deleted:?}"
    );
    assert_nothing_remains(h, sandbox).await
}

/// Publishes `cmd`; when `step` is set, waits for hostd to die there and restarts it armed
/// with the next point of `points`. Returns the result of the (redelivered) command.
async fn through_crash(
    h: &mut Harness,
    cmd: &Command,
    step: Option<Step>,
    points: &mut std::collections::VecDeque<String>,
) -> anyhow::Result<CommandResult> {
    h.publish(cmd).await?;
    if let Some(step) = step {
        h.await_crash()
            .await
            .with_context(|| format!("{} at {}", cmd.kind, step.as_str()))?;
        h.spawn_hostd_process(points.pop_front().as_deref())?;
    }
    let result = h.result_of(cmd.id).await?;
    ensure!(result.generation == cmd.generation && result.kind == cmd.kind);
    Ok(result)
}

/// The sandbox is the host's only one and is held once: when `running`, one running container
/// (in either runtime root), its overlay and disk mounted on one loop device; when stopped, no
/// container, mount or loop device. Either way one network namespace, one veth marked as this
/// host's, and one guest address in the firewall.
async fn assert_one_sandbox(h: &Harness, sandbox: SandboxId, running: bool) -> anyhow::Result<()> {
    let names = h.names(sandbox);
    let containers = all_containers(h).await?;
    if running {
        ensure!(
            containers == [(names.container_id.clone(), "running".to_owned())],
            "containers: {containers:?}"
        );
    } else {
        ensure!(containers.is_empty(), "containers: {containers:?}");
    }
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    let dir = path_str(&h.sandbox_dir(sandbox));
    let mounted = mounts.lines().filter(|l| l.contains(&dir)).count();
    let loops = loop_devices_below(&h.sandbox_dir(sandbox)).len();
    let expected = if running { (2, 1) } else { (0, 0) };
    ensure!(
        (mounted, loops) == expected,
        "mounts and loop devices: {:?}, expected {expected:?}",
        (mounted, loops)
    );
    let netns = run("ip", &["netns", "list"]).await?;
    ensure!(
        netns.lines().filter(|l| l.contains(&names.netns)).count() == 1,
        "netns {} missing: {netns}",
        names.netns
    );
    let links = run("ip", &["-o", "link", "show"]).await?;
    let alias = format!("alias berth:{}:", h.host_id);
    let veths: Vec<&str> = links.lines().filter(|l| l.contains(&alias)).collect();
    ensure!(
        veths.len() == 1 && veths[0].contains(&names.veth_host),
        "this host's veths: {veths:?}"
    );
    ensure!(
        firewall_mentions(h, sandbox).await? == 1,
        "the sandbox's guest address is not in the firewall exactly once"
    );
    Ok(())
}

/// How many guest-address elements (`"<veth>" . <address>`) of `sandbox` the host's
/// nftables table holds (0 when the table is gone).
async fn firewall_mentions(h: &Harness, sandbox: SandboxId) -> anyhow::Result<usize> {
    let table = berth_hostd::layout::firewall_table(h.host_id);
    let Ok(listed) = run("nft", &["list", "table", "inet", &table]).await else {
        return Ok(0);
    };
    let needle = format!("\"{}\" . ", h.names(sandbox).veth_host);
    Ok(listed.matches(&needle).count())
}

/// Every container in the host's runc and runsc roots, as (id, status).
async fn all_containers(h: &Harness) -> anyhow::Result<Vec<(String, String)>> {
    let mut all = h.containers().await?;
    let out = run(
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
    let listed: Option<Vec<serde_json::Value>> = serde_json::from_str(&out)?;
    all.extend(listed.unwrap_or_default().into_iter().map(|c| {
        (
            c["id"].as_str().unwrap_or("").to_owned(),
            c["status"].as_str().unwrap_or("").to_owned(),
        )
    }));
    Ok(all)
}
