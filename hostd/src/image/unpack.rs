//! Applies OCI image layers (tar, tar+gzip) onto a root filesystem, with whiteouts, refusing
//! anything that could reach outside that root or plant a device.
//!
//! Source: OCI image spec `layer.md` ("Representing Changes", "Whiteouts", "Opaque
//! Whiteout"): a file `.wh.NAME` deletes `NAME` of the lower layers, a file `.wh..wh..opq`
//! deletes every child of its directory that came from the lower layers; whiteout files are
//! never part of the result.
//!
//! # Guarantees
//! - Every entry lands strictly inside the root: a path with `..` refuses the layer, and the
//!   symlinks of earlier entries and layers are followed as the sandbox would see them, inside
//!   the root (an absolute target starts at the root, `..` stops there), never the host's: a
//!   symlink to `/etc` makes `etc/x` land in the root's `etc`. Hard link targets and deletions
//!   (whiteouts, an entry replacing one of another kind) resolve the same way, and nothing
//!   ever follows the final symlink of a path.
//! - Character and block devices refuse the layer: a sandbox's `/dev` comes from its runtime.
//!   FIFOs and sockets are skipped.
//! - The sum of entry sizes is bounded by [`UnpackLimits::max_bytes`] and their number by
//!   [`UnpackLimits::max_entries`] across all layers (a decompression bomb stops there).
//! - Extended attributes are not applied: a `trusted.overlay.*` attribute would change how
//!   the overlay that sandboxes mount on this root reads it. File capabilities are lost with
//!   them (as with `docker export`).
//!
//! # Assumptions
//! The caller unpacks into a fresh directory it owns and nobody else writes there meanwhile;
//! on error it removes the whole directory (the root is then partial).

use std::fs;
use std::io::{BufReader, Read};
use std::path::{Component, Path, PathBuf};

use super::ImageError;

/// The prefix of a whiteout file name.
pub const WHITEOUT_PREFIX: &str = ".wh.";

/// The name of an opaque-directory whiteout.
pub const OPAQUE_WHITEOUT: &str = ".wh..wh..opq";

/// How a layer blob is compressed, from its media type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// `application/vnd.oci.image.layer.v1.tar` (and Docker's plain tar).
    None,
    /// `...tar+gzip`, Docker's `application/vnd.docker.image.rootfs.diff.tar.gzip`.
    Gzip,
}

impl Compression {
    /// The compression of a layer of `media_type`.
    ///
    /// Errors: [`ImageError::UnsupportedLayer`] for zstd, foreign (non-distributable) layers and
    /// anything that is not a layer.
    pub fn of(media_type: &str) -> Result<Self, ImageError> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Ok(Self::None),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip" => Ok(Self::Gzip),
            other => Err(ImageError::UnsupportedLayer {
                media_type: other.to_owned(),
            }),
        }
    }
}

/// Bounds on what the layers of one image may unpack to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpackLimits {
    /// The sum of the sizes of all regular-file entries of all layers, in bytes.
    pub max_bytes: u64,
    /// The number of entries of all layers.
    pub max_entries: u64,
}

/// What has been unpacked so far (across layers), checked against [`UnpackLimits`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Unpacked {
    /// Bytes of entry data written.
    pub bytes: u64,
    /// Entries seen.
    pub entries: u64,
}

/// Applies the layer blob at `blob` onto `root`, counting into `so_far`.
///
/// Errors: [`ImageError::Hostile`] for an entry with `..` or a device;
/// [`ImageError::TooLarge`] past `limits`; [`ImageError::Io`] when the blob can't be read or
/// an entry can't be written.
pub fn apply_layer(
    root: &Path,
    blob: &Path,
    compression: Compression,
    limits: &UnpackLimits,
    so_far: &mut Unpacked,
) -> Result<(), ImageError> {
    let layer = blob
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Pass 1: the layer's deletions apply to the lower layers only, so they all go before any
    // of its own entries (an opaque marker may follow entries of its directory in the tar).
    for_each_entry(blob, compression, &layer, |_entry, path| {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let Some(name) = name.filter(|n| n.starts_with(WHITEOUT_PREFIX)) else {
            return Ok(());
        };
        let dir = resolve_in_root(root, path.parent().unwrap_or(Path::new("")), &layer)?;
        if !fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            return Ok(());
        }
        if name == OPAQUE_WHITEOUT {
            let children =
                fs::read_dir(&dir).map_err(ImageError::io(format!("list {}", dir.display())))?;
            for child in children {
                let child = child.map_err(ImageError::io(format!("list {}", dir.display())))?;
                remove(&child.path())?;
            }
        } else {
            let target = &name[WHITEOUT_PREFIX.len()..];
            if target.is_empty() || target == "." || target == ".." || target.contains('/') {
                return Err(hostile(&layer, path, "whiteout of no plain name"));
            }
            remove(&dir.join(target))?;
        }
        Ok(())
    })?;
    // Pass 2: the layer's own entries.
    for_each_entry(blob, compression, &layer, |entry, path| {
        so_far.entries += 1;
        if so_far.entries > limits.max_entries {
            return Err(ImageError::TooLarge {
                what: "entries in the layers",
                limit: limits.max_entries,
            });
        }
        let kind = entry.header().entry_type();
        let Some(file_name) = path.file_name() else {
            return Ok(()); // the root itself: its mode is ours
        };
        if file_name.to_string_lossy().starts_with(WHITEOUT_PREFIX) {
            return Ok(());
        }
        if kind.is_character_special() || kind.is_block_special() {
            return Err(hostile(&layer, path, "device node"));
        }
        if !(kind.is_file()
            || kind.is_contiguous()
            || kind.is_dir()
            || kind.is_symlink()
            || kind.is_hard_link())
        {
            return Ok(()); // FIFOs, and headers that are not entries
        }
        if kind.is_file() || kind.is_contiguous() {
            so_far.bytes = so_far.bytes.saturating_add(entry.size());
            if so_far.bytes > limits.max_bytes {
                return Err(ImageError::TooLarge {
                    what: "unpacked bytes of the layers",
                    limit: limits.max_bytes,
                });
            }
        }
        let parent = resolve_in_root(root, path.parent().unwrap_or(Path::new("")), &layer)?;
        fs::create_dir_all(&parent)
            .map_err(ImageError::io(format!("create {}", parent.display())))?;
        let dst = parent.join(file_name);
        // A later layer replaces an entry of another kind: a directory by a file or the reverse.
        if let Ok(existing) = fs::symlink_metadata(&dst) {
            if !(existing.is_dir() && kind.is_dir()) {
                remove(&dst)?;
            }
        }
        if kind.is_hard_link() {
            let target = entry
                .link_name()
                .map_err(ImageError::io(format!(
                    "read the link of {}",
                    path.display()
                )))?
                .ok_or_else(|| hostile(&layer, path, "hard link without a target"))?;
            let target = relative(&target)
                .ok_or_else(|| hostile(&layer, path, "hard link target with '..'"))?;
            let target_parent =
                resolve_in_root(root, target.parent().unwrap_or(Path::new("")), &layer)?;
            let source = target_parent.join(target.file_name().unwrap_or_default());
            return fs::hard_link(&source, &dst).map_err(ImageError::io(format!(
                "hard link {} to {} of layer {layer}",
                path.display(),
                target.display()
            )));
        }
        entry.unpack(&dst).map_err(ImageError::io(format!(
            "unpack {} of layer {layer}",
            path.display()
        )))?;
        Ok(())
    })
}

/// Calls `each` with every entry of the layer and its path, relative and checked for `..`.
fn for_each_entry(
    blob: &Path,
    compression: Compression,
    layer: &str,
    mut each: impl FnMut(&mut tar::Entry<'_, Box<dyn Read>>, &Path) -> Result<(), ImageError>,
) -> Result<(), ImageError> {
    let file = fs::File::open(blob).map_err(ImageError::io(format!("open {}", blob.display())))?;
    let reader = BufReader::new(file);
    let stream: Box<dyn Read> = match compression {
        Compression::None => Box::new(reader),
        Compression::Gzip => Box::new(flate2::read::GzDecoder::new(reader)),
    };
    let mut archive = tar::Archive::new(stream);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_preserve_mtime(true);
    archive.set_unpack_xattrs(false);
    archive.set_overwrite(true);
    let entries = archive
        .entries()
        .map_err(ImageError::io(format!("read layer {layer}")))?;
    for entry in entries {
        let mut entry = entry.map_err(ImageError::io(format!("read layer {layer}")))?;
        let raw = entry
            .path()
            .map_err(ImageError::io(format!("read a path of layer {layer}")))?
            .into_owned();
        let path = relative(&raw).ok_or_else(|| hostile(layer, &raw, "path with '..'"))?;
        each(&mut entry, &path)?;
    }
    Ok(())
}

/// `path` without its leading `/` and `.` parts, or `None` when it has a `..` part.
fn relative(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::Prefix(_) | Component::RootDir | Component::CurDir => {}
            Component::ParentDir => return None,
            Component::Normal(p) => out.push(p),
        }
    }
    Some(out)
}

/// Where `dir` (relative, without `..`) of the image lands under `root`, following the
/// symlinks earlier entries made as the sandbox will see them: an absolute target starts again
/// at `root`, a `..` never climbs above it (as `chroot` would resolve them; Docker's
/// `FollowSymlinkInScope` does the same). The result is always inside `root`; parts that do not
/// exist yet are appended as they are.
///
/// Errors: [`ImageError::Hostile`] past [`MAX_SYMLINK_HOPS`] symlinks (a loop).
fn resolve_in_root(root: &Path, dir: &Path, layer: &str) -> Result<PathBuf, ImageError> {
    let mut resolved = PathBuf::new(); // relative to root, never with `..`
    let mut pending: Vec<std::ffi::OsString> = dir
        .components()
        .rev()
        .filter_map(|c| match c {
            Component::Normal(p) => Some(p.to_owned()),
            _ => None,
        })
        .collect();
    let mut hops = 0;
    while let Some(part) = pending.pop() {
        if part == ".." {
            resolved.pop();
            continue;
        }
        if part == "." || part.is_empty() {
            continue;
        }
        let candidate = root.join(&resolved).join(&part);
        match fs::symlink_metadata(&candidate) {
            Ok(m) if m.file_type().is_symlink() => {
                hops += 1;
                if hops > MAX_SYMLINK_HOPS {
                    return Err(hostile(layer, dir, "too many symlinks (a loop)"));
                }
                let target = fs::read_link(&candidate)
                    .map_err(ImageError::io(format!("read link {}", candidate.display())))?;
                if target.is_absolute() {
                    resolved = PathBuf::new();
                }
                pending.extend(target.components().rev().filter_map(|c| match c {
                    Component::Normal(p) => Some(p.to_owned()),
                    Component::ParentDir => Some("..".into()),
                    _ => None,
                }));
            }
            _ => resolved.push(&part),
        }
    }
    Ok(root.join(resolved))
}

/// The most symlinks followed to resolve one path (Linux's `MAXSYMLINKS`).
pub const MAX_SYMLINK_HOPS: usize = 40;

/// Removes `path` whatever it is (a directory with its contents), never following a symlink;
/// a missing path is fine.
fn remove(path: &Path) -> Result<(), ImageError> {
    let removed = match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(_) => Ok(()),
    };
    removed.map_err(ImageError::io(format!("remove {}", path.display())))
}

fn hostile(layer: &str, path: &Path, reason: &str) -> ImageError {
    ImageError::Hostile {
        layer: layer.to_owned(),
        path: path.display().to_string(),
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
#[path = "unpack_tests.rs"]
mod tests;
