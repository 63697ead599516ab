//! What a user may read of a host-side failure: [`HostdError::public_reason`].
//!
//! A snapshot's `reason` and a clone's or restore's `state_reason` reach the API. The full
//! [`HostdError::report`] names host file-system paths (the state dir, a sandbox's upper dir,
//! the local object store's directory), command lines and console output; those stay in
//! hostd's log. The public reason says what kind of thing failed, in words the user can act on.

use berth_storage::StorageError;

use super::HostdError;

/// The public reason of any failure this module does not name: details only in the log.
pub const HOST_FAILURE: &str = "the host failed (the details are in its log)";

impl HostdError {
    /// What a user may read of this error: its kind, never a host path, a command line or a
    /// console (log [`HostdError::report`] beside it). An error of a kind not named here reads
    /// as [`HOST_FAILURE`].
    pub fn public_reason(&self) -> String {
        match self {
            HostdError::Storage(e) => storage_reason(e),
            HostdError::UnknownSandbox { .. } => "the sandbox is not running on its host".into(),
            HostdError::ShuttingDown => "its host is shutting down".into(),
            HostdError::UnsupportedRuntime { name, .. } => {
                format!("runtime {name:?} is not offered by its host")
            }
            HostdError::SnapshotUnsupported { .. } => self.to_string(),
            HostdError::AgentTimeout { .. } | HostdError::Agent { .. } => {
                "the sandbox's agent did not answer".into()
            }
            HostdError::ContainerExited { .. } => "the sandbox exited while booting".into(),
            _ => HOST_FAILURE.into(),
        }
    }
}

fn storage_reason(e: &StorageError) -> String {
    match e {
        StorageError::Store { op, .. } => format!(
            "the object store failed a {op} (it refused the request, was unreachable or timed \
             out)"
        ),
        StorageError::Config { .. } => "the host's object store setting is invalid".into(),
        StorageError::Corrupt { hash, .. } => {
            format!("chunk {hash} is corrupt or missing in the object store")
        }
        StorageError::BadManifest { snapshot, .. } => {
            format!("the manifest of snapshot {snapshot} is invalid")
        }
        StorageError::NotFound(_) | StorageError::NoSuchTree { .. } => e.to_string(),
        StorageError::Unsupported { reason, .. } => {
            format!("the sandbox's disk holds what a snapshot cannot carry ({reason})")
        }
        StorageError::Io { action, .. } => {
            format!("the host could not {action} a file of the snapshot (details in its log)")
        }
        StorageError::Task(_) => HOST_FAILURE.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    const HOST_DIR: &str = "/var/lib/berth/sandboxes/0190-secret/upper";

    #[test]
    fn no_public_reason_names_a_host_path_and_the_store_is_named() {
        let local_store = object_store::Error::Generic {
            store: "LocalFileSystem",
            source: format!("Unable to open file {HOST_DIR}/objects/chunks/ab#1: Not a directory")
                .into(),
        };
        let errors = [
            HostdError::Storage(StorageError::Store {
                op: berth_storage::StoreOp::Put,
                key: "chunks/ab/ab12.zst".into(),
                source: local_store,
            }),
            HostdError::Storage(StorageError::Io {
                action: "read",
                path: PathBuf::from(HOST_DIR).join("etc/passwd"),
                source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
            }),
            HostdError::Storage(StorageError::Unsupported {
                path: PathBuf::from(HOST_DIR).join("dev/sda"),
                reason: "a device".into(),
            }),
            HostdError::Io {
                context: format!("create {HOST_DIR}"),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            },
            HostdError::Tool {
                program: "runc".into(),
                args: format!("--root {HOST_DIR} pause x"),
                status: "exit status: 1".into(),
                stderr: format!("{HOST_DIR}: no such file"),
            },
        ];
        for e in &errors {
            assert!(
                e.report().contains(HOST_DIR),
                "the log keeps it: {}",
                e.report()
            );
            let public = e.public_reason();
            assert!(!public.contains("/var"), "{public}");
            assert!(!public.contains(HOST_DIR), "{public}");
        }
        assert!(errors[0].public_reason().contains("object store"));
        assert!(errors[2].public_reason().contains("a device"));
        assert_eq!(errors[4].public_reason(), HOST_FAILURE);
    }
}
