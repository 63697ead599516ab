//! runsc's root, read as `runsc list` reads it.
//!
//! Source: gVisor `runsc/container/state_file.go` (`List`, `parseFileName`, `Load`) and
//! `container.go` (`IsSandboxRunning`, `SignalContainer`), release 20221219 as Debian ships
//! it. Each container is one file `<root>/<container id>_sandbox:<sandbox id>.state` (beside
//! its `.lock`), JSON with the container's recorded `status` (`creating`, `created`,
//! `running`, `paused`, `stopped`) and its sandbox's `sandbox.pid`. `runsc list` loads every
//! such file and checks only two recorded statuses against the processes:
//! - `created` becomes `stopped` when `kill(sandbox pid, 0)` fails: no process has the pid
//!   (a zombie still has it).
//! - `running` becomes `stopped` when signal 0 to the container through the sandbox's control
//!   socket fails: the sandbox process is gone or exited, or is not this sandbox. Here: the
//!   process is alive (not a zombie) and its `/proc/<pid>/cmdline` is this sandbox's
//!   `runsc-sandbox … <id>`. A sandbox process that lives but whose Sentry no longer answers
//!   its socket is `stopped` to `runsc list` and `running` here; hostd's agent ping (the
//!   heartbeat's `answers`) still calls such a sandbox unhealthy.
//! - Every other status is printed as recorded.

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use super::{entries, read_if_present, read_proc_stat, valid_id, StateFileError};
use crate::runtime::ContainerStatus;

/// The separator of container and sandbox id in a state file's name.
const SANDBOX_SEPARATOR: &str = "_sandbox:";

/// The extension of a state file.
const STATE_EXTENSION: &str = ".state";

/// What this module reads of a runsc state file (the rest is ignored).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RunscState {
    /// The recorded status, lowercase.
    pub status: String,
    /// The sandbox; absent or null once a delete stopped it.
    #[serde(default)]
    pub sandbox: Option<SandboxState>,
}

/// The sandbox part of a runsc state file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SandboxState {
    /// The host pid of the sandbox process (`runsc-sandbox`); 0 when none.
    #[serde(default)]
    pub pid: i64,
}

/// What the sandbox's pid names now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxProcess {
    /// No process has the pid.
    Gone,
    /// A zombie or dead process has it.
    Exited,
    /// A live process has it, not this sandbox's (the pid was reused).
    Other,
    /// This container's sandbox, alive.
    Own,
}

/// The container and sandbox ids of a state file's name, `<container>_sandbox:<sandbox>.state`
/// (`parseFileName`'s greedy match: the last separator splits); `None` for other names and
/// invalid ids.
pub fn parse_file_name(name: &str) -> Option<(&str, &str)> {
    let stem = name.strip_suffix(STATE_EXTENSION)?;
    let at = stem.rfind(SANDBOX_SEPARATOR)?;
    let (container, sandbox) = (&stem[..at], &stem[at + SANDBOX_SEPARATOR.len()..]);
    (valid_id(container) && valid_id(sandbox)).then_some((container, sandbox))
}

/// Parses a state file.
///
/// Errors: [`StateFileError::Parse`] naming `path`.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<RunscState, StateFileError> {
    serde_json::from_slice(bytes).map_err(|source| StateFileError::Parse {
        path: path.to_owned(),
        source,
    })
}

/// A recorded status string as the runtime spec's status.
///
/// Errors: [`StateFileError::Unexpected`] for a status runsc 20221219 does not write.
pub fn recorded_status(path: &Path, status: &str) -> Result<ContainerStatus, StateFileError> {
    Ok(match status {
        "creating" => ContainerStatus::Creating,
        "created" => ContainerStatus::Created,
        "running" => ContainerStatus::Running,
        "paused" => ContainerStatus::Paused,
        "stopped" => ContainerStatus::Stopped,
        other => {
            return Err(StateFileError::Unexpected {
                path: path.to_owned(),
                what: "status",
                value: other.to_owned(),
            })
        }
    })
}

/// The status `runsc list` prints for a container recorded as `recorded` whose sandbox pid
/// names `sandbox` (see the module docs).
pub fn status(recorded: ContainerStatus, sandbox: SandboxProcess) -> ContainerStatus {
    match (recorded, sandbox) {
        (ContainerStatus::Created, SandboxProcess::Gone) => ContainerStatus::Stopped,
        (ContainerStatus::Running, SandboxProcess::Own) => ContainerStatus::Running,
        (ContainerStatus::Running, _) => ContainerStatus::Stopped,
        (recorded, _) => recorded,
    }
}

/// Every container of the root `root`, by container id, with the status `runsc list` would
/// print.
///
/// Errors: [`StateFileError`] when something does not read as expected (see the parent
/// module's guarantees); the caller then asks `runsc list`.
pub fn list(root: &Path) -> Result<HashMap<String, ContainerStatus>, StateFileError> {
    let mut out = HashMap::new();
    for (name, _) in entries(root)? {
        let Some((container, sandbox)) = parse_file_name(&name) else {
            continue;
        };
        let path = root.join(&name);
        // Deleted since the directory was read: gone, as `runsc list` skips it.
        let Some(bytes) = read_if_present(&path)? else {
            continue;
        };
        let state = parse(&path, &bytes)?;
        let recorded = recorded_status(&path, &state.status)?;
        let checked = match recorded {
            ContainerStatus::Created | ContainerStatus::Running => {
                let pid = state.sandbox.as_ref().map_or(0, |s| s.pid);
                status(recorded, sandbox_process(pid, sandbox)?)
            }
            other => other,
        };
        out.insert(container.to_owned(), checked);
    }
    Ok(out)
}

/// What `pid` names now, for the sandbox `sandbox_id`.
///
/// Errors: [`StateFileError`] from `/proc`.
fn sandbox_process(pid: i64, sandbox_id: &str) -> Result<SandboxProcess, StateFileError> {
    let Some(stat) = read_proc_stat(pid)? else {
        return Ok(SandboxProcess::Gone);
    };
    if stat.exited() {
        return Ok(SandboxProcess::Exited);
    }
    let Some(cmdline) = read_if_present(Path::new(&format!("/proc/{pid}/cmdline")))? else {
        return Ok(SandboxProcess::Gone);
    };
    Ok(
        if crate::runtime::runsc::is_process_of(&cmdline, "runsc-sandbox", sandbox_id) {
            SandboxProcess::Own
        } else {
            SandboxProcess::Other
        },
    )
}
