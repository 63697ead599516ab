//! [`HostdError`]: the one error type at the `berth-hostd` crate boundary.
//!
//! Messages are lowercase and short; context travels in fields, and the underlying cause is the
//! `#[source]`. [`HostdError::report`] renders the whole chain on one line, which is what a
//! `ResultOutcome::Failed { reason }` carries back to the control plane (or `Rejected`, when
//! [`HostdError::is_the_requests_fault`]) — except a snapshot's, a clone's and a restore's,
//! which reach users through the API and carry [`HostdError::public_reason`] (no host paths;
//! `public.rs`), the report going to hostd's log.

mod public;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use berth_schemas::SandboxId;

/// A boxed error from a dependency whose error types are many and generic (async-nats).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong inside hostd.
#[derive(Debug, thiserror::Error)]
pub enum HostdError {
    /// A filesystem or process operation failed; `context` says which and on what.
    #[error("{context}")]
    Io {
        /// What was being done, on what.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// An external tool (`ip`, `runc`, `ldd`, `busybox`) exited unsuccessfully.
    #[error("{program} {args} failed ({status}): {stderr}")]
    Tool {
        /// The tool.
        program: String,
        /// Its arguments, space-separated.
        args: String,
        /// How it exited.
        status: String,
        /// What it wrote on stderr.
        stderr: String,
    },

    /// A mount or unmount syscall failed.
    #[error("{operation} {path}")]
    Mount {
        /// `mount` or `umount`.
        operation: &'static str,
        /// The mount point.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: nix::Error,
    },

    /// A JSON state file (sandbox record, bundle manifest) could not be read or written.
    #[error("invalid state file {path}")]
    StateFile {
        /// The file.
        path: PathBuf,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },

    /// A directory on the way to the state dir cannot be searched by other users, so runc
    /// cannot reach a sandbox's root filesystem from inside its user namespace (whose root is an
    /// unprivileged host uid).
    #[error(
        "{path} (mode {mode:o}) is not searchable by other users: runc sandboxes run in a user \
         namespace and must reach their root filesystem below the state dir; \
         `chmod o+x {path}` or choose another --state-dir"
    )]
    StateDirNotSearchable {
        /// The directory.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },

    /// The `<state_dir>/host-id` file holds something that is not a host id.
    #[error("invalid host id file {path}: {content:?}")]
    HostIdFile {
        /// The file.
        path: PathBuf,
        /// What it holds.
        content: String,
    },

    /// The state dir belongs to another host than the NATS credentials speak for.
    #[error("{path} holds host id {state}, but the NATS credentials are host {creds}'s")]
    HostIdMismatch {
        /// The `host-id` file.
        path: PathBuf,
        /// The id it holds.
        state: berth_schemas::HostId,
        /// The id the credentials were issued for.
        creds: berth_schemas::HostId,
    },

    /// The command asked for a template this host cannot build.
    #[error("unknown template {name:?} (known: {known})")]
    UnknownTemplate {
        /// The name asked for.
        name: String,
        /// The names this host knows, comma-separated.
        known: String,
    },

    /// A template's OCI image could not be pulled or unpacked.
    #[error("template image: {0}")]
    Image(#[from] crate::image::ImageError),

    /// Every /30 of the pool is taken.
    #[error("address pool {pool}/16 is exhausted")]
    AddressPoolExhausted {
        /// The pool's base address.
        pool: Ipv4Addr,
    },

    /// The agent bundle (binary plus shared libraries) could not be assembled.
    #[error("agent bundle: {reason}")]
    Bundle {
        /// Why.
        reason: String,
    },

    /// The agent did not answer a ping within `waited`.
    #[error("agent at {address} did not answer within {waited:?}")]
    AgentTimeout {
        /// Where the agent listens.
        address: SocketAddr,
        /// How long hostd waited.
        waited: Duration,
    },

    /// The agent answered with an error, garbage, or the connection broke.
    #[error("agent at {address}: {reason}")]
    Agent {
        /// Where the agent listens.
        address: SocketAddr,
        /// What went wrong.
        reason: String,
    },

    /// The container stopped while hostd waited for its agent.
    #[error("container {container_id} exited while booting; console: {console_tail}")]
    ContainerExited {
        /// The container.
        container_id: String,
        /// The last lines of its console log.
        console_tail: String,
    },

    /// The OCI runtime spec could not be built or written.
    #[error("oci runtime spec")]
    Oci(#[from] oci_spec::OciSpecError),

    /// A runtime was asked for that this host does not offer (`HostdConfig::runtimes`, or a
    /// template's runtime).
    #[error("runtime {name:?} is not offered by this host (offered: {offered})")]
    UnsupportedRuntime {
        /// The runtime asked for.
        name: String,
        /// The runtimes offered, comma-separated.
        offered: String,
    },

    /// A memory snapshot was asked of a runtime that cannot take one.
    #[error("runtime {runtime} cannot snapshot memory")]
    SnapshotUnsupported {
        /// The runtime.
        runtime: &'static str,
    },

    /// nftables refused a change (`nft` exited unsuccessfully), with the ruleset text sent.
    #[error("nft: {stderr}")]
    Nft {
        /// What `nft` wrote on stderr.
        stderr: String,
        /// The ruleset text sent.
        ruleset: String,
    },

    /// A file operation in the sandbox was refused before reaching the agent.
    #[error("file {path:?}: {reason}")]
    File {
        /// The path in the sandbox.
        path: String,
        /// Why it was refused.
        reason: String,
    },

    /// A NATS or JetStream operation failed.
    #[error("nats {operation}")]
    Nats {
        /// What was being done.
        operation: &'static str,
        /// The client's error.
        #[source]
        source: BoxError,
    },

    /// One or more cleanup steps failed; every step was still attempted (last-in-first-out).
    #[error("cleanup failed: {}", errors.join("; "))]
    Cleanup {
        /// Each failed step, as `"<what>: <error>"`.
        errors: Vec<String>,
    },

    /// A command needs a local sandbox this host does not have.
    #[error("no sandbox {sandbox_id} on this host")]
    UnknownSandbox {
        /// The sandbox.
        sandbox_id: SandboxId,
    },

    /// The operation was abandoned because hostd is shutting down.
    #[error("hostd is shutting down")]
    ShuttingDown,

    /// Capturing, storing or fetching a snapshot failed (the object store refused or is down,
    /// a chunk is corrupt, a tree holds what an artifact cannot carry).
    #[error("snapshot storage")]
    Storage(#[from] berth_storage::StorageError),
}

impl HostdError {
    /// The error and every source below it, joined with `": "`, on one line.
    pub fn report(&self) -> String {
        let mut out = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            out.push_str(": ");
            out.push_str(&cause.to_string());
            source = cause.source();
        }
        out
    }

    /// Whether the command itself is at fault (a template or runtime this host does not
    /// offer): another host would fail it the same way, so the result is
    /// `ResultOutcome::Rejected`, which the control plane neither retries elsewhere nor counts
    /// against this host's health. Every other error is the host's.
    pub fn is_the_requests_fault(&self) -> bool {
        matches!(
            self,
            HostdError::UnknownTemplate { .. } | HostdError::UnsupportedRuntime { .. }
        ) || matches!(self, HostdError::Image(e) if !e.is_transient())
    }

    /// A `map_err` adapter for I/O errors: `fs::read(p).map_err(HostdError::io(format!(..)))`.
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> HostdError {
        let context = context.into();
        move |source| HostdError::Io { context, source }
    }

    /// A `map_err` adapter for NATS errors.
    pub(crate) fn nats<E>(operation: &'static str) -> impl FnOnce(E) -> HostdError
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        move |source| HostdError::Nats {
            operation,
            source: Box::new(source),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unknown_template_or_runtime_is_the_requests_fault() {
        let template = HostdError::UnknownTemplate {
            name: "nope".into(),
            known: "base".into(),
        };
        let runtime = HostdError::UnsupportedRuntime {
            name: "kata".into(),
            offered: "runc".into(),
        };
        assert!(template.is_the_requests_fault() && runtime.is_the_requests_fault());
        let tool = HostdError::Tool {
            program: "runc".into(),
            args: "run".into(),
            status: "exit status: 1".into(),
            stderr: "boom".into(),
        };
        assert!(!tool.is_the_requests_fault());
    }

    #[test]
    fn report_joins_the_whole_source_chain_on_one_line() {
        let err = HostdError::Io {
            context: "read /x".into(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "gone"),
        };
        assert_eq!(err.report(), "read /x: gone");
    }
}
