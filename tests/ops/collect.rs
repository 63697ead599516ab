//! Every delete collects what a sandbox's durable stop stored (issue 14), not only a user's
//! `DELETE`: the reconciler's auto-delete and expiry, the operator's org delete and the
//! OpenSandbox compat kill remove its manifest and the chunks nothing else references. A start
//! and a newer durable stop collect the stop snapshot they supersede.

use std::time::Duration;

use berth_reconciler::pass::PassConfig;
use reqwest::Method;
use sqlx::PgPool;

use crate::archive::{stop_durably, stored_chunks, walk};
use crate::resume::run;
use crate::support::http::running_sandbox;
use crate::support::{eventually, Stack};

/// A running sandbox with a file of its own (so its durable stop stores chunks no other
/// sandbox's does), stopped durably; its durable stop snapshot's id.
async fn durably_stopped(stack: &Stack) -> (String, uuid::Uuid) {
    let id = running_sandbox(stack).await;
    run(stack, &id, "head -c 200000 /dev/urandom > /root/own").await;
    stop_durably(stack, &id).await;
    let snapshot = sqlx::query_scalar("SELECT durable_snapshot FROM sandboxes WHERE id = $1::uuid")
        .bind(&id)
        .fetch_one(&stack.db)
        .await
        .unwrap();
    (id, snapshot)
}

pub(crate) fn manifest_stored(stack: &Stack, snapshot: uuid::Uuid) -> bool {
    let name = format!("{snapshot}.json");
    walk(&stack.object_store_dir())
        .iter()
        .any(|p| p.file_name().is_some_and(|n| n == name.as_str()))
}

/// Waits until `id` is deleted and what its durable stop stored is gone: its manifest, its
/// chunk references and the row's `durable_snapshot`.
pub(crate) async fn collected(stack: &Stack, id: &str, snapshot: uuid::Uuid) {
    // From the database: an org's delete revoked the key the API would be asked with.
    eventually("the sandbox is deleted", || async {
        sqlx::query_scalar::<_, String>("SELECT state FROM sandboxes WHERE id = $1::uuid")
            .bind(id)
            .fetch_one(&stack.db)
            .await
            .unwrap()
            == "deleted"
    })
    .await;
    eventually(
        "the durable stop's manifest is removed from the store",
        || async { !manifest_stored(stack, snapshot) },
    )
    .await;
    let (refs, named): (i64, Option<uuid::Uuid>) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM durable_chunks WHERE sandbox_id = $1::uuid),
                (SELECT durable_snapshot FROM sandboxes WHERE id = $1::uuid)",
    )
    .bind(id)
    .fetch_one(&stack.db)
    .await
    .unwrap();
    assert_eq!((refs, named), (0, None), "{id}");
}

/// Once every sandbox is deleted, no chunk is left in the store.
async fn no_chunks_left(stack: &Stack) {
    eventually("every chunk is removed from the store", || async {
        stored_chunks(&stack.object_store_dir()) == 0
    })
    .await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_reconcilers_auto_delete_and_expiry_collect_the_durable_stop(db: PgPool) {
    let config = PassConfig {
        interval: Duration::from_millis(100),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db, 1, config).await;
    let (auto, auto_snapshot) = durably_stopped(&stack).await;
    let (expiring, expiring_snapshot) = durably_stopped(&stack).await;
    assert!(manifest_stored(&stack, auto_snapshot) && manifest_stored(&stack, expiring_snapshot));
    assert!(stored_chunks(&stack.object_store_dir()) > 0);

    // Auto-delete: `auto_delete_minutes` passed (back-dated, not waited for).
    let (status, body) = stack
        .call(
            Method::PATCH,
            &format!("/v1/sandboxes/{auto}"),
            Some(serde_json::json!({"auto_delete_minutes": 1})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    sqlx::query(
        "UPDATE sandboxes SET updated_at = now() - interval '2 minutes' WHERE id = $1::uuid",
    )
    .bind(&auto)
    .execute(&stack.db)
    .await
    .unwrap();
    collected(&stack, &auto, auto_snapshot).await;
    assert!(
        manifest_stored(&stack, expiring_snapshot),
        "another sandbox's durable stop is kept"
    );

    // Expiry with `on_expiry: delete`.
    let at = chrono::Utc::now() + chrono::Duration::seconds(1);
    let (status, body) = stack
        .call(
            Method::PATCH,
            &format!("/v1/sandboxes/{expiring}"),
            Some(serde_json::json!({"expires_at": at.to_rfc3339(), "on_expiry": "delete"})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    collected(&stack, &expiring, expiring_snapshot).await;
    no_chunks_left(&stack).await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_org_delete_and_a_compat_kill_collect_the_durable_stop(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let (killed, killed_snapshot) = durably_stopped(&stack).await;
    let (kept, kept_snapshot) = durably_stopped(&stack).await;

    // The OpenSandbox kill collects as Berth's own delete does, before it answers.
    let resp = stack
        .http
        .request(
            Method::DELETE,
            stack.url(&format!("/compat/opensandbox/v1/sandboxes/{killed}")),
        )
        .header("OPEN-SANDBOX-API-KEY", &stack.key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 204);
    assert!(
        !manifest_stored(&stack, killed_snapshot),
        "collected before the kill answered"
    );
    collected(&stack, &killed, killed_snapshot).await;
    assert!(manifest_stored(&stack, kept_snapshot));

    // `berth admin delete-org` (a process without the object store): the API's collector.
    let name: String = sqlx::query_scalar(
        "SELECT o.name FROM orgs o JOIN sandboxes s ON s.org_id = o.id WHERE s.id = $1::uuid",
    )
    .bind(&kept)
    .fetch_one(&stack.db)
    .await
    .unwrap();
    let deleted = berth_api::service::orgs::delete(&stack.db, &name)
        .await
        .unwrap();
    assert_eq!(deleted.sandboxes_deleted, 1);
    collected(&stack, &kept, kept_snapshot).await;
    no_chunks_left(&stack).await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// The manifests in the store (every snapshot's and durable stop's).
fn manifests(stack: &Stack) -> Vec<String> {
    walk(&stack.object_store_dir())
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect()
}

/// Stop → start cycles (the attack of issue 14's durable stops): each start, and each newer
/// durable stop, supersedes the stop snapshot before, and the collector removes it, so the
/// store holds at most the current durable stop's manifest; a delete leaves nothing.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn stop_start_cycles_keep_only_the_current_durable_stop_and_a_delete_leaves_nothing(
    db: PgPool,
) {
    let stack = Stack::start(db, 1).await;
    let id = running_sandbox(&stack).await;
    let mut earlier = Vec::new();
    for cycle in 0..3 {
        // New content every cycle, so each stop stores chunks the one before did not.
        run(&stack, &id, "head -c 300000 /dev/urandom > /root/own").await;
        stop_durably(&stack, &id).await;
        let current: uuid::Uuid =
            sqlx::query_scalar("SELECT durable_snapshot FROM sandboxes WHERE id = $1::uuid")
                .bind(&id)
                .fetch_one(&stack.db)
                .await
                .unwrap();
        eventually(
            "only the current durable stop's manifest is stored",
            || async { manifests(&stack) == [current.to_string()] },
        )
        .await;
        for old in &earlier {
            assert!(
                !manifest_stored(&stack, *old),
                "cycle {cycle}: {old} collected"
            );
        }
        earlier.push(current);
        assert_eq!(stack.request(&id, "start").await.0, 202);
        stack.wait_state(&id, "running").await;
        eventually("a start's superseded stop is collected", || async {
            manifests(&stack).is_empty()
        })
        .await;
    }
    // Its chunks go after its manifest (claimed one by one).
    eventually("nothing references a chunk while it runs", || async {
        stored_chunks(&stack.object_store_dir()) == 0
    })
    .await;
    run(&stack, &id, "head -c 300000 /dev/urandom > /root/own").await;
    stop_durably(&stack, &id).await;
    assert!(stored_chunks(&stack.object_store_dir()) > 0);
    let (status, body) = stack
        .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert!(status == 200 || status == 202, "{status} {body}");
    stack.wait_state(&id, "deleted").await;
    eventually("nothing of the sandbox is left in the store", || async {
        manifests(&stack).is_empty() && stored_chunks(&stack.object_store_dir()) == 0
    })
    .await;
    let left: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM durable_superseded WHERE sandbox_id = $1::uuid)
              + (SELECT count(*) FROM durable_chunks WHERE sandbox_id = $1::uuid)",
    )
    .bind(&id)
    .fetch_one(&stack.db)
    .await
    .unwrap();
    assert_eq!(left, 0);
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// A start right after a stop, while the stop's background upload is storing chunks (its
/// manifest not yet): the upload is not cut short (it would leave chunks no manifest names)
/// but finishes off the command chain; its late report hands the snapshot to the collector.
/// With the file it stored gone before the next stop, a delete then leaves no chunk at all.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_start_during_a_stop_upload_leaves_no_chunk_no_manifest_names(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = running_sandbox(&stack).await;
    // 200 MB of chunks: long enough an upload to start in the middle of.
    run(&stack, &id, "head -c 200000000 /dev/urandom > /root/big").await;
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    let store = stack.object_store_dir();
    let deadline = std::time::Instant::now() + crate::support::SETTLE_TIMEOUT;
    while stored_chunks(&store) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the upload never began"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let (status, body) = stack.request(&id, "start").await;
    assert_eq!(status, 202, "{body}");
    let mid_upload = manifests(&stack).is_empty();
    eprintln!(
        "started with {} chunks stored and {} manifest",
        stored_chunks(&store),
        if mid_upload { "no" } else { "its" }
    );
    stack.wait_state(&id, "running").await;
    // What the stop stored is named by nothing now: it goes.
    run(&stack, &id, "rm /root/big").await;
    eventually(
        "the cut upload's chunks and manifest are collected",
        || async { manifests(&stack).is_empty() && stored_chunks(&store) == 0 },
    )
    .await;
    let (status, body) = stack
        .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert!(status == 200 || status == 202, "{status} {body}");
    stack.wait_state(&id, "deleted").await;
    eventually("nothing is left in the store", || async {
        manifests(&stack).is_empty() && stored_chunks(&store) == 0
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}
