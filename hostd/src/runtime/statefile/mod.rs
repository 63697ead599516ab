//! Every container of a runtime's root, read from the runtime's own state files with the
//! status its `list --format json` would print, without running the runtime (issue 16).
//!
//! Each heartbeat listed both roots by spawning `runc list` and `runsc list`: two Go processes
//! every beat (every 2 s, and an early beat whenever a sandbox becomes ready), on a 2-core host.
//! [`runc::list`] and [`runsc::list`] read the files those commands read and apply the same
//! checks to them (see each module for its source).
//!
//! # Guarantees
//! - A container is left out only where the runtime's `list` leaves it out too: its state
//!   file is gone (deleted, or not written yet) or its name is not one the runtime takes for a
//!   container.
//! - Anything else that does not read as expected (a file that cannot be read, does not parse,
//!   or holds a status or freezer state these modules do not know) is an error, never a
//!   stopped or absent container: the caller asks the runtime's `list` instead
//!   ([`super::cli::OciCli::list_from_state`]), so a format a new runtime version writes can
//!   cost a process, never make a live sandbox look dead.
//!
//! # Assumptions
//! - One process (hostd) reads; the runtimes write. runc replaces `state.json` by rename, so a
//!   read sees a whole file; runsc rewrites its file in place under a lock this module does not
//!   take, so a read may see a torn file, which does not parse: an error, as above.

pub mod runc;
pub mod runsc;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use thiserror::Error;

/// Why a root could not be read as the runtime's `list` reads it.
#[derive(Debug, Error)]
pub enum StateFileError {
    /// A file or directory exists but could not be read.
    #[error("read {path}")]
    Read {
        /// What was read.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A state file is not the JSON this module knows (torn by a concurrent write, or a
    /// format change).
    #[error("parse {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
    /// A value this module does not know how to judge (a status, a freezer state, a
    /// `/proc/<pid>/stat` line).
    #[error("unexpected {what} in {path}: {value:?}")]
    Unexpected {
        /// The file.
        path: PathBuf,
        /// Which value.
        what: &'static str,
        /// The value, as read.
        value: String,
    },
}

impl StateFileError {
    /// Every [`StateFileError::reason`].
    pub const REASONS: [&'static str; 3] = ["read", "parse", "unexpected"];

    /// The `reason` label of [`crate::metrics::RUNTIME_STATE_FALLBACKS`]: `read`, `parse` or
    /// `unexpected`.
    pub fn reason(&self) -> &'static str {
        match self {
            StateFileError::Read { .. } => "read",
            StateFileError::Parse { .. } => "parse",
            StateFileError::Unexpected { .. } => "unexpected",
        }
    }

    /// The error and its source, joined with `": "`, on one line.
    pub fn report(&self) -> String {
        match std::error::Error::source(self) {
            Some(source) => format!("{self}: {source}"),
            None => self.to_string(),
        }
    }
}

/// What a runtime needs of one process, from `/proc/<pid>/stat` (proc(5)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// Field 3, the state: `R`, `S`, `D`, `Z` (zombie), `X` (dead), ….
    pub state: char,
    /// Field 22, `starttime`: when the process started, in clock ticks after boot.
    pub start_time: u64,
}

impl ProcStat {
    /// Whether it is a zombie or dead (`Z`, `X`, or `x` on older kernels): runc's
    /// `runType` and [`super::exit::alive`] call such a process gone.
    pub fn exited(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Parses a `/proc/<pid>/stat` line: the fields after the command name's closing parenthesis
/// (the name may hold spaces and parentheses), as runc's `system.Stat` does. `None` when the
/// line is not of that shape.
pub fn parse_proc_stat(stat: &str) -> Option<ProcStat> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 was the state; field 22 is 19 further on.
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start_time })
}

/// `/proc/<pid>/stat` of `pid`, parsed; `None` when there is no such process (or `pid` is not
/// positive).
///
/// Errors: [`StateFileError::Read`] for any other read error, [`StateFileError::Unexpected`]
/// for a line [`parse_proc_stat`] does not take.
pub fn read_proc_stat(pid: i64) -> Result<Option<ProcStat>, StateFileError> {
    if pid <= 0 {
        return Ok(None);
    }
    let path = PathBuf::from(format!("/proc/{pid}/stat"));
    let Some(text) = read_if_present(&path)? else {
        return Ok(None);
    };
    let text = String::from_utf8_lossy(&text);
    parse_proc_stat(&text)
        .map(Some)
        .ok_or_else(|| StateFileError::Unexpected {
            path,
            what: "process stat",
            value: text.into_owned(),
        })
}

/// The bytes of `path`; `None` when it does not exist (`ENOENT`, `ENOTDIR`, or `ESRCH` for a
/// `/proc` entry whose process just exited).
///
/// Errors: [`StateFileError::Read`].
pub fn read_if_present(path: &Path) -> Result<Option<Vec<u8>>, StateFileError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if gone(&e) => Ok(None),
        Err(source) => Err(StateFileError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Whether an I/O error says the thing is not there.
fn gone(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound
        || matches!(
            e.raw_os_error(),
            Some(nix::libc::ENOTDIR | nix::libc::ESRCH | nix::libc::ENODEV)
        )
}

/// The names and types of `root`'s entries (none for a root that does not exist yet).
///
/// Errors: [`StateFileError::Read`].
fn entries(root: &Path) -> Result<Vec<(String, std::fs::FileType)>, StateFileError> {
    let read = |source| StateFileError::Read {
        path: root.to_owned(),
        source,
    };
    let dir = match std::fs::read_dir(root) {
        Ok(dir) => dir,
        Err(e) if gone(&e) => return Ok(Vec::new()),
        Err(e) => return Err(read(e)),
    };
    let mut out = Vec::new();
    for entry in dir {
        let entry = entry.map_err(read)?;
        let kind = match entry.file_type() {
            Ok(kind) => kind,
            Err(e) if gone(&e) => continue,
            Err(e) => return Err(read(e)),
        };
        // A name that is not UTF-8 is no container id of either runtime.
        if let Ok(name) = entry.file_name().into_string() {
            out.push((name, kind));
        }
    }
    Ok(out)
}

/// Whether `id` is a container id both runtimes accept: non-empty, of letters, digits and
/// `_ + , - .` (runc's and runsc's `validateID`: `^[\w+-\.]+$`, where `+-\.` is the range
/// `+` to `.`), and neither `.` nor `..`.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'+' | b',' | b'-' | b'.'))
}
