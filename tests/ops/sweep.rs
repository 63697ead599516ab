//! The store-wide sweep of the object store's orphans (issue 14, `berth_api::sweep`), run by
//! the collector of a `berth api` process beside the stack with a grace period of zero: what an
//! upload cut before its manifest stored (a hostd killed at `stop:uploading`, the sandbox then
//! deleted while its host stays down), a manifest nothing names and a chunk removal whose
//! remover died after its claim are removed, while a ready snapshot's content and another
//! sandbox's durable stop are untouched and still restore byte for byte.

use std::collections::BTreeSet;

use berth_hostd::fault::Step;
use berth_schemas::ids::SnapshotId;
use berth_schemas::CommandKind;
use berth_storage::{ChunkCache, Objects, StoreSettings, TreeKind};
use sqlx::PgPool;

use crate::archive::stop_durably;
use crate::crash14::{crash, manifests_of};
use crate::migrate::{cordon, FILES};
use crate::resume::{ready_snapshot, run};
use crate::support::api_process::ApiProcess;
use crate::support::http::running_sandbox;
use crate::support::{eventually, Stack, SETTLE_TIMEOUT};

/// The sweep's counter of what it removed, by kind.
const REMOVED: &str = "berth_object_sweep_removed_total";

/// The stack's object store, opened as the hosts open it.
fn objects(stack: &Stack) -> Objects {
    Objects::open(&StoreSettings::new(berth_storage::Location::Local(
        stack.object_store_dir(),
    )))
    .unwrap()
}

/// The chunks the manifests of `kept` reference.
async fn chunks_of(objects: &Objects, kept: &[SnapshotId]) -> BTreeSet<String> {
    let mut all = BTreeSet::new();
    for &id in kept {
        let manifest = berth_storage::fetch_manifest(objects, id).await.unwrap();
        all.extend(manifest.distinct_chunks().into_iter().map(|(h, _)| h));
    }
    all
}

async fn stored_chunks(objects: &Objects) -> BTreeSet<String> {
    objects
        .list_chunks()
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.name)
        .collect()
}

/// The md5 of `root/own` in snapshot `id`'s disk tree, restored from the store alone into
/// `dir` through a cache of its own.
async fn restored_md5(objects: &Objects, id: SnapshotId, dir: &std::path::Path) -> String {
    let manifest = berth_storage::fetch_manifest(objects, id).await.unwrap();
    assert!(berth_storage::missing_chunks(objects, &manifest)
        .await
        .unwrap()
        .is_empty());
    let cache = std::sync::Arc::new(ChunkCache::open(&dir.join("cache"), 1 << 30).unwrap());
    let tree = dir.join("tree");
    berth_storage::materialize(objects, &cache, &manifest, TreeKind::Disk, &tree)
        .await
        .unwrap();
    let out = std::process::Command::new("md5sum")
        .arg(tree.join("root/own"))
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap()[..32].to_owned()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_sweep_removes_what_a_crashed_upload_a_lost_report_and_a_dead_remover_left_and_keeps_the_rest(
    db: PgPool,
) {
    let mut stack = Stack::start(db.clone(), 1).await;
    let store = objects(&stack);
    // What must stay: a ready snapshot of a sandbox, then that sandbox's durable stop.
    let kept_sandbox = running_sandbox(&stack).await;
    let md5 = run(
        &stack,
        &kept_sandbox,
        "head -c 300000 /dev/urandom > /root/own && md5sum /root/own",
    )
    .await[..32]
        .to_owned();
    let snapshot: SnapshotId = ready_snapshot(&stack, &kept_sandbox).await.parse().unwrap();
    stop_durably(&stack, &kept_sandbox).await;
    let durable: SnapshotId = sqlx::query_scalar::<_, uuid::Uuid>(
        "SELECT durable_snapshot FROM sandboxes WHERE id = $1::uuid",
    )
    .bind(&kept_sandbox)
    .fetch_one(&db)
    .await
    .unwrap()
    .to_string()
    .parse()
    .unwrap();
    let kept = [snapshot, durable];

    // A sandbox on a second host whose hostd dies with its stop's first chunk stored and no
    // manifest; the sandbox is then deleted, its host staying down.
    cordon(&stack, 0).await;
    stack
        .add_host_env(
            (None, None),
            &[],
            None,
            crash(CommandKind::Stop, Step::Uploading),
        )
        .await;
    let doomed = running_sandbox(&stack).await;
    run(&stack, &doomed, FILES).await;
    assert_eq!(stack.request(&doomed, "stop").await.0, 202);
    let child = stack.hosts[1].child.as_mut().unwrap();
    let exited = tokio::time::timeout(SETTLE_TIMEOUT, child.wait()).await;
    assert!(exited.is_ok(), "hostd never crashed at stop:uploading");
    stack.hosts[1].child = None;
    let (status, body) = stack.delete(&doomed).await;
    assert!(status == 202 || status == 200, "{status} {body}");

    let named = chunks_of(&store, &kept).await;
    let orphans: BTreeSet<String> = stored_chunks(&store)
        .await
        .difference(&named)
        .cloned()
        .collect();
    assert!(
        !orphans.is_empty(),
        "the cut upload left chunks no manifest names"
    );
    // A manifest nothing names (an archive's whose report was lost for good)...
    let lost_report = SnapshotId::new();
    let body = store
        .get(&Objects::manifest_key(durable))
        .await
        .unwrap()
        .unwrap();
    store
        .put(&Objects::manifest_key(lost_report), body)
        .await
        .unwrap();
    // ...and a chunk whose remover died two hours ago (past `chunks::STALE_CLAIM`) between its
    // claim and its finish.
    let dead_claim = "ab".repeat(32);
    store
        .put(
            &Objects::chunk_key(&dead_claim),
            bytes::Bytes::from_static(b"x"),
        )
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO chunk_removals (sha256, removing_at) VALUES ($1, now() - interval '2 hours')",
    )
    .bind(&dead_claim)
    .execute(&db)
    .await
    .unwrap();

    let store_dir = stack.object_store_dir().display().to_string();
    let sweeper = ApiProcess::spawn_with_env(
        &stack,
        &["--object-sweep-grace", "0s", "--object-sweep-every", "1s"],
        &[(berth_storage::store::OBJECT_STORE_ENV, store_dir.as_str())],
    )
    .await;
    eventually(
        "the sweep leaves only what the kept manifests name",
        || async { stored_chunks(&store).await == named },
    )
    .await;
    eventually("the unnamed manifest is removed", || async {
        !berth_storage::is_durable(&store, lost_report)
            .await
            .unwrap()
    })
    .await;
    // The takeover deletes the object before it finishes the row and counts it: wait for both.
    eventually(
        "the dead remover's claim is taken over, finished and counted",
        || async {
            let finished: bool = sqlx::query_scalar(
                "SELECT removed_at IS NOT NULL FROM chunk_removals WHERE sha256 = $1",
            )
            .bind(&dead_claim)
            .fetch_one(&db)
            .await
            .unwrap();
            finished
                && sweeper
                    .metric(&format!("{REMOVED}{{kind=\"stale_claim\"}}"))
                    .await
                    >= 1.0
        },
    )
    .await;
    assert!(manifests_of(&stack, &doomed).is_empty());
    for id in kept {
        assert!(
            berth_storage::is_durable(&store, id).await.unwrap(),
            "{id} is kept"
        );
    }
    // Each is counted after its object went (a chunk's after its whole batch).
    eventually("the removed chunks and manifest are counted", || async {
        sweeper
            .metric(&format!("{REMOVED}{{kind=\"chunk\"}}"))
            .await
            >= orphans.len() as f64
            && sweeper
                .metric(&format!("{REMOVED}{{kind=\"manifest\"}}"))
                .await
                >= 1.0
    })
    .await;

    // What stayed restores from the store alone, byte for byte.
    let scratch = stack.root.join("restored");
    for (i, id) in kept.into_iter().enumerate() {
        let dir = scratch.join(i.to_string());
        assert_eq!(restored_md5(&store, id, &dir).await, md5, "{id}");
    }
    drop(sweeper);
    stack.teardown().await;
}
