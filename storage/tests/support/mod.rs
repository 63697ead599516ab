//! What the storage tests share: the two stores behind one [`Backend`], a real S3 server
//! (`s3s-fs`) started per test, and tree builders and comparers.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use berth_schemas::ids::{SandboxId, SnapshotId};
use berth_schemas::wire::Runtime;
use berth_storage::{Location, Objects, RetrySettings, SnapshotInfo, StoreSettings};
use rand::RngCore;

/// The S3 server the root package's tests start too (one starter for both).
#[path = "../../../tests/support/s3.rs"]
mod s3;
pub use s3::{S3Server, ACCESS_KEY, BUCKET, SECRET_KEY};

/// A scratch directory below `BERTH_TEST_ROOT` (or the system temp dir), removed on drop.
pub fn scratch() -> tempfile::TempDir {
    let root = std::env::var_os("BERTH_TEST_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    fs::create_dir_all(&root).unwrap();
    tempfile::Builder::new()
        .prefix("storage-")
        .tempdir_in(root)
        .unwrap()
}

impl S3Server {
    /// Settings for a store in this server's bucket under `prefix`.
    pub fn settings(&self, prefix: &str, retry: RetrySettings) -> StoreSettings {
        let mut s = StoreSettings::new(Location::S3 {
            bucket: BUCKET.into(),
            prefix: prefix.into(),
        });
        s.s3_options = [
            ("aws_endpoint", format!("http://127.0.0.1:{}", self.port)),
            ("aws_access_key_id", ACCESS_KEY.into()),
            ("aws_secret_access_key", SECRET_KEY.into()),
            ("aws_region", "us-east-1".into()),
            ("aws_allow_http", "true".into()),
            ("aws_virtual_hosted_style_request", "false".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        s.retry = retry;
        s
    }
}

/// One of the two stores, with the scratch space a test works in.
pub struct Backend {
    /// The store under test.
    pub objects: Objects,
    /// The S3 server behind it, for the S3 store.
    pub server: Option<S3Server>,
    /// The test's scratch space.
    pub dir: tempfile::TempDir,
}

impl Backend {
    /// The default store: a local directory, as under a state dir.
    pub fn local() -> Backend {
        let dir = scratch();
        let objects = Objects::open(&StoreSettings::new(Location::default_under(
            &dir.path().join("state"),
        )))
        .unwrap();
        Backend {
            objects,
            server: None,
            dir,
        }
    }

    /// A real S3 server with a fresh prefix.
    pub fn s3() -> Backend {
        let dir = scratch();
        let server = S3Server::start(&dir.path().join("s3"));
        let objects =
            Objects::open(&server.settings("snapshots/test", RetrySettings::default())).unwrap();
        Backend {
            objects,
            server: Some(server),
            dir,
        }
    }

    /// A path inside the scratch dir.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Bytes of every object under `prefix` in the store, read back from the store itself.
    pub async fn stored_bytes(&self, prefix: &str) -> u64 {
        self.objects
            .list(prefix)
            .await
            .unwrap()
            .iter()
            .map(|(_, n)| n)
            .sum()
    }
}

/// Info for a snapshot of a fresh sandbox.
pub fn info(parent: Option<SnapshotId>) -> SnapshotInfo {
    SnapshotInfo {
        snapshot_id: SnapshotId::new(),
        sandbox_id: SandboxId::new(),
        template: "base".into(),
        runtime: Runtime::Runc,
        vcpus: 1,
        memory_mib: 256,
        disk_mib: 1024,
        parent,
    }
}

/// `len` random (incompressible) bytes.
pub fn random(len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand::rng().fill_bytes(&mut v);
    v
}

/// What a tree holds, for comparing two: path → (kind, mode, uid, gid, mtime, content).
pub fn describe(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let m = fs::symlink_metadata(&p).unwrap();
        let ft = m.file_type();
        let what = if ft.is_dir() {
            let opaque = xattr::get(&p, "trusted.overlay.opaque").unwrap();
            format!("dir opaque={opaque:?}")
        } else if ft.is_file() {
            format!(
                "file {}",
                berth_storage::chunk::sha256_hex(&fs::read(&p).unwrap())
            )
        } else if ft.is_symlink() {
            format!("link {}", fs::read_link(&p).unwrap().display())
        } else if ft.is_char_device() {
            format!("chr {}", m.rdev())
        } else if ft.is_fifo() {
            "fifo".into()
        } else {
            "other".into()
        };
        let mtime = m.mtime() * 1_000_000_000 + m.mtime_nsec();
        let mode = if ft.is_symlink() {
            0
        } else {
            m.permissions().mode() & 0o7777
        };
        let rel = p.strip_prefix(root).unwrap().display().to_string();
        out.insert(
            rel,
            format!(
                "{what} mode={mode:o} owner={}:{} mtime={mtime}",
                m.uid(),
                m.gid()
            ),
        );
        if ft.is_dir() {
            walk(root, &p, out);
        }
    }
}
