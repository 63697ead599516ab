//! The runtime keeper (`berth runtime-keeper`, `hostd/src/keeper.rs`): it answers with the
//! runtime's own exit code at once, stays the parent of what the runtime leaves running and
//! reaps it the moment it dies, and dies with the runtime when killed before the runtime
//! ended. On gVisor, the sandbox's process is the keeper's child, so a stop and a delete leave
//! no zombie for `runsc delete` to wait on.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use berth_schemas::wire::ResultOutcome;
use berth_schemas::{CommandKind, SandboxId};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::{getpgid, Pid};

use crate::harness::*;
use crate::support::cleanup;
use crate::support::env::path_str;

/// How long a process may take to be reaped, or a keeper to answer, before the test fails (a
/// bound on a loaded machine, not a figure: reaping takes microseconds).
const BOUND: Duration = Duration::from_secs(10);

/// A process's state letter and parent pid from `/proc/<pid>/stat`; `None` when it is gone.
fn stat(pid: u32) -> Option<(char, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut after = text[text.rfind(')')? + 1..].split_whitespace();
    let state = after.next()?.chars().next()?;
    let ppid = after.next()?.parse().ok()?;
    Some((state, ppid))
}

/// A process's command line, its arguments joined by spaces.
fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
        .unwrap_or_default()
}

/// Waits until `pid` is gone from `/proc` (reaped, not a zombie), at most [`BOUND`].
async fn reaped(pid: u32) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + BOUND;
    while let Some((state, ppid)) = stat(pid) {
        if tokio::time::Instant::now() >= deadline {
            bail!("process {pid} is still there in state {state}, child of {ppid}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Waits until `path` holds a pid, at most [`BOUND`].
async fn pid_in(path: &Path) -> anyhow::Result<u32> {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        if let Ok(pid) = std::fs::read_to_string(path)
            .unwrap_or_default()
            .trim()
            .parse()
        {
            return Ok(pid);
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "no pid in {}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn keeper(argv: &[&str]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_berth"));
    command
        .args([berth_hostd::keeper::KEEPER_SUBCOMMAND, "--"])
        .args(argv)
        .kill_on_drop(true);
    command
}

#[tokio::test]
async fn a_keeper_answers_with_the_runtimes_code_and_reaps_what_it_left_running(
) -> anyhow::Result<()> {
    let dir = cleanup::fresh_dir("keeper");
    let pidfile = dir.join("pid");
    // As `runsc run --detach`: start something that outlives it, then exit.
    let script = format!(
        "sleep 60 </dev/null >/dev/null 2>&1 & echo $! > {}; exit 3",
        path_str(&pidfile)
    );
    let status = tokio::time::timeout(BOUND, keeper(&["sh", "-c", &script]).status())
        .await
        .context("the keeper did not answer before what it left running ended")??;
    assert_eq!(status.code(), Some(3), "the runtime's own code");
    let left = pid_in(&pidfile).await?;
    let (state, parent) = stat(left).context("the left process is gone already")?;
    ensure!(state != 'Z', "already dead: {state}");
    ensure!(
        cmdline(parent).contains("runtime-keeper"),
        "the left process's parent {parent} is not the keeper: {:?}",
        cmdline(parent)
    );
    // It keeps no directory of its caller's busy (hostd's working directory).
    let deadline = tokio::time::Instant::now() + BOUND;
    while std::fs::read_link(format!("/proc/{parent}/cwd"))? != Path::new("/") {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the keeper stays in its caller's working directory"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(left as i32),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    reaped(left).await?;
    // With nothing left to reap, the keeper ends.
    ended(parent, "the keeper, after what it kept").await?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[tokio::test]
async fn a_signal_to_the_callers_process_group_spares_the_keeper_and_what_it_keeps(
) -> anyhow::Result<()> {
    let dir = cleanup::fresh_dir("keeper");
    let pidfile = dir.join("pid");
    // The caller as hostd in a terminal: a shell leading its own process group, which starts
    // the keeper and then waits; a Ctrl-C sends SIGINT to that whole group. What the runtime
    // left running stands for runsc's gofer, which dies of a SIGINT (and its sandbox with it).
    let berth = path_str(Path::new(env!("CARGO_BIN_EXE_berth")));
    let left = format!(
        "sleep 60 </dev/null >/dev/null 2>&1 & echo $! > {}",
        path_str(&pidfile)
    );
    let caller = format!(
        "{berth} {} -- sh -c '{left}'; exec sleep 60",
        berth_hostd::keeper::KEEPER_SUBCOMMAND
    );
    let mut shell = tokio::process::Command::new("sh");
    shell
        .args(["-c", &caller])
        .process_group(0)
        .kill_on_drop(true);
    // The test may run with SIGINT ignored (a background job of a shell, `nohup`), and an
    // ignored signal stays ignored across exec: the caller's group must take SIGINT as from a
    // terminal, or its `sleep` outlives the signal, and what the keeper keeps its own 60 s.
    // SAFETY: signal(2) is async-signal-safe.
    unsafe {
        shell.pre_exec(|| {
            nix::sys::signal::signal(Signal::SIGINT, nix::sys::signal::SigHandler::SigDfl)
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
    let mut shell = shell.spawn()?;
    let group = Pid::from_raw(shell.id().context("the caller's pid")? as i32);
    let left = pid_in(&pidfile).await?;
    // Until its runtime ended the keeper dies with its caller, by design (a hostd killed
    // mid-create takes that create down), and what the runtime left is still the runtime's
    // child: the test looks, and signals, once the keeper answered, when the shell, done
    // waiting for it, has become `sleep`.
    let deadline = tokio::time::Instant::now() + BOUND;
    while !cmdline(group.as_raw() as u32).starts_with("sleep") {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the keeper never answered its caller"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (_, keeper) = stat(left).context("the left process is gone already")?;
    ensure!(
        cmdline(keeper).contains("runtime-keeper"),
        "the left process's parent {keeper} is not the keeper: {:?}",
        cmdline(keeper)
    );
    // A shell's `&` child ignores SIGINT, so the left process's group is checked instead.
    ensure!(
        getpgid(Some(Pid::from_raw(left as i32)))? != group,
        "what the keeper keeps is in its caller's process group"
    );
    killpg(group, Signal::SIGINT)?;
    tokio::time::timeout(BOUND, shell.wait())
        .await
        .context("the caller's group outlived its SIGINT")??;
    tokio::time::sleep(Duration::from_millis(100)).await;
    ensure!(
        stat(keeper).is_some_and(|(state, _)| state != 'Z'),
        "the keeper ({keeper}) died of the SIGINT to its caller's group"
    );
    kill(Pid::from_raw(left as i32), Signal::SIGKILL)?;
    reaped(left).await?;
    ended(keeper, "the keeper, after what it kept").await?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[tokio::test]
async fn a_keeper_killed_before_its_runtime_ended_takes_the_runtime_with_it() -> anyhow::Result<()>
{
    let dir = cleanup::fresh_dir("keeper");
    let pidfile = dir.join("pid");
    // As a runtime that hangs: hostd kills the keeper at its timeout.
    let script = format!("echo $$ > {}; exec sleep 60", path_str(&pidfile));
    let mut child = keeper(&["sh", "-c", &script]).spawn()?;
    let runtime = pid_in(&pidfile).await?;
    child.kill().await?;
    ended(runtime, "the runtime, after its keeper was killed").await?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[tokio::test]
async fn an_exit_code_too_is_the_keepers_when_the_runtime_cannot_start() -> anyhow::Result<()> {
    let status = tokio::time::timeout(BOUND, keeper(&["/nonexistent/runtime"]).status()).await??;
    assert_eq!(status.code(), Some(berth_hostd::keeper::NOT_STARTED));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gvisor_sandbox_is_the_keepers_child_and_is_reaped_at_its_stop_and_delete(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(gvisor_reaped(h))).await
}

async fn gvisor_reaped(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let create = h.command_with_template(sandbox, 1, CommandKind::Create, "base-gvisor");
    succeeded_address(&h.send(&create).await?)?;
    let pid = sandbox_pid(h, sandbox).await?;
    let keeper = keeper_of(pid)?;
    assert_booted_pid_in_own_cgroup(h, sandbox)?;

    // An exec right before the stop leaves a kept agent connection to close and settle: the
    // memory stop must still find none open.
    let (code, _, _) = finished(&h.exec(sandbox, &["true"], EXEC_TIMEOUT_MS).await?)?;
    ensure!(code == 0);
    stop_with_memory(h, sandbox, 2, "right after an exec").await?;
    ensure!(
        stat(pid).is_none(),
        "the checkpointed sandbox {pid} is not reaped: {:?}",
        stat(pid)
    );
    ended(keeper, "the keeper, after its sandbox").await?;

    succeeded_address(&h.send(&h.command(sandbox, 3, CommandKind::Start)).await?)?;
    let pid = sandbox_pid(h, sandbox).await?;
    let keeper = keeper_of(pid)?;
    let deleted = h.send(&h.command(sandbox, 4, CommandKind::Delete)).await?;
    ensure!(
        matches!(deleted.outcome, ResultOutcome::Succeeded { .. }),
        "{deleted:?}"
    );
    ensure!(
        stat(pid).is_none(),
        "the deleted sandbox {pid} is not reaped: {:?}",
        stat(pid)
    );
    ended(keeper, "the keeper, after its sandbox").await?;
    assert_nothing_remains(h, sandbox).await
}

/// The pid of the sandbox process of `sandbox`'s gVisor container (`runsc state`).
async fn sandbox_pid(h: &Harness, sandbox: SandboxId) -> anyhow::Result<u32> {
    let out = tokio::process::Command::new("runsc")
        .arg("--root")
        .arg(h.runsc_root())
        .args(["state", &h.names(sandbox).container_id])
        .output()
        .await?;
    let state: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("runsc state: {}", String::from_utf8_lossy(&out.stderr)))?;
    state["pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
        .context("no pid in runsc state")
}

/// The keeper whose child `pid` is.
fn keeper_of(pid: u32) -> anyhow::Result<u32> {
    let (_, parent) = stat(pid).context("the sandbox process is gone")?;
    ensure!(
        cmdline(parent).contains("runtime-keeper"),
        "the sandbox process {pid}'s parent {parent} is not a keeper: {:?}",
        cmdline(parent)
    );
    Ok(parent)
}

/// Waits until `pid` has ended (a zombie until its parent reaps it, or gone), at most
/// [`BOUND`]; `what` names it in the failure.
async fn ended(pid: u32, what: &str) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + BOUND;
    while stat(pid).is_some_and(|(state, _)| state != 'Z') {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{what} ({pid}) still runs: {:?}",
            cmdline(pid)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}
