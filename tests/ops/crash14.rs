//! hostd killed (SIGKILL, at the named crash points of `berth_hostd::fault`) in the middle of
//! issue 14's transfers, each converging with the sandbox's files and nothing left over: the
//! background upload of a stop's snapshot (resumed when hostd starts again, so the stop still
//! becomes durable and a start elsewhere is no longer refused), an archive's upload, an archive
//! that recorded its copy but did not report it (redelivered, it reports that copy), the delete
//! that frees an archived sandbox's disk, and an unarchive's download; and that freeing delete
//! held back on its host (failing there until a later command passes it) so the unarchive
//! reaches the host first. Races of start and delete against the transitional states are in
//! `race14.rs`.

use berth_hostd::fault::{crash_at, Step, CRASH_AT_ENV, FAIL_AT_ENV};
use berth_schemas::CommandKind;
use sqlx::PgPool;

use crate::archive::{freed, get, remove_a_chunk_of, stop_durably, walk};
use crate::collect::{collected, manifest_stored};
use crate::migrate::{copy_on, cordon, start_as, CHECK, FILES};
use crate::resume::run;
use crate::support::http::{host_of, running_sandbox};
use crate::support::inproc::reserved;
use crate::support::{eventually, Stack, SETTLE_TIMEOUT};

/// The environment that makes hostd kill itself at `step` of a `kind` command.
pub(crate) fn crash(kind: CommandKind, step: Step) -> Vec<(String, String)> {
    vec![(CRASH_AT_ENV.to_owned(), crash_at(kind, step))]
}

/// The environment that makes every apply of a `kind` command fail at `step` (retried later).
fn fail(kind: CommandKind, step: Step) -> Vec<(String, String)> {
    vec![(FAIL_AT_ENV.to_owned(), crash_at(kind, step))]
}

/// Waits until host `index` killed itself at its crash point `what`, and takes the crash
/// point out of its environment; the host is not started again.
async fn crashed(stack: &mut Stack, index: usize, what: &str) {
    let child = stack.hosts[index].child.as_mut().unwrap();
    let exited = tokio::time::timeout(SETTLE_TIMEOUT, child.wait()).await;
    assert!(exited.is_ok(), "hostd never crashed at {what}");
    let host = &mut stack.hosts[index];
    host.child = None;
    host.env.retain(|(k, _)| k != CRASH_AT_ENV);
}

/// Waits until host `index` killed itself at its crash point `what`, then starts it again with
/// the crash point `next` (none: `None`), keeping the rest of its environment (its object
/// store).
pub(crate) async fn crashed_then_restart(
    stack: &mut Stack,
    index: usize,
    what: &str,
    next: Option<(CommandKind, Step)>,
) {
    crashed(stack, index, what).await;
    if let Some((kind, step)) = next {
        stack.hosts[index].env.extend(crash(kind, step));
    }
    stack.restart_host(index).await;
}

/// The durable stop snapshot the row names.
pub(crate) async fn durable_snapshot(stack: &Stack, id: &str) -> Option<uuid::Uuid> {
    sqlx::query_scalar("SELECT durable_snapshot FROM sandboxes WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(&stack.db)
        .await
        .unwrap()
}

/// Deletes `id` and checks that it converged ([`converged_deleted`]).
pub(crate) async fn delete_leaves_nothing(stack: &Stack, id: &str) {
    let snapshot = durable_snapshot(stack, id).await;
    let (status, body) = stack.delete(id).await;
    assert!(status == 202 || status == 200, "{status} {body}");
    converged_deleted(stack, id, snapshot).await;
}

/// The stop snapshots in the object store whose manifest names sandbox `id`.
pub(crate) fn manifests_of(stack: &Stack, id: &str) -> Vec<String> {
    walk(&stack.object_store_dir())
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .filter(|p| {
            let body = std::fs::read_to_string(p).unwrap_or_default();
            let manifest: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            manifest["info"]["sandbox_id"] == id
        })
        .map(|p| p.display().to_string())
        .collect()
}

/// Checks that the deleted `id` converged: `deleted`, nothing of it on any host, its stored
/// stops collected (`snapshot`, the one its row named before the delete, and every other:
/// no manifest in the store names it, no superseded row awaits) and no capacity drift.
pub(crate) async fn converged_deleted(stack: &Stack, id: &str, snapshot: Option<uuid::Uuid>) {
    stack.wait_state(id, "deleted").await;
    eventually("nothing of the sandbox is left on any host", || async {
        stack.leftovers(id).is_empty()
    })
    .await;
    if let Some(snapshot) = snapshot {
        collected(stack, id, snapshot).await;
    }
    eventually(
        "no superseded stop of the sandbox awaits collection",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM durable_superseded WHERE sandbox_id = $1::uuid",
            )
            .bind(id)
            .fetch_one(&stack.db)
            .await
            .unwrap()
                == 0
        },
    )
    .await;
    eventually("no manifest in the store names the sandbox", || async {
        manifests_of(stack, id).is_empty()
    })
    .await;
    stack.assert_no_capacity_drift().await;
}

/// The setup of every test here: a stack with one host whose hostd runs with `env` (a crash or
/// failure point), and a sandbox running there that holds [`FILES`].
async fn sandbox_with_files(db: PgPool, env: Vec<(String, String)>) -> (Stack, String) {
    let mut stack = Stack::start(db, 0).await;
    stack.add_host_env((None, None), &[], None, env).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, FILES).await;
    (stack, id)
}

/// Stops `id` durably, archives it and waits until it is `archived`.
async fn archived(stack: &Stack, id: &str) {
    stop_durably(stack, id).await;
    assert_eq!(stack.request(id, "archive").await.0, 202);
    stack.wait_state(id, "archived").await;
}

/// Starts `id` (stopped or archived) and checks that it runs with its [`FILES`].
async fn starts_with_its_files(stack: &Stack, id: &str) {
    assert_eq!(stack.request(id, "start").await.0, 202);
    runs_with_its_files(stack, id).await;
}

/// Waits until `id` runs and checks that its [`FILES`] are there, intact.
async fn runs_with_its_files(stack: &Stack, id: &str) {
    stack.wait_state(id, "running").await;
    assert_eq!(run(stack, id, CHECK).await, "kept\nintact\n");
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn hostd_killed_mid_stop_upload_uploads_again_when_it_starts_and_the_sandbox_then_starts_elsewhere(
    db: PgPool,
) {
    let (mut stack, id) = sandbox_with_files(db, crash(CommandKind::Stop, Step::Uploading)).await;
    let first = host_of(&stack, &id).await;
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    // The stop's result is published (and the command acked) before its upload begins: the
    // row is `stopped`, and hostd dies with the first chunk stored and no manifest.
    stack.wait_state(&id, "stopped").await;
    crashed_then_restart(&mut stack, 0, "stop:uploading", None).await;
    // Nothing redelivers the acked stop: the restarted hostd uploads again by itself.
    eventually("the interrupted stop becomes durable", || async {
        !get(&stack, &id).await["durable_at"].is_null()
    })
    .await;
    let snapshot = durable_snapshot(&stack, &id).await.unwrap();
    assert!(manifest_stored(&stack, snapshot), "its manifest is stored");
    assert_eq!(stack.state_of(&id).await, "stopped");

    // Durable, so a start no longer needs its host: with that host cordoned it moves.
    stack.add_host().await;
    cordon(&stack, 0).await;
    start_as(&stack, &id, "migrating").await;
    runs_with_its_files(&stack, &id).await;
    assert_ne!(host_of(&stack, &id).await, first, "started elsewhere");
    eventually("the old host's stale copy is deleted", || async {
        !copy_on(&stack, 0, &id)
    })
    .await;
    delete_leaves_nothing(&stack, &id).await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn hostd_killed_mid_archive_upload_ends_archived_with_its_files_and_never_without_a_copy(
    db: PgPool,
) {
    let (mut stack, id) = sandbox_with_files(db, crash(CommandKind::Stop, Step::Uploading)).await;
    // Big enough that the archive, delivered as soon as hostd is back, finds the stop's
    // resumed upload still capturing and takes over from it.
    run(&stack, &id, "head -c 20000000 /dev/urandom > /root/big").await;
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    // hostd dies mid-upload of the stop; the archive is asked for while it is down, so the
    // archive (redelivered when it is back) must upload itself, and dies mid-upload too.
    crashed(&mut stack, 0, "stop:uploading").await;
    let (status, body) = stack.request(&id, "archive").await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], "archiving", "{body}");
    stack.hosts[0]
        .env
        .extend(crash(CommandKind::Archive, Step::Uploading));
    stack.restart_host(0).await;
    crashed_then_restart(&mut stack, 0, "archive:uploading", None).await;
    // Never without a copy: until the archive is confirmed the disk stays on its host.
    let archived = stack.wait_state(&id, "archived").await;
    assert!(!archived["durable_at"].is_null(), "{archived}");
    let snapshot = durable_snapshot(&stack, &id).await.unwrap();
    assert!(manifest_stored(&stack, snapshot));
    freed(&stack, &id).await;
    stack.assert_no_capacity_drift().await;
    starts_with_its_files(&stack, &id).await;
    delete_leaves_nothing(&stack, &id).await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn hostd_killed_after_an_archive_recorded_its_copy_reports_that_copy_when_redelivered(
    db: PgPool,
) {
    let (mut stack, id) = sandbox_with_files(db, crash(CommandKind::Archive, Step::Captured)).await;
    stop_durably(&stack, &id).await;
    let stop = durable_snapshot(&stack, &id).await.unwrap();
    // The recorded stop lacks a chunk, so the archive stores the disk anew; hostd dies with
    // that copy whole and recorded, before it reports.
    remove_a_chunk_of(&stack, &id).await;
    assert_eq!(stack.request(&id, "archive").await.0, 202);
    crashed_then_restart(&mut stack, 0, "archive:captured", None).await;
    // The redelivered archive reports the copy it recorded instead of storing a third one.
    stack.wait_state(&id, "archived").await;
    let archived = durable_snapshot(&stack, &id).await.unwrap();
    assert_ne!(archived, stop, "stored anew");
    freed(&stack, &id).await;
    eventually("only the archived copy is left in the store", || async {
        manifests_of(&stack, &id).len() == 1
    })
    .await;
    assert!(manifest_stored(&stack, archived));
    starts_with_its_files(&stack, &id).await;
    delete_leaves_nothing(&stack, &id).await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn hostd_killed_while_the_delete_frees_an_archived_disk_converges_and_unarchives_with_its_files(
    db: PgPool,
) {
    let (mut stack, id) = sandbox_with_files(db, crash(CommandKind::Delete, Step::TornDown)).await;
    // `archived` is written with the delete that frees the disk; hostd dies in that delete.
    archived(&stack, &id).await;
    crashed(&mut stack, 0, "delete:torn-down").await;
    // The worst place to die: the removal of the sandbox dir got past its record and its disk
    // image. The redelivered delete removes what is left by derived names.
    let dir = stack.hosts[0].state_dir.join("sandboxes").join(&id);
    for gone in ["record.json", "disk.img"] {
        std::fs::remove_file(dir.join(gone)).unwrap();
    }
    stack.restart_host(0).await;
    freed(&stack, &id).await;
    assert_eq!(stack.state_of(&id).await, "archived");
    // The unarchive lands on the same host: the delete (older) never undoes it.
    starts_with_its_files(&stack, &id).await;
    delete_leaves_nothing(&stack, &id).await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_unarchive_that_reaches_the_host_before_the_freeing_delete_drops_the_old_copy_and_the_late_delete_is_refused_stale(
    db: PgPool,
) {
    // Every delete fails on the host before it touches anything (and is redelivered): the
    // delete queued with `archived` is held back there until the unarchive has come.
    let (mut stack, id) = sandbox_with_files(db, fail(CommandKind::Delete, Step::Fenced)).await;
    archived(&stack, &id).await;
    let host = stack.hosts[0].host_id;
    let (delete, generation): (uuid::Uuid, i64) = sqlx::query_as(
        "SELECT id, generation FROM commands
          WHERE sandbox_id = $1::uuid AND kind = 'sandbox.delete'",
    )
    .bind(&id)
    .fetch_one(&stack.db)
    .await
    .unwrap();
    let log = stack.hosts[0].state_dir.with_extension("log");
    eventually(
        "the freeing delete reached its host and failed there",
        || async {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("fault injection: failing the command")
        },
    )
    .await;
    assert!(
        !stack.leftovers(&id).is_empty(),
        "the archived disk is still on its host"
    );

    // The unarchive, one generation later, reaches the host first: it drops the old copy and
    // boots from the store, on the same host.
    start_as(&stack, &id, "unarchiving").await;
    runs_with_its_files(&stack, &id).await;
    assert_eq!(host_of(&stack, &id).await, host.0);
    assert!(get(&stack, &id).await["generation"].as_i64() > Some(generation));
    // The held delete comes again and is refused as stale: it removes nothing.
    eventually("the late delete is refused stale", || async {
        sqlx::query_scalar::<_, Option<String>>("SELECT outcome FROM commands WHERE id = $1")
            .bind(delete)
            .fetch_one(&stack.db)
            .await
            .unwrap()
            .as_deref()
            == Some("refused_stale")
    })
    .await;
    assert_eq!(stack.state_of(&id).await, "running");
    assert_eq!(run(&stack, &id, CHECK).await, "kept\nintact\n");
    // One copy: the running one, in the sandbox's own dir; nothing beside it.
    let sandboxes = stack.hosts[0].state_dir.join("sandboxes");
    let entries: Vec<String> = std::fs::read_dir(&sandboxes)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains(&id))
        .collect();
    assert_eq!(
        entries,
        std::slice::from_ref(&id),
        "no copy beside the running one"
    );
    let disk = sandboxes.join(&id).join("disk");
    assert!(disk.join("upper").is_dir() && !disk.join("upper.partial").exists());
    // Capacity: the host holds exactly the running sandbox.
    stack.assert_no_capacity_drift().await;
    let sandbox = get(&stack, &id).await;
    let needs = (
        sandbox["vcpus"].as_i64().unwrap(),
        sandbox["memory_mib"].as_i64().unwrap(),
    );
    assert_eq!(reserved(&stack.db, host).await, needs);

    // Without the failure point, a delete converges as any other.
    stack.hosts[0].stop(false).await;
    stack.hosts[0].env.retain(|(k, _)| k != FAIL_AT_ENV);
    stack.restart_host(0).await;
    delete_leaves_nothing(&stack, &id).await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn hostd_killed_mid_unarchive_download_converges_running_with_its_files(db: PgPool) {
    let (mut stack, id) =
        sandbox_with_files(db, crash(CommandKind::Unarchive, Step::Fetched)).await;
    archived(&stack, &id).await;
    start_as(&stack, &id, "unarchiving").await;
    // It dies with the disk tree fetched beside its place; the redelivered unarchive fetches
    // again into a fresh partial tree and boots.
    crashed_then_restart(&mut stack, 0, "unarchive:fetched", None).await;
    runs_with_its_files(&stack, &id).await;
    stack.assert_no_capacity_drift().await;
    // Nothing of the interrupted download is left beside the disk's upper dir.
    let disk = stack.hosts[0]
        .state_dir
        .join("sandboxes")
        .join(&id)
        .join("disk");
    assert!(disk.join("upper").is_dir() && !disk.join("upper.partial").exists());
    delete_leaves_nothing(&stack, &id).await;
    stack.teardown().await;
}
