//! hostd's reading of the runtimes' state files (`berth_hostd::runtime::statefile`) says what
//! `runc list` and `runsc list` say, for real containers of a hostd's roots: running, created
//! and not started (made by hand: hostd always runs detached), paused, killed, and deleted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context as _};
use berth_hostd::runtime::statefile;
use berth_schemas::wire::GuestStatus;
use berth_schemas::{CommandKind, SandboxId};

use crate::harness::*;
use crate::support::env::{path_str, run};

/// The id of the container made with `create` and never started.
const CREATED: &str = "probe-created";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runc_state_files_say_what_runc_list_says() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(runc_equivalence(h))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runsc_state_files_say_what_runsc_list_says() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(runsc_equivalence(h))).await
}

/// `<runtime> --root <root> list --format json`, by id.
async fn listed(runtime: &str, root: &Path) -> anyhow::Result<HashMap<String, String>> {
    let out = run(
        runtime,
        &["--root", &path_str(root), "list", "--format", "json"],
    )
    .await?;
    let entries: Option<Vec<serde_json::Value>> = serde_json::from_str(&out)?;
    Ok(entries
        .unwrap_or_default()
        .into_iter()
        .map(|c| {
            (
                c["id"].as_str().unwrap_or_default().to_owned(),
                c["status"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect())
}

/// Checks that the state files of `root` read as `runtime list` prints it, and that `id`
/// has `expected` there (`None`: absent).
async fn agree(
    runtime: &str,
    root: &Path,
    read: fn(
        &Path,
    ) -> Result<
        HashMap<String, berth_hostd::runtime::ContainerStatus>,
        statefile::StateFileError,
    >,
    id: &str,
    expected: Option<&str>,
    when: &str,
) -> anyhow::Result<()> {
    let from_files: HashMap<String, String> = read(root)
        .with_context(|| format!("{runtime} state files, {when}"))?
        .into_iter()
        .map(|(id, status)| (id, format!("{status:?}").to_lowercase()))
        .collect();
    let from_cli = listed(runtime, root).await?;
    ensure!(
        from_files == from_cli,
        "{runtime}, {when}: state files {from_files:?}, {runtime} list {from_cli:?}"
    );
    ensure!(
        from_files.get(id).map(String::as_str) == expected,
        "{runtime}, {when}: {id} is {:?}, not {expected:?}",
        from_files.get(id)
    );
    Ok(())
}

/// A busybox bundle under the harness's state dir that sleeps, without a network namespace
/// of its own for runsc (`--network=none` is given on its command line).
fn probe_bundle(h: &Harness) -> anyhow::Result<PathBuf> {
    let bundle = h.state_dir.join("probe-bundle");
    let bin = bundle.join("rootfs/bin");
    std::fs::create_dir_all(&bin)?;
    std::fs::copy("/bin/busybox", bin.join("busybox"))?;
    std::os::unix::fs::symlink("busybox", bin.join("sleep"))?;
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false, "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sleep", "600"], "env": ["PATH=/bin"], "cwd": "/",
        },
        "root": {"path": "rootfs", "readonly": true},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "ipc"}, {"type": "uts"}]},
    });
    std::fs::write(bundle.join("config.json"), serde_json::to_vec(&spec)?)?;
    Ok(bundle)
}

/// Runs `program args` (a `create`) with its stdio on `/dev/null`: the created container's
/// processes keep the stdio they are given, so a pipe would never close.
fn create_detached(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let status = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()?;
    ensure!(status.success(), "{program} {args:?}: {status}");
    Ok(())
}

/// Creates a sandbox of `template` through hostd and waits until it runs.
async fn running_sandbox(h: &mut Harness, template: &str) -> anyhow::Result<SandboxId> {
    let sandbox = SandboxId::new();
    let create = h.command_with_template(sandbox, 1, CommandKind::Create, template);
    succeeded_address(&h.send(&create).await?)?;
    h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    Ok(sandbox)
}

async fn runc_equivalence(h: &mut Harness) -> anyhow::Result<()> {
    let root = h.runc_root();
    let root_arg = path_str(&root);
    let read = statefile::runc::list;
    let sandbox = running_sandbox(h, "base").await?;
    let id = h.names(sandbox).container_id;
    agree("runc", &root, read, &id, Some("running"), "running").await?;

    let bundle = path_str(&probe_bundle(h)?);
    create_detached(
        "runc",
        &["--root", &root_arg, "create", "--bundle", &bundle, CREATED],
    )?;
    agree("runc", &root, read, CREATED, Some("created"), "created").await?;

    run("runc", &["--root", &root_arg, "pause", &id]).await?;
    agree("runc", &root, read, &id, Some("paused"), "paused").await?;
    run("runc", &["--root", &root_arg, "resume", &id]).await?;
    agree("runc", &root, read, &id, Some("running"), "resumed").await?;

    run("runc", &["--root", &root_arg, "kill", &id, "KILL"]).await?;
    wait_until_stopped("runc", &root, &id).await?;
    agree("runc", &root, read, &id, Some("stopped"), "killed").await?;

    let delete = h.command(sandbox, 2, CommandKind::Delete);
    h.send(&delete).await?;
    agree("runc", &root, read, &id, None, "deleted").await?;
    run("runc", &["--root", &root_arg, "delete", "--force", CREATED]).await?;
    agree("runc", &root, read, CREATED, None, "created, deleted").await
}

async fn runsc_equivalence(h: &mut Harness) -> anyhow::Result<()> {
    let root = h.runsc_root();
    let root_arg = path_str(&root);
    let read = statefile::runsc::list;
    let sandbox = running_sandbox(h, "base-gvisor").await?;
    let id = h.names(sandbox).container_id;
    agree("runsc", &root, read, &id, Some("running"), "running").await?;

    let bundle = path_str(&probe_bundle(h)?);
    create_detached(
        "runsc",
        &[
            "--root",
            &root_arg,
            "--platform=ptrace",
            "--network=none",
            "create",
            "--bundle",
            &bundle,
            CREATED,
        ],
    )?;
    agree("runsc", &root, read, CREATED, Some("created"), "created").await?;

    run("runsc", &["--root", &root_arg, "pause", &id]).await?;
    agree("runsc", &root, read, &id, Some("paused"), "paused").await?;
    run("runsc", &["--root", &root_arg, "resume", &id]).await?;
    agree("runsc", &root, read, &id, Some("running"), "resumed").await?;

    // Kill the sandbox process itself (its keeper reaps it): the state file still says
    // running, and both must tell it stopped.
    let state: serde_json::Value = serde_json::from_slice(&std::fs::read(
        root.join(format!("{id}_sandbox:{id}.state")),
    )?)?;
    let pid = state["sandbox"]["pid"].as_i64().context("no sandbox pid")?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid)?),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    wait_until_stopped("runsc", &root, &id).await?;
    agree("runsc", &root, read, &id, Some("stopped"), "killed").await?;

    let delete = h.command(sandbox, 2, CommandKind::Delete);
    h.send(&delete).await?;
    agree("runsc", &root, read, &id, None, "deleted").await?;
    run(
        "runsc",
        &["--root", &root_arg, "delete", "--force", CREATED],
    )
    .await?;
    agree("runsc", &root, read, CREATED, None, "created, deleted").await
}

/// Waits until `runtime list` calls `id` stopped (a killed init takes a moment to exit).
async fn wait_until_stopped(runtime: &str, root: &Path, id: &str) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + HEARTBEAT_TIMEOUT;
    loop {
        let status = listed(runtime, root).await?.remove(id);
        if status.as_deref() == Some("stopped") {
            return Ok(());
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{runtime}: {id} still {status:?} after the kill"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
