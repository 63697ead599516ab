//! A sandbox's files and mounts, as async steps both the apply use cases and the OCI backend
//! take: blocking filesystem work off the async threads, unmounting, removing dirs.
//!
//! # Guarantees
//! Every step is idempotent: removing or unmounting what is already gone succeeds.

use std::path::{Path, PathBuf};

use crate::error::HostdError;
use crate::layout::SandboxPaths;
use crate::overlay;

/// Runs a blocking filesystem/mount step off the async threads.
///
/// Errors: the step's own; [`HostdError::Io`] when the blocking task panicked.
pub async fn blocking<T, F>(f: F) -> Result<T, HostdError>
where
    F: FnOnce() -> Result<T, HostdError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| HostdError::Io {
            context: "blocking task".into(),
            source: std::io::Error::other(e),
        })?
}

/// Removes a directory tree; succeeds when it is already gone.
///
/// Errors: [`HostdError::Io`].
pub async fn remove_dir_if_present(dir: &Path) -> Result<(), HostdError> {
    match tokio::fs::remove_dir_all(dir).await {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(HostdError::io(format!("remove {}", dir.display()))(e))
        }
        _ => Ok(()),
    }
}

/// Unmounts the overlay at `path`; succeeds when nothing is mounted there (only the mount
/// table is read then).
///
/// Errors: [`HostdError`] from [`overlay::unmount`].
pub async fn unmount(path: PathBuf) -> Result<(), HostdError> {
    blocking(move || overlay::unmount(&path)).await
}

/// Removes the sandbox dir (its disk image with it); succeeds when it is already gone.
/// Refuses while the overlay or the disk is still mounted (removing through the overlay would
/// only litter the upper dir with whiteouts, and through the disk would empty a filesystem
/// that outlives its image's name).
///
/// Errors: [`HostdError::Io`], `ResourceBusy` while mounted.
pub async fn remove_sandbox_dir(paths: &SandboxPaths) -> Result<(), HostdError> {
    for (mount, what) in [(paths.rootfs(), "overlay"), (paths.disk_mount(), "disk")] {
        if overlay::is_mounted(&mount)? {
            return Err(HostdError::Io {
                context: format!("remove {}: {what} still mounted", paths.dir().display()),
                source: std::io::ErrorKind::ResourceBusy.into(),
            });
        }
    }
    remove_dir_if_present(paths.dir()).await
}
