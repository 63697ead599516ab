//! The runtime keeper: the parent a detached container's processes are left to, which reaps
//! them the moment they exit (`<berth> runtime-keeper -- <runtime argv…>`).
//!
//! # Why
//! `runsc run --detach` and `runsc restore --detach` exit once the sandbox runs, so its
//! sandbox and gofer processes are orphaned and go to the nearest *child subreaper* above
//! them, else to PID 1. A killed sandbox's process stays a zombie until that parent reaps it,
//! and `runsc delete` waits for it to be gone, polling `kill(pid, 0)` every 100 ms, which a
//! zombie answers. Where PID 1 reaps late (1.5 s on the test machine, whose init is not a
//! Linux init), every gVisor stop and delete took 1.5 s (issue 16's profile). hostd itself
//! must not be the subreaper: tokio reaps hostd's own children by pid, and a reaper of
//! hostd's would race it. runc needs no keeper: it calls a container whose init is a zombie
//! stopped (`runtime::runc`), so its containers save the keeper's process.
//!
//! # How
//! The keeper forks. The child (the keeper proper) makes itself a child subreaper, runs the
//! runtime's argv as its child and, once that exits, writes the exit code to the parent over
//! a pipe; the parent exits with that code, so the caller sees the runtime's own outcome and
//! the keeper's stdio (the container's console) is released by everything but the container.
//! The keeper then reaps whatever is left to it and exits when it has no child left: when the
//! container is gone. Until the runtime exits, the keeper and the runtime die with their
//! parent (`PR_SET_PDEATHSIG`), so a caller that kills the keeper on a timeout ends the
//! runtime too. The keeper leads a process group of its own, which the runtime, the gofer and
//! the sandbox start in: a signal to hostd's group (a terminal's Ctrl-C) leaves them running.
//!
//! Source: the same role as containerd's shim and Podman's conmon, which stay the parent of
//! the container's init (`prctl(2)`: `PR_SET_CHILD_SUBREAPER`, `PR_SET_PDEATHSIG`).
//!
//! std only, and no threads: it forks, so it runs before any runtime starts.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus};

use nix::errno::Errno;
use nix::sys::prctl;
use nix::sys::signal::Signal;
use nix::sys::wait::waitpid;
use nix::unistd::{fork, ForkResult, Pid};

/// The `berth` subcommand that runs the keeper (hidden from `--help`).
pub const KEEPER_SUBCOMMAND: &str = "runtime-keeper";

/// The exit code when the runtime could not be started at all (as a shell's).
pub const NOT_STARTED: i32 = 127;

/// The argv prefix that runs `argv` under a keeper: `<berth> runtime-keeper --`.
pub fn prefix(berth: &std::path::Path) -> Vec<String> {
    vec![
        berth.to_string_lossy().into_owned(),
        KEEPER_SUBCOMMAND.to_owned(),
        "--".to_owned(),
    ]
}

/// Runs `argv` under a keeper and returns the exit code to exit with: the runtime's own, or
/// 128 + its signal, or [`NOT_STARTED`]. Only the calling (parent) process returns; the
/// keeper exits on its own.
///
/// Errors: the pipe or the fork failed.
pub fn run(argv: &[OsString]) -> std::io::Result<i32> {
    // Close-on-exec: a copy of the write end inherited by the runtime (and so by the sandbox)
    // would keep the parent from ever reading the end of the code.
    let (read, write) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)?;
    // SAFETY: the process is single-threaded (see the module docs), so the child may do
    // anything the parent could.
    match unsafe { fork() }.map_err(std::io::Error::from)? {
        ForkResult::Child => {
            drop(read);
            keep(argv, write)
        }
        ForkResult::Parent { .. } => {
            drop(write);
            let mut code = String::new();
            std::fs::File::from(read).read_to_string(&mut code)?;
            // No code: the keeper died before the runtime ended (killed with its parent).
            Ok(code.trim().parse().unwrap_or(NOT_STARTED))
        }
    }
}

/// The keeper proper: never returns.
fn keep(argv: &[OsString], report: OwnedFd) -> ! {
    let parent = nix::unistd::getppid();
    let status = (|| {
        prctl::set_pdeathsig(Signal::SIGKILL)?;
        if nix::unistd::getppid() != parent {
            // The parent died before the line above took effect.
            return Err(Errno::ESRCH.into());
        }
        prctl::set_child_subreaper(true)?;
        // A process group of its own, as the console writer's: a terminal's Ctrl-C to hostd
        // (a signal to hostd's group) must end neither the keeper nor what the runtime leaves
        // here: runsc's gofer dies of a SIGINT, and the gVisor sandbox with it.
        nix::unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
        let (program, args) = argv.split_first().ok_or(Errno::EINVAL)?;
        let mut command = Command::new(program);
        command.args(args);
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            command
                .pre_exec(|| prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from));
        }
        let status = command.status()?;
        prctl::set_pdeathsig(None)?;
        Ok::<_, std::io::Error>(status)
    })();
    let code = match status {
        Ok(status) => exit_code(status),
        Err(e) => {
            let program = argv
                .first()
                .map(|p| p.to_string_lossy())
                .unwrap_or_default();
            eprintln!("berth {KEEPER_SUBCOMMAND}: {program}: {e}");
            NOT_STARTED
        }
    };
    let mut report = std::fs::File::from(report);
    // The parent gone, nobody waits for the code.
    let _ = writeln!(report, "{code}");
    drop(report);
    release_stdio();
    // It outlives its caller: hold no directory of the caller's (a mount point) busy.
    let _ = std::env::set_current_dir("/");
    // Reap what the runtime left here until nothing is left.
    loop {
        match waitpid(Pid::from_raw(-1), None) {
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(_) => std::process::exit(0),
        }
    }
}

/// The code a shell would give `status`.
fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|signal| 128 + signal))
        .unwrap_or(NOT_STARTED)
}

/// Points stdin, stdout and stderr at `/dev/null`, so the keeper holds no end of the
/// container's console pipe.
fn release_stdio() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..=2 {
            // SAFETY: dup2 onto the standard descriptors, which this process owns.
            let _ = unsafe { nix::libc::dup2(null.as_raw_fd(), fd) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exit_code_is_the_shells() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
    }
}
