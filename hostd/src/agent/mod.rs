//! The in-sandbox agent (`berth agent --listen ADDR`) and hostd's client for it.
//!
//! The agent is the container's PID 1. It forks at once: the parent stays PID 1 and only reaps
//! children (orphans of every exec are reparented to it), exiting with the server's status when
//! the server child ends; the child serves the TCP protocol in [`protocol`].
//!
//! The agent side is std only (threads, no tokio), so it runs from the bundle with nothing but
//! libc (see `bundle`).
//!
//! Both agent processes are non-dumpable (`PR_SET_DUMPABLE` 0, inherited by the fork, reset
//! by every exec): the sandbox's own processes run as the same user with the same
//! capabilities, so without it they could read the agent's memory (`/proc/1/mem`, requests
//! carrying other execs' environments and stdin, file contents) or `ptrace` it. A
//! non-dumpable process can be read only with `CAP_SYS_PTRACE` over its user namespace, which
//! a sandbox never has (see `oci::CAPABILITIES`). Source: proc(5) (`/proc/pid/mem` needs
//! `PTRACE_MODE_ATTACH`), ptrace(2) ("dumpable" in the access mode checks).

pub mod client;
pub mod kept;
pub mod protocol;
pub mod server;
pub mod tty;

use std::net::{SocketAddr, TcpListener};

use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};

/// Exit status of the server child when it could not bind or serve.
const SERVER_FAILURE_EXIT: i32 = 1;

/// Runs the agent: forks a reaper (this process, PID 1 in a container) and a TCP server
/// listening on `listen`. Returns only in the parent, once the server child has exited (the
/// caller exits with the returned error, or success).
///
/// Call it before any other thread exists (before starting an async runtime): `fork` copies
/// only the calling thread.
///
/// Errors: the fork error, or an I/O error carrying the server's exit status when it failed.
pub fn main(listen: SocketAddr) -> std::io::Result<()> {
    nix::sys::prctl::set_dumpable(false).map_err(std::io::Error::from)?;
    // SAFETY: the documented precondition is that no other thread exists yet, so the child
    // starts from a consistent single-threaded copy.
    match unsafe { fork() }.map_err(std::io::Error::from)? {
        ForkResult::Child => {
            let code = match TcpListener::bind(listen).and_then(server::serve) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("berth agent: {e}");
                    SERVER_FAILURE_EXIT
                }
            };
            std::process::exit(code);
        }
        ForkResult::Parent { child } => reap_until(child),
    }
}

/// Reaps every child until `server` exits; mirrors its exit status.
fn reap_until(server: Pid) -> std::io::Result<()> {
    loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == server => {
                return if code == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::other(format!(
                        "agent server exited with {code}"
                    )))
                };
            }
            Ok(WaitStatus::Signaled(pid, signal, _)) if pid == server => {
                return Err(std::io::Error::other(format!(
                    "agent server killed by {signal}"
                )));
            }
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}
