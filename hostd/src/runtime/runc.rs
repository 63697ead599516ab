//! The `runc` driver: `runc --root <state_dir>/runc …`, one root per hostd. No memory
//! snapshots (CRIU does not work on every kernel; stop is disk-only). Its containers get a
//! user namespace mapping their ids to [`crate::isolation::SANDBOX_IDS`]; since the network
//! namespace they join is the host's, `runc exec` (which joins the user namespace first)
//! cannot enter them: hostd reaches them through the agent only.

use std::collections::HashMap;
use std::path::PathBuf;

use futures::future::BoxFuture;
use futures::FutureExt;

use super::cli::{ConsoleConfig, OciCli};
use super::exit::{wait_exited, KILL_WAIT};
use super::statefile::{self, runc::RuncState};
use super::{ContainerStatus, RunRequest, RuntimeDriver};
use crate::error::HostdError;

pub use super::cli::{console_tail, CONSOLE_TAIL_BYTES};

/// The runtime's name.
pub const RUNC: &str = "runc";

/// The runc binary, looked up on `PATH`.
const RUNC_BINARY: &str = "runc";

/// The runc driver.
#[derive(Debug, Clone)]
pub struct Runc {
    cli: OciCli,
}

impl Runc {
    /// A driver keeping its state in `root` (created if missing), writing consoles as
    /// `console` says.
    ///
    /// Errors: [`HostdError::Io`].
    pub fn new(root: PathBuf, console: ConsoleConfig) -> Result<Self, HostdError> {
        Ok(Self {
            cli: OciCli::new(RUNC, RUNC_BINARY, root, Vec::new(), console)?,
        })
    }
}

impl RuntimeDriver for Runc {
    fn name(&self) -> &'static str {
        RUNC
    }

    fn memory_snapshot(&self) -> bool {
        false
    }

    fn user_namespace(&self) -> Option<crate::isolation::IdRange> {
        Some(crate::isolation::SANDBOX_IDS)
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
            self.cli
                .timed(
                    "run",
                    self.cli.detached(false, &[], &args, req.console_log, "run"),
                )
                .await
        }
        .boxed()
    }

    fn status<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<ContainerStatus>, HostdError>> {
        async move { Ok(self.state(container_id).await?.map(|(s, _)| s)) }.boxed()
    }

    fn pid<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<Option<i64>, HostdError>> {
        async move {
            let state = self.state(container_id).await?;
            Ok(state.and_then(|(status, state)| {
                (status != ContainerStatus::Stopped).then_some(state.init_process_pid)
            }))
        }
        .boxed()
    }

    fn list(&self) -> BoxFuture<'_, Result<HashMap<String, ContainerStatus>, HostdError>> {
        self.cli
            .list_from_state(super::statefile::runc::list)
            .boxed()
    }

    /// Kills a running container and waits for its init to exit before `delete --force`.
    /// runc 1.1's `delete --force` of a running container sends `SIGKILL`, then sleeps 100 ms
    /// before it first looks whether the init exited (`killContainer` in runc's `delete.go`),
    /// which was most of a delete's and a stop's time (issue 16); found stopped, it destroys
    /// at once. The init is read from runc's state file and signalled through a pidfd, as
    /// `runc kill` would but without its process: the pidfd is checked against the init's
    /// start time first, so a reused pid is never signalled. A paused container is left to
    /// `delete --force` (a frozen task does not act on `SIGKILL` until thawed), and so is one
    /// whose init outlives [`KILL_WAIT`].
    fn destroy<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>> {
        async move {
            if let Some((ContainerStatus::Running, state)) = self.state(container_id).await? {
                let (pid, start) = (state.init_process_pid, state.init_process_start);
                match kill_started_at(pid, start) {
                    Ok(true) => {
                        wait_exited(pid, KILL_WAIT).await;
                    }
                    // Exited in between: `delete --force` finds it stopped.
                    Ok(false) => {}
                    // Refused: `delete --force` kills what is left.
                    Err(e) => tracing::debug!(error = %e, pid, "kill before delete"),
                }
            }
            self.cli.destroy(container_id).await
        }
        .boxed()
    }
}

impl Runc {
    /// Container `container_id`'s status and state file, read from runc's root
    /// ([`statefile::runc::state`]); from `runc state` when the file does not read as
    /// expected (then the state carries only the init's pid, so a destroy leaves the kill to
    /// `delete --force`).
    ///
    /// Errors: those of `runc state`, on the fallback.
    async fn state(
        &self,
        container_id: &str,
    ) -> Result<Option<(ContainerStatus, RuncState)>, HostdError> {
        let fallback = async {
            Ok(self.cli.state(container_id).await?.map(|(status, pid)| {
                let state = RuncState {
                    init_process_pid: pid.unwrap_or(0),
                    init_process_start: 0,
                    cgroup_paths: Default::default(),
                };
                (status, state)
            }))
        };
        self.cli
            .from_state(
                "state_file",
                || statefile::runc::state(&self.cli.root, container_id),
                fallback,
            )
            .await
    }
}

/// Sends `SIGKILL` to process `pid` if it is the one that started at `start` (clock ticks
/// after boot, `/proc/<pid>/stat` field 22, as runc records its init's); `Ok(false)` when
/// no such process runs (gone, a zombie, or the pid now names another process). The signal
/// goes through a pidfd opened before the check, so it reaches the checked process or none
/// (pidfd_open(2), pidfd_send_signal(2); Linux 5.3).
///
/// Errors: the system calls' (`EPERM` and the like).
pub fn kill_started_at(pid: i64, start: u64) -> std::io::Result<bool> {
    let positive = i32::try_from(pid).ok().filter(|p| *p > 0);
    let Some(pid) = positive.and_then(rustix::process::Pid::from_raw) else {
        return Ok(false);
    };
    let pidfd = match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::SRCH) => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    let same = statefile::read_proc_stat(i64::from(pid.as_raw_nonzero().get()))
        .map_err(|e| std::io::Error::other(e.report()))?
        .is_some_and(|stat| !stat.exited() && stat.start_time == start);
    if !same {
        return Ok(false);
    }
    match rustix::process::pidfd_send_signal(&pidfd, rustix::process::Signal::KILL) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::SRCH) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    #[test]
    fn a_process_is_killed_only_while_it_is_the_one_that_started_at_the_recorded_time() {
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = i64::from(child.id());
        let start = statefile::read_proc_stat(pid)
            .unwrap()
            .expect("the child runs")
            .start_time;
        // Another start time is another process under a reused pid: never signalled.
        assert!(!kill_started_at(pid, start + 1).unwrap());
        assert!(child.try_wait().unwrap().is_none(), "the child still runs");

        assert!(kill_started_at(pid, start).unwrap());
        // Dead but not reaped: a zombie is no process to kill.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while statefile::read_proc_stat(pid)
            .unwrap()
            .is_some_and(|stat| !stat.exited())
        {
            assert!(std::time::Instant::now() < deadline, "the child never died");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!kill_started_at(pid, start).unwrap());
        assert_eq!(child.wait().unwrap().signal(), Some(9));
        // Reaped: gone (or the pid names a newer process, which started later).
        assert!(!kill_started_at(pid, start).unwrap());
        // No pid at all.
        assert!(!kill_started_at(0, 0).unwrap());
        assert!(!kill_started_at(-1, 0).unwrap());
    }
}
