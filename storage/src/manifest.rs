//! The snapshot manifest: what a snapshot is and holds, and the list of chunks its trees are
//! made of. Stored as JSON at `manifests/<snapshot id>.json`, written after every chunk it
//! names, so its presence means the snapshot is durable. The format is documented in
//! ARCHITECTURE.md ("Snapshot artifacts").

use std::collections::BTreeSet;
use std::path::{Component, Path};

use berth_schemas::ids::{SandboxId, SnapshotId};
use berth_schemas::wire::Runtime;
use serde::{Deserialize, Serialize};

use crate::error::{Result, StorageError};

/// The newest manifest format this code writes and reads: format 1 plus
/// [`EntryKind::HardLink`]. A manifest is written in the oldest format that describes it
/// ([`Manifest::needed_format`]), so a snapshot without hard links stays readable by a host of
/// an older build; a manifest of a format outside [`MANIFEST_FORMATS`] is refused.
pub const MANIFEST_FORMAT: u32 = 2;
/// The first format: every entry kind but [`EntryKind::HardLink`].
pub const MANIFEST_FORMAT_V1: u32 = 1;
/// The formats this code reads.
pub const MANIFEST_FORMATS: std::ops::RangeInclusive<u32> = MANIFEST_FORMAT_V1..=MANIFEST_FORMAT;
/// Files are cut into chunks of this many bytes (the last one shorter). Fixed-size chunks keep
/// an in-place write to a large file (a disk image, a memory checkpoint) to the chunks it
/// touched.
pub const CHUNK_BYTES: usize = 4 << 20;

/// A snapshot's identity and what the sandbox was, filled in by the caller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotInfo {
    /// The snapshot.
    pub snapshot_id: SnapshotId,
    /// The sandbox it was taken of.
    pub sandbox_id: SandboxId,
    /// The template the sandbox was created from (its name as the API shows it).
    pub template: String,
    /// The runtime the sandbox ran in.
    pub runtime: Runtime,
    /// Whole vCPUs.
    pub vcpus: u32,
    /// Memory in MiB.
    pub memory_mib: u32,
    /// Disk limit in MiB.
    pub disk_mib: u32,
    /// The snapshot this one is incremental against, if any.
    pub parent: Option<SnapshotId>,
}

/// Which of a snapshot's trees: the sandbox's upper dir, or its memory checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TreeKind {
    /// The overlay upper dir: every file the sandbox changed against its template.
    Disk,
    /// A `runsc checkpoint` image directory (gVisor only).
    Memory,
}

impl TreeKind {
    /// The name used in errors and docs.
    pub fn name(self) -> &'static str {
        match self {
            TreeKind::Disk => "disk",
            TreeKind::Memory => "memory",
        }
    }
}

/// What a snapshot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Holds {
    /// Files only: a restore cold-boots them.
    Disk,
    /// Files and a memory checkpoint: a restore continues the processes.
    DiskAndMemory,
}

/// One chunk of a file: the SHA-256 of its uncompressed bytes (its name) and its sizes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkRef {
    /// SHA-256 of the uncompressed bytes, lowercase hex.
    pub sha256: String,
    /// Uncompressed length in bytes (at most [`CHUNK_BYTES`]).
    pub len: u32,
    /// Stored (zstd-compressed) length in bytes.
    pub stored: u32,
}

/// What a tree entry is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EntryKind {
    /// A directory; `opaque` is overlayfs's `trusted.overlay.opaque=y` (it hides the lower dir).
    Dir {
        /// Whether the directory is opaque.
        opaque: bool,
    },
    /// A regular file.
    File {
        /// Length in bytes.
        size: u64,
        /// SHA-256 of the whole file, lowercase hex.
        sha256: String,
        /// Its chunks in order.
        chunks: Vec<ChunkRef>,
        /// Change key `(inode, ctime ns, mtime ns)` on the host that captured it: a later
        /// snapshot of the same upper dir reuses this entry without reading a file whose key
        /// and size did not change.
        change_key: (u64, i64, i64),
    },
    /// A symbolic link.
    Symlink {
        /// The link's target, as stored (never followed on capture or restore).
        target: String,
    },
    /// An overlayfs whiteout (a 0:0 character device): the file was deleted from the lower dir.
    Whiteout,
    /// A named pipe (recreated empty).
    Fifo,
    /// Another name of a regular file listed earlier in the same tree (a hard link: both
    /// names are one inode, restored as one). Format 2 on.
    HardLink {
        /// The `path` of that earlier `file` entry.
        target: String,
    },
}

/// One file, directory, link or whiteout in a tree. (Its fields and its kind's share one JSON
/// object; serde cannot refuse unknown fields across a flattened enum, so an entry ignores
/// them, while every other struct of the manifest refuses them.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Relative path, `/`-separated, only normal components.
    pub path: String,
    /// Permission bits (and setuid/setgid/sticky).
    pub mode: u32,
    /// Owner uid as seen on the host (a runc sandbox's ids are shifted by its user namespace).
    pub uid: u32,
    /// Owner gid as seen on the host.
    pub gid: u32,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// What it is.
    #[serde(flatten)]
    pub kind: EntryKind,
}

/// A tree: its entries, parents before children.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tree {
    /// Entries in walk order (a directory before what it holds).
    pub entries: Vec<Entry>,
}

/// Sizes in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sizes {
    /// Sum of the regular files' lengths across all trees.
    pub logical_bytes: u64,
    /// Compressed bytes of the distinct chunks this snapshot references.
    pub stored_bytes: u64,
    /// Compressed bytes of the chunks its parent did not reference (what it added).
    pub new_bytes: u64,
}

/// A snapshot's manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The format it is written in: [`Manifest::needed_format`], one of [`MANIFEST_FORMATS`].
    pub format: u32,
    /// Who and what.
    pub info: SnapshotInfo,
    /// What it holds (memory exactly when `memory` is present).
    pub holds: Holds,
    /// The chunk size the files were cut with.
    pub chunk_bytes: u32,
    /// The upper dir.
    pub disk: Tree,
    /// The memory checkpoint, on gVisor.
    pub memory: Option<Tree>,
    /// Sizes.
    pub sizes: Sizes,
}

impl Manifest {
    /// The tree of `kind`, if this snapshot holds it.
    pub fn tree(&self, kind: TreeKind) -> Option<&Tree> {
        match kind {
            TreeKind::Disk => Some(&self.disk),
            TreeKind::Memory => self.memory.as_ref(),
        }
    }

    /// Every distinct chunk hash the snapshot references.
    pub fn chunk_hashes(&self) -> BTreeSet<&str> {
        self.trees()
            .flat_map(|t| t.entries.iter())
            .filter_map(|e| match &e.kind {
                EntryKind::File { chunks, .. } => Some(chunks.iter().map(|c| c.sha256.as_str())),
                _ => None,
            })
            .flatten()
            .collect()
    }

    /// Every distinct chunk the snapshot references, once each, in the order the trees list
    /// them: `(sha256, stored bytes)` (what a host reports so the control plane knows which
    /// chunks a snapshot or a durable stop holds on to).
    pub fn distinct_chunks(&self) -> Vec<(String, u32)> {
        let mut seen = std::collections::HashSet::new();
        self.trees()
            .flat_map(|t| t.entries.iter())
            .filter_map(|e| match &e.kind {
                EntryKind::File { chunks, .. } => Some(chunks.iter()),
                _ => None,
            })
            .flatten()
            .filter(|c| seen.insert(c.sha256.as_str()))
            .map(|c| (c.sha256.clone(), c.stored))
            .collect()
    }

    /// The oldest format that describes this manifest: [`MANIFEST_FORMAT`] when a tree holds a
    /// hard link, else [`MANIFEST_FORMAT_V1`].
    pub fn needed_format(&self) -> u32 {
        let linked = self
            .trees()
            .flat_map(|t| t.entries.iter())
            .any(|e| matches!(e.kind, EntryKind::HardLink { .. }));
        if linked {
            MANIFEST_FORMAT
        } else {
            MANIFEST_FORMAT_V1
        }
    }

    fn trees(&self) -> impl Iterator<Item = &Tree> {
        std::iter::once(&self.disk).chain(self.memory.as_ref())
    }

    /// Serializes for storage.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a manifest always serializes")
    }

    /// Parses and checks a stored manifest: the format version (format 1 holds no hard link),
    /// that it is the snapshot asked for, that `holds` matches its trees, that every path is
    /// relative with only normal components and every entry's parent is a directory listed
    /// before it, that every hard link names a file listed before it in its tree, and that
    /// every chunk hash is 64 hex digits no longer than the chunk size.
    ///
    /// Errors: [`StorageError::BadManifest`].
    pub fn from_json(expected: SnapshotId, body: &[u8]) -> Result<Manifest> {
        let bad = |reason: String| StorageError::BadManifest {
            snapshot: expected,
            reason,
        };
        let m: Manifest = serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
        if !MANIFEST_FORMATS.contains(&m.format) {
            return Err(bad(format!(
                "format {} (this build reads {MANIFEST_FORMAT_V1} to {MANIFEST_FORMAT})",
                m.format
            )));
        }
        if m.info.snapshot_id != expected {
            return Err(bad(format!("it names snapshot {}", m.info.snapshot_id)));
        }
        if (m.holds == Holds::DiskAndMemory) != m.memory.is_some() {
            return Err(bad("`holds` does not match its trees".into()));
        }
        if m.chunk_bytes == 0 || m.chunk_bytes as usize > CHUNK_BYTES {
            return Err(bad(format!("chunk size {}", m.chunk_bytes)));
        }
        for tree in m.trees() {
            let mut dirs: BTreeSet<&str> = BTreeSet::new();
            let mut files: BTreeSet<&str> = BTreeSet::new();
            for e in &tree.entries {
                check_path(&e.path).map_err(|r| bad(format!("{:?}: {r}", e.path)))?;
                let parent = e.path.rsplit_once('/').map_or("", |(p, _)| p);
                if !parent.is_empty() && !dirs.contains(parent) {
                    return Err(bad(format!("{:?} comes before its directory", e.path)));
                }
                match &e.kind {
                    EntryKind::Dir { .. } => {
                        dirs.insert(&e.path);
                    }
                    EntryKind::File {
                        size,
                        chunks,
                        sha256,
                        ..
                    } => {
                        let total: u64 = chunks.iter().map(|c| u64::from(c.len)).sum();
                        let hex_ok =
                            |h: &str| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit());
                        if total != *size
                            || !hex_ok(sha256)
                            || chunks
                                .iter()
                                .any(|c| !hex_ok(&c.sha256) || c.len > m.chunk_bytes)
                        {
                            return Err(bad(format!(
                                "{:?}: chunks do not add up to the file",
                                e.path
                            )));
                        }
                        files.insert(&e.path);
                    }
                    EntryKind::HardLink { target } => {
                        if m.format < MANIFEST_FORMAT {
                            return Err(bad(format!(
                                "{:?}: a hard link in a format {} manifest",
                                e.path, m.format
                            )));
                        }
                        if !files.contains(target.as_str()) {
                            return Err(bad(format!(
                                "{:?}: a hard link to {target:?}, which is not a file before it",
                                e.path
                            )));
                        }
                    }
                    EntryKind::Symlink { .. } | EntryKind::Whiteout | EntryKind::Fifo => {}
                }
            }
        }
        Ok(m)
    }
}

/// A path an entry may have: relative, `/`-separated, only normal components, UTF-8.
pub(crate) fn check_path(path: &str) -> Result<(), &'static str> {
    if path.is_empty() || path.contains('\0') {
        return Err("empty or has a NUL");
    }
    if Path::new(path)
        .components()
        .any(|c| !matches!(c, Component::Normal(_)))
        || path.split('/').any(str::is_empty)
    {
        return Err("not a plain relative path");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(entries: Vec<Entry>) -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT,
            info: SnapshotInfo {
                snapshot_id: SnapshotId::new(),
                sandbox_id: SandboxId::new(),
                template: "base".into(),
                runtime: Runtime::Runc,
                vcpus: 1,
                memory_mib: 256,
                disk_mib: 1024,
                parent: None,
            },
            holds: Holds::Disk,
            chunk_bytes: CHUNK_BYTES as u32,
            disk: Tree { entries },
            memory: None,
            sizes: Sizes::default(),
        }
    }

    fn entry(path: &str, kind: EntryKind) -> Entry {
        Entry {
            path: path.into(),
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime_ns: 0,
            kind,
        }
    }

    #[test]
    fn a_manifest_round_trips_and_a_tampered_one_is_refused() {
        let m = manifest(vec![
            entry("etc", EntryKind::Dir { opaque: false }),
            entry(
                "etc/hosts",
                EntryKind::Symlink {
                    target: "/x".into(),
                },
            ),
        ]);
        let id = m.info.snapshot_id;
        assert_eq!(Manifest::from_json(id, &m.to_json()).unwrap(), m);
        assert!(
            Manifest::from_json(SnapshotId::new(), &m.to_json()).is_err(),
            "another snapshot's manifest"
        );
        for path in ["../etc", "/etc", "etc/../../x", "a//b", "", "./a"] {
            let m = manifest(vec![entry(path, EntryKind::Whiteout)]);
            assert!(Manifest::from_json(id, &m.to_json()).is_err(), "{path:?}");
        }
        let orphan = manifest(vec![entry("nodir/file", EntryKind::Whiteout)]);
        assert!(Manifest::from_json(orphan.info.snapshot_id, &orphan.to_json()).is_err());
        let lying = manifest(vec![entry(
            "f",
            EntryKind::File {
                size: 10,
                sha256: "0".repeat(64),
                chunks: vec![],
                change_key: (0, 0, 0),
            },
        )]);
        assert!(Manifest::from_json(lying.info.snapshot_id, &lying.to_json()).is_err());
    }

    fn file(path: &str) -> Entry {
        entry(
            path,
            EntryKind::File {
                size: 0,
                sha256: "0".repeat(64),
                chunks: vec![],
                change_key: (0, 0, 0),
            },
        )
    }

    fn link(path: &str, target: &str) -> Entry {
        entry(
            path,
            EntryKind::HardLink {
                target: target.into(),
            },
        )
    }

    #[test]
    fn a_format_1_manifest_written_before_hard_links_still_reads() {
        let mut old = manifest(vec![entry("etc", EntryKind::Dir { opaque: false })]);
        old.format = MANIFEST_FORMAT_V1;
        let id = old.info.snapshot_id;
        // As an older build wrote it: no `hard_link` kind anywhere.
        let json = String::from_utf8(old.to_json()).unwrap();
        assert!(json.contains("\"format\":1"), "{json}");
        assert_eq!(Manifest::from_json(id, json.as_bytes()).unwrap(), old);
        assert_eq!(old.needed_format(), MANIFEST_FORMAT_V1, "no link: format 1");
        let mut future = old.clone();
        future.format = MANIFEST_FORMAT + 1;
        assert!(Manifest::from_json(id, &future.to_json()).is_err());
    }

    #[test]
    fn a_hard_link_needs_format_2_and_a_file_before_it_in_its_tree() {
        let m = manifest(vec![
            entry("d", EntryKind::Dir { opaque: false }),
            file("d/a"),
            link("d/b", "d/a"),
        ]);
        let id = m.info.snapshot_id;
        assert_eq!(m.needed_format(), MANIFEST_FORMAT);
        assert_eq!(Manifest::from_json(id, &m.to_json()).unwrap(), m);
        let mut as_v1 = m.clone();
        as_v1.format = MANIFEST_FORMAT_V1;
        assert!(
            Manifest::from_json(id, &as_v1.to_json()).is_err(),
            "format 1 has no hard links"
        );
        for entries in [
            vec![link("b", "a"), file("a")],
            vec![entry("a", EntryKind::Dir { opaque: false }), link("b", "a")],
            vec![file("a"), link("b", "nowhere")],
            vec![file("a"), link("b", "../a")],
        ] {
            let bad = manifest(entries);
            assert!(
                Manifest::from_json(bad.info.snapshot_id, &bad.to_json()).is_err(),
                "{:?}",
                bad.disk.entries
            );
        }
    }
}
