//! The `runc` driver: `runc --root <state_dir>/runc …`, one root per hostd.
//!
//! Source: runc 1.1 command line (`run --detach --bundle`, `state`, `list --format json`,
//! `delete --force`). A detached `runc run` hands the container its stdio, so stdout/stderr go
//! to a file, never to pipes (a pipe would stay open for the container's life).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Instant;

use futures::future::BoxFuture;
use futures::FutureExt;
use serde::Deserialize;

use super::{ContainerStatus, RunRequest, RuntimeDriver};
use crate::error::HostdError;
use crate::metrics;
use crate::tool;

/// The runtime's name.
pub const RUNC: &str = "runc";

/// The runc binary, looked up on `PATH`.
const RUNC_BINARY: &str = "runc";

/// How much of the console log a failed `runc run` quotes.
pub const CONSOLE_TAIL_BYTES: usize = 2048;

/// The runc driver.
#[derive(Debug, Clone)]
pub struct Runc {
    root: PathBuf,
}

#[derive(Deserialize)]
struct StateJson {
    status: ContainerStatus,
}

#[derive(Deserialize)]
struct ListEntry {
    id: String,
    status: ContainerStatus,
}

impl Runc {
    /// A driver keeping its state in `root` (created if missing).
    ///
    /// Errors: [`HostdError::Io`].
    pub fn new(root: PathBuf) -> Result<Self, HostdError> {
        std::fs::create_dir_all(&root)
            .map_err(HostdError::io(format!("create {}", root.display())))?;
        Ok(Self { root })
    }

    fn root_arg(&self) -> String {
        self.root.to_string_lossy().into_owned()
    }

    async fn runc(&self, args: &[&str]) -> Result<tool::ToolOutput, HostdError> {
        let root = self.root_arg();
        let mut full = vec!["--root", root.as_str()];
        full.extend_from_slice(args);
        tool::run(RUNC_BINARY, &full).await
    }

    async fn run_detached(&self, req: RunRequest<'_>) -> Result<(), HostdError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(req.console_log)
            .map_err(HostdError::io(format!(
                "open {}",
                req.console_log.display()
            )))?;
        let log_err = log
            .try_clone()
            .map_err(HostdError::io("duplicate console log handle"))?;
        let bundle = req.bundle.to_string_lossy().into_owned();
        let root = self.root_arg();
        let args = [
            "--root",
            root.as_str(),
            "run",
            "--detach",
            "--bundle",
            bundle.as_str(),
            req.container_id,
        ];
        let status = tokio::process::Command::new(RUNC_BINARY)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .kill_on_drop(true)
            .status();
        let status = tokio::time::timeout(tool::TOOL_TIMEOUT, status)
            .await
            .map_err(|_| HostdError::Io {
                context: format!("runc run {} timed out", req.container_id),
                source: std::io::ErrorKind::TimedOut.into(),
            })?
            .map_err(HostdError::io("spawn runc run"))?;
        if status.success() {
            Ok(())
        } else {
            Err(HostdError::Tool {
                program: RUNC_BINARY.to_owned(),
                args: args.join(" "),
                status: status.to_string(),
                stderr: console_tail(req.console_log),
            })
        }
    }
}

/// The last [`CONSOLE_TAIL_BYTES`] of a console log, trimmed, for error messages.
pub fn console_tail(path: &std::path::Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let start = bytes.len().saturating_sub(CONSOLE_TAIL_BYTES);
    String::from_utf8_lossy(&bytes[start..]).trim().to_owned()
}

fn timed<'a, T: Send + 'a>(
    operation: &'static str,
    fut: impl std::future::Future<Output = Result<T, HostdError>> + Send + 'a,
) -> BoxFuture<'a, Result<T, HostdError>> {
    async move {
        let started = Instant::now();
        let out = fut.await;
        metrics::runtime_operation(RUNC, operation, started.elapsed());
        out
    }
    .boxed()
}

impl RuntimeDriver for Runc {
    fn name(&self) -> &'static str {
        RUNC
    }

    fn memory_snapshot(&self) -> bool {
        false
    }

    fn run<'a>(&'a self, req: RunRequest<'a>) -> BoxFuture<'a, Result<(), HostdError>> {
        timed("run", self.run_detached(req))
    }

    fn status<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<ContainerStatus>, HostdError>> {
        timed("state", async move {
            match self.runc(&["state", container_id]).await {
                Ok(out) => serde_json::from_str::<StateJson>(&out.stdout)
                    .map(|s| Some(s.status))
                    .map_err(|e| HostdError::Io {
                        context: format!("parse runc state of {container_id}"),
                        source: std::io::Error::other(e),
                    }),
                Err(HostdError::Tool { stderr, .. }) if stderr.contains("does not exist") => {
                    Ok(None)
                }
                Err(e) => Err(e),
            }
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<HashMap<String, ContainerStatus>, HostdError>> {
        timed("list", async move {
            let out = self.runc(&["list", "--format", "json"]).await?;
            // runc prints `null` for an empty root.
            let entries: Option<Vec<ListEntry>> =
                serde_json::from_str(&out.stdout).map_err(|e| HostdError::Io {
                    context: "parse runc list".into(),
                    source: std::io::Error::other(e),
                })?;
            Ok(entries
                .unwrap_or_default()
                .into_iter()
                .map(|e| (e.id, e.status))
                .collect())
        })
    }

    fn destroy<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>> {
        timed("delete", async move {
            match self.runc(&["delete", "--force", container_id]).await {
                Ok(_) => Ok(()),
                Err(HostdError::Tool { stderr, .. }) if stderr.contains("does not exist") => Ok(()),
                Err(e) => Err(e),
            }
        })
    }
}
