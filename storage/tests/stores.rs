//! The snapshot artifact against both object stores: the local filesystem store (the default)
//! and a real S3 server (`s3s-fs`), the same tests behind each. Needs root (whiteouts are
//! character devices, owners are shifted ids, opaque dirs are `trusted.*` xattrs).

mod support;

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use berth_storage::manifest::{EntryKind, CHUNK_BYTES, MANIFEST_FORMAT, MANIFEST_FORMAT_V1};
use berth_storage::{
    fetch_manifest, is_durable, materialize, missing_chunks, stage, upload, ChunkCache, Holds,
    Manifest, Objects, RetrySettings, StorageError, StoreOp, TreeKind, TreeSource, UploadReport,
};
use support::{describe, info, random, Backend, S3Server};

const NO_OBSERVER: &(dyn Fn(berth_storage::UploadProgress) + Send + Sync) = &|_| {};
const CACHE_BYTES: u64 = 1 << 30;

/// An upper dir as a runc sandbox leaves it: shifted owners, a setuid file, a file of several
/// chunks, an empty file, links, a whiteout, an opaque dir, a FIFO and a socket.
fn upper_dir(root: &std::path::Path) {
    use nix::sys::stat::{mknod, Mode, SFlag};
    fs::create_dir_all(root.join("etc/app")).unwrap();
    fs::create_dir_all(root.join("var/cache")).unwrap();
    fs::write(root.join("etc/app/config.toml"), b"answer = 42\n").unwrap();
    fs::write(root.join("etc/empty"), b"").unwrap();
    fs::write(root.join("var/big.bin"), random(2 * CHUNK_BYTES + 12345)).unwrap();
    fs::write(root.join("var/zeros"), vec![0u8; CHUNK_BYTES]).unwrap();
    fs::write(root.join("var/suid"), b"#!/bin/sh\n").unwrap();
    std::os::unix::fs::symlink("../etc/app/config.toml", root.join("var/link")).unwrap();
    std::os::unix::fs::symlink("/nowhere/at/all", root.join("dangling")).unwrap();
    mknod(&root.join("etc/deleted"), SFlag::S_IFCHR, Mode::empty(), 0).unwrap();
    xattr::set(root.join("var/cache"), "trusted.overlay.opaque", b"y").unwrap();
    nix::unistd::mkfifo(&root.join("var/pipe"), Mode::from_bits_truncate(0o640)).unwrap();
    let _socket = std::os::unix::net::UnixListener::bind(root.join("var/sock")).unwrap();
    for p in [
        "etc",
        "etc/app",
        "etc/app/config.toml",
        "var/big.bin",
        "var/suid",
        "var/cache",
    ] {
        std::os::unix::fs::chown(root.join(p), Some(100_000), Some(100_000)).unwrap();
    }
    std::os::unix::fs::lchown(root.join("var/link"), Some(100_001), Some(100_002)).unwrap();
    fs::set_permissions(root.join("var/suid"), fs::Permissions::from_mode(0o4755)).unwrap();
    fs::set_permissions(root.join("etc/app"), fs::Permissions::from_mode(0o700)).unwrap();
}

/// A `runsc checkpoint` image directory stand-in: the files it writes.
fn memory_dir(root: &std::path::Path) {
    fs::create_dir_all(root).unwrap();
    fs::write(root.join("checkpoint.img"), random(CHUNK_BYTES / 2)).unwrap();
    fs::write(root.join("pages.img"), vec![7u8; 3 * CHUNK_BYTES]).unwrap();
}

async fn snapshot(
    b: &Backend,
    sources: Vec<TreeSource>,
    parent: Option<&Manifest>,
    cache: Option<&ChunkCache>,
) -> Result<(Manifest, UploadReport), StorageError> {
    let staged = stage(
        info(parent.map(|p| p.info.snapshot_id)),
        &sources,
        parent,
        &b.path("staging"),
    )?;
    let manifest = staged.manifest.clone();
    let report = upload(&b.objects, staged, cache, NO_OBSERVER).await?;
    Ok((manifest, report))
}

fn disk(root: std::path::PathBuf) -> Vec<TreeSource> {
    vec![TreeSource {
        kind: TreeKind::Disk,
        root,
    }]
}

async fn a_snapshot_restores_disk_and_memory_exactly_as_captured(b: Backend) {
    let (upper, mem) = (b.path("upper"), b.path("checkpoint"));
    upper_dir(&upper);
    memory_dir(&mem);
    let sources = vec![
        TreeSource {
            kind: TreeKind::Disk,
            root: upper.clone(),
        },
        TreeSource {
            kind: TreeKind::Memory,
            root: mem.clone(),
        },
    ];
    assert!(
        !b.path("staging").exists() || fs::read_dir(b.path("staging")).unwrap().next().is_none()
    );
    let (m, report) = snapshot(&b, sources, None, None).await.unwrap();
    assert!(is_durable(&b.objects, m.info.snapshot_id).await.unwrap());
    assert_eq!(m.holds, Holds::DiskAndMemory);
    assert!(
        !m.disk.entries.iter().any(|e| e.path == "var/sock"),
        "a socket is not captured"
    );
    assert_eq!(
        fs::read_dir(b.path("staging")).unwrap().count(),
        0,
        "the staging dir is gone once durable"
    );
    // `var/zeros` and `pages.img` repeat one chunk: stored once.
    assert_eq!(report.chunks_uploaded as usize, m.chunk_hashes().len());
    assert!(m.sizes.stored_bytes < m.sizes.logical_bytes);
    assert_eq!(
        m.sizes.new_bytes, m.sizes.stored_bytes,
        "no parent: everything is new"
    );
    assert_eq!(report.bytes_uploaded, m.sizes.stored_bytes);

    let fetched = fetch_manifest(&b.objects, m.info.snapshot_id)
        .await
        .unwrap();
    assert_eq!(fetched, m);
    let cache = Arc::new(ChunkCache::open(&b.path("cache"), CACHE_BYTES).unwrap());
    let mut without_socket = describe(&upper);
    without_socket.remove("var/sock");
    materialize(
        &b.objects,
        &cache,
        &fetched,
        TreeKind::Disk,
        &b.path("restored"),
    )
    .await
    .unwrap();
    assert_eq!(describe(&b.path("restored")), without_socket);
    materialize(
        &b.objects,
        &cache,
        &fetched,
        TreeKind::Memory,
        &b.path("restored-mem"),
    )
    .await
    .unwrap();
    assert_eq!(describe(&b.path("restored-mem")), describe(&mem));

    let disk_only = snapshot(&b, disk(upper.clone()), None, None)
        .await
        .unwrap()
        .0;
    assert_eq!(disk_only.holds, Holds::Disk);
    let err = materialize(
        &b.objects,
        &cache,
        &disk_only,
        TreeKind::Memory,
        &b.path("none"),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, StorageError::NoSuchTree { .. }), "{err}");
    let err = materialize(
        &b.objects,
        &cache,
        &fetched,
        TreeKind::Disk,
        &b.path("restored"),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, StorageError::Io { .. }),
        "a non-empty destination is refused: {err}"
    );
}

async fn a_second_snapshot_uploads_only_what_changed(b: Backend) {
    let upper = b.path("upper");
    fs::create_dir_all(upper.join("data")).unwrap();
    let big = random(3 * CHUNK_BYTES);
    fs::write(upper.join("data/big.bin"), &big).unwrap();
    fs::write(upper.join("data/keep.txt"), random(100_000)).unwrap();
    fs::write(upper.join("data/gone.txt"), random(50_000)).unwrap();
    let (first, r1) = snapshot(&b, disk(upper.clone()), None, None).await.unwrap();
    assert_eq!(r1.chunks_uploaded, 5);
    let before = b.stored_bytes("chunks").await;
    assert_eq!(
        before, r1.bytes_uploaded,
        "the store holds exactly what the first upload counted"
    );

    // Change one chunk of the big file in place, add a file, delete one.
    let mut changed = big.clone();
    changed[CHUNK_BYTES + 10..CHUNK_BYTES + 20].copy_from_slice(b"0123456789");
    fs::write(upper.join("data/big.bin"), &changed).unwrap();
    let added = random(200_000);
    fs::write(upper.join("data/new.bin"), &added).unwrap();
    fs::remove_file(upper.join("data/gone.txt")).unwrap();

    let (second, r2) = snapshot(&b, disk(upper.clone()), Some(&first), None)
        .await
        .unwrap();
    assert_eq!(second.info.parent, Some(first.info.snapshot_id));
    assert_eq!(r2.chunks_uploaded, 2, "the changed chunk and the new file");
    let after = b.stored_bytes("chunks").await;
    assert_eq!(
        after - before,
        r2.bytes_uploaded,
        "the store grew by exactly the counted bytes"
    );
    assert_eq!(r2.bytes_uploaded, second.sizes.new_bytes);
    assert!(
        r2.bytes_uploaded < (CHUNK_BYTES + added.len() + 4096) as u64,
        "{} bytes uploaded for one changed chunk and a 200 kB file",
        r2.bytes_uploaded
    );

    let cache = Arc::new(ChunkCache::open(&b.path("cache"), CACHE_BYTES).unwrap());
    materialize(&b.objects, &cache, &second, TreeKind::Disk, &b.path("r2"))
        .await
        .unwrap();
    assert_eq!(fs::read(b.path("r2/data/big.bin")).unwrap(), changed);
    assert_eq!(fs::read(b.path("r2/data/new.bin")).unwrap(), added);
    assert!(!b.path("r2/data/gone.txt").exists());
    materialize(&b.objects, &cache, &first, TreeKind::Disk, &b.path("r1"))
        .await
        .unwrap();
    assert_eq!(
        fs::read(b.path("r1/data/big.bin")).unwrap(),
        big,
        "the parent is untouched"
    );
    assert!(b.path("r1/data/gone.txt").exists());

    // The same content from another sandbox's tree: stored already, nothing sent.
    let other = b.path("other");
    fs::create_dir_all(&other).unwrap();
    fs::write(other.join("copy.bin"), &added).unwrap();
    let (_, r3) = snapshot(&b, disk(other), None, None).await.unwrap();
    assert_eq!(
        (
            r3.chunks_uploaded,
            r3.chunks_already_stored,
            r3.bytes_uploaded
        ),
        (0, 1, 0)
    );
}

async fn a_clone_on_another_host_fetches_only_what_its_cache_lacks(b: Backend) {
    let upper = b.path("upper");
    fs::create_dir_all(&upper).unwrap();
    for i in 0..3 {
        fs::write(upper.join(format!("f{i}")), random(300_000)).unwrap();
    }
    let host_a = ChunkCache::open(&b.path("cache-a"), CACHE_BYTES).unwrap();
    let (first, _) = snapshot(&b, disk(upper.clone()), None, Some(&host_a))
        .await
        .unwrap();
    let host_a = Arc::new(host_a);
    let local = materialize(&b.objects, &host_a, &first, TreeKind::Disk, &b.path("a1"))
        .await
        .unwrap();
    assert_eq!(
        (local.chunks_fetched, local.chunks_from_cache),
        (0, 3),
        "the snapshotting host has it all"
    );

    let host_b = Arc::new(ChunkCache::open(&b.path("cache-b"), CACHE_BYTES).unwrap());
    let cold = materialize(&b.objects, &host_b, &first, TreeKind::Disk, &b.path("b1"))
        .await
        .unwrap();
    assert_eq!(cold.chunks_fetched, 3);
    assert_eq!(cold.bytes_fetched, first.sizes.stored_bytes);
    let warm = materialize(&b.objects, &host_b, &first, TreeKind::Disk, &b.path("b2"))
        .await
        .unwrap();
    assert_eq!((warm.chunks_fetched, warm.bytes_fetched), (0, 0));

    fs::write(upper.join("f1"), random(300_000)).unwrap();
    let (second, _) = snapshot(&b, disk(upper.clone()), Some(&first), None)
        .await
        .unwrap();
    let incremental = materialize(&b.objects, &host_b, &second, TreeKind::Disk, &b.path("b3"))
        .await
        .unwrap();
    assert_eq!(
        (incremental.chunks_fetched, incremental.chunks_from_cache),
        (1, 2)
    );
    assert_eq!(describe(&b.path("b3")), describe(&upper));
}

/// What a snapshot delete relies on from the store (its claimed chunk removals are
/// `berth-api`'s `service::snapshots::remove_chunks`): once its manifest is gone the snapshot
/// is not durable and cannot be read, and removing only the chunks no remaining manifest
/// references leaves the other snapshot whole.
async fn a_deleted_manifest_is_not_durable_and_a_snapshot_sharing_its_chunks_still_restores(
    b: Backend,
) {
    let upper = b.path("upper");
    fs::create_dir_all(&upper).unwrap();
    fs::write(upper.join("shared"), random(100_000)).unwrap();
    fs::write(upper.join("mine"), random(100_000)).unwrap();
    let (first, _) = snapshot(&b, disk(upper.clone()), None, None).await.unwrap();
    fs::remove_file(upper.join("mine")).unwrap();
    let (second, _) = snapshot(&b, disk(upper.clone()), Some(&first), None)
        .await
        .unwrap();

    let remaining = second.chunk_hashes();
    b.objects
        .delete(&Objects::manifest_key(first.info.snapshot_id))
        .await
        .unwrap();
    let orphans: Vec<&str> = first
        .chunk_hashes()
        .into_iter()
        .filter(|h| !remaining.contains(h))
        .collect();
    assert_eq!(orphans.len(), 1, "only `mine` is the first's own");
    for h in orphans {
        b.objects.delete(&Objects::chunk_key(h)).await.unwrap();
    }
    assert!(!is_durable(&b.objects, first.info.snapshot_id)
        .await
        .unwrap());
    assert!(matches!(
        fetch_manifest(&b.objects, first.info.snapshot_id).await,
        Err(StorageError::NotFound(_))
    ));
    let cache = Arc::new(ChunkCache::open(&b.path("cache"), CACHE_BYTES).unwrap());
    materialize(&b.objects, &cache, &second, TreeKind::Disk, &b.path("r"))
        .await
        .unwrap();
    assert_eq!(describe(&b.path("r")), describe(&upper));
    assert_eq!(b.objects.list("chunks").await.unwrap().len(), 1);
}

/// A snapshot of two files of one chunk each, stored whole: the setup of the chunk checks.
async fn two_chunk_snapshot(b: &Backend) -> Manifest {
    let upper = b.path("upper");
    fs::create_dir_all(&upper).unwrap();
    fs::write(upper.join("a"), random(100_000)).unwrap();
    fs::write(upper.join("b"), random(100_000)).unwrap();
    let (m, _) = snapshot(b, disk(upper), None, None).await.unwrap();
    assert_eq!(m.distinct_chunks().len(), 2);
    assert!(missing_chunks(&b.objects, &m).await.unwrap().is_empty());
    m
}

/// A snapshot whose manifest reads back may still lack a chunk (removed since its upload
/// skipped it): `missing_chunks` names exactly the ones gone.
async fn a_snapshot_whose_chunk_was_removed_names_it_missing(b: Backend) {
    let m = two_chunk_snapshot(&b).await;
    let (gone, _) = m.distinct_chunks()[1].clone();
    b.objects.delete(&Objects::chunk_key(&gone)).await.unwrap();
    assert!(is_durable(&b.objects, m.info.snapshot_id).await.unwrap());
    assert_eq!(missing_chunks(&b.objects, &m).await.unwrap(), [gone]);
}

/// A chunk object that is there but not of the manifest's `stored` length (truncated, or
/// replaced by other bytes) is named as `missing_chunks` names a removed one; and a new upload
/// of the same content writes it again rather than skipping it as held, so the copy is whole.
async fn a_snapshot_whose_chunk_was_truncated_names_it_missing(b: Backend) {
    let m = two_chunk_snapshot(&b).await;
    let (cut, stored) = m.distinct_chunks()[0].clone();
    let key = Objects::chunk_key(&cut);
    let body = b.objects.get(&key).await.unwrap().unwrap();
    assert_eq!(body.len() as u64, u64::from(stored));
    b.objects
        .put(&key, body.slice(..body.len() / 2))
        .await
        .unwrap();
    assert_eq!(
        missing_chunks(&b.objects, &m).await.unwrap(),
        std::slice::from_ref(&cut)
    );
    let longer = [body.as_ref(), b"tail"].concat();
    b.objects.put(&key, longer.into()).await.unwrap();
    assert_eq!(
        missing_chunks(&b.objects, &m).await.unwrap(),
        std::slice::from_ref(&cut)
    );

    let (again, report) = snapshot(&b, disk(b.path("upper")), None, None)
        .await
        .unwrap();
    assert_eq!(report.chunks_uploaded, 1, "only the damaged chunk travels");
    assert_eq!(report.chunks_already_stored, 1);
    assert!(missing_chunks(&b.objects, &again).await.unwrap().is_empty());
    assert!(missing_chunks(&b.objects, &m).await.unwrap().is_empty());
    assert_eq!(b.objects.size(&key).await.unwrap(), Some(u64::from(stored)));
}

/// What the store-wide sweep of orphans reads (issue 14): every manifest by its snapshot id and
/// every chunk by its hash, each with a last-modified time of when it was written, and nothing
/// that is not in the key layout.
async fn a_listing_names_every_manifest_and_chunk_with_when_it_was_written(b: Backend) {
    let upper = b.path("upper");
    fs::create_dir_all(&upper).unwrap();
    fs::write(upper.join("a"), random(100_000)).unwrap();
    fs::write(upper.join("b"), random(100_000)).unwrap();
    let before = std::time::SystemTime::now() - std::time::Duration::from_secs(2);
    let (m, _) = snapshot(&b, disk(upper), None, None).await.unwrap();
    let after = std::time::SystemTime::now() + std::time::Duration::from_secs(2);
    // Not in the layout: never named, so never removed by a sweep.
    let stray = object_store::path::Path::from("chunks/zz/not-a-chunk.zst");
    b.objects
        .put(&stray, bytes::Bytes::from_static(b"x"))
        .await
        .unwrap();

    let manifests = b.objects.list_manifests().await.unwrap();
    assert_eq!(
        manifests.iter().map(|l| l.name).collect::<Vec<_>>(),
        [m.info.snapshot_id]
    );
    let chunks = b.objects.list_chunks().await.unwrap();
    let named: BTreeSet<String> = chunks.iter().map(|l| l.name.clone()).collect();
    let expected: BTreeSet<String> = m.distinct_chunks().into_iter().map(|(h, _)| h).collect();
    assert_eq!(named, expected);
    for listed in manifests
        .iter()
        .map(|l| (l.size, l.last_modified))
        .chain(chunks.iter().map(|l| (l.size, l.last_modified)))
    {
        assert!(listed.0 > 0);
        assert!(
            (before..after).contains(&listed.1),
            "written during the test: {:?}",
            listed.1
        );
    }
}

async fn a_damaged_chunk_or_manifest_in_the_store_is_refused(b: Backend) {
    let upper = b.path("upper");
    fs::create_dir_all(&upper).unwrap();
    fs::write(upper.join("f"), random(10_000)).unwrap();
    let (m, _) = snapshot(&b, disk(upper), None, None).await.unwrap();
    let EntryKind::File { chunks, .. } = &m.disk.entries[0].kind else {
        panic!("a file")
    };
    let key = Objects::chunk_key(&chunks[0].sha256);
    b.objects
        .put(
            &key,
            zstd::bulk::compress(&random(10_000), 3).unwrap().into(),
        )
        .await
        .unwrap();
    let cache = Arc::new(ChunkCache::open(&b.path("cache"), CACHE_BYTES).unwrap());
    let err = materialize(&b.objects, &cache, &m, TreeKind::Disk, &b.path("r"))
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::Corrupt { .. }), "{err}");
    assert!(
        !cache.contains(&chunks[0].sha256),
        "a bad chunk is not cached"
    );

    b.objects
        .put(
            &Objects::manifest_key(m.info.snapshot_id),
            b"{\"format\": 1}".to_vec().into(),
        )
        .await
        .unwrap();
    let err = fetch_manifest(&b.objects, m.info.snapshot_id)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::BadManifest { .. }), "{err}");
}

/// Hard links within the tree come back as one inode (also from an incremental snapshot); a
/// link to a file outside the tree comes back as a file of its own.
async fn hard_links_within_the_tree_come_back_as_one_inode(b: Backend) {
    use std::os::unix::fs::MetadataExt;
    let upper = b.path("upper");
    fs::create_dir_all(upper.join("a")).unwrap();
    fs::create_dir_all(upper.join("b")).unwrap();
    fs::write(upper.join("a/data"), b"shared\n").unwrap();
    fs::hard_link(upper.join("a/data"), upper.join("b/again")).unwrap();
    fs::hard_link(upper.join("a/data"), upper.join("third")).unwrap();
    fs::write(b.path("outside"), b"outside\n").unwrap();
    fs::hard_link(b.path("outside"), upper.join("from-outside")).unwrap();
    fs::write(upper.join("alone"), b"alone\n").unwrap();

    let (m, _) = snapshot(&b, disk(upper.clone()), None, None).await.unwrap();
    assert_eq!(
        m.format, MANIFEST_FORMAT,
        "a tree with links needs format 2"
    );
    let links: Vec<_> = m
        .disk
        .entries
        .iter()
        .filter_map(|e| match &e.kind {
            EntryKind::HardLink { target } => Some((e.path.as_str(), target.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(links, [("b/again", "a/data"), ("third", "a/data")]);
    assert_eq!(
        m.chunk_hashes().len(),
        3,
        "the linked content is one file: shared, outside, alone"
    );
    let cache = Arc::new(ChunkCache::open(&b.path("cache"), CACHE_BYTES).unwrap());
    let check = |root: &std::path::Path| {
        let ino = |p: &str| fs::metadata(root.join(p)).unwrap().ino();
        assert_eq!(ino("a/data"), ino("b/again"), "{}", root.display());
        assert_eq!(ino("a/data"), ino("third"));
        assert_eq!(fs::metadata(root.join("a/data")).unwrap().nlink(), 3);
        assert_eq!(fs::metadata(root.join("from-outside")).unwrap().nlink(), 1);
        assert_eq!(fs::read(root.join("from-outside")).unwrap(), b"outside\n");
        // One file: a write through one name is read through the others.
        fs::write(root.join("b/again"), b"changed\n").unwrap();
        assert_eq!(fs::read(root.join("a/data")).unwrap(), b"changed\n");
        assert_eq!(fs::read(root.join("third")).unwrap(), b"changed\n");
    };
    let fetched = fetch_manifest(&b.objects, m.info.snapshot_id)
        .await
        .unwrap();
    assert_eq!(fetched, m);
    materialize(&b.objects, &cache, &fetched, TreeKind::Disk, &b.path("r1"))
        .await
        .unwrap();
    check(&b.path("r1"));

    // Incremental: the parent's entries are reused, the links are kept.
    let (second, _) = snapshot(&b, disk(upper.clone()), Some(&m), None)
        .await
        .unwrap();
    assert_eq!(second.sizes.new_bytes, 0, "nothing changed");
    materialize(&b.objects, &cache, &second, TreeKind::Disk, &b.path("r2"))
        .await
        .unwrap();
    check(&b.path("r2"));

    // Without links the manifest stays in format 1, which older hosts read.
    fs::remove_file(upper.join("b/again")).unwrap();
    fs::remove_file(upper.join("third")).unwrap();
    fs::remove_file(upper.join("from-outside")).unwrap();
    let (plain, _) = snapshot(&b, disk(upper), None, None).await.unwrap();
    assert_eq!(plain.format, MANIFEST_FORMAT_V1);
}

macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod local {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                super::$name(super::Backend::local()).await
            })*
        }
        mod s3 {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                super::$name(super::Backend::s3()).await
            })*
        }
    };
}

on_both_stores!(
    a_snapshot_restores_disk_and_memory_exactly_as_captured,
    a_second_snapshot_uploads_only_what_changed,
    a_clone_on_another_host_fetches_only_what_its_cache_lacks,
    a_deleted_manifest_is_not_durable_and_a_snapshot_sharing_its_chunks_still_restores,
    a_damaged_chunk_or_manifest_in_the_store_is_refused,
    a_snapshot_whose_chunk_was_removed_names_it_missing,
    a_snapshot_whose_chunk_was_truncated_names_it_missing,
    a_listing_names_every_manifest_and_chunk_with_when_it_was_written,
    hard_links_within_the_tree_come_back_as_one_inode,
);

/// Retries small enough that a dead server fails the upload soon, as a test can wait for.
const IMPATIENT: RetrySettings = RetrySettings {
    max_retries: 1,
    retry_timeout: std::time::Duration::from_secs(5),
    request_timeout: std::time::Duration::from_secs(10),
    connect_timeout: std::time::Duration::from_secs(2),
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_server_killed_mid_upload_fails_it_with_a_typed_error_and_no_manifest() {
    let dir = support::scratch();
    let server = S3Server::start(&dir.path().join("s3"));
    let objects = Objects::open(&server.settings("snaps", IMPATIENT)).unwrap();
    let upper = dir.path().join("upper");
    fs::create_dir_all(&upper).unwrap();
    for i in 0..12 {
        fs::write(upper.join(format!("f{i:02}")), random(256 * 1024)).unwrap();
    }
    let staging = dir.path().join("staging");
    let sources = disk(upper.clone());
    let staged = stage(info(None), &sources, None, &staging).unwrap();
    let id = staged.manifest.info.snapshot_id;
    let killed = std::sync::atomic::AtomicBool::new(false);
    let kill_after_first_chunk = |p: berth_storage::UploadProgress| {
        if p.chunks_done == 1 && !killed.swap(true, std::sync::atomic::Ordering::SeqCst) {
            server.kill();
        }
    };
    let err = upload(&objects, staged, None, &kill_after_first_chunk)
        .await
        .unwrap_err();
    assert!(killed.load(std::sync::atomic::Ordering::SeqCst));
    assert!(
        matches!(
            err,
            StorageError::Store {
                op: StoreOp::Head | StoreOp::Put,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        fs::read_dir(&staging).unwrap().count(),
        0,
        "a failed upload leaves no staging dir"
    );

    // The same bucket served again: no manifest, so the snapshot was never durable.
    let again = S3Server::start(&server.root);
    let objects = Objects::open(&again.settings("snaps", IMPATIENT)).unwrap();
    assert!(!is_durable(&objects, id).await.unwrap());
    assert!(matches!(
        fetch_manifest(&objects, id).await,
        Err(StorageError::NotFound(_))
    ));
    assert!(objects.list("manifests").await.unwrap().is_empty());
    let left = objects.list("chunks").await.unwrap().len();
    assert!(
        left < 12,
        "the upload stopped part way ({left} chunks stored)"
    );

    // A retry completes, skipping what the first attempt stored.
    let staged = stage(info(None), &sources, None, &staging).unwrap();
    let report = upload(&objects, staged, None, NO_OBSERVER).await.unwrap();
    assert_eq!(report.chunks_already_stored as usize, left);
    assert_eq!((report.chunks_uploaded + report.chunks_already_stored), 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_store_with_wrong_credentials_fails_with_a_typed_error() {
    let dir = support::scratch();
    let server = S3Server::start(&dir.path().join("s3"));
    let mut settings = server.settings("snaps", IMPATIENT);
    for (k, v) in settings.s3_options.iter_mut() {
        if k == "aws_secret_access_key" {
            *v = "wrong".into();
        }
    }
    let objects = Objects::open(&settings).unwrap();
    let upper = dir.path().join("upper");
    fs::create_dir_all(&upper).unwrap();
    fs::write(upper.join("f"), b"x").unwrap();
    let staged = stage(info(None), &disk(upper), None, &dir.path().join("staging")).unwrap();
    let err = upload(&objects, staged, None, NO_OBSERVER)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::Store { .. }), "{err}");
}
