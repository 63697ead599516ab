//! Capturing trees into a staged snapshot: walk the upper dir (and a memory checkpoint), cut
//! regular files into chunks, and compress into a staging directory only the chunks the
//! parent snapshot does not already reference. This is the part that runs while a sandbox is
//! frozen, so it reads only what changed: a file whose size and change key (inode, ctime,
//! mtime) match its entry in the parent is taken from the parent without being read.
//! [`crate::upload`] sends the staged chunks after the sandbox is thawed.
//!
//! Sockets are skipped (nothing can be restored into them); devices other than overlay
//! whiteouts and names that are not UTF-8 fail the capture ([`StorageError::Unsupported`]).
//! Hard links within a tree are kept: the first name of an inode (in walk order) is its `file`
//! entry, every other name a `hard_link` entry naming it, and a restore links them again
//! (manifest format 2, written only when a tree holds one). A link to a file outside the tree
//! is captured as a file of its own.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::chunk;
use crate::error::{Result, StorageError};
use crate::manifest::{
    ChunkRef, Entry, EntryKind, Holds, Manifest, Sizes, SnapshotInfo, Tree, TreeKind, CHUNK_BYTES,
    MANIFEST_FORMAT_V1,
};

/// The overlayfs xattr that marks a directory opaque.
pub(crate) const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// One tree to capture.
#[derive(Debug, Clone)]
pub struct TreeSource {
    /// Which tree it is.
    pub kind: TreeKind,
    /// Its root directory on the host (not itself an entry).
    pub root: PathBuf,
}

/// A snapshot captured locally, not yet durable: its manifest and the compressed chunks it
/// adds, in its own staging directory (removed when this is dropped).
#[derive(Debug)]
pub struct Staged {
    /// The manifest to write once every new chunk is stored.
    pub manifest: Manifest,
    pub(crate) dir: PathBuf,
    /// Chunks to upload: hash and compressed size in bytes.
    pub(crate) new_chunks: Vec<(String, u64)>,
}

impl Staged {
    /// The chunks this snapshot adds over its parent (hash, compressed bytes).
    pub fn new_chunks(&self) -> &[(String, u64)] {
        &self.new_chunks
    }

    pub(crate) fn chunk_path(&self, hash: &str) -> PathBuf {
        self.dir.join(format!("{hash}.zst"))
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Captures `sources` (a [`TreeKind::Disk`] one is required; [`TreeKind::Memory`] optional)
/// into `staging_root/<snapshot id>`, incremental against `parent` when given. Blocking: call
/// it from `spawn_blocking`.
///
/// Errors: [`StorageError::Io`] reading the trees or writing the staging dir,
/// [`StorageError::Unsupported`] for what an artifact cannot carry. The staging dir is removed
/// on every error.
pub fn stage(
    info: SnapshotInfo,
    sources: &[TreeSource],
    parent: Option<&Manifest>,
    staging_root: &Path,
) -> Result<Staged> {
    let dir = staging_root.join(info.snapshot_id.to_string());
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).map_err(StorageError::io("create", &dir))?;
    let mut staged = Staged {
        manifest: Manifest {
            format: MANIFEST_FORMAT_V1,
            info,
            holds: Holds::Disk,
            chunk_bytes: CHUNK_BYTES as u32,
            disk: Tree::default(),
            memory: None,
            sizes: Sizes::default(),
        },
        dir,
        new_chunks: Vec::new(),
    };
    let mut known: HashMap<String, u32> = HashMap::new();
    let mut previous: HashMap<(TreeKind, &str), &Entry> = HashMap::new();
    if let Some(p) = parent {
        for kind in [TreeKind::Disk, TreeKind::Memory] {
            for e in p
                .tree(kind)
                .map(|t| t.entries.as_slice())
                .unwrap_or_default()
            {
                previous.insert((kind, e.path.as_str()), e);
                if let EntryKind::File { chunks, .. } = &e.kind {
                    known.extend(chunks.iter().map(|c| (c.sha256.clone(), c.stored)));
                }
            }
        }
    }
    let from_parent: std::collections::HashSet<String> = known.keys().cloned().collect();
    let mut walker = Walker {
        staged: &mut staged,
        known: &mut known,
        previous: &previous,
        kind: TreeKind::Disk,
        links: HashMap::new(),
    };
    let mut disk = None;
    let mut memory = None;
    for source in sources {
        walker.kind = source.kind;
        walker.links.clear();
        let mut entries = Vec::new();
        walker.walk(&source.root, "", &mut entries)?;
        match source.kind {
            TreeKind::Disk => disk = Some(Tree { entries }),
            TreeKind::Memory => memory = Some(Tree { entries }),
        }
    }
    let m = &mut staged.manifest;
    m.disk = disk.ok_or_else(|| StorageError::NoSuchTree {
        snapshot: m.info.snapshot_id,
        tree: "disk",
    })?;
    m.holds = if memory.is_some() {
        Holds::DiskAndMemory
    } else {
        Holds::Disk
    };
    m.memory = memory;
    let mut sizes = Sizes::default();
    for tree in std::iter::once(&m.disk).chain(m.memory.as_ref()) {
        for e in &tree.entries {
            if let EntryKind::File { size, .. } = e.kind {
                sizes.logical_bytes += size;
            }
        }
    }
    for hash in m.chunk_hashes() {
        let stored = u64::from(known[hash]);
        sizes.stored_bytes += stored;
        if !from_parent.contains(hash) {
            sizes.new_bytes += stored;
        }
    }
    m.sizes = sizes;
    m.format = m.needed_format();
    Ok(staged)
}

struct Walker<'a, 'p> {
    staged: &'a mut Staged,
    known: &'a mut HashMap<String, u32>,
    previous: &'a HashMap<(TreeKind, &'p str), &'p Entry>,
    kind: TreeKind,
    /// The first path seen in this tree of each inode with more than one name, by
    /// `(device, inode)`.
    links: HashMap<(u64, u64), String>,
}

impl Walker<'_, '_> {
    fn walk(&mut self, dir: &Path, rel: &str, out: &mut Vec<Entry>) -> Result<()> {
        let mut names: Vec<_> = fs::read_dir(dir)
            .map_err(StorageError::io("read", dir))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<std::io::Result<_>>()
            .map_err(StorageError::io("read", dir))?;
        names.sort();
        for name in names {
            let path = dir.join(&name);
            let name = name.to_str().ok_or_else(|| StorageError::Unsupported {
                path: path.clone(),
                reason: "the name is not UTF-8".into(),
            })?;
            let rel = if rel.is_empty() {
                name.to_owned()
            } else {
                format!("{rel}/{name}")
            };
            let meta = fs::symlink_metadata(&path).map_err(StorageError::io("stat", &path))?;
            let ft = meta.file_type();
            let kind = if ft.is_dir() {
                let opaque = matches!(xattr::get(&path, OPAQUE_XATTR), Ok(Some(v)) if v == b"y");
                EntryKind::Dir { opaque }
            } else if ft.is_file() && meta.nlink() > 1 {
                match self.links.get(&(meta.dev(), meta.ino())) {
                    Some(first) => EntryKind::HardLink {
                        target: first.clone(),
                    },
                    None => {
                        self.links.insert((meta.dev(), meta.ino()), rel.clone());
                        self.file(&path, &rel, &meta)?
                    }
                }
            } else if ft.is_file() {
                self.file(&path, &rel, &meta)?
            } else if ft.is_symlink() {
                let target = fs::read_link(&path).map_err(StorageError::io("readlink", &path))?;
                let target = target.into_os_string().into_string().map_err(|_| {
                    StorageError::Unsupported {
                        path: path.clone(),
                        reason: "the link target is not UTF-8".into(),
                    }
                })?;
                EntryKind::Symlink { target }
            } else if ft.is_char_device() && meta.rdev() == 0 {
                EntryKind::Whiteout
            } else if ft.is_fifo() {
                EntryKind::Fifo
            } else if ft.is_socket() {
                continue;
            } else {
                return Err(StorageError::Unsupported {
                    path,
                    reason: "a device".into(),
                });
            };
            let is_dir = matches!(kind, EntryKind::Dir { .. });
            out.push(Entry {
                path: rel.clone(),
                mode: meta.mode() & 0o7777,
                uid: meta.uid(),
                gid: meta.gid(),
                mtime_ns: meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
                kind,
            });
            if is_dir {
                self.walk(&path, &rel, out)?;
            }
        }
        Ok(())
    }

    fn file(&mut self, path: &Path, rel: &str, meta: &fs::Metadata) -> Result<EntryKind> {
        let change_key = (
            meta.ino(),
            meta.ctime() * 1_000_000_000 + meta.ctime_nsec(),
            meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
        );
        if let Some(Entry {
            kind:
                kind @ EntryKind::File {
                    size,
                    change_key: k,
                    ..
                },
            ..
        }) = self.previous.get(&(self.kind, rel)).copied()
        {
            if *k == change_key && *size == meta.len() {
                return Ok(kind.clone());
            }
        }
        let mut f = File::options()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(path)
            .map_err(StorageError::io("open", path))?;
        let mut whole = Sha256::new();
        let mut chunks = Vec::new();
        let mut size = 0u64;
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            let n = read_full(&mut f, &mut buf).map_err(StorageError::io("read", path))?;
            if n == 0 {
                break;
            }
            let data = &buf[..n];
            whole.update(data);
            size += n as u64;
            let sha256 = chunk::sha256_hex(data);
            let stored = match self.known.get(&sha256) {
                Some(s) => *s,
                None => {
                    let packed = chunk::encode(data);
                    let dest = self.staged.chunk_path(&sha256);
                    fs::write(&dest, &packed).map_err(StorageError::io("write", &dest))?;
                    let s = packed.len() as u32;
                    self.known.insert(sha256.clone(), s);
                    self.staged.new_chunks.push((sha256.clone(), u64::from(s)));
                    s
                }
            };
            chunks.push(ChunkRef {
                sha256,
                len: n as u32,
                stored,
            });
            if n < CHUNK_BYTES {
                break;
            }
        }
        Ok(EntryKind::File {
            size,
            sha256: hex::encode(whole.finalize()),
            chunks,
            change_key,
        })
    }
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
