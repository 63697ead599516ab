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
        async move { Ok(self.cli.state(container_id).await?.map(|(s, _)| s)) }.boxed()
    }

    fn pid<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<Option<i64>, HostdError>> {
        async move { Ok(self.cli.state(container_id).await?.and_then(|(_, p)| p)) }.boxed()
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
    /// at once. A paused container is left to `delete --force` (a frozen task does not act on
    /// `SIGKILL` until thawed), and so is one whose init outlives
    /// [`KILL_WAIT`].
    fn destroy<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>> {
        async move {
            if let Some((ContainerStatus::Running, Some(pid))) =
                self.cli.state(container_id).await?
            {
                match self.cli.call(&["kill", container_id, "KILL"]).await {
                    Ok(_) => {
                        wait_exited(pid, KILL_WAIT).await;
                    }
                    // Exited in between, or refused: `delete --force` kills what is left.
                    Err(e) => tracing::debug!(error = %e.report(), "kill before delete"),
                }
            }
            self.cli.destroy(container_id).await
        }
        .boxed()
    }
}
