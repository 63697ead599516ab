//! Durable stops, archive and unarchive on the real stack (issue 14, first slice): a stop
//! becomes durable in the object store in the background; an archived sandbox's disk is freed
//! by the delete the control plane sends with `archived`, and it comes back with its files on
//! the other host; an archive whose chunk check finds a lost chunk, or that finds its recorded
//! stop lacking a chunk, never loses the disk; auto-archive; an S3 server killed
//! mid-archive leaves the sandbox stopped with its disk, and a later archive succeeds; a
//! delete during `archiving` and `archived`; an archived sandbox shows no host.

use std::time::Duration;

use berth_reconciler::pass::PassConfig;
use reqwest::Method;
use serde_json::Value;
use sqlx::PgPool;

use crate::resume::{count, run, COUNTER};
use crate::support::http::{host_of, running_sandbox};
use crate::support::inproc::{self, Plane};
use crate::support::{eventually, Stack};

pub(crate) async fn get(stack: &Stack, id: &str) -> Value {
    let (status, body) = stack
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(status, 200, "{body}");
    body
}

/// Stops `id` and waits until its stop is durable; returns the sandbox.
pub(crate) async fn stop_durably(stack: &Stack, id: &str) -> Value {
    assert_eq!(stack.request(id, "stop").await.0, 202);
    stack.wait_state(id, "stopped").await;
    eventually("the stop becomes durable", || async {
        !get(stack, id).await["durable_at"].is_null()
    })
    .await;
    get(stack, id).await
}

/// Waits until the host's copy of the archived `id` is freed: the delete the control plane
/// queued with `archived` landed (the two-phase free; hostd never frees it on its own).
pub(crate) async fn freed(stack: &Stack, id: &str) {
    eventually(
        "the archived sandbox's disk is freed on its host",
        || async { stack.leftovers(id).is_empty() },
    )
    .await;
}

/// `(to_state, reason, message)` of each event of the sandbox, oldest first.
pub(crate) async fn events(db: &PgPool, id: &str) -> Vec<(String, String, Option<String>)> {
    sqlx::query_as(
        "SELECT to_state, reason, message FROM events
          WHERE sandbox_id = $1::uuid AND snapshot_id IS NULL ORDER BY id",
    )
    .bind(id)
    .fetch_all(db)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_archived_sandbox_frees_its_disk_and_unarchives_on_the_other_host_with_its_files(
    db: PgPool,
) {
    let mut stack = Stack::start(db.clone(), 0).await;
    // The first host fits one sandbox: once it runs another, the unarchive must go elsewhere.
    stack.add_host_with((Some(1), Some(256))).await;
    let id = running_sandbox(&stack).await;
    run(
        &stack,
        &id,
        "echo kept > /root/f && head -c 3000000 /dev/urandom > /root/blob && md5sum /root/blob > /root/sum",
    )
    .await;
    let first_host = host_of(&stack, &id).await;
    let stopped = stop_durably(&stack, &id).await;
    assert_eq!(stopped["state"], "stopped");

    let (status, body) = stack.request(&id, "archive").await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], "archiving", "{body}");
    let (status, body) = stack.request(&id, "archive").await;
    assert!(
        status == 200 || status == 202,
        "archive again: {status} {body}"
    );
    stack.wait_state(&id, "archived").await;
    freed(&stack, &id).await;
    let archived = get(&stack, &id).await;
    assert!(!archived["durable_at"].is_null(), "{archived}");
    // Requests an archived sandbox refuses.
    assert_eq!(stack.request(&id, "stop").await.0, 200, "already settled");
    let (status, body) = stack
        .call(Method::POST, &format!("/v1/sandboxes/{id}/snapshot"), None)
        .await;
    assert_eq!(status, 409, "{body}");
    stack.assert_no_capacity_drift().await;

    // Fill the first host, then give the unarchive a second one.
    let filler = running_sandbox(&stack).await;
    assert_eq!(host_of(&stack, &filler).await, first_host);
    stack.add_host().await;
    let (status, body) = stack.request(&id, "start").await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], "unarchiving", "{body}");
    stack.wait_state(&id, "running").await;
    assert_ne!(host_of(&stack, &id).await, first_host, "placed elsewhere");
    let out = run(
        &stack,
        &id,
        "cat /root/f && md5sum -c /root/sum >/dev/null && echo intact",
    )
    .await;
    assert_eq!(out, "kept\nintact\n");
    let running = get(&stack, &id).await;
    assert!(
        running["durable_at"].is_null(),
        "a running sandbox: {running}"
    );
    stack.assert_no_capacity_drift().await;
    let states: Vec<String> = events(&db, &id)
        .await
        .into_iter()
        .map(|(to, _, _)| to)
        .collect();
    assert_eq!(
        states,
        [
            "provisioning",
            "running",
            "stopping",
            "stopped",
            "archiving",
            "archived",
            "unarchiving",
            "running"
        ]
    );
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_stopped_sandbox_is_auto_archived_after_its_interval(db: PgPool) {
    let config = PassConfig {
        interval: Duration::from_millis(100),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db.clone(), 1, config).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo kept > /root/f").await;
    stop_durably(&stack, &id).await;
    let (status, body) = stack
        .call(
            Method::PATCH,
            &format!("/v1/sandboxes/{id}"),
            Some(serde_json::json!({"auto_archive_days": 1})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["auto_archive_days"], 1, "{body}");
    let (status, body) = stack
        .call(
            Method::PATCH,
            &format!("/v1/sandboxes/{id}"),
            Some(serde_json::json!({"auto_archive_days": 0})),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(stack.state_of(&id).await, "stopped", "a day has not passed");
    // The tests' seconds override of `auto_archive_days`.
    sqlx::query("UPDATE sandboxes SET auto_archive_seconds = 1 WHERE id = $1::uuid")
        .bind(&id)
        .execute(&stack.db)
        .await
        .unwrap();
    stack.wait_state(&id, "archived").await;
    let reasons: Vec<(String, String)> = events(&db, &id)
        .await
        .into_iter()
        .map(|(to, reason, _)| (to, reason))
        .collect();
    assert!(
        reasons.contains(&("archiving".to_owned(), "auto_archive".to_owned())),
        "{reasons:?}"
    );
    freed(&stack, &id).await;
    assert_eq!(stack.request(&id, "start").await.0, 202);
    stack.wait_state(&id, "running").await;
    assert_eq!(run(&stack, &id, "cat /root/f").await, "kept\n");
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_delete_is_accepted_while_archiving_and_once_archived(db: PgPool) {
    let stack = Stack::start(db.clone(), 1).await;
    // Archiving: the delete waits for nothing; the host's delete follows its archive.
    let a = running_sandbox(&stack).await;
    assert_eq!(stack.request(&a, "stop").await.0, 202);
    stack.wait_state(&a, "stopped").await;
    assert_eq!(stack.request(&a, "archive").await.0, 202);
    let (status, body) = stack.delete(&a).await;
    assert_eq!(status, 202, "{body}");
    stack.wait_state(&a, "deleted").await;
    eventually("the deleted sandbox left nothing", || async {
        stack.leftovers(&a).is_empty()
    })
    .await;
    // Archived: a tombstone at once.
    let b = running_sandbox(&stack).await;
    stop_durably(&stack, &b).await;
    assert_eq!(stack.request(&b, "archive").await.0, 202);
    stack.wait_state(&b, "archived").await;
    let snapshot: uuid::Uuid =
        sqlx::query_scalar("SELECT durable_snapshot FROM sandboxes WHERE id = $1::uuid")
            .bind(&b)
            .fetch_one(&stack.db)
            .await
            .unwrap();
    let manifest = format!("{snapshot}.json");
    let stored = |name: &str| {
        walk(&stack.object_store_dir())
            .iter()
            .any(|p| p.file_name().is_some_and(|n| n == name))
    };
    assert!(stored(&manifest), "the archive is in the store");
    let (status, body) = stack.delete(&b).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], "deleted", "{body}");
    assert_eq!(stack.request(&b, "start").await.0, 409);
    assert!(
        !stored(&manifest),
        "its stored content is collected with the sandbox"
    );
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// The `.zst` chunk objects under `dir` (an S3 server's directory of a key prefix).
pub(crate) fn stored_chunks(dir: &std::path::Path) -> usize {
    walk(dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "zst"))
        .count()
}

pub(crate) fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_s3_server_killed_mid_archive_leaves_it_stopped_with_its_disk_and_a_later_archive_succeeds(
    db: PgPool,
) {
    use crate::support::s3::S3Server;
    use crate::support::throttle::Throttle;
    const PREFIX: &str = "archives/berth";
    let mut stack = Stack::start(db.clone(), 0).await;
    let root = stack.root.join("s3");
    let s3 = S3Server::start(&root);
    // 1 MiB/s per connection: the 20 MB below take long enough to kill the server mid-upload.
    let link = Throttle::start(s3.port, 1 << 20).await;
    let env = s3.env(PREFIX, link.port);
    stack.add_host_env((None, None), &[], None, env).await;
    let id = running_sandbox(&stack).await;
    run(
        &stack,
        &id,
        "head -c 20000000 /dev/urandom > /root/big && md5sum /root/big > /root/sum && echo before > /root/f",
    )
    .await;
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    // The archive cancels the stop's background upload and uploads itself.
    let (status, body) = stack.request(&id, "archive").await;
    assert_eq!(status, 202, "{body}");
    let chunks = s3.dir_of(PREFIX).join("chunks");
    eventually("the upload stores a chunk", || async {
        stored_chunks(&chunks) > 0
    })
    .await;
    assert_eq!(stack.state_of(&id).await, "archiving");
    // The request × state table's choice: a start while archiving is refused, not queued.
    let (status, body) = stack.request(&id, "start").await;
    assert_eq!(status, 409, "{body}");
    s3.kill();

    stack.wait_state(&id, "stopped").await;
    let last = events(&db, &id).await.pop().unwrap();
    assert_eq!(
        (last.0.as_str(), last.1.as_str()),
        ("stopped", "runtime_error")
    );
    let message = last.2.unwrap_or_default();
    assert!(message.contains("keeps its disk"), "{message}");
    // The user reads what failed, never the store's endpoint or a host path.
    assert!(message.contains("the object store failed"), "{message}");
    assert!(
        !message.contains('/') && !message.contains("127.0.0.1"),
        "{message}"
    );
    assert!(
        !stack.leftovers(&id).is_empty(),
        "the disk stays on its host"
    );
    assert!(get(&stack, &id).await["durable_at"].is_null());

    // The server back on the same directory and port: the next archive succeeds, and the
    // sandbox comes back with its files.
    let port = s3.port;
    drop(s3);
    let s3 = S3Server::start_on(&root, port);
    assert_eq!(stack.request(&id, "archive").await.0, 202);
    stack.wait_state(&id, "archived").await;
    freed(&stack, &id).await;
    assert_eq!(stack.request(&id, "start").await.0, 202);
    stack.wait_state(&id, "running").await;
    assert_eq!(
        run(&stack, &id, "cat /root/f && md5sum -c /root/sum >/dev/null").await,
        "before\n"
    );
    stack.assert_no_capacity_drift().await;
    drop(s3);
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_gvisor_sandbox_archived_after_a_memory_stop_continues_its_processes_on_the_other_host(
    db: PgPool,
) {
    let mut stack = Stack::start(db.clone(), 0).await;
    stack.add_host_with((Some(1), Some(256))).await;
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(serde_json::json!({"template": "base-gvisor", "vcpus": 1, "memory_mib": 256})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    let first_host = host_of(&stack, &id).await;
    run(&stack, &id, COUNTER).await;
    let pid = run(&stack, &id, "cat /root/pid").await;
    let stopped = stop_durably(&stack, &id).await;
    assert_eq!(stopped["last_stop"], "memory", "{stopped}");
    assert_eq!(stack.request(&id, "archive").await.0, 202);
    stack.wait_state(&id, "archived").await;
    freed(&stack, &id).await;

    let filler = running_sandbox(&stack).await;
    assert_eq!(host_of(&stack, &filler).await, first_host);
    stack.add_host().await;
    assert_eq!(stack.request(&id, "start").await.0, 202);
    stack.wait_state(&id, "running").await;
    assert_ne!(host_of(&stack, &id).await, first_host);
    // The same process, still counting.
    run(&stack, &id, &format!("kill -0 {}", pid.trim())).await;
    let first = count(&stack, &id).await;
    eventually("the unarchived counter counts on", || async {
        count(&stack, &id).await > first
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_archive_whose_host_never_answers_times_out_to_stopped_and_its_late_archive_keeps_the_disk(
    db: PgPool,
) {
    let config = PassConfig {
        interval: Duration::from_millis(100),
        archive_timeout: Duration::from_secs(10),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db.clone(), 1, config).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo kept > /root/f").await;
    stop_durably(&stack, &id).await;
    stack.hosts[0].freeze();
    assert_eq!(stack.request(&id, "archive").await.0, 202);
    let stopped = stack.wait_state(&id, "stopped").await;
    let reason = stopped["state_reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("timeout") && reason.contains("sandbox.archive"),
        "{stopped}"
    );
    stack.hosts[0].thaw();
    // The host archives late (its result is fenced: the row stays stopped, and what it
    // stored goes to the collector) and, never freeing a disk on its own, keeps the disk...
    let record = stack.hosts[0]
        .state_dir
        .join("sandboxes")
        .join(&id)
        .join("record.json");
    eventually("the late archive is recorded on its host", || async {
        std::fs::read_to_string(&record).is_ok_and(|r| r.contains("durable_by"))
    })
    .await;
    assert_eq!(stack.state_of(&id).await, "stopped");
    assert!(
        !stack.leftovers(&id).is_empty(),
        "the disk stays on its host"
    );
    // ...so a start boots it there with its files.
    assert_eq!(stack.request(&id, "start").await.0, 202);
    stack.wait_state(&id, "running").await;
    assert_eq!(run(&stack, &id, "cat /root/f").await, "kept\n");
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_unarchive_whose_host_never_answers_fails_start_releasing_capacity_and_a_delete_while_unarchiving_converges(
    db: PgPool,
) {
    let config = PassConfig {
        interval: Duration::from_millis(100),
        archive_timeout: Duration::from_secs(10),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db.clone(), 1, config).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo kept > /root/f").await;
    stop_durably(&stack, &id).await;
    assert_eq!(stack.request(&id, "archive").await.0, 202);
    stack.wait_state(&id, "archived").await;
    stack.hosts[0].freeze();
    let (status, body) = stack.request(&id, "start").await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], "unarchiving", "{body}");
    let failed = stack.wait_state(&id, "failed-start").await;
    let reason = failed["state_reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("timeout") && reason.contains("sandbox.unarchive"),
        "{failed}"
    );
    stack.assert_no_capacity_drift().await;
    stack.hosts[0].thaw();
    // The late unarchive is stopped by the timeout's compensation, keeping the fetched disk:
    // a start boots it with its files.
    eventually("the compensating stop is applied", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM commands WHERE sandbox_id = $1::uuid
                 AND kind = 'sandbox.stop' AND outcome = 'succeeded'
                 AND generation = (SELECT generation FROM sandboxes WHERE id = $1::uuid))",
        )
        .bind(&id)
        .fetch_one(&db)
        .await
        .unwrap()
    })
    .await;
    assert_eq!(stack.request(&id, "start").await.0, 202);
    stack.wait_state(&id, "running").await;
    assert_eq!(run(&stack, &id, "cat /root/f").await, "kept\n");

    // A delete while `unarchiving`.
    stop_durably(&stack, &id).await;
    assert_eq!(stack.request(&id, "archive").await.0, 202);
    stack.wait_state(&id, "archived").await;
    assert_eq!(stack.request(&id, "start").await.0, 202);
    let (status, body) = stack.delete(&id).await;
    assert_eq!(status, 202, "{body}");
    stack.wait_state(&id, "deleted").await;
    eventually("the deleted sandbox left nothing", || async {
        stack.leftovers(&id).is_empty()
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// The object of chunk `hash` in the stack's object store.
fn chunk_object(stack: &Stack, hash: &str) -> std::path::PathBuf {
    stack
        .object_store_dir()
        .join("chunks")
        .join(&hash[..2])
        .join(format!("{hash}.zst"))
}

/// Removes from the object store the biggest chunk of `id`'s recorded durable stop (as a chunk
/// removal would have); returns its hash.
pub(crate) async fn remove_a_chunk_of(stack: &Stack, id: &str) -> String {
    damage_a_chunk_of(stack, id, Damage::Removed).await
}

/// What happens to a stored chunk of a recorded durable stop.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Damage {
    /// Its object is removed (as a chunk removal would).
    Removed,
    /// Its object is cut to half its length (a torn write, a replaced object).
    Truncated,
}

/// Damages in the object store the biggest chunk of `id`'s recorded durable stop; returns its
/// hash.
pub(crate) async fn damage_a_chunk_of(stack: &Stack, id: &str, damage: Damage) -> String {
    let hash: String = sqlx::query_scalar(
        "SELECT sha256 FROM durable_chunks WHERE sandbox_id = $1::uuid
          ORDER BY stored DESC, sha256 LIMIT 1",
    )
    .bind(id)
    .fetch_one(&stack.db)
    .await
    .unwrap();
    let path = chunk_object(stack, &hash);
    match damage {
        Damage::Removed => std::fs::remove_file(path).expect("the chunk is stored"),
        Damage::Truncated => {
            let body = std::fs::read(&path).expect("the chunk is stored");
            std::fs::write(&path, &body[..body.len() / 2]).unwrap();
        }
    }
    hash
}

/// The stop snapshots of `id` handed to the collector and not collected yet.
async fn awaiting_collection(db: &PgPool, id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM durable_superseded WHERE sandbox_id = $1::uuid")
        .bind(id)
        .fetch_one(db)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_archive_whose_skipped_chunk_a_removal_claimed_stays_stopped_with_its_disk_and_archives_again(
    db: PgPool,
) {
    use crate::crash14::delete_leaves_nothing;
    use crate::migrate::{CHECK, FILES};
    let stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    // A file of one chunk whose hash the test knows: its content is the sandbox's id.
    run(
        &stack,
        &id,
        &format!("{FILES} && printf %s {id} > /root/tag"),
    )
    .await;
    let chunk = berth_storage::chunk::sha256_hex(id.as_bytes());
    // A snapshot delete queued that chunk, and a remover claimed it (nothing references it)
    // and has not removed its object yet.
    let mut conn = db.acquire().await.unwrap();
    berth_store::chunks::queue(&mut conn, std::slice::from_ref(&chunk))
        .await
        .unwrap();
    assert!(berth_store::chunks::claim(&mut conn, &chunk).await.unwrap());
    // The stop's upload stores the chunk; its report is refused (the claimed removal may take
    // the chunk) and its snapshot handed to the collector.
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    eventually("the stop's refused snapshot awaits collection", || async {
        awaiting_collection(&db, &id).await == 1
    })
    .await;
    assert!(chunk_object(&stack, &chunk).is_file());
    assert!(get(&stack, &id).await["durable_at"].is_null());

    // The archive's upload skips the stored chunk and its host finds every chunk there; the
    // control plane's check finds the claim: the archive fails and the disk stays.
    let (status, body) = stack.request(&id, "archive").await;
    assert_eq!((status, body["state"].as_str()), (202, Some("archiving")));
    let stopped = stack.wait_state(&id, "stopped").await;
    let (to, reason, message) = events(&db, &id).await.pop().unwrap();
    assert_eq!((to.as_str(), reason.as_str()), ("stopped", "runtime_error"));
    let message = message.unwrap_or_default();
    assert!(
        message.contains("lost chunks") && message.contains("keeps its disk"),
        "{message}"
    );
    assert_eq!(stopped["state_reason"], message.as_str(), "{stopped}");
    assert!(stopped["durable_at"].is_null(), "{stopped}");
    assert!(
        !stack.leftovers(&id).is_empty(),
        "the disk stays on its host"
    );
    assert_eq!(
        awaiting_collection(&db, &id).await,
        2,
        "the refused archive's snapshot goes to the collector too"
    );
    stack.assert_no_capacity_drift().await;

    // The remover finishes: the chunk's object is gone.
    std::fs::remove_file(chunk_object(&stack, &chunk)).unwrap();
    berth_store::chunks::finish(&mut conn, &chunk)
        .await
        .unwrap();
    drop(conn);
    // Archived again: its host stores the disk anew (the chunk too), the check passes, and the
    // delete queued with `archived` frees the disk.
    assert_eq!(stack.request(&id, "archive").await.0, 202);
    stack.wait_state(&id, "archived").await;
    freed(&stack, &id).await;
    assert!(chunk_object(&stack, &chunk).is_file(), "stored again");
    stack.assert_no_capacity_drift().await;
    assert_eq!(stack.request(&id, "start").await.0, 202);
    stack.wait_state(&id, "running").await;
    assert_eq!(run(&stack, &id, CHECK).await, "kept\nintact\n");
    assert_eq!(run(&stack, &id, "cat /root/tag").await, id);
    delete_leaves_nothing(&stack, &id).await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_archive_whose_recorded_stop_lacks_a_chunk_uploads_again_and_unarchives_with_its_files(
    db: PgPool,
) {
    archive_with_a_damaged_recorded_stop(db, Damage::Removed).await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_archive_whose_recorded_stop_has_a_truncated_chunk_uploads_again_and_unarchives_with_its_files(
    db: PgPool,
) {
    archive_with_a_damaged_recorded_stop(db, Damage::Truncated).await;
}

/// A recorded durable stop whose manifest reads back and one of whose chunks is `damage`d:
/// the archive does not reuse it, stores the disk anew (the chunk whole again), frees the
/// disk, and the sandbox unarchives on the same host with its files.
async fn archive_with_a_damaged_recorded_stop(db: PgPool, damage: Damage) {
    use crate::crash14::{delete_leaves_nothing, durable_snapshot};
    use crate::migrate::{CHECK, FILES};
    let stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, FILES).await;
    stop_durably(&stack, &id).await;
    let stop = durable_snapshot(&stack, &id).await.unwrap();
    let stored: i64 = sqlx::query_scalar(
        "SELECT max(stored)::int8 FROM durable_chunks WHERE sandbox_id = $1::uuid",
    )
    .bind(&id)
    .fetch_one(&db)
    .await
    .unwrap();
    // Its manifest still reads back; one of its chunks does not, whole.
    let damaged = damage_a_chunk_of(&stack, &id, damage).await;
    assert_eq!(stack.request(&id, "archive").await.0, 202);
    stack.wait_state(&id, "archived").await;
    let archived = durable_snapshot(&stack, &id).await.unwrap();
    assert_ne!(
        archived, stop,
        "the disk was stored anew, not the stop reused ({damage:?})"
    );
    let object = chunk_object(&stack, &damaged);
    assert_eq!(
        std::fs::metadata(&object).map(|m| m.len() as i64).ok(),
        Some(stored),
        "the chunk is stored again, whole"
    );
    freed(&stack, &id).await;
    stack.assert_no_capacity_drift().await;
    // Unarchived on the same host, after the delete that freed its disk there.
    assert_eq!(stack.request(&id, "start").await.0, 202);
    stack.wait_state(&id, "running").await;
    assert_eq!(run(&stack, &id, CHECK).await, "kept\nintact\n");
    delete_leaves_nothing(&stack, &id).await;
    stack.teardown().await;
}

/// A sandbox of `plane` created, stopped and archived by hand (each host report delivered
/// through the reconciler's result apply; no hostd): `archived`, on the plane's host.
pub(crate) async fn archived_by_hand(plane: &Plane) -> berth_schemas::SandboxId {
    use berth_schemas::wire::{ResultOutcome, StopDurable};
    let (id, _stop) = plane.stopped().await;
    plane.request(id, "archive").await;
    let archive = plane.latest(id).await;
    let copy = StopDurable {
        snapshot_id: berth_schemas::ids::SnapshotId::new(),
        memory: false,
        stored_bytes: 1,
        chunks: vec![("7".repeat(64), 1)],
    };
    plane.deliver(&archive, ResultOutcome::Durable(copy)).await;
    assert_eq!(inproc::row(&plane.db, id).await.state, "archived");
    id
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_archived_sandbox_shows_no_host_until_a_start_places_it(db: PgPool) {
    let plane = Plane::start(db).await;
    let id = plane.create().await;
    let host = plane.host.to_string();
    assert_eq!(
        plane.shown(id, "").await["host_id"],
        host.as_str(),
        "placed: its host"
    );

    let archived = archived_by_hand(&plane).await;
    let body = plane.shown(archived, "").await;
    assert_eq!(body["state"], "archived");
    assert!(
        body["host_id"].is_null(),
        "an archived sandbox holds no host: {body}"
    );
    // The row still names the host its disk was on (its freeing delete goes there).
    assert_eq!(
        inproc::commands_of(&plane.db, archived)
            .await
            .last()
            .map(|c| (c.kind, c.host_id)),
        Some((berth_schemas::CommandKind::Delete, plane.host))
    );
    // The OpenSandbox surface shows no host at all, archived or not.
    let compat = plane
        .api
        .send(
            axum::http::Request::get(format!("/compat/opensandbox/v1/sandboxes/{archived}"))
                .header("OPEN-SANDBOX-API-KEY", &plane.org.key)
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(compat.status, 200, "{}", compat.body);
    assert_eq!(
        compat.body["status"]["reason"], "archived",
        "{}",
        compat.body
    );
    assert!(!compat.body.to_string().contains(&host), "{}", compat.body);

    // A start places it again: it shows the host it is placed on.
    plane.request(archived, "start").await;
    let body = plane.shown(archived, "").await;
    assert_eq!(body["state"], "unarchiving");
    assert_eq!(body["host_id"], host.as_str(), "{body}");
}
