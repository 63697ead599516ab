//! A sandbox's writable disk, limited to its `disk_mib`: a sparse ext4 image
//! (`sandboxes/<id>/disk.img`) loop-mounted at `sandboxes/<id>/disk/`, which holds the
//! overlay's upper and work dirs. A write beyond the limit fails inside the sandbox with
//! `ENOSPC`; the host's filesystem only ever holds the image, at most `disk_mib` plus the
//! filesystem's metadata, and blocks the sandbox frees go back to the host (`discard` punches
//! holes in the image).
//!
//! # Why an image
//! - Project quotas (ext4 `prjquota`, xfs `pquota`) need the host filesystem made and mounted
//!   for them, which a stock Debian root filesystem is not; hostd cannot turn them on.
//! - A tmpfs upper dir with `size=` would cost RAM and vanish on a host reboot, and a stopped
//!   sandbox must keep its disk.
//! - A loop-mounted ext4 image is the same on every filesystem that holds sparse files, and
//!   costs little at create: `mkfs.ext4` writes only its metadata (lazy inode tables and
//!   journal), and `mount -o loop` attaches the device with autoclear, so unmounting also
//!   detaches it: about 5 ms and 3 ms for a 2 GiB image, and an empty one takes 1.2 MiB of
//!   the host's disk. `berth bench` put create→running p50 at 1.01–1.15× of the run before,
//!   about +14 ms over the runtime's floor (`tests/bench/RESULTS.md`, 2026-12-01 13:15).
//!
//! # Guarantees
//! - [`ensure`] and [`release`] are idempotent: a mounted disk is left as it is, an image that
//!   exists is never made again (its data survives stops and hostd restarts), unmounting what
//!   is not mounted succeeds.
//! - An image is made aside and renamed into place once formatted, so a crash mid-format
//!   leaves no half-made image that [`ensure`] would mount.
//! - An image is never attached twice (two loop devices on one ext4 image would corrupt it):
//!   [`release`] unmounts for real, never lazily, waiting while the runtime's last processes
//!   still hold the disk, and returns once the loop device is gone; [`ensure`] refuses to mount
//!   an image a loop device still holds.
//! - A sandbox without a limit (`disk_mib` 0: a record from before disk limits) keeps the
//!   older layout: its upper and work dirs directly in the sandbox dir, on the host filesystem.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::mount::{umount2, MntFlags};

use crate::disk::blocking;
use crate::error::HostdError;
use crate::layout::SandboxPaths;
use crate::{overlay, tool};

/// The filesystem tool; `-F` because the target is a file, not a block device.
const MKFS: &str = "mkfs.ext4";

/// `mkfs.ext4` options: quiet; no blocks reserved for root (sandbox root may not be host
/// root); inode tables and journal left for the kernel, which reads the sparse file's holes as
/// the zeros it would have written; no discard pass over a file that is all holes.
const MKFS_OPTIONS: &[&str] = &[
    "-q",
    "-F",
    "-m",
    "0",
    "-E",
    "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
];

/// `mount` options: a loop device (util-linux sets it to autoclear, so unmounting detaches
/// it); `noinit_itable` keeps the kernel from zeroing inode tables in the background (the holes
/// already read as zeros); `discard` gives freed blocks back to the host as holes.
const MOUNT_OPTIONS: &str = "loop,noinit_itable,discard";

/// Bytes in a MiB.
const MIB: u64 = 1024 * 1024;

/// How long [`release`] waits for a busy disk (a runtime's processes still closing its files
/// after `delete`) to unmount and its loop device to go, and [`ensure`] for an image still
/// attached, before giving up.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// Pause between attempts while waiting for a busy disk.
const RELEASE_POLL: Duration = Duration::from_millis(20);

/// Where the kernel lists block devices (`loopN/loop/backing_file` for loop devices).
const SYS_BLOCK: &str = "/sys/block";

/// The overlay's upper and work dirs of a sandbox whose disk is `disk_mib` MiB: inside the
/// disk's mount, or (no limit) directly in the sandbox dir.
pub fn overlay_dirs(paths: &SandboxPaths, disk_mib: u32) -> (PathBuf, PathBuf) {
    if disk_mib == 0 {
        (paths.upper(), paths.work())
    } else {
        let mount = paths.disk_mount();
        (mount.join("upper"), mount.join("work"))
    }
}

/// Makes the sandbox's disk image when it has none (`disk_mib` MiB, sparse) and mounts it at
/// its mount point unless something is mounted there. A no-op for `disk_mib` 0.
///
/// Errors: [`HostdError::Io`] for the files; [`HostdError::Tool`] from `mkfs.ext4` or
/// `mount` (a missing loop device, say).
pub async fn ensure(paths: &SandboxPaths, disk_mib: u32) -> Result<(), HostdError> {
    if disk_mib == 0 {
        return Ok(());
    }
    let mount_point = paths.disk_mount();
    if overlay::is_mounted(&mount_point)? {
        return Ok(());
    }
    let image = paths.disk_image();
    if image.is_file() {
        let image = image.clone();
        blocking(move || wait_detached(&image, Instant::now() + RELEASE_TIMEOUT)).await?;
    } else {
        make_image(&image, disk_mib).await?;
    }
    {
        let mount_point = mount_point.clone();
        blocking(move || {
            std::fs::create_dir_all(&mount_point)
                .map_err(HostdError::io(format!("create {}", mount_point.display())))
        })
        .await?;
    }
    let (image, point) = (path_arg(&image), path_arg(&mount_point));
    tool::run(
        "mount",
        &["-t", "ext4", "-o", MOUNT_OPTIONS, &image, &point],
    )
    .await?;
    Ok(())
}

/// Unmounts the sandbox's disk and waits for its loop device to detach; succeeds when it is
/// not mounted. While the disk is busy (the overlay above it, or the runtime's last
/// processes, not yet gone) it tries again for up to [`RELEASE_TIMEOUT`]. The image stays: a
/// stopped sandbox keeps its disk. Unmount the overlay first.
///
/// Errors: [`HostdError::Mount`] when the disk stays busy or cannot be unmounted;
/// [`HostdError::Io`] when its loop device does not go.
pub async fn release(paths: &SandboxPaths) -> Result<(), HostdError> {
    let (mount_point, image) = (paths.disk_mount(), paths.disk_image());
    blocking(move || {
        let deadline = Instant::now() + RELEASE_TIMEOUT;
        while overlay::is_mounted(&mount_point)? {
            match umount2(&mount_point, MntFlags::empty()) {
                Ok(()) => {}
                Err(Errno::EBUSY) if Instant::now() < deadline => std::thread::sleep(RELEASE_POLL),
                Err(source) => {
                    return Err(HostdError::Mount {
                        operation: "unmount",
                        path: mount_point,
                        source,
                    })
                }
            }
        }
        wait_detached(&image, deadline)
    })
    .await
}

/// Waits until no loop device is backed by `image`, polling until `deadline`.
///
/// Errors: [`HostdError::Io`] (`ResourceBusy`) when one still is at the deadline.
fn wait_detached(image: &Path, deadline: Instant) -> Result<(), HostdError> {
    loop {
        let devices = loop_devices_of(image);
        if devices.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(HostdError::Io {
                context: format!(
                    "disk image {} still attached to {}",
                    image.display(),
                    devices.join(", ")
                ),
                source: std::io::ErrorKind::ResourceBusy.into(),
            });
        }
        std::thread::sleep(RELEASE_POLL);
    }
}

/// The loop devices (`loopN`) whose backing file is `image` (also after it was unlinked: the
/// kernel then shows its path with ` (deleted)`).
pub fn loop_devices_of(image: &Path) -> Vec<String> {
    // The kernel shows the path it resolved; resolve ours the same way (the dir still exists
    // when the image does not).
    let resolved = match (image.parent(), image.file_name()) {
        (Some(dir), Some(name)) => std::fs::canonicalize(dir)
            .map(|d| d.join(name))
            .unwrap_or_else(|_| image.to_path_buf()),
        _ => image.to_path_buf(),
    };
    let Ok(entries) = std::fs::read_dir(SYS_BLOCK) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let backing = std::fs::read_to_string(entry.path().join("loop/backing_file")).ok()?;
            let backing = backing.trim_end_matches('\n');
            let backing = backing.strip_suffix(" (deleted)").unwrap_or(backing);
            (Path::new(backing) == resolved)
                .then(|| entry.file_name().to_string_lossy().into_owned())
        })
        .collect()
}

/// Formats a sparse `disk_mib` MiB ext4 image beside `image` and renames it into place.
async fn make_image(image: &Path, disk_mib: u32) -> Result<(), HostdError> {
    let partial = image.with_extension("img.partial");
    {
        let partial = partial.clone();
        blocking(move || {
            if let Some(dir) = partial.parent() {
                std::fs::create_dir_all(dir)
                    .map_err(HostdError::io(format!("create {}", dir.display())))?;
            }
            let file = std::fs::File::create(&partial)
                .map_err(HostdError::io(format!("create {}", partial.display())))?;
            file.set_len(u64::from(disk_mib) * MIB)
                .map_err(HostdError::io(format!("size {}", partial.display())))
        })
        .await?;
    }
    let target = path_arg(&partial);
    let mut args = MKFS_OPTIONS.to_vec();
    args.push(&target);
    tool::run(MKFS, &args).await?;
    let image = image.to_path_buf();
    blocking(move || {
        std::fs::rename(&partial, &image)
            .map_err(HostdError::io(format!("rename {}", partial.display())))
    })
    .await
}

fn path_arg(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::StateLayout;
    use berth_schemas::SandboxId;

    #[test]
    fn an_image_no_loop_device_holds_has_none() {
        assert!(loop_devices_of(Path::new("/nonexistent/berth/disk.img")).is_empty());
    }

    #[test]
    fn a_limited_disk_keeps_its_overlay_dirs_inside_the_mount() {
        let layout = StateLayout::new(Path::new("/state"));
        let paths = layout.sandbox(SandboxId::new());
        let (upper, work) = overlay_dirs(&paths, 64);
        assert_eq!(upper, paths.disk_mount().join("upper"));
        assert_eq!(work, paths.disk_mount().join("work"));
        assert_eq!(overlay_dirs(&paths, 0), (paths.upper(), paths.work()));
    }
}
