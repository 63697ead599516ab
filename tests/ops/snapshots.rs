//! Snapshots of running sandboxes on the real stack (issue 13 items 3 and 4): a runc sandbox
//! is frozen, captured and thawed, and keeps running; the snapshot becomes `ready` only once its
//! manifest is in the stack's object store; a second one stores only what changed; the routes'
//! refusals, the org's quota and the delete; and an object store that refuses the upload, or a
//! real S3 server killed mid-upload, fails the snapshot, never the sandbox.

use std::time::Duration;

use reqwest::Method;
use serde_json::Value;
use sqlx::PgPool;

use crate::support::http::running_sandbox;
use crate::support::{Stack, SETTLE_TIMEOUT};

/// Polls the snapshot until it leaves `creating`; returns it.
async fn settled(stack: &Stack, id: &str) -> Value {
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    loop {
        let (status, body) = stack
            .call(Method::GET, &format!("/v1/snapshots/{id}"), None)
            .await;
        assert_eq!(status, 200, "{body}");
        if body["state"] != "creating" {
            return body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "snapshot {id} never settled: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn snapshot(stack: &Stack, sandbox: &str) -> (u16, Value) {
    stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{sandbox}/snapshot"),
            None,
        )
        .await
}

async fn run(stack: &Stack, sandbox: &str, script: &str) -> Value {
    let (status, out) = stack.exec(sandbox, &["sh", "-c", script]).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["exit_code"], 0, "{script}: {out}");
    out
}

/// `(type, snapshot_id)` of the sandbox's snapshot events, in order.
async fn snapshot_events(db: &PgPool, sandbox: &str) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT type, snapshot_id::text FROM events
          WHERE sandbox_id = $1::uuid AND type LIKE 'snapshot.%' ORDER BY at, id",
    )
    .bind(sandbox)
    .fetch_all(db)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_running_sandbox_is_snapshotted_in_place_and_a_second_snapshot_stores_only_what_changed(
    db: PgPool,
) {
    let stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    run(
        &stack,
        &id,
        "head -c 3000000 /dev/urandom > /root/big && echo one > /root/note",
    )
    .await;

    let (status, first) = snapshot(&stack, &id).await;
    assert_eq!(status, 202, "{first}");
    assert_eq!(first["state"], "creating");
    let first_id = first["id"].as_str().unwrap().to_owned();
    let first = settled(&stack, &first_id).await;
    assert_eq!(first["state"], "ready", "{first}");
    assert_eq!(first["holds"], "disk");
    assert!(first["paused_ms"].as_i64().is_some(), "{first}");
    assert!(
        first["stored_bytes"].as_i64().unwrap() >= 3_000_000,
        "{first}"
    );
    let manifest = stack
        .object_store_dir()
        .join(format!("manifests/{first_id}.json"));
    assert!(
        manifest.is_file(),
        "ready means the manifest is stored: {}",
        manifest.display()
    );
    assert_eq!(
        stack.state_of(&id).await,
        "running",
        "a snapshot does not stop its sandbox"
    );
    let out = run(&stack, &id, "cat /root/note").await;
    assert_eq!(out["stdout"], "one\n", "the sandbox was thawed");

    run(&stack, &id, "echo two > /root/note2").await;
    let (status, second) = snapshot(&stack, &id).await;
    assert_eq!(status, 202, "{second}");
    let second = settled(&stack, second["id"].as_str().unwrap()).await;
    assert_eq!(second["state"], "ready", "{second}");
    assert_eq!(
        second["parent_id"],
        first_id.as_str(),
        "incremental against the first"
    );
    let new_bytes = second["new_bytes"].as_i64().unwrap();
    assert!(
        new_bytes < 100_000,
        "only the changes are stored again: {second}"
    );

    let (status, list) = stack
        .call(Method::GET, &format!("/v1/sandboxes/{id}/snapshots"), None)
        .await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["snapshots"].as_array().unwrap().len(), 2);
    let events = snapshot_events(&db, &id).await;
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "snapshot.created",
            "snapshot.ready",
            "snapshot.created",
            "snapshot.ready"
        ]
    );
    assert_eq!(events[1].1, first_id);

    // Another org sees none of it.
    let (_, other) = berth_api::auth::create_org(&db, &format!("other-{}", uuid::Uuid::new_v4()))
        .await
        .unwrap();
    let (status, _) = stack
        .call_as(
            &other,
            Method::GET,
            &format!("/v1/snapshots/{first_id}"),
            None,
        )
        .await;
    assert_eq!(status, 404);
    let (status, _) = stack
        .call_as(
            &other,
            Method::POST,
            &format!("/v1/sandboxes/{id}/snapshot"),
            None,
        )
        .await;
    assert_eq!(status, 404);
    // Its list is `not_found` for another org, as for an id no one has.
    let unknown = berth_schemas::ids::SandboxId::new();
    for (key, sandbox) in [(&other, id.clone()), (&stack.key, unknown.to_string())] {
        let (status, body) = stack
            .call_as(
                key,
                Method::GET,
                &format!("/v1/sandboxes/{sandbox}/snapshots"),
                None,
            )
            .await;
        assert_eq!(status, 404, "{body}");
        assert_eq!(body["error"]["code"], "not_found", "{body}");
    }

    // Deleting the first keeps what the second still references.
    let (status, body) = stack
        .call(Method::DELETE, &format!("/v1/snapshots/{first_id}"), None)
        .await;
    assert_eq!(status, 204, "{body}");
    assert!(!manifest.exists());
    let (status, _) = stack
        .call(Method::GET, &format!("/v1/snapshots/{first_id}"), None)
        .await;
    assert_eq!(status, 404);
    let big_chunks: i64 = sqlx::query_scalar("SELECT count(*) FROM snapshot_chunks")
        .fetch_one(&db)
        .await
        .unwrap();
    assert!(
        big_chunks > 0,
        "the second snapshot's chunks stay referenced"
    );

    // A deleted sandbox's snapshots stay.
    let (status, _) = stack.delete(&id).await;
    assert_eq!(status, 202);
    stack.wait_state(&id, "deleted").await;
    let (status, kept) = stack
        .call(
            Method::GET,
            &format!("/v1/snapshots/{}", second["id"].as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!((status, kept["state"].as_str()), (200, Some("ready")));
    let (status, list) = stack
        .call(Method::GET, &format!("/v1/sandboxes/{id}/snapshots"), None)
        .await;
    assert_eq!(status, 200, "a deleted sandbox's list: {list}");
    assert_eq!(list["snapshots"].as_array().unwrap().len(), 1, "{list}");
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn snapshots_are_refused_when_not_running_over_quota_and_deletes_while_creating(db: PgPool) {
    let stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    let org: String = sqlx::query_scalar(
        "SELECT o.name FROM orgs o JOIN sandboxes s ON s.org_id = o.id WHERE s.id = $1::uuid",
    )
    .bind(&id)
    .fetch_one(&db)
    .await
    .unwrap();
    let limits = berth_store::orgs::SnapshotQuota {
        max_snapshots: Some(1),
        max_snapshot_bytes: None,
    };
    assert!(berth_store::orgs::set_snapshot_quota(&db, &org, limits)
        .await
        .unwrap());
    let (status, list) = stack
        .call(Method::GET, &format!("/v1/sandboxes/{id}/snapshots"), None)
        .await;
    assert_eq!(status, 200, "a sandbox without snapshots: {list}");
    assert_eq!(list["snapshots"], serde_json::json!([]), "{list}");
    let (status, first) = snapshot(&stack, &id).await;
    assert_eq!(status, 202, "{first}");
    let (status, body) = snapshot(&stack, &id).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["limit"], "max_snapshots", "{body}");
    let first = settled(&stack, first["id"].as_str().unwrap()).await;
    assert_eq!(first["state"], "ready", "{first}");

    let (status, _) = stack.request(&id, "stop").await;
    assert_eq!(status, 202);
    stack.wait_state(&id, "stopped").await;
    let limits = berth_store::orgs::SnapshotQuota::default();
    assert!(berth_store::orgs::set_snapshot_quota(&db, &org, limits)
        .await
        .unwrap());
    let (status, body) = snapshot(&stack, &id).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["state"], "stopped", "{body}");
    let (status, _) = stack
        .call(
            Method::POST,
            "/v1/sandboxes/00000000-0000-0000-0000-000000000000/snapshot",
            None,
        )
        .await;
    assert_eq!(status, 404);

    // A snapshot still creating cannot be deleted: its host is writing it.
    let creating = berth_schemas::ids::SnapshotId::new();
    sqlx::query(
        "INSERT INTO snapshots (id, org_id, sandbox_id, host_id, state, template, runtime, vcpus, memory_mib, disk_mib, command_id)
         SELECT $1, org_id, id, host_id, 'creating', template, runtime, 1, 256, 64, gen_random_uuid() FROM sandboxes WHERE id = $2::uuid",
    )
    .bind(creating)
    .bind(&id)
    .execute(&db)
    .await
    .unwrap();
    let (status, body) = stack
        .call(Method::DELETE, &format!("/v1/snapshots/{creating}"), None)
        .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["state"], "creating", "{body}");
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_object_store_that_refuses_the_upload_fails_the_snapshot_and_never_the_sandbox(
    db: PgPool,
) {
    let mut stack = Stack::start(db.clone(), 0).await;
    // An S3 endpoint nothing listens on: every request of the upload is refused.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let env = [
        ("BERTH_OBJECT_STORE", "s3://berth/snapshots".to_owned()),
        ("AWS_ENDPOINT", format!("http://127.0.0.1:{dead}")),
        ("AWS_ALLOW_HTTP", "true".to_owned()),
        ("AWS_ACCESS_KEY_ID", "k".to_owned()),
        ("AWS_SECRET_ACCESS_KEY", "s".to_owned()),
        ("AWS_REGION", "us-east-1".to_owned()),
    ];
    stack
        .add_host_env(
            (None, None),
            &[],
            None,
            env.iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        )
        .await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo before > /root/f").await;
    let (status, body) = snapshot(&stack, &id).await;
    assert_eq!(status, 202, "{body}");
    let failed = settled(&stack, body["id"].as_str().unwrap()).await;
    assert_eq!(failed["state"], "failed", "{failed}");
    assert!(
        failed["reason"].as_str().unwrap().contains("object store"),
        "{failed}"
    );
    assert!(
        failed.get("stored_bytes").is_none(),
        "nothing reported stored: {failed}"
    );
    assert_eq!(
        stack.state_of(&id).await,
        "running",
        "the sandbox is untouched"
    );
    let out = run(&stack, &id, "cat /root/f && echo after > /root/g").await;
    assert_eq!(out["stdout"], "before\n", "and still answers, thawed");
    let kinds: Vec<String> = snapshot_events(&db, &id)
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(kinds, ["snapshot.created", "snapshot.failed"]);
    stack.teardown().await;
}

/// The `.zst` chunk objects under `dir` (an S3 server's directory of a key prefix).
fn stored_chunks(dir: &std::path::Path) -> usize {
    let Ok(shards) = std::fs::read_dir(dir) else {
        return 0;
    };
    shards
        .flatten()
        .filter_map(|shard| std::fs::read_dir(shard.path()).ok())
        .flat_map(|objects| objects.flatten())
        .filter(|o| o.file_name().to_string_lossy().ends_with(".zst"))
        .count()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_s3_server_killed_mid_upload_fails_the_snapshot_and_once_back_takes_the_next(
    db: PgPool,
) {
    use crate::support::s3::S3Server;
    use crate::support::throttle::Throttle;
    const PREFIX: &str = "snapshots/berth";
    let mut stack = Stack::start(db.clone(), 0).await;
    let root = stack.root.join("s3");
    let s3 = S3Server::start(&root);
    // A slow link to the store (1 MiB/s per connection): the 40 MB below take over ten seconds
    // to upload, so the server is surely killed mid-upload.
    let link = Throttle::start(s3.port, 1 << 20).await;
    let env = s3.env(PREFIX, link.port);
    // The first host fits one sandbox: the clone at the end goes to the second, which fetches
    // the snapshot from the S3 server.
    stack
        .add_host_env((Some(1), Some(256)), &[], None, env.clone())
        .await;
    let id = running_sandbox(&stack).await;
    run(
        &stack,
        &id,
        "head -c 40000000 /dev/urandom > /root/big && md5sum /root/big > /root/sum && echo before > /root/f",
    )
    .await;

    let (status, body) = snapshot(&stack, &id).await;
    assert_eq!(status, 202, "{body}");
    let doomed = body["id"].as_str().unwrap().to_owned();
    let stored = s3.dir_of(PREFIX);
    let chunks = stored.join("chunks");
    let manifest = |id: &str| stored.join(format!("manifests/{id}.json"));
    crate::support::eventually("the upload stores its first chunk", || async {
        stored_chunks(&chunks) > 0
    })
    .await;
    assert!(
        !manifest(&doomed).exists(),
        "the upload is still in progress"
    );
    s3.kill();

    let failed = settled(&stack, &doomed).await;
    assert_eq!(failed["state"], "failed", "{failed}");
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("object store"), "{failed}");
    assert!(
        failed.get("stored_bytes").is_none(),
        "nothing reported stored: {failed}"
    );
    assert!(!manifest(&doomed).exists(), "nothing made durable");
    let kinds: Vec<String> = snapshot_events(&db, &id)
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        kinds,
        ["snapshot.created", "snapshot.failed"],
        "never reported ready"
    );
    assert_eq!(
        stack.state_of(&id).await,
        "running",
        "the sandbox is untouched"
    );
    let out = run(&stack, &id, "cat /root/f && md5sum -c /root/sum >/dev/null").await;
    assert_eq!(out["stdout"], "before\n", "and still answers, thawed");

    // The server back on the same directory and port: the next snapshot is durable, and a
    // clone on the other host boots from it.
    let port = s3.port;
    drop(s3);
    let s3 = S3Server::start_on(&root, port);
    let (status, body) = snapshot(&stack, &id).await;
    assert_eq!(status, 202, "{body}");
    let ready = settled(&stack, body["id"].as_str().unwrap()).await;
    assert_eq!(ready["state"], "ready", "{ready}");
    assert!(
        ready["stored_bytes"].as_i64().unwrap() >= 40_000_000,
        "{ready}"
    );
    let ready_id = ready["id"].as_str().unwrap().to_owned();
    assert!(manifest(&ready_id).is_file(), "ready means stored");
    stack.add_host_env((None, None), &[], None, env).await;
    let (status, clone) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/clone"),
            Some(serde_json::json!({ "snapshot_id": ready_id })),
        )
        .await;
    assert_eq!(status, 202, "{clone}");
    let clone_id = clone["id"].as_str().unwrap().to_owned();
    stack.wait_state(&clone_id, "running").await;
    assert_ne!(
        crate::support::http::host_of(&stack, &clone_id).await,
        crate::support::http::host_of(&stack, &id).await,
        "the clone fetched from the store on the other host"
    );
    let out = run(
        &stack,
        &clone_id,
        "cat /root/f && md5sum -c /root/sum >/dev/null",
    )
    .await;
    assert_eq!(out["stdout"], "before\n");
    stack.assert_no_capacity_drift().await;
    drop(s3);
    stack.teardown().await;
}

/// A snapshot that fails on its host says why in words the user can act on, never with the
/// host's file-system paths (they stay in hostd's log): here the local object store cannot
/// take the upload (its `chunks` directory is a file).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_failed_snapshots_reason_names_no_host_path(db: PgPool) {
    let stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo data > /root/f").await;
    let objects = stack.object_store_dir();
    let chunks = objects.join("chunks");
    std::fs::create_dir_all(&objects).unwrap();
    let _ = std::fs::remove_dir_all(&chunks);
    std::fs::write(&chunks, b"not a directory").unwrap();

    let (status, body) = snapshot(&stack, &id).await;
    assert_eq!(status, 202, "{body}");
    let failed = settled(&stack, body["id"].as_str().unwrap()).await;
    std::fs::remove_file(&chunks).unwrap();
    assert_eq!(failed["state"], "failed", "{failed}");
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("object store"), "{failed}");
    let root = std::env::var("BERTH_TEST_ROOT").unwrap_or_else(|_| "/var/tmp".into());
    for host_path in [objects.display().to_string(), root, "/var/".into()] {
        assert!(
            !reason.contains(&host_path),
            "the reason leaks {host_path}: {failed}"
        );
    }
    assert_eq!(
        stack.state_of(&id).await,
        "running",
        "the sandbox is untouched"
    );
    stack.teardown().await;
}
