//! Backups on the real stack (issue 14): `POST /v1/sandboxes/{id}/backup` stores a running
//! sandbox's disk (never its memory) as a snapshot of kind `backup`, `ready` only once its
//! manifest is in the object store; the sandbox keeps running and names its newest ready backup
//! (`last_backup_id`, `last_backup_at`); a sandbox that is not running is 409.

use std::time::Duration;

use reqwest::Method;
use serde_json::Value;
use sqlx::PgPool;

use crate::support::http::running_sandbox;
use crate::support::{Stack, SETTLE_TIMEOUT};

/// Polls the snapshot until it leaves `creating`; returns it.
pub async fn settled(stack: &Stack, id: &str) -> Value {
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
            "backup {id} never settled: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub async fn backup(stack: &Stack, sandbox: &str) -> (u16, Value) {
    stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{sandbox}/backup"),
            None,
        )
        .await
}

pub async fn run(stack: &Stack, sandbox: &str, script: &str) -> Value {
    let (status, out) = stack.exec(sandbox, &["sh", "-c", script]).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["exit_code"], 0, "{script}: {out}");
    out
}

async fn sandbox(stack: &Stack, id: &str) -> Value {
    let (status, body) = stack
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(status, 200, "{body}");
    body
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_backup_is_a_durable_disk_snapshot_named_by_its_running_sandbox(db: PgPool) {
    let stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    assert_eq!(sandbox(&stack, &id).await["last_backup_id"], Value::Null);
    run(&stack, &id, "echo before > /root/note").await;

    let (status, first) = backup(&stack, &id).await;
    assert_eq!(status, 202, "{first}");
    assert_eq!(first["kind"], "backup", "{first}");
    assert_eq!(first["state"], "creating", "{first}");
    let first_id = first["id"].as_str().unwrap().to_owned();
    let first = settled(&stack, &first_id).await;
    assert_eq!(first["state"], "ready", "{first}");
    assert_eq!(first["holds"], "disk", "a backup never keeps memory");
    assert!(
        stack
            .object_store_dir()
            .join(format!("manifests/{first_id}.json"))
            .is_file(),
        "ready means the manifest is stored"
    );
    let row = sandbox(&stack, &id).await;
    assert_eq!(
        row["state"], "running",
        "a backup does not stop its sandbox"
    );
    assert_eq!(row["last_backup_id"], first_id.as_str(), "{row}");
    assert_eq!(row["last_backup_at"], first["ready_at"], "{row}");
    assert_eq!(
        run(&stack, &id, "cat /root/note").await["stdout"],
        "before\n"
    );

    // A second backup becomes the newest; deleting it points the sandbox back at the first.
    let (status, second) = backup(&stack, &id).await;
    assert_eq!(status, 202, "{second}");
    let second_id = second["id"].as_str().unwrap().to_owned();
    assert_eq!(settled(&stack, &second_id).await["state"], "ready");
    assert_eq!(
        sandbox(&stack, &id).await["last_backup_id"],
        second_id.as_str()
    );
    // A user snapshot is not a backup: the sandbox still names the second backup.
    let (status, snap) = stack
        .call(Method::POST, &format!("/v1/sandboxes/{id}/snapshot"), None)
        .await;
    assert_eq!(status, 202, "{snap}");
    assert_eq!(snap["kind"], "snapshot");
    settled(&stack, snap["id"].as_str().unwrap()).await;
    assert_eq!(
        sandbox(&stack, &id).await["last_backup_id"],
        second_id.as_str()
    );
    let (status, _) = stack
        .call(Method::DELETE, &format!("/v1/snapshots/{second_id}"), None)
        .await;
    assert_eq!(status, 204);
    assert_eq!(
        sandbox(&stack, &id).await["last_backup_id"],
        first_id.as_str()
    );
    let newest = berth_store::snapshots::newest_ready_backup(&db, id.parse().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(newest.0.to_string(), first_id);

    // Not running: 409 with the state; unknown: 404.
    let (status, _) = stack.request(&id, "stop").await;
    assert_eq!(status, 202);
    stack.wait_state(&id, "stopped").await;
    let (status, body) = backup(&stack, &id).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["state"], "stopped", "{body}");
    let (status, _) = backup(&stack, "00000000-0000-0000-0000-000000000000").await;
    assert_eq!(status, 404);
    stack.teardown().await;
}

/// The sandbox's backups as `(state, reason of their event)`, oldest first.
async fn backups_of(db: &PgPool, sandbox: &str) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT b.state, e.reason FROM snapshots b
           JOIN events e ON e.snapshot_id = b.id AND e.type = 'snapshot.created'
          WHERE b.sandbox_id = $1::uuid AND b.kind = 'backup' ORDER BY b.created_at",
    )
    .bind(sandbox)
    .fetch_all(db)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_running_sandbox_is_backed_up_every_backup_interval_min(db: PgPool) {
    let config = berth_reconciler::pass::PassConfig {
        interval: Duration::from_millis(100),
        // One minute of `backup_interval_min` lasts 2 s here.
        backup_unit: Duration::from_secs(2),
        ..Default::default()
    };
    let stack = Stack::start_with(db.clone(), 1, config).await;
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(
                serde_json::json!({"template": "base", "vcpus": 1, "memory_mib": 256,
                                    "backup_interval_min": 1}),
            ),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["backup_interval_min"], 1, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;

    crate::support::eventually("two periodic backups are ready", || async {
        let backups = backups_of(&db, &id).await;
        backups.iter().filter(|(s, _)| s == "ready").count() >= 2
    })
    .await;
    let backups = backups_of(&db, &id).await;
    assert!(
        backups.iter().all(|(_, reason)| reason == "auto_backup"),
        "{backups:?}"
    );
    let row = sandbox(&stack, &id).await;
    assert!(row["last_backup_at"].is_string(), "{row}");
    assert_eq!(row["state"], "running");

    // PATCH: 0 is refused; null turns the backups off.
    let patch = |v: Value| {
        let stack = &stack;
        let id = id.clone();
        async move {
            stack
                .call(
                    Method::PATCH,
                    &format!("/v1/sandboxes/{id}"),
                    Some(serde_json::json!({ "backup_interval_min": v })),
                )
                .await
        }
    };
    let (status, body) = patch(serde_json::json!(0)).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["field"], "backup_interval_min", "{body}");
    let (status, body) = patch(Value::Null).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["backup_interval_min"], Value::Null, "{body}");
    // Let a backup in flight settle, then no new one is requested over several intervals.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = backups_of(&db, &id).await.len();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(backups_of(&db, &id).await.len(), before, "backups are off");

    // A stopped sandbox is not backed up even with an interval.
    let (status, _) = patch(serde_json::json!(1)).await;
    assert_eq!(status, 200);
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stopped = backups_of(&db, &id).await.len();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        backups_of(&db, &id).await.len(),
        stopped,
        "not while stopped"
    );
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_gvisor_backup_keeps_the_disk_only_and_its_processes_keep_running(db: PgPool) {
    let stack = Stack::start(db.clone(), 1).await;
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
    run(
        &stack,
        &id,
        "sleep 600 >/dev/null 2>&1 & echo $! > /root/pid; echo kept > /root/f",
    )
    .await;
    let (status, b) = backup(&stack, &id).await;
    assert_eq!(status, 202, "{b}");
    let b = settled(&stack, b["id"].as_str().unwrap()).await;
    assert_eq!(b["state"], "ready", "{b}");
    assert_eq!(b["holds"], "disk", "no checkpoint for a backup: {b}");
    assert_eq!(stack.state_of(&id).await, "running");
    run(&stack, &id, "kill -0 $(cat /root/pid)").await;
    stack.teardown().await;
}
