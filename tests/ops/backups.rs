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
