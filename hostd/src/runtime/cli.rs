//! The command line both OCI runtimes share: `<binary> --root <dir> [global flags] run
//! --detach --bundle …`, `state`, `list --format json`, `delete --force`.
//!
//! Source: runc 1.1 and runsc (gVisor) command lines, which agree on these subcommands. A
//! detached `run` hands the container its stdio, so stdout/stderr go to the pipe of a console
//! writer of their own ([`crate::console`]), never to hostd (the pipe stays open for the
//! container's life, which may outlast hostd's).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

use serde::Deserialize;

use super::statefile::StateFileError;
use super::ContainerStatus;
use crate::console::ConsoleWriter;
use crate::error::HostdError;
use crate::metrics;
use crate::tool;

/// How much of the console log a failed `run` quotes.
pub const CONSOLE_TAIL_BYTES: usize = 2048;

/// One OCI runtime binary with its state root and global flags.
#[derive(Debug, Clone)]
pub struct OciCli {
    /// The runtime's name (metrics label).
    pub name: &'static str,
    /// The binary, looked up on `PATH`.
    pub binary: &'static str,
    /// `--root`: one per hostd and runtime.
    pub root: PathBuf,
    /// Flags placed after `--root` on every invocation (`--platform=ptrace`).
    pub global: Vec<String>,
    /// How a container's console is written.
    pub console: ConsoleConfig,
}

/// How containers' consoles are written: by `<berth> console-log`, capped per file.
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// The `berth` binary that runs the console writer.
    pub berth: PathBuf,
    /// The cap of one console log file, in bytes.
    pub max_bytes: u64,
}

#[derive(Deserialize)]
struct StateJson {
    status: ContainerStatus,
    #[serde(default)]
    pid: Option<i64>,
}

#[derive(Deserialize)]
struct ListEntry {
    id: String,
    status: ContainerStatus,
}

impl OciCli {
    /// A runtime keeping its state in `root` (created if missing).
    ///
    /// Errors: [`HostdError::Io`].
    pub fn new(
        name: &'static str,
        binary: &'static str,
        root: PathBuf,
        global: Vec<String>,
        console: ConsoleConfig,
    ) -> Result<Self, HostdError> {
        std::fs::create_dir_all(&root)
            .map_err(HostdError::io(format!("create {}", root.display())))?;
        // Every series exists from the start, so `rate()` and `absent()` work before the
        // first fallback.
        for reason in StateFileError::REASONS {
            metrics::runtime_state_fallbacks_exist(name, reason);
        }
        Ok(Self {
            name,
            binary,
            root,
            global,
            console,
        })
    }

    /// `--root <root> <global…>`.
    pub fn base_args(&self) -> Vec<String> {
        let mut args = vec![
            "--root".to_owned(),
            self.root.to_string_lossy().into_owned(),
        ];
        args.extend(self.global.iter().cloned());
        args
    }

    /// Runs `<binary> <base args> <args>` and returns its output.
    pub async fn call(&self, args: &[&str]) -> Result<tool::ToolOutput, HostdError> {
        let base = self.base_args();
        let mut full: Vec<&str> = base.iter().map(String::as_str).collect();
        full.extend_from_slice(args);
        tool::run(self.binary, &full).await
    }

    /// Runs a detached command (`run --detach`, `restore --detach`) whose stdout and stderr,
    /// which the container inherits, go to a new console writer of `console_log` (see
    /// [`crate::console`]). `wrapper` is prepended to the argv (a program and its arguments
    /// that end by exec'ing the rest), or empty; with `keeper`, all of it runs under a runtime
    /// keeper ([`crate::keeper`]), which stays the parent of the container's processes.
    ///
    /// Errors: [`HostdError::Tool`] with the console log's tail; [`HostdError::Io`].
    pub async fn detached(
        &self,
        keeper: bool,
        wrapper: &[&str],
        args: &[&str],
        console_log: &Path,
        what: &str,
    ) -> Result<(), HostdError> {
        let writer =
            ConsoleWriter::spawn(&self.console.berth, console_log, self.console.max_bytes)?;
        let mut argv: Vec<String> = wrapper.iter().map(|s| s.to_string()).collect();
        argv.push(self.binary.to_owned());
        argv.extend(self.base_args());
        argv.extend(args.iter().map(|s| s.to_string()));
        let keeper = if keeper {
            crate::keeper::prefix(&self.console.berth)
        } else {
            Vec::new()
        };
        let (program, args) = match keeper.split_first() {
            Some((program, keeper_args)) => (program, [keeper_args, &argv].concat()),
            None => (&argv[0], argv[1..].to_vec()),
        };
        let spawned = (|| -> Result<_, HostdError> {
            // Spawns at once; the command and its copies of the pipe drop with this closure.
            Ok(tokio::process::Command::new(program)
                .args(&args)
                .stdin(Stdio::null())
                .stdout(writer.stdio()?)
                .stderr(writer.stdio()?)
                .kill_on_drop(true)
                .status())
        })();
        let status = match spawned {
            Ok(status) => tokio::time::timeout(tool::TOOL_TIMEOUT, status)
                .await
                .map_err(|_| HostdError::Io {
                    context: format!("{} {what} timed out", self.binary),
                    source: std::io::ErrorKind::TimedOut.into(),
                })
                .and_then(|s| s.map_err(HostdError::io(format!("spawn {} {what}", self.binary)))),
            Err(e) => Err(e),
        };
        match status {
            Ok(status) if status.success() => {
                writer.detach();
                Ok(())
            }
            Ok(status) => Err(HostdError::Tool {
                program: self.binary.to_owned(),
                args: argv[1..].join(" "),
                status: status.to_string(),
                stderr: writer.fail(CONSOLE_TAIL_BYTES).await,
            }),
            Err(e) => {
                writer.fail(CONSOLE_TAIL_BYTES).await;
                Err(e)
            }
        }
    }

    /// Whether the root may hold the container: some entry of the root is named after it.
    /// Both runtimes keep a container's state there under its id (runc: `<id>/state.json`;
    /// runsc: `<id>_sandbox:<id>.state` and `.lock`), made first by `run` and removed last by
    /// `delete`. Without one there is no container, and no runtime process is run to say
    /// so: a `runc state` costs about 7 ms and a `runsc state` 30 ms, on the path of every
    /// create, start and delete (issue 16).
    pub fn may_hold(&self, container_id: &str) -> bool {
        match std::fs::read_dir(&self.root) {
            Ok(entries) => entries.filter_map(Result::ok).any(|entry| {
                entry
                    .file_name()
                    .as_encoded_bytes()
                    .starts_with(container_id.as_bytes())
            }),
            // Not readable: ask the runtime.
            Err(_) => true,
        }
    }

    /// The container's status and init pid; `None` when it does not exist.
    pub async fn state(
        &self,
        container_id: &str,
    ) -> Result<Option<(ContainerStatus, Option<i64>)>, HostdError> {
        if !self.may_hold(container_id) {
            return Ok(None);
        }
        self.timed("state", async {
            match self.call(&["state", container_id]).await {
                Ok(out) => serde_json::from_str::<StateJson>(&out.stdout)
                    .map(|s| Some((s.status, s.pid.filter(|p| *p > 0))))
                    .map_err(|e| HostdError::Io {
                        context: format!("parse {} state of {container_id}", self.binary),
                        source: std::io::Error::other(e),
                    }),
                Err(HostdError::Tool { stderr, .. }) if stderr.contains("does not exist") => {
                    Ok(None)
                }
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// Every container of the root, by id, as `read` finds it in the runtime's own state
    /// files ([`super::statefile`]: the status `list` would print, without a process), timed
    /// as operation `list_state`. When `read` fails, from [`OciCli::list`] (the `list`
    /// process), counted in [`metrics::RUNTIME_STATE_FALLBACKS`] and logged: a state file
    /// this hostd cannot judge never makes a container look stopped or absent.
    ///
    /// Errors: as [`OciCli::list`], only when it is run.
    pub async fn list_from_state(
        &self,
        read: fn(&Path) -> Result<HashMap<String, ContainerStatus>, StateFileError>,
    ) -> Result<HashMap<String, ContainerStatus>, HostdError> {
        self.from_state("list_state", || read(&self.root), self.list())
            .await
    }

    /// What `read` gives from the runtime's state files (timed as `operation`), else what
    /// `fallback` (the runtime's own command) gives: a state file that does not read as
    /// expected is logged and counted in `berth_hostd_runtime_state_fallbacks_total`, and
    /// never taken for a stopped or absent container.
    ///
    /// Errors: those of `fallback`.
    pub async fn from_state<T>(
        &self,
        operation: &'static str,
        read: impl FnOnce() -> Result<T, StateFileError>,
        fallback: impl std::future::Future<Output = Result<T, HostdError>>,
    ) -> Result<T, HostdError> {
        let started = Instant::now();
        let read = read();
        metrics::runtime_operation(self.name, operation, started.elapsed());
        match read {
            Ok(found) => Ok(found),
            Err(e) => {
                tracing::warn!(
                    runtime = self.name,
                    operation,
                    reason = e.reason(),
                    error = %e.report(),
                    "runtime state files not read; asking the runtime"
                );
                metrics::runtime_state_fallback(self.name, e.reason());
                fallback.await
            }
        }
    }

    /// Every container of the root: `<binary> list --format json`, a process (about 7 ms for
    /// runc, 30 ms for runsc); the heartbeat reads state files instead
    /// ([`OciCli::list_from_state`]).
    ///
    /// Errors: [`HostdError::Tool`] / [`HostdError::Io`] from the process or its output.
    pub async fn list(&self) -> Result<HashMap<String, ContainerStatus>, HostdError> {
        self.timed("list", async {
            let out = self.call(&["list", "--format", "json"]).await?;
            // Both print `null` for an empty root.
            let entries: Option<Vec<ListEntry>> =
                serde_json::from_str(&out.stdout).map_err(|e| HostdError::Io {
                    context: format!("parse {} list", self.binary),
                    source: std::io::Error::other(e),
                })?;
            Ok(entries
                .unwrap_or_default()
                .into_iter()
                .map(|e| (e.id, e.status))
                .collect())
        })
        .await
    }

    /// `delete --force`; succeeds when the container does not exist.
    pub async fn destroy(&self, container_id: &str) -> Result<(), HostdError> {
        if !self.may_hold(container_id) {
            return Ok(());
        }
        self.timed("delete", async {
            match self.call(&["delete", "--force", container_id]).await {
                Ok(_) => Ok(()),
                Err(HostdError::Tool { stderr, .. }) if stderr.contains("does not exist") => Ok(()),
                Err(e) => Err(e),
            }
        })
        .await
    }

    /// Times `fut` as `operation` in the runtime metrics.
    pub async fn timed<T>(
        &self,
        operation: &'static str,
        fut: impl std::future::Future<Output = Result<T, HostdError>>,
    ) -> Result<T, HostdError> {
        let started = Instant::now();
        let out = fut.await;
        metrics::runtime_operation(self.name, operation, started.elapsed());
        out
    }
}

/// The last [`CONSOLE_TAIL_BYTES`] of a console log (and its rotated file), trimmed, for
/// error messages; only those bytes are read (see [`crate::console::tail`]).
pub fn console_tail(path: &Path) -> String {
    let bytes = crate::console::tail(path, CONSOLE_TAIL_BYTES);
    String::from_utf8_lossy(&bytes).trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_root_may_hold_a_container_only_with_an_entry_named_after_it() {
        let root = std::env::temp_dir().join(format!("berth-root-{}", uuid::Uuid::new_v4()));
        let console = ConsoleConfig {
            berth: PathBuf::from("berth"),
            max_bytes: 1,
        };
        let cli = OciCli::new("runsc", "runsc", root.clone(), Vec::new(), console).unwrap();
        assert!(!cli.may_hold("0193"), "an empty root holds nothing");
        // runsc's layout, then runc's.
        std::fs::write(root.join("0193_sandbox:0193.state"), "{}").unwrap();
        std::fs::create_dir(root.join("0194")).unwrap();
        assert!(cli.may_hold("0193"));
        assert!(cli.may_hold("0194"));
        assert!(!cli.may_hold("0195"));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
