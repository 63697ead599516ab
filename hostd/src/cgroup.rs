//! A sandbox's memory cgroup, read from the host: how many processes its OOM killer has
//! killed, so an exec can say it ended by an OOM kill.
//!
//! Source: Linux `Documentation/admin-guide/cgroup-v1/memory.rst` (`memory.oom_control`
//! lists `oom_kill N` since 4.13) and `cgroup-v2.rst` (`memory.events` lists `oom_kill N`).
//! The cgroup is found from a process of the sandbox (`/proc/<pid>/cgroup`).

use std::path::PathBuf;

use crate::error::HostdError;

/// Where cgroup hierarchies are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The OOM kills counted in the memory cgroup of process `pid`; `None` when the process or
/// its counter can't be found (a runtime without a host memory cgroup, an old kernel).
///
/// Errors: none today; reserved for a cgroup that exists but can't be read.
pub fn oom_kills(pid: i64) -> Result<Option<u64>, HostdError> {
    Ok(oom_counter_of(pid).and_then(|file| read_oom_kills(&file)))
}

/// The file counting OOM kills in the memory cgroup of process `pid`, if it can be found.
/// Keep it to read the count again after the process is gone (a gVisor sandbox killed whole).
pub fn oom_counter_of(pid: i64) -> Option<PathBuf> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    oom_counter_file(&table)
}

/// Whether the counter `file` (from [`oom_counter_of`]) is that of the cgroup whose path ends
/// in `cgroup` (a sandbox's `cgroupsPath`, [`crate::layout::SandboxNames::cgroup`]).
pub fn is_in(file: &std::path::Path, cgroup: &str) -> bool {
    file.parent().is_some_and(|dir| dir.ends_with(cgroup))
}

/// The `oom_kill` count in `file` (from [`oom_counter_of`]); `None` when it is gone.
pub fn read_oom_kills(file: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|text| parse_oom_kill(&text))
}

/// The file holding the `oom_kill` counter for a `/proc/<pid>/cgroup` table: the v1 memory
/// controller's `memory.oom_control`, else the v2 unified hierarchy's `memory.events`.
fn oom_counter_file(table: &str) -> Option<PathBuf> {
    let mut unified = None;
    for line in table.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let relative = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            return Some(
                PathBuf::from(CGROUP_ROOT)
                    .join("memory")
                    .join(relative)
                    .join("memory.oom_control"),
            );
        }
        if controllers.is_empty() {
            unified = Some(
                PathBuf::from(CGROUP_ROOT)
                    .join(relative)
                    .join("memory.events"),
            );
        }
    }
    unified
}

/// The `oom_kill N` value of a `memory.oom_control` or `memory.events` text.
fn parse_oom_kill(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_v1_memory_controller_is_preferred_and_v2_is_the_fallback() {
        let v1 = "9:name=systemd:/\n4:memory:/x/berth-0123\n0::/\n";
        assert_eq!(
            oom_counter_file(v1),
            Some(PathBuf::from(
                "/sys/fs/cgroup/memory/x/berth-0123/memory.oom_control"
            ))
        );
        assert_eq!(
            oom_counter_file("0::/berth-0123\n"),
            Some(PathBuf::from("/sys/fs/cgroup/berth-0123/memory.events"))
        );
    }

    #[test]
    fn a_counter_is_a_sandboxs_only_in_the_cgroup_named_after_it() {
        let file = PathBuf::from("/sys/fs/cgroup/memory/x/berth-0123/memory.oom_control");
        assert!(is_in(&file, "berth-0123"));
        assert!(!is_in(&file, "berth-0124"));
        assert!(!is_in(&file, "0123"), "whole components only");
    }

    #[test]
    fn the_oom_kill_counter_is_read_from_either_file() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n";
        assert_eq!(parse_oom_kill(v1), Some(2));
        let v2 = "low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n";
        assert_eq!(parse_oom_kill(v2), Some(1));
        assert_eq!(parse_oom_kill("oom 1\n"), None);
    }
}
