//! The sweep of orphaned chunks (issue 14 rule 3), against a real Postgres and real object
//! stores (the local directory store and an `s3s-fs` server): a chunk nothing references and
//! older than the grace is removed, through the chunk removal claim; a fresh one, one a ready
//! snapshot, a durable stop, a superseded stop or a removal in flight holds, and every manifest
//! are kept; a round's work is bounded and the next round goes on where it stopped; and what an
//! upload cut before its manifest (the S3 server killed) stored is gone after a sweep with a
//! tiny grace, while a ready snapshot's chunks stay.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use berth_api::service::chunk_sweep::{SweepConfig, SweepRound, Sweeper};
use berth_schemas::ids::SnapshotId;
use berth_schemas::{Capacity, CommandId, CommandKind, HostId, OrgId, SandboxId, SandboxState};
use berth_storage::manifest::EntryKind;
use berth_storage::{
    stage, upload, Location, Manifest, Objects, RetrySettings, SnapshotInfo, StoreSettings,
    TreeKind, TreeSource,
};
use berth_store::snapshots::{self, NewSnapshot, Settled};
use berth_store::{chunks, orgs, sandboxes, SandboxRow};
use sqlx::PgPool;

#[path = "../../store/tests/common/mod.rs"]
mod common;
// The shared starter has more than these tests use.
#[allow(dead_code)]
#[path = "../../tests/support/s3.rs"]
mod s3;

use s3::{S3Server, ACCESS_KEY, BUCKET, SECRET_KEY};

const NO_OBSERVER: &(dyn Fn(berth_storage::UploadProgress) + Send + Sync) = &|_| {};
const DAY: Duration = Duration::from_secs(24 * 3600);
/// The key prefix of the S3 store in its bucket.
const PREFIX: &str = "sweep/test";

/// An object store under test, with the directory its objects live in as files.
struct Store {
    objects: Objects,
    /// Where `<key>` is a file (`<files>/<key>`).
    files: PathBuf,
    /// The test's scratch dir (removed on drop).
    scratch: PathBuf,
    server: Option<S3Server>,
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Some(server) = &self.server {
            server.kill();
        }
        let _ = fs::remove_dir_all(&self.scratch);
    }
}

fn scratch() -> PathBuf {
    let root = std::env::var_os("BERTH_TEST_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = root.join(format!("chunk-sweep-{}", uuid::Uuid::now_v7()));
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn s3_settings(server: &S3Server, retry: RetrySettings) -> StoreSettings {
    let mut s = StoreSettings::new(Location::S3 {
        bucket: BUCKET.into(),
        prefix: PREFIX.into(),
    });
    s.s3_options = [
        ("aws_endpoint", format!("http://127.0.0.1:{}", server.port)),
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

impl Store {
    /// The default store: a local directory.
    fn local() -> Store {
        let scratch = scratch();
        let files = scratch.join("objects");
        let objects = Objects::open(&StoreSettings::new(Location::Local(files.clone()))).unwrap();
        Store {
            objects,
            files,
            scratch,
            server: None,
        }
    }

    /// A real S3 server, retrying little (so a killed one fails an upload at once).
    fn s3() -> Store {
        let scratch = scratch();
        let server = S3Server::start(&scratch.join("s3"));
        let objects = Objects::open(&s3_settings(&server, IMPATIENT)).unwrap();
        Store {
            objects,
            files: server.dir_of(PREFIX),
            scratch,
            server: Some(server),
        }
    }

    /// Serves the killed S3 server's directory again on its port.
    fn restart(&mut self) {
        let old = self.server.take().unwrap();
        old.kill();
        let server = S3Server::start_on(&old.root, old.port);
        self.objects = Objects::open(&s3_settings(&server, IMPATIENT)).unwrap();
        self.server = Some(server);
    }

    /// Stores chunk `hash` last written `age` ago (its file's mtime set back).
    async fn chunk(&self, hash: &str, age: Duration) {
        let key = Objects::chunk_key(hash);
        self.objects
            .put(&key, bytes::Bytes::from(hash.to_owned()))
            .await
            .unwrap();
        self.age(key.as_ref(), age);
    }

    fn age(&self, key: &str, age: Duration) {
        let file = fs::File::options()
            .write(true)
            .open(self.files.join(key))
            .unwrap();
        file.set_modified(SystemTime::now() - age).unwrap();
    }

    async fn has_chunk(&self, hash: &str) -> bool {
        self.objects
            .exists(&Objects::chunk_key(hash))
            .await
            .unwrap()
    }

    async fn chunks(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .objects
            .list("chunks")
            .await
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        keys.sort();
        keys
    }
}

const IMPATIENT: RetrySettings = RetrySettings {
    max_retries: 1,
    retry_timeout: Duration::from_secs(5),
    request_timeout: Duration::from_secs(10),
    connect_timeout: Duration::from_secs(2),
};

fn hash(c: char) -> String {
    c.to_string().repeat(64)
}

/// Everything a round may do, at the default grace unless given.
fn unbounded(grace: Duration) -> SweepConfig {
    SweepConfig {
        grace,
        max_listed: usize::MAX,
        max_removed: usize::MAX,
        ..SweepConfig::default()
    }
}

async fn sweep(db: &PgPool, store: &Store, config: SweepConfig) -> SweepRound {
    Sweeper::default()
        .round(db, &store.objects, &config)
        .await
        .unwrap()
}

/// The removal row of `hash`: (claimed, finished).
async fn removal(db: &PgPool, hash: &str) -> Option<(bool, bool)> {
    sqlx::query_as(
        "SELECT removing_at IS NOT NULL, removed_at IS NOT NULL FROM chunk_removals
          WHERE sha256 = $1",
    )
    .bind(hash)
    .fetch_optional(db)
    .await
    .unwrap()
}

async fn an_orphan_past_the_grace_is_removed_and_a_fresh_one_and_every_manifest_kept(
    s: Store,
    db: PgPool,
) {
    let (old, young, fresh) = (hash('a'), hash('b'), hash('c'));
    s.chunk(&old, DAY + Duration::from_secs(3600)).await;
    s.chunk(&young, DAY - Duration::from_secs(3600)).await;
    s.chunk(&fresh, Duration::ZERO).await;
    let manifest = Objects::manifest_key(SnapshotId::new());
    s.objects
        .put(&manifest, bytes::Bytes::from_static(b"{}"))
        .await
        .unwrap();
    s.age(manifest.as_ref(), 30 * DAY);

    let round = sweep(&db, &s, SweepConfig::default()).await;
    assert_eq!(
        (round.listed, round.old, round.removed),
        (3, 1, 1),
        "{round:?}"
    );
    assert_eq!(
        round.shards,
        berth_storage::CHUNK_SHARDS,
        "one round covers a small store"
    );
    assert!(
        !s.has_chunk(&old).await,
        "an orphan past the grace is removed"
    );
    assert!(
        s.has_chunk(&young).await,
        "a chunk inside the grace is kept"
    );
    assert!(s.has_chunk(&fresh).await);
    assert!(
        s.objects.exists(&manifest).await.unwrap(),
        "a manifest is never swept"
    );
    assert_eq!(
        removal(&db, &old).await,
        Some((true, true)),
        "removed through the claim, stamped finished"
    );
    assert_eq!(removal(&db, &young).await, None);
    let again = sweep(&db, &s, SweepConfig::default()).await;
    assert_eq!((again.listed, again.removed), (2, 0));
}

/// A `creating` snapshot row `id`.
async fn creating(db: &PgPool, org: OrgId, id: SnapshotId) -> SnapshotId {
    let mut tx = db.begin().await.unwrap();
    snapshots::create(
        &mut tx,
        &NewSnapshot {
            id,
            org_id: org,
            sandbox_id: SandboxId::new(),
            host_id: HostId::new(),
            parent_id: None,
            template: "base",
            runtime: "runc",
            vcpus: 1,
            memory_mib: 256,
            disk_mib: 1024,
            command_id: CommandId::new(),
            expires_at: None,
            kind: snapshots::KIND_SNAPSHOT,
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    id
}

async fn ready(db: &PgPool, id: SnapshotId, chunks: &[(String, i64)]) {
    let mut conn = db.acquire().await.unwrap();
    let settled = Settled {
        holds: "disk",
        logical_bytes: 10,
        stored_bytes: 10,
        new_bytes: 10,
        paused_ms: 1,
        chunks,
    };
    assert!(snapshots::write_ready(&mut conn, id, &settled)
        .await
        .unwrap());
}

/// A ready snapshot referencing `hashes`.
async fn ready_snapshot(db: &PgPool, hashes: &[String]) {
    let org = orgs::create(db, &format!("org-{}", OrgId::new()))
        .await
        .unwrap()
        .unwrap();
    let id = creating(db, org, SnapshotId::new()).await;
    let chunks: Vec<(String, i64)> = hashes.iter().map(|h| (h.clone(), 10)).collect();
    ready(db, id, &chunks).await;
}

/// Writes `to` (a user's transition) and returns the row after it.
async fn go(db: &PgPool, row: &SandboxRow, to: SandboxState) -> SandboxRow {
    let (kind, capacity) = match to {
        SandboxState::Starting => (CommandKind::Start, Capacity::Reserve),
        _ => (CommandKind::Stop, Capacity::Release),
    };
    let t = common::transition(to, kind, capacity);
    let mut tx = db.begin().await.unwrap();
    let row = sandboxes::lock(&mut tx, row.id, None)
        .await
        .unwrap()
        .unwrap();
    let written = sandboxes::write_transition(&mut tx, &row, &t)
        .await
        .unwrap()
        .row;
    tx.commit().await.unwrap();
    written
}

/// Records a durable stop `snapshot` referencing `hash` for the stopped `row`.
async fn durable(db: &PgPool, row: &SandboxRow, hash: &str) {
    let mut tx = db.begin().await.unwrap();
    assert!(sandboxes::write_durable(
        &mut tx,
        row.id,
        row.generation,
        SnapshotId::new(),
        &[(hash.to_owned(), 10)]
    )
    .await
    .unwrap());
    tx.commit().await.unwrap();
}

async fn referenced_chunks_and_removals_in_flight_are_kept_however_old(s: Store, db: PgPool) {
    let (snapshot, stop, superseded) = (hash('1'), hash('2'), hash('3'));
    let (queued, claimed, orphan) = (hash('4'), hash('5'), hash('6'));
    for h in [&snapshot, &stop, &superseded, &queued, &claimed, &orphan] {
        s.chunk(h, 30 * DAY).await;
    }
    ready_snapshot(&db, std::slice::from_ref(&snapshot)).await;
    // A stop made durable, then superseded by a start (awaiting collection), then the next
    // stop made durable: `superseded` is a superseded stop's chunk, `stop` the durable one's.
    let host = common::host(&db).await;
    let row = common::placed(&db, host).await;
    let stopped = go(&db, &row, SandboxState::Stopped).await;
    durable(&db, &stopped, &superseded).await;
    let started = go(&db, &stopped, SandboxState::Starting).await;
    let stopped = go(&db, &started, SandboxState::Stopped).await;
    durable(&db, &stopped, &stop).await;
    // A delete's removals in flight: one queued, one claimed and not finished.
    let mut conn = db.acquire().await.unwrap();
    chunks::queue(&mut conn, &[queued.clone(), claimed.clone()])
        .await
        .unwrap();
    assert!(chunks::claim(&mut conn, &claimed).await.unwrap());
    drop(conn);

    let round = sweep(&db, &s, SweepConfig::default()).await;
    assert_eq!(
        (round.listed, round.old, round.removed),
        (6, 6, 1),
        "{round:?}"
    );
    assert!(!s.has_chunk(&orphan).await);
    for (h, what) in [
        (&snapshot, "a ready snapshot's"),
        (&stop, "a durable stop's"),
        (&superseded, "a superseded stop's"),
        (&queued, "a queued removal's"),
        (&claimed, "a claimed removal's"),
    ] {
        assert!(s.has_chunk(h).await, "{what} chunk is kept");
    }
    for h in [&snapshot, &stop, &superseded] {
        assert_eq!(
            removal(&db, h).await,
            None,
            "a referenced chunk is not queued"
        );
    }
    assert_eq!(
        removal(&db, &queued).await,
        Some((false, false)),
        "left to its remover"
    );
    assert_eq!(
        removal(&db, &claimed).await,
        Some((true, false)),
        "never unclaimed"
    );

    // The filter itself: of all six, only the orphan (removed, so queued afresh were it
    // stored again) is queued.
    let mut tx = db.begin().await.unwrap();
    let all = [&snapshot, &stop, &superseded, &queued, &claimed, &orphan].map(|h| h.to_string());
    assert_eq!(
        chunks::queue_unreferenced(&mut tx, &all, 100)
            .await
            .unwrap(),
        vec![orphan.clone()]
    );
    tx.rollback().await.unwrap();
}

async fn a_round_is_bounded_and_the_next_goes_on_where_it_stopped(s: Store, db: PgPool) {
    // Five orphans in five shards; a round that stops after listing one key removes one.
    let spread: Vec<String> = ['1', '3', '5', '7', '9'].into_iter().map(hash).collect();
    for h in &spread {
        s.chunk(h, 2 * DAY).await;
    }
    let config = SweepConfig {
        max_listed: 1,
        ..unbounded(DAY)
    };
    let mut sweeper = Sweeper::default();
    for left in (0..spread.len()).rev() {
        let round = sweeper.round(&db, &s.objects, &config).await.unwrap();
        assert_eq!((round.listed, round.removed), (1, 1), "{round:?}");
        assert!(round.shards < berth_storage::CHUNK_SHARDS);
        assert_eq!(s.chunks().await.len(), left);
    }

    // Three orphans in one shard; at most two removed a round: the next lists it again.
    let one_shard: Vec<String> = ["ab", "ac", "ad"]
        .iter()
        .map(|p| format!("aa{}", p.repeat(31)))
        .collect();
    for h in &one_shard {
        s.chunk(h, 2 * DAY).await;
    }
    let config = SweepConfig {
        max_removed: 2,
        ..unbounded(DAY)
    };
    let mut sweeper = Sweeper::default();
    let first = sweeper.round(&db, &s.objects, &config).await.unwrap();
    assert_eq!(first.removed, 2, "{first:?}");
    assert_eq!(s.chunks().await.len(), 1);
    let second = sweeper.round(&db, &s.objects, &config).await.unwrap();
    assert_eq!(second.removed, 1, "{second:?}");
    assert!(s.chunks().await.is_empty());
}

/// `files` files of random (incompressible) content, one chunk each, below `root`.
fn write_tree(root: &Path, files: usize) {
    use rand::RngCore;
    fs::create_dir_all(root).unwrap();
    for i in 0..files {
        let mut body = vec![0u8; 256 * 1024];
        rand::rng().fill_bytes(&mut body);
        fs::write(root.join(format!("f{i:02}")), body).unwrap();
    }
}

fn info() -> SnapshotInfo {
    SnapshotInfo {
        snapshot_id: SnapshotId::new(),
        sandbox_id: SandboxId::new(),
        template: "base".into(),
        runtime: berth_schemas::wire::Runtime::Runc,
        vcpus: 1,
        memory_mib: 256,
        disk_mib: 1024,
        parent: None,
    }
}

fn chunks_of(manifest: &Manifest) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for e in &manifest.disk.entries {
        if let EntryKind::File { chunks, .. } = &e.kind {
            out.extend(
                chunks
                    .iter()
                    .map(|c| (c.sha256.clone(), i64::from(c.stored))),
            );
        }
    }
    out.sort();
    out.dedup();
    out
}

async fn an_upload_cut_before_its_manifest_leaves_no_chunk_after_a_sweep(mut s: Store, db: PgPool) {
    // A snapshot uploaded whole and settled ready.
    let kept_tree = s.scratch.join("kept");
    write_tree(&kept_tree, 3);
    let sources = |root: &Path| {
        vec![TreeSource {
            kind: TreeKind::Disk,
            root: root.to_owned(),
        }]
    };
    let staging = s.scratch.join("staging");
    let staged = stage(info(), &sources(&kept_tree), None, &staging).unwrap();
    let kept = staged.manifest.clone();
    upload(&s.objects, staged, None, NO_OBSERVER).await.unwrap();
    let org = orgs::create(&db, &format!("org-{}", OrgId::new()))
        .await
        .unwrap()
        .unwrap();
    let id = creating(&db, org, kept.info.snapshot_id).await;
    ready(&db, id, &chunks_of(&kept)).await;
    let kept_keys: Vec<String> = {
        let mut k: Vec<String> = chunks_of(&kept)
            .iter()
            .map(|(h, _)| Objects::chunk_key(h).to_string())
            .collect();
        k.sort();
        k
    };
    assert_eq!(s.chunks().await, kept_keys);
    // A stop snapshot stored whole whose durability report has not arrived: no row names it,
    // but its manifest does (and hostd trusts a stored manifest).
    let unreported_tree = s.scratch.join("unreported");
    write_tree(&unreported_tree, 2);
    let staged = stage(info(), &sources(&unreported_tree), None, &staging).unwrap();
    let unreported = staged.manifest.clone();
    upload(&s.objects, staged, None, NO_OBSERVER).await.unwrap();
    let mut stay = kept_keys.clone();
    stay.extend(
        chunks_of(&unreported)
            .iter()
            .map(|(h, _)| Objects::chunk_key(h).to_string()),
    );
    stay.sort();
    assert_eq!(s.chunks().await, stay);

    // Another upload, cut by the S3 server dying after its first chunk: no manifest.
    let cut_tree = s.scratch.join("cut");
    write_tree(&cut_tree, 12);
    let staged = stage(info(), &sources(&cut_tree), None, &staging).unwrap();
    let cut = staged.manifest.info.snapshot_id;
    let server = s.server.as_ref().unwrap();
    let killed = std::sync::atomic::AtomicBool::new(false);
    let kill_after_first_chunk = |p: berth_storage::UploadProgress| {
        if p.chunks_done == 1 && !killed.swap(true, std::sync::atomic::Ordering::SeqCst) {
            server.kill();
        }
    };
    upload(&s.objects, staged, None, &kill_after_first_chunk)
        .await
        .unwrap_err();
    s.restart();
    assert!(!s.objects.exists(&Objects::manifest_key(cut)).await.unwrap());
    let left = s.chunks().await.len() - stay.len();
    assert!(left >= 1, "the cut upload stored chunks");

    // The default grace keeps them (just written); a tiny one sweeps them all.
    let round = sweep(&db, &s, SweepConfig::default()).await;
    assert_eq!(round.removed, 0);
    let round = sweep(&db, &s, unbounded(Duration::from_millis(1))).await;
    assert_eq!(round.removed, left, "{round:?}");
    assert_eq!(
        round.pinned, 2,
        "the unreported stop's chunks are pinned by its manifest"
    );
    assert_eq!(
        s.chunks().await,
        stay,
        "only the ready snapshot's and the stored manifest's chunks stay"
    );
    assert!(s
        .objects
        .exists(&Objects::manifest_key(kept.info.snapshot_id))
        .await
        .unwrap());
}

/// Each scenario against the local store and against S3.
macro_rules! both {
    ($($scenario:ident => $local:ident, $s3:ident;)*) => {$(
        #[sqlx::test(migrator = "berth_store::MIGRATOR")]
        async fn $local(db: PgPool) {
            $scenario(Store::local(), db).await;
        }
        #[sqlx::test(migrator = "berth_store::MIGRATOR")]
        async fn $s3(db: PgPool) {
            $scenario(Store::s3(), db).await;
        }
    )*};
}

both! {
    an_orphan_past_the_grace_is_removed_and_a_fresh_one_and_every_manifest_kept
        => local_an_orphan_past_the_grace_is_removed_and_a_fresh_one_kept,
           s3_an_orphan_past_the_grace_is_removed_and_a_fresh_one_kept;
    referenced_chunks_and_removals_in_flight_are_kept_however_old
        => local_referenced_chunks_and_removals_in_flight_are_kept,
           s3_referenced_chunks_and_removals_in_flight_are_kept;
    a_round_is_bounded_and_the_next_goes_on_where_it_stopped
        => local_a_round_is_bounded_and_the_next_goes_on_where_it_stopped,
           s3_a_round_is_bounded_and_the_next_goes_on_where_it_stopped;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn s3_an_upload_cut_before_its_manifest_leaves_no_chunk_after_a_sweep(db: PgPool) {
    an_upload_cut_before_its_manifest_leaves_no_chunk_after_a_sweep(Store::s3(), db).await;
}
