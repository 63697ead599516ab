//! A `berth hostd` child process of this process: the end-to-end tests' hosts
//! (`tests/support/stack.rs`, `HostProcess`) and `berth bench --failover`'s hosts. It is signalled
//! and stopped by the PID that was started (never by name), and dropping it kills and reaps the
//! process, gives back its address pool and removes what it left on the machine
//! ([`crate::host_leftovers`]), synchronously, so a panicking test or a failed bench leaks
//! nothing. How the process is started stays with each user (their flags differ).

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use berth_schemas::HostId;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::host_leftovers::{
    release_address_pool, remove_dir_unless_mounted, remove_host_leftovers,
};

/// How long a hostd gets to exit after the signal of [`HostdChild::stop`] before SIGKILL.
pub const HOSTD_STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// Why a [`HostdChild`] could not be signalled.
#[derive(Debug, thiserror::Error)]
pub enum HostdChildError {
    /// Its process was never started, was stopped, or has been reaped.
    #[error("hostd of host {host} is not running")]
    NotRunning {
        /// The host.
        host: HostId,
    },
    /// `kill(2)` refused.
    #[error("signal {signal} to hostd of host {host}: {source}")]
    Signal {
        /// The host.
        host: HostId,
        /// The signal.
        signal: Signal,
        /// What `kill(2)` said.
        source: nix::Error,
    },
}

/// What a [`HostdChild`] does with its state dir when dropped, after what the host left on the
/// machine is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateDir {
    /// Left in place (its owner removes the directory above it, or keeps it to be read after a
    /// failure).
    Keep,
    /// Removed, unless something is still mounted below it.
    Remove,
}

/// A `berth hostd` child process (see the module doc). Fields are public: a user fills in
/// `child` when it starts the process (again), and takes it to wait on a kill it made itself.
#[derive(Debug)]
pub struct HostdChild {
    /// The host it runs as (`hosts.id`, kept in its state dir).
    pub host_id: HostId,
    /// Its `--state-dir`.
    pub state_dir: PathBuf,
    /// Its `--address-pool`, from [`crate::host_leftovers::free_address_pool`]; given back on
    /// drop.
    pub address_pool: Ipv4Addr,
    /// The process, while it runs (`None` before it starts and once it is stopped).
    pub child: Option<tokio::process::Child>,
    /// What drop does with `state_dir`.
    pub on_drop: StateDir,
}

impl HostdChild {
    /// A host not started yet (`child` is `None`).
    pub fn new(
        host_id: HostId,
        state_dir: PathBuf,
        address_pool: Ipv4Addr,
        on_drop: StateDir,
    ) -> Self {
        Self {
            host_id,
            state_dir,
            address_pool,
            child: None,
            on_drop,
        }
    }

    /// The PID of the process started, while it has not been reaped.
    pub fn pid(&self) -> Option<Pid> {
        let pid = self.child.as_ref()?.id()?;
        Some(Pid::from_raw(i32::try_from(pid).ok()?))
    }

    /// Sends `signal` to the process started (SIGSTOP freezes it: it neither consumes commands
    /// nor heartbeats; SIGCONT thaws it).
    ///
    /// Errors: [`HostdChildError::NotRunning`] when there is no process to signal,
    /// [`HostdChildError::Signal`] when `kill(2)` refuses.
    pub fn signal(&self, signal: Signal) -> Result<(), HostdChildError> {
        let pid = self
            .pid()
            .ok_or(HostdChildError::NotRunning { host: self.host_id })?;
        nix::sys::signal::kill(pid, signal).map_err(|source| HostdChildError::Signal {
            host: self.host_id,
            signal,
            source,
        })
    }

    /// Stops the process with `signal` (SIGTERM to let it shut down, SIGKILL to crash it), sent
    /// after a SIGCONT (a frozen process would not act on it), and waits for it to exit; after
    /// [`HOSTD_STOP_TIMEOUT`] it is killed. Nothing is removed: the host may be started again.
    pub async fn stop(&mut self, signal: Signal) {
        if self.signal(Signal::SIGCONT).is_ok() {
            let _ = self.signal(signal);
        }
        if let Some(mut child) = self.child.take() {
            if tokio::time::timeout(HOSTD_STOP_TIMEOUT, child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
    }
}

impl Drop for HostdChild {
    /// Kills the process (SIGKILL, by the PID started) and reaps it, so its runc children are
    /// not mid-create while what it left is removed; gives back its address pool; removes its
    /// containers, networks, mounts and nftables table, and its state dir if `on_drop` says so.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
                let _ = nix::sys::wait::waitpid(Pid::from_raw(pid), None);
            }
        }
        release_address_pool(self.address_pool);
        for what in remove_host_leftovers(self.host_id, &self.state_dir) {
            eprintln!("cleanup of host {}: removed {what}", self.host_id);
        }
        if self.on_drop == StateDir::Remove {
            remove_dir_unless_mounted(&self.state_dir);
        }
    }
}
