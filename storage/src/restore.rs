//! Reading a snapshot back: its manifest, and a tree of it rebuilt into an empty directory,
//! each chunk taken from the host's [`ChunkCache`] when held, else fetched from the object
//! store, checked against its hash, and kept in the cache.
//!
//! Guarantees: every file is checked against its chunks' hashes and its whole-file hash; the
//! tree is written below `dest` only (paths are plain relative ones, every parent is a
//! directory this restore made, files are created new with `O_NOFOLLOW`, so a symlink in the
//! snapshot is never followed, and a hard link only joins a file this restore wrote); owners,
//! modes, mtimes, whiteouts, opaque directories and hard links are restored as captured.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use berth_schemas::ids::SnapshotId;
use nix::sys::stat::{mknod, utimensat, Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::{fchownat, mkfifo, Gid, Uid};
use sha2::{Digest, Sha256};

use crate::cache::ChunkCache;
use crate::capture::OPAQUE_XATTR;
use crate::chunk;
use crate::error::{Result, StorageError};
use crate::manifest::{EntryKind, Manifest, TreeKind};
use crate::store::Objects;

/// What a restore read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FetchReport {
    /// Chunks fetched from the object store.
    pub chunks_fetched: u64,
    /// Compressed bytes fetched from the object store.
    pub bytes_fetched: u64,
    /// Chunk reads the host cache served.
    pub chunks_from_cache: u64,
}

/// Whether the snapshot's manifest is stored, i.e. the snapshot is durable.
///
/// Errors: [`StorageError::Store`].
pub async fn is_durable(objects: &Objects, id: SnapshotId) -> Result<bool> {
    objects.exists(&Objects::manifest_key(id)).await
}

/// The snapshot's manifest, checked ([`Manifest::from_json`]).
///
/// Errors: [`StorageError::NotFound`] when it is not stored, [`StorageError::BadManifest`],
/// [`StorageError::Store`].
pub async fn fetch_manifest(objects: &Objects, id: SnapshotId) -> Result<Manifest> {
    let body = objects
        .get(&Objects::manifest_key(id))
        .await?
        .ok_or(StorageError::NotFound(id))?;
    Manifest::from_json(id, &body)
}

/// The chunks `manifest` names that the store does not hold whole: missing, or of another
/// size than the manifest's `stored` length for it (truncated or replaced), one `HEAD` per
/// distinct chunk, [`crate::upload::UPLOAD_CONCURRENCY`] at once, in the manifest's order;
/// empty when the snapshot is whole. A manifest that reads back proves only that its upload
/// finished: a chunk the upload skipped because the store held it may have been removed or
/// damaged since (a snapshot delete's chunk removal, issue 14), and only this look says so
/// before a host frees the disk it was captured from or reuses it. The size is what the store
/// confirms without reading the object; a chunk of the right size but wrong bytes is caught
/// by the hash check of every read ([`materialize`]).
///
/// Errors: [`StorageError::Store`].
pub async fn missing_chunks(objects: &Objects, manifest: &Manifest) -> Result<Vec<String>> {
    use futures::StreamExt;
    let looks = manifest
        .distinct_chunks()
        .into_iter()
        .map(|(hash, stored)| {
            let objects = objects.clone();
            async move {
                let size = objects.size(&Objects::chunk_key(&hash)).await?;
                Ok::<_, StorageError>((size != Some(u64::from(stored))).then_some(hash))
            }
        });
    let found: Vec<Option<String>> = futures::stream::iter(looks)
        .buffered(crate::upload::UPLOAD_CONCURRENCY)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    Ok(found.into_iter().flatten().collect())
}

/// Rebuilds the `kind` tree of `manifest` into `dest`, which must be missing or empty.
///
/// Errors: [`StorageError::NoSuchTree`], [`StorageError::Corrupt`] (a chunk or file that does
/// not match its hash, or a chunk missing from the store), [`StorageError::Io`] (including a
/// `dest` that is not empty), [`StorageError::BadManifest`] for an entry whose parent is not a
/// directory of the tree, [`StorageError::Store`]. On error `dest` holds a partial tree that
/// the caller removes.
pub async fn materialize(
    objects: &Objects,
    cache: &Arc<ChunkCache>,
    manifest: &Manifest,
    kind: TreeKind,
    dest: &Path,
) -> Result<FetchReport> {
    let snapshot = manifest.info.snapshot_id;
    let tree = manifest
        .tree(kind)
        .ok_or(StorageError::NoSuchTree {
            snapshot,
            tree: kind.name(),
        })?
        .clone();
    let (objects, cache, dest) = (objects.clone(), cache.clone(), dest.to_owned());
    let handle = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        fs::create_dir_all(&dest).map_err(StorageError::io("create", &dest))?;
        if fs::read_dir(&dest)
            .map_err(StorageError::io("read", &dest))?
            .next()
            .is_some()
        {
            return Err(StorageError::io("restore into", &dest)(
                std::io::Error::from(std::io::ErrorKind::DirectoryNotEmpty),
            ));
        }
        let mut report = FetchReport::default();
        let mut dirs: HashSet<&str> = HashSet::new();
        let mut files: HashSet<&str> = HashSet::new();
        for e in &tree.entries {
            crate::manifest::check_path(&e.path).map_err(|r| StorageError::BadManifest {
                snapshot,
                reason: format!("{:?}: {r}", e.path),
            })?;
            let parent = e.path.rsplit_once('/').map_or("", |(p, _)| p);
            if !parent.is_empty() && !dirs.contains(parent) {
                return Err(StorageError::BadManifest {
                    snapshot,
                    reason: format!("{:?} has no directory", e.path),
                });
            }
            let path = dest.join(&e.path);
            match &e.kind {
                EntryKind::Dir { opaque } => {
                    fs::create_dir(&path).map_err(StorageError::io("create", &path))?;
                    if *opaque {
                        xattr::set(&path, OPAQUE_XATTR, b"y")
                            .map_err(StorageError::io("set opaque on", &path))?;
                    }
                    dirs.insert(&e.path);
                }
                EntryKind::File {
                    size,
                    sha256,
                    chunks,
                    ..
                } => {
                    let mut f = File::options()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .custom_flags(nix::libc::O_NOFOLLOW)
                        .open(&path)
                        .map_err(StorageError::io("create", &path))?;
                    let mut whole = Sha256::new();
                    for c in chunks {
                        let stored = match cache.get(&c.sha256) {
                            Some(b) => {
                                report.chunks_from_cache += 1;
                                b
                            }
                            None => {
                                let key = Objects::chunk_key(&c.sha256);
                                let b = handle.block_on(objects.get(&key))?.ok_or_else(|| {
                                    StorageError::Corrupt {
                                        hash: c.sha256.clone(),
                                        reason: "missing from the object store".into(),
                                    }
                                })?;
                                report.chunks_fetched += 1;
                                report.bytes_fetched += b.len() as u64;
                                b
                            }
                        };
                        let data = chunk::decode(&c.sha256, c.len, &stored)?;
                        cache.insert(&c.sha256, &stored)?;
                        whole.update(&data);
                        f.write_all(&data)
                            .map_err(StorageError::io("write", &path))?;
                    }
                    if hex::encode(whole.finalize()) != *sha256 {
                        return Err(StorageError::Corrupt {
                            hash: sha256.clone(),
                            reason: format!("{} of {size} bytes", e.path),
                        });
                    }
                    files.insert(&e.path);
                }
                EntryKind::HardLink { target } => {
                    if !files.contains(target.as_str()) {
                        return Err(StorageError::BadManifest {
                            snapshot,
                            reason: format!("{:?} links to {target:?}, no file before it", e.path),
                        });
                    }
                    fs::hard_link(dest.join(target), &path)
                        .map_err(StorageError::io("link", &path))?;
                }
                EntryKind::Symlink { target } => {
                    std::os::unix::fs::symlink(target, &path)
                        .map_err(StorageError::io("symlink", &path))?;
                }
                EntryKind::Whiteout => {
                    mknod(&path, SFlag::S_IFCHR, Mode::empty(), 0)
                        .map_err(|e| StorageError::io("mknod", &path)(e.into()))?;
                }
                EntryKind::Fifo => {
                    mkfifo(&path, Mode::empty())
                        .map_err(|e| StorageError::io("mkfifo", &path)(e.into()))?;
                }
            }
            fchownat(
                nix::fcntl::AT_FDCWD,
                &path,
                Some(Uid::from_raw(e.uid)),
                Some(Gid::from_raw(e.gid)),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(|err| StorageError::io("chown", &path)(err.into()))?;
            if !matches!(e.kind, EntryKind::Symlink { .. }) {
                fs::set_permissions(&path, fs::Permissions::from_mode(e.mode))
                    .map_err(StorageError::io("chmod", &path))?;
            }
        }
        // Times last, deepest first, so writing a child does not move its directory's mtime.
        for e in tree.entries.iter().rev() {
            let path = dest.join(&e.path);
            let t = TimeSpec::new(
                e.mtime_ns.div_euclid(1_000_000_000),
                e.mtime_ns.rem_euclid(1_000_000_000),
            );
            utimensat(
                nix::fcntl::AT_FDCWD,
                &path,
                &t,
                &t,
                UtimensatFlags::NoFollowSymlink,
            )
            .map_err(|err| StorageError::io("set times on", &path)(err.into()))?;
        }
        Ok(report)
    })
    .await
    .map_err(|e| StorageError::Task(e.to_string()))?
}
