//! Waiting for a process the runtime's destroy killed: runc's and runsc's `delete --force` of
//! a running container kill it, then sleep 100 ms before they first look whether it exited
//! (runc's `killContainer`; runsc's poll of `kill(pid, 0)`), which was most of a delete's and
//! a stop's time (issue 16). hostd kills first, waits here, and the runtime's delete then finds
//! the container stopped and removes it at once.

use std::time::Duration;

/// How long a destroy waits for a killed container's init (runc) or sandbox (runsc) to exit.
pub const KILL_WAIT: Duration = Duration::from_secs(2);

/// How often it looks.
const KILL_POLL: Duration = Duration::from_millis(1);

/// Waits until process `pid` is gone or a zombie (runc then calls its container stopped), for
/// at most `wait`; says whether it saw that.
pub async fn wait_exited(pid: i64, wait: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + wait;
    let stat = format!("/proc/{pid}/stat");
    loop {
        if !alive(&std::fs::read_to_string(&stat).unwrap_or_default()) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(pid, waited = ?wait, "the killed init still runs; delete --force waits for it");
            return false;
        }
        tokio::time::sleep(KILL_POLL).await;
    }
}

/// Waits until process `pid` is gone from `/proc` (reaped, not only dead), for at most
/// `wait`; says whether it saw that.
pub async fn wait_gone(pid: i64, wait: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + wait;
    let proc = format!("/proc/{pid}");
    loop {
        if !std::path::Path::new(&proc).exists() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(pid, waited = ?wait, "the killed process is not reaped; delete --force waits for it");
            return false;
        }
        tokio::time::sleep(KILL_POLL).await;
    }
}

/// Whether a `/proc/<pid>/stat` line names a live process: present, and in a state other than
/// zombie (`Z`) or dead (`X`, `x`). The state follows the command name's closing parenthesis.
pub fn alive(stat: &str) -> bool {
    match stat
        .rfind(')')
        .and_then(|end| stat[end + 1..].trim_start().chars().next())
    {
        Some(state) => !matches!(state, 'Z' | 'X' | 'x'),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_alive_until_it_is_a_zombie_or_gone() {
        assert!(alive("42 (sleep) S 1 42 42 0 -1"));
        assert!(alive("42 (a) b) R 1 42"), "the name may hold a parenthesis");
        assert!(!alive("42 (sleep) Z 1 42 42 0 -1"));
        assert!(!alive("42 (sleep) X 1"));
        assert!(!alive(""), "no stat file: gone");
    }

    #[tokio::test]
    async fn waiting_for_a_killed_process_returns_once_it_is_a_zombie() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let pid = i64::from(child.id());
        assert!(
            !wait_exited(pid, Duration::from_millis(20)).await,
            "it runs"
        );
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("kill");
        // Not reaped yet: a zombie, as a container's init is until its parent reaps it.
        assert!(wait_exited(pid, Duration::from_secs(60)).await);
        child.wait().expect("reap");
    }
}
