//! The sandbox's root filesystem: an overlayfs of the template (lower, read-only) and the
//! sandbox's own upper dir, mounted at `sandboxes/<id>/rootfs` while the container exists.
//!
//! Both operations are idempotent: mounting what is mounted and unmounting what is not are
//! no-ops, so a retried or converging command can call them blindly.

use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::error::HostdError;

/// The mount table of this process's mount namespace.
const MOUNTINFO: &str = "/proc/self/mountinfo";

/// Mounts `lower` + `upper` (with `work`) at `merged`, unless something is mounted there.
/// Creates `upper`, `work` and `merged` when missing.
///
/// Errors: [`HostdError::Io`], [`HostdError::Mount`].
pub fn mount_overlay(
    lower: &Path,
    upper: &Path,
    work: &Path,
    merged: &Path,
) -> Result<(), HostdError> {
    for dir in [upper, work, merged] {
        std::fs::create_dir_all(dir)
            .map_err(HostdError::io(format!("create {}", dir.display())))?;
    }
    if is_mounted(merged)? {
        return Ok(());
    }
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    mount(
        Some("overlay"),
        merged,
        Some("overlay"),
        MsFlags::empty(),
        Some(options.as_str()),
    )
    .map_err(|source| HostdError::Mount {
        operation: "mount overlay at",
        path: merged.to_path_buf(),
        source,
    })
}

/// Unmounts whatever is mounted at `path` (all stacked mounts); a no-op when nothing is.
/// Falls back to a lazy unmount when the mount is busy.
///
/// Errors: [`HostdError::Io`], [`HostdError::Mount`].
pub fn unmount(path: &Path) -> Result<(), HostdError> {
    while is_mounted(path)? {
        if let Err(e) = umount2(path, MntFlags::empty()) {
            let lazy = e == nix::errno::Errno::EBUSY;
            if !lazy {
                return Err(HostdError::Mount {
                    operation: "unmount",
                    path: path.to_path_buf(),
                    source: e,
                });
            }
            tracing::warn!(path = %path.display(), "mount busy, detaching lazily");
            umount2(path, MntFlags::MNT_DETACH).map_err(|source| HostdError::Mount {
                operation: "detach",
                path: path.to_path_buf(),
                source,
            })?;
        }
    }
    Ok(())
}

/// Whether something is mounted exactly at `path`.
///
/// Errors: [`HostdError::Io`] when the mount table cannot be read.
pub fn is_mounted(path: &Path) -> Result<bool, HostdError> {
    let table =
        std::fs::read_to_string(MOUNTINFO).map_err(HostdError::io(format!("read {MOUNTINFO}")))?;
    let mounted = mount_points(&table).any(|p| p == path);
    Ok(mounted)
}

/// The mount points of a `/proc/<pid>/mountinfo` table (field 5, octal escapes decoded).
pub fn mount_points(mountinfo: &str) -> impl Iterator<Item = PathBuf> + '_ {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_octal(p)))
}

/// Decodes the `\NNN` octal escapes the kernel uses for space, tab, newline and backslash.
fn unescape_octal(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|b| (b'0'..=b'7').contains(b)) {
                let value = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(v) = u8::try_from(value) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO_SAMPLE: &str = "\
22 1 254:0 / / rw,relatime - ext4 /dev/vda rw
98 22 0:52 / /var/tmp/with\\040space/rootfs rw,relatime - overlay overlay rw,lowerdir=/a
99 22 0:53 / /var/tmp/plain rw - tmpfs tmpfs rw
";

    #[test]
    fn mount_points_are_read_from_field_five_with_escapes_decoded() {
        let points: Vec<_> = mount_points(MOUNTINFO_SAMPLE).collect();
        assert_eq!(
            points,
            [
                PathBuf::from("/"),
                PathBuf::from("/var/tmp/with space/rootfs"),
                PathBuf::from("/var/tmp/plain")
            ]
        );
    }

    #[test]
    fn a_backslash_without_octal_digits_is_kept() {
        assert_eq!(unescape_octal("a\\x"), "a\\x");
        assert_eq!(unescape_octal("a\\134b"), "a\\b");
        assert_eq!(unescape_octal("end\\04"), "end\\04");
    }

    #[test]
    fn the_root_is_mounted_and_a_fresh_dir_is_not() {
        assert!(is_mounted(Path::new("/")).unwrap());
        assert!(!is_mounted(Path::new("/definitely/not/a/mount/point")).unwrap());
    }
}
