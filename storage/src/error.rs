//! The crate's one error type (STYLE.md habit 3).

use std::fmt;
use std::path::PathBuf;

use berth_schemas::ids::SnapshotId;

/// The object-store operation that failed, for [`StorageError::Store`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOp {
    /// Writing an object.
    Put,
    /// Reading an object.
    Get,
    /// Asking whether an object exists.
    Head,
    /// Removing an object.
    Delete,
    /// Listing keys under a prefix.
    List,
}

impl fmt::Display for StoreOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StoreOp::Put => "put",
            StoreOp::Get => "get",
            StoreOp::Head => "head",
            StoreOp::Delete => "delete",
            StoreOp::List => "list",
        })
    }
}

/// Everything that can go wrong storing or fetching a snapshot artifact.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// `BERTH_OBJECT_STORE` (or an S3 option) could not be understood.
    #[error("bad object store setting {value:?}: {reason}")]
    Config {
        /// The setting as given.
        value: String,
        /// Why it was refused.
        reason: String,
    },
    /// The object store refused or failed an operation (after the configured retries): the
    /// server is down, refused the credentials, or the request timed out.
    #[error("object store {op} of {key} failed")]
    Store {
        /// What was being done.
        op: StoreOp,
        /// The object key (below the configured prefix).
        key: String,
        /// The store's own error.
        #[source]
        source: object_store::Error,
    },
    /// A local file or directory could not be read or written.
    #[error("{action} {}", .path.display())]
    Io {
        /// What was being done (`read`, `create`, ...).
        action: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A chunk's content does not hash to its name, or does not decompress within the chunk
    /// size: the stored copy is damaged or was tampered with.
    #[error("chunk {hash} is corrupt: {reason}")]
    Corrupt {
        /// The chunk's expected SHA-256 (hex).
        hash: String,
        /// What did not match.
        reason: String,
    },
    /// A manifest does not parse, has an unknown format version, or names a path that would
    /// leave the tree it describes.
    #[error("manifest of snapshot {snapshot} is invalid: {reason}")]
    BadManifest {
        /// The snapshot whose manifest it is.
        snapshot: SnapshotId,
        /// What is wrong with it.
        reason: String,
    },
    /// No manifest is stored for this snapshot: it was never made durable, or it was deleted.
    #[error("snapshot {0} is not in the object store")]
    NotFound(SnapshotId),
    /// The tree holds something an artifact cannot carry (a device other than an overlay
    /// whiteout, a socket, a FIFO, a name that is not UTF-8).
    #[error("cannot capture {path}: {reason}")]
    Unsupported {
        /// The offending path.
        path: PathBuf,
        /// Why it cannot be captured.
        reason: String,
    },
    /// The snapshot asked for a tree it does not hold (memory from a disk-only snapshot).
    #[error("snapshot {snapshot} holds no {tree} tree")]
    NoSuchTree {
        /// The snapshot.
        snapshot: SnapshotId,
        /// The tree asked for.
        tree: &'static str,
    },
    /// A blocking task panicked or was cancelled.
    #[error("background task failed: {0}")]
    Task(String),
}

impl StorageError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| StorageError::Io {
            action,
            path,
            source,
        }
    }

    pub(crate) fn store(
        op: StoreOp,
        key: &object_store::path::Path,
    ) -> impl FnOnce(object_store::Error) -> Self + '_ {
        move |source| StorageError::Store {
            op,
            key: key.to_string(),
            source,
        }
    }
}

/// Shorthand for this crate's results.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;
