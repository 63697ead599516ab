//! runc's root, read as `runc list` reads it.
//!
//! Source: runc 1.1 (`list.go` `getContainers`, `libcontainer/factory_linux.go` `Load`,
//! `libcontainer/container_linux.go` `refreshState`/`runType`/`isPaused`, the cgroup
//! managers' `GetFreezerState`). `runc list` takes every directory of the root whose name is
//! a valid id and that holds `state.json` (the rest it skips), and gives each a status:
//! 1. `paused` when its cgroup is frozen: on cgroup v2 (`/sys/fs/cgroup` is cgroup2)
//!    `cgroup.freeze` of `cgroup_paths[""]` reads `1`; on v1 `freezer.state` of
//!    `cgroup_paths["freezer"]` reads `FROZEN` and `freezer.self_freezing` (where the kernel
//!    has it) reads `1`. A missing file or path means not frozen.
//! 2. `stopped` when `/proc/<init_process_pid>/stat` is gone, is a zombie or dead, or
//!    started at another time than `init_process_start` (the pid now names another process).
//! 3. `created` while `<root>/<id>/exec.fifo` exists (`runc create` makes it; `runc start`
//!    removes it).
//! 4. `running` otherwise.
//!
//! Berth freezes runc containers only around a snapshot's capture (`runc pause`/`resume`,
//! [`crate::runtime::RuntimeDriver::freeze`]); a heartbeat taken then says `paused`, as
//! `runc list` did.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::Deserialize;

use super::{entries, read_if_present, read_proc_stat, valid_id, ProcStat, StateFileError};
use crate::runtime::ContainerStatus;

/// The state file in a container's directory.
pub const STATE_FILE: &str = "state.json";

/// The fifo `runc create` leaves until `runc start`.
pub const EXEC_FIFO: &str = "exec.fifo";

/// What this module reads of a runc `state.json` (the rest is ignored).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RuncState {
    /// The host pid of the container's init.
    pub init_process_pid: i64,
    /// The init's start time, in clock ticks after boot (`/proc/<pid>/stat` field 22).
    pub init_process_start: u64,
    /// The container's cgroups: controller (`""` for the v2 unified hierarchy) to path.
    #[serde(default)]
    pub cgroup_paths: HashMap<String, String>,
}

/// Parses a `state.json`.
///
/// Errors: [`StateFileError::Parse`] naming `path`.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<RuncState, StateFileError> {
    serde_json::from_slice(bytes).map_err(|source| StateFileError::Parse {
        path: path.to_owned(),
        source,
    })
}

/// The status runc gives a container whose cgroup is `frozen` or not, whose init's
/// `/proc/<pid>/stat` is `init` (`None`: gone), and whose `exec.fifo` exists or not (see the
/// module docs for the order).
pub fn status(
    state: &RuncState,
    frozen: bool,
    init: Option<ProcStat>,
    exec_fifo: bool,
) -> ContainerStatus {
    if frozen {
        return ContainerStatus::Paused;
    }
    match init {
        Some(init) if !init.exited() && init.start_time == state.init_process_start => {
            if exec_fifo {
                ContainerStatus::Created
            } else {
                ContainerStatus::Running
            }
        }
        _ => ContainerStatus::Stopped,
    }
}

/// Every container of the root `root`, by id, with the status `runc list` would print.
///
/// Errors: [`StateFileError`] when something does not read as expected (see the parent
/// module's guarantees); the caller then asks `runc list`.
pub fn list(root: &Path) -> Result<HashMap<String, ContainerStatus>, StateFileError> {
    let mut out = HashMap::new();
    for (id, kind) in entries(root)? {
        if !kind.is_dir() || !valid_id(&id) {
            continue;
        }
        let dir = root.join(&id);
        if let Some((status, _)) = container(&dir)? {
            out.insert(id, status);
        }
    }
    Ok(out)
}

/// Container `id` of the root `root` as `runc state` sees it: the status `runc state` would
/// print and its state file; `None` when runc has no such container (no directory, no
/// `state.json`, or `id` is no valid container id).
///
/// Errors: [`StateFileError`] when something does not read as expected (see the parent
/// module's guarantees); the caller then asks `runc state`.
pub fn state(
    root: &Path,
    id: &str,
) -> Result<Option<(ContainerStatus, RuncState)>, StateFileError> {
    if !valid_id(id) {
        return Ok(None);
    }
    container(&root.join(id))
}

/// The status and state file of the container whose directory is `dir`; `None` without its
/// `state.json`.
fn container(dir: &Path) -> Result<Option<(ContainerStatus, RuncState)>, StateFileError> {
    let path = dir.join(STATE_FILE);
    let Some(bytes) = read_if_present(&path)? else {
        return Ok(None);
    };
    let state = parse(&path, &bytes)?;
    let frozen = frozen(&state.cgroup_paths)?;
    let init = read_proc_stat(state.init_process_pid)?;
    // runc's `os.Stat`: any error is "no fifo".
    let exec_fifo = std::fs::metadata(dir.join(EXEC_FIFO)).is_ok();
    Ok(Some((status(&state, frozen, init, exec_fifo), state)))
}

/// Whether the container's cgroup is frozen, as runc's cgroup manager for this machine's
/// hierarchy reads it (see the module docs).
///
/// Errors: [`StateFileError::Read`]; [`StateFileError::Unexpected`] for a freezer state runc
/// would wait out (`FREEZING`) or does not know.
fn frozen(cgroup_paths: &HashMap<String, String>) -> Result<bool, StateFileError> {
    if unified_hierarchy() {
        match cgroup_paths.get("") {
            Some(dir) => v2_frozen(Path::new(dir)),
            None => Ok(false),
        }
    } else {
        match cgroup_paths.get("freezer") {
            Some(dir) => v1_frozen(Path::new(dir)),
            None => Ok(false),
        }
    }
}

/// Whether `/sys/fs/cgroup` is the cgroup v2 unified hierarchy (runc's
/// `IsCgroup2UnifiedMode`); found once.
fn unified_hierarchy() -> bool {
    static UNIFIED: OnceLock<bool> = OnceLock::new();
    *UNIFIED.get_or_init(|| {
        nix::sys::statfs::statfs("/sys/fs/cgroup")
            .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
    })
}

/// cgroup v2: `cgroup.freeze` of `dir` (`0`/`1`; missing: not frozen).
fn v2_frozen(dir: &Path) -> Result<bool, StateFileError> {
    let path = dir.join("cgroup.freeze");
    match read_if_present(&path)? {
        None => Ok(false),
        Some(text) => v2_freeze_value(&path, &text),
    }
}

/// The value of a v2 `cgroup.freeze` file at `path`: `1` is frozen (runc then waits for
/// `cgroup.events` to say `frozen 1`, and says paused).
///
/// Errors: [`StateFileError::Unexpected`] for anything but `0` or `1`.
pub fn v2_freeze_value(path: &Path, text: &[u8]) -> Result<bool, StateFileError> {
    match text.trim_ascii() {
        b"0" => Ok(false),
        b"1" => Ok(true),
        other => Err(unexpected(path, "cgroup.freeze", other)),
    }
}

/// cgroup v1: `freezer.state` of `dir`, and `freezer.self_freezing` when frozen (a cgroup
/// frozen only through an ancestor is not paused itself).
fn v1_frozen(dir: &Path) -> Result<bool, StateFileError> {
    let state_path = dir.join("freezer.state");
    let Some(state) = read_if_present(&state_path)? else {
        return Ok(false);
    };
    let self_path = dir.join("freezer.self_freezing");
    let self_freezing = if state.trim_ascii() == b"FROZEN" {
        read_if_present(&self_path)?
    } else {
        None
    };
    v1_freezer_values(&state_path, &state, &self_path, self_freezing.as_deref())
}

/// The values of a v1 `freezer.state` and `freezer.self_freezing` (`None`: missing, as on
/// kernels before it): `THAWED` is not frozen; `FROZEN` is, unless `self_freezing` is `0`.
///
/// Errors: [`StateFileError::Unexpected`] for `FREEZING` (runc retries until it settles) and
/// any other value.
pub fn v1_freezer_values(
    state_path: &Path,
    state: &[u8],
    self_path: &Path,
    self_freezing: Option<&[u8]>,
) -> Result<bool, StateFileError> {
    match state.trim_ascii() {
        b"THAWED" => Ok(false),
        b"FROZEN" => match self_freezing.map(<[u8]>::trim_ascii) {
            None | Some(b"1") => Ok(true),
            Some(b"0") => Ok(false),
            Some(other) => Err(unexpected(self_path, "freezer.self_freezing", other)),
        },
        other => Err(unexpected(state_path, "freezer.state", other)),
    }
}

fn unexpected(path: &Path, what: &'static str, value: &[u8]) -> StateFileError {
    StateFileError::Unexpected {
        path: PathBuf::from(path),
        what,
        value: String::from_utf8_lossy(value).into_owned(),
    }
}
