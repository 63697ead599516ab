//! The `runsc` (gVisor) driver: `runsc --root <state_dir>/runsc --platform=ptrace …`, with
//! memory snapshots (`checkpoint` / `restore`).
//!
//! # Networking
//! The sandbox uses gVisor's own network stack (`--network=sandbox`, the default) inside the
//! sandbox's pre-made network namespace (the OCI spec's namespace path): runsc takes over the
//! namespace's `eth0` (and removes its addresses, which `netns::ensure` puts back before the
//! next start). Debian's runsc (release 20221219) decides it runs in the *root* network
//! namespace when `/proc/sys/net/core/rmem_default` is visible, and refuses ("cannot run with
//! network enabled in root network namespace"); Linux 6.x shows that file in every namespace.
//! So `run` and `restore` are started inside a private mount namespace of their own
//! (`unshare --mount`) where `/proc/sys/net` is covered by an empty tmpfs: the check then
//! sees a non-root namespace, which is true. Nothing else of the host changes.
//!
//! # Checkpoint
//! gVisor refuses to save a connected TCP endpoint (TIME_WAIT included): the agent closes
//! its connections passively (see `agent::server`) and hostd quiesces a sandbox's agent
//! traffic before a checkpoint. A checkpoint that fails anyway leaves the container dead; the
//! caller then falls back to a disk-only stop.
//!
//! # Reaping
//! `run` and `restore` run under a runtime keeper ([`crate::keeper`]) that stays the parent of
//! the sandbox and gofer processes: `runsc delete` waits for a killed sandbox to be reaped
//! (`kill(pid, 0)` every 100 ms), which took 1.5 s whenever PID 1 reaped late.
//!
//! Platform: `ptrace` (KVM is not available everywhere; `systrap` is newer than this runsc).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use futures::future::BoxFuture;
use futures::FutureExt;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::cli::{ConsoleConfig, OciCli};
use super::exit::{wait_gone, KILL_WAIT};
use super::{ContainerStatus, RunRequest, RuntimeDriver};
use crate::error::HostdError;

/// The runtime's name.
pub const RUNSC: &str = "runsc";

/// The runsc binary, looked up on `PATH`.
const RUNSC_BINARY: &str = "runsc";

/// The gVisor platform: works without KVM.
pub const RUNSC_PLATFORM: &str = "--platform=ptrace";

/// Load the OCI spec's seccomp filter ([`crate::seccomp`]) inside the sandbox, for the
/// sandbox's processes against gVisor's kernel. Without it runsc ignores `linux.seccomp`
/// (the sentry has its own host-side filter either way).
pub const RUNSC_OCI_SECCOMP: &str = "--oci-seccomp";

/// The `pids.max` of a gVisor sandbox's host cgroup (runc's sandboxes get
/// [`crate::oci::PIDS_LIMIT`]). That cgroup holds the Sentry and the gofer (about 100 host
/// threads) and, on the ptrace platform, a stub process per live guest process with one thread
/// per Sentry thread that ran the guest there: about 10 host tasks per live guest process on
/// the test machine (2,211 with 200 `sleep`s running). With runc's 1024 a sandbox holding
/// about 90–140 live processes left the Sentry no room: its next stub (an exec's, or the
/// checkpoint's) failed with `EAGAIN`, the Sentry panicked ("error initializing first thread:
/// resource temporarily unavailable") and `runsc checkpoint` reported `EOF` (issue 12 item
/// 4). 8192 holds several hundred live guest processes and still stops a fork bomb well short
/// of the host's `pid_max` (32768 by default); a guest that exceeds it takes only its own
/// sandbox down, as it did at 1024.
pub const GVISOR_PIDS_LIMIT: i64 = 8192;

/// Size the Sentry's CPUs (its Go scheduler's, and so the stub threads per guest process)
/// by the sandbox's CPU quota (at least 2) instead of the host's CPU count, so the host tasks
/// a guest process costs do not grow with the machine.
pub const RUNSC_CPU_NUM_FROM_QUOTA: &str = "--cpu-num-from-quota";

/// The mount namespace wrapper of `run` and `restore` (see the module docs): a shell that
/// covers `/proc/sys/net` with an empty tmpfs in a private mount namespace, then execs the
/// runtime command given as its arguments.
const NETNS_CHECK_WRAPPER: &[&str] = &[
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    "mount -t tmpfs -o size=4k,mode=0555 berth-hide-sysctl-net /proc/sys/net && exec \"$@\"",
    "berth-runsc",
];

/// The runsc driver.
#[derive(Debug, Clone)]
pub struct Runsc {
    cli: OciCli,
    hide_proc_sys_net: bool,
}

impl Runsc {
    /// A driver keeping its state in `root` (created if missing), writing consoles as
    /// `console` says. `hide_proc_sys_net` turns on the workaround of the module docs.
    ///
    /// Errors: [`HostdError::Io`].
    pub fn new(
        root: PathBuf,
        hide_proc_sys_net: bool,
        console: ConsoleConfig,
    ) -> Result<Self, HostdError> {
        Ok(Self {
            cli: OciCli::new(
                RUNSC,
                RUNSC_BINARY,
                root,
                vec![
                    RUNSC_PLATFORM.to_owned(),
                    RUNSC_OCI_SECCOMP.to_owned(),
                    RUNSC_CPU_NUM_FROM_QUOTA.to_owned(),
                ],
                console,
            )?,
            hide_proc_sys_net,
        })
    }

    /// Whether the runsc binary is on `PATH`.
    pub fn available() -> bool {
        std::env::var_os("PATH").is_some_and(|paths| {
            std::env::split_paths(&paths).any(|dir| dir.join(RUNSC_BINARY).is_file())
        })
    }

    /// The status runsc's state file gives the container, when its sandbox process (checked
    /// as [`Runsc::own_processes`] does) still lives.
    fn status_while_alive(&self, container_id: &str) -> Option<ContainerStatus> {
        let state = self.state_file(container_id)?;
        let status: ContainerStatus = serde_json::from_value(state["status"].clone()).ok()?;
        let pid = i32::try_from(state["sandbox"]["pid"].as_i64()?).ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        (is_process_of(&cmdline, "runsc-sandbox", container_id) && super::exit::alive(&stat))
            .then_some(status)
    }

    /// runsc's state file of the container, `<root>/<id>_sandbox:<id>.state` (its `status`,
    /// `sandbox.pid` and `goferPid`), when it reads as JSON.
    fn state_file(&self, container_id: &str) -> Option<serde_json::Value> {
        let file = self
            .cli
            .root
            .join(format!("{container_id}_sandbox:{container_id}.state"));
        serde_json::from_slice(&std::fs::read(file).ok()?).ok()
    }

    /// The host pids of a container's sandbox and gofer processes that still live: runsc's
    /// state file of the container (`<root>/<id>_sandbox:<id>.state`, whose `sandbox.pid` and
    /// `goferPid` runsc writes) names them, and `/proc/<pid>/cmdline` shows each is this
    /// container's (`runsc-sandbox … <id>`; `runsc-gofer … --bundle <dir>/<id>`), so a pid the
    /// kernel gave to another process since is never taken for theirs.
    fn own_processes(&self, container_id: &str) -> Vec<i32> {
        let Some(state) = self.state_file(container_id) else {
            return Vec::new();
        };
        [
            (&state["sandbox"]["pid"], "runsc-sandbox"),
            (&state["goferPid"], "runsc-gofer"),
        ]
        .into_iter()
        .filter_map(|(pid, program)| {
            let pid = i32::try_from(pid.as_i64()?).ok().filter(|p| *p > 1)?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            is_process_of(&cmdline, program, container_id).then_some(pid)
        })
        .collect()
    }

    fn wrapper(&self) -> &'static [&'static str] {
        if self.hide_proc_sys_net {
            NETNS_CHECK_WRAPPER
        } else {
            &[]
        }
    }
}

impl RuntimeDriver for Runsc {
    fn name(&self) -> &'static str {
        RUNSC
    }

    fn memory_snapshot(&self) -> bool {
        true
    }

    fn pids_limit(&self) -> i64 {
        GVISOR_PIDS_LIMIT
    }

    fn freeze<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>> {
        async move {
            let args = ["pause", container_id];
            let pause = self.cli.call(&args);
            self.cli.timed("pause", pause).await.map(|_| ())
        }
        .boxed()
    }

    fn thaw<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>> {
        async move {
            let args = ["resume", container_id];
            let resume = self.cli.call(&args);
            self.cli.timed("resume", resume).await.map(|_| ())
        }
        .boxed()
    }

    fn run<'a>(&'a self, req: RunRequest<'a>) -> BoxFuture<'a, Result<(), HostdError>> {
        let args = req.run_args();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let run = self
                .cli
                .detached(true, self.wrapper(), &args, req.console_log, "run");
            self.cli.timed("run", run).await
        }
        .boxed()
    }

    /// From runsc's state file while its sandbox process lives (no `runsc state`: 30–40 ms
    /// on every stop's path and every second of a long exec, issue 16); else, or when the
    /// file does not read as expected, from `runsc state`, which also tells a container
    /// whose sandbox died stopped.
    fn status<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<ContainerStatus>, HostdError>> {
        async move {
            if let Some(status) = self.status_while_alive(container_id) {
                return Ok(Some(status));
            }
            Ok(self.cli.state(container_id).await?.map(|(s, _)| s))
        }
        .boxed()
    }

    fn pid<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<Option<i64>, HostdError>> {
        async move { Ok(self.cli.state(container_id).await?.and_then(|(_, p)| p)) }.boxed()
    }

    fn list(&self) -> BoxFuture<'_, Result<HashMap<String, ContainerStatus>, HostdError>> {
        self.cli
            .list_from_state(super::statefile::runsc::list)
            .boxed()
    }

    /// Kills the container's sandbox and gofer processes and waits for them to be reaped
    /// before `delete --force`, which would send the kills itself and then poll `kill(pid, 0)`
    /// every 100 ms: 134 ms for a delete by hand here, against 4 ms to kill and see them
    /// reaped by their keeper, then 27 ms for the delete (issue 16). Also after a checkpoint,
    /// whose sandbox and gofer end on their own but not always before runsc looks. The pids
    /// come from runsc's own state file, so no `runsc state` (30 ms) is run; when that file
    /// does not read as expected, `delete --force` does it all, as before.
    fn destroy<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>> {
        async move {
            let own = self.own_processes(container_id);
            for pid in &own {
                if let Err(e) = kill(Pid::from_raw(*pid), Signal::SIGKILL) {
                    tracing::debug!(pid, error = %e, "kill before delete");
                }
            }
            for pid in own {
                // Gone, not only dead: runsc's `kill(pid, 0)` answers for a zombie too. The
                // keeper reaps them at once.
                wait_gone(i64::from(pid), KILL_WAIT).await;
            }
            self.cli.destroy(container_id).await
        }
        .boxed()
    }

    fn checkpoint<'a>(
        &'a self,
        container_id: &'a str,
        image_dir: &'a Path,
    ) -> BoxFuture<'a, Result<(), HostdError>> {
        async move {
            fresh_dir(image_dir)?;
            let image = image_dir.to_string_lossy().into_owned();
            let args = ["checkpoint", "--image-path", &image, container_id];
            let checkpoint = self.cli.call(&args);
            self.cli.timed("checkpoint", checkpoint).await.map(|_| ())
        }
        .boxed()
    }

    fn restore<'a>(
        &'a self,
        req: RunRequest<'a>,
        image_dir: &'a Path,
    ) -> BoxFuture<'a, Result<(), HostdError>> {
        let bundle = req.bundle.to_string_lossy().into_owned();
        let image = image_dir.to_string_lossy().into_owned();
        let pid_file = req.pid_file.to_string_lossy().into_owned();
        async move {
            // The checkpointed container's remains hold the id until deleted.
            self.cli.destroy(req.container_id).await?;
            let args = [
                "restore",
                "--detach",
                "--image-path",
                &image,
                "--pid-file",
                &pid_file,
                "--bundle",
                &bundle,
                req.container_id,
            ];
            let restore =
                self.cli
                    .detached(true, self.wrapper(), &args, req.console_log, "restore");
            self.cli.timed("restore", restore).await
        }
        .boxed()
    }
}

/// Whether a `/proc/<pid>/cmdline` is that of `container_id`'s `program` (argv[0]): its
/// sandbox (`runsc-sandbox`), whose last argument is the id, or its gofer (`runsc-gofer`),
/// whose bundle dir is named after it.
pub(crate) fn is_process_of(cmdline: &[u8], program: &str, container_id: &str) -> bool {
    let mut args = cmdline.split(|b| *b == 0).filter(|a| !a.is_empty());
    if args.next() != Some(program.as_bytes()) {
        return false;
    }
    let id = container_id.as_bytes();
    match program {
        "runsc-sandbox" => args.next_back() == Some(id),
        _ => args.any(|arg| arg.ends_with(&[b"/", id].concat())),
    }
}

/// Makes `dir` an empty directory.
fn fresh_dir(dir: &Path) -> Result<(), HostdError> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(HostdError::io(format!("remove {}", dir.display()))(e))
        }
        _ => {}
    }
    std::fs::create_dir_all(dir).map_err(HostdError::io(format!("create {}", dir.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_containers_own_sandbox_and_gofer_are_taken_for_them() {
        let sandbox = b"runsc-sandbox\0--root=/r\0boot\0--bundle=/s/c1\0c1\0";
        assert!(is_process_of(sandbox, "runsc-sandbox", "c1"));
        assert!(
            !is_process_of(sandbox, "runsc-sandbox", "c2"),
            "another container's"
        );
        assert!(!is_process_of(sandbox, "runsc-gofer", "c1"), "not a gofer");
        let gofer = b"runsc-gofer\0--root=/r\0gofer\0--bundle\0/s/c1\0--spec-fd=3\0";
        assert!(is_process_of(gofer, "runsc-gofer", "c1"));
        assert!(!is_process_of(gofer, "runsc-gofer", "1"), "a whole name");
        assert!(
            !is_process_of(gofer, "runsc-gofer", "c2"),
            "another container's"
        );
        assert!(
            !is_process_of(b"sleep\0c1\0", "runsc-sandbox", "c1"),
            "a reused pid"
        );
        assert!(!is_process_of(b"", "runsc-sandbox", "c1"), "gone");
    }
}
