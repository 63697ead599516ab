//! Guarantee 4: host capacity reserved = sum of the resources of the sandboxes placed there
//! that hold capacity, at every commit; and placement never goes beyond it.

use futures::future::join_all;
use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use crate::support::http::host_of;
use crate::support::Stack;

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn a_host_without_free_capacity_is_never_chosen(db: PgPool) {
    let mut stack = Stack::start(db, 0).await;
    let small = stack.add_host_with((Some(8), Some(128))).await; // less than one sandbox's memory
    stack.add_host().await;
    let small_id = stack.hosts[small].host_id.as_uuid();
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(stack.create().await);
    }
    for id in &ids {
        stack.wait_state(id, "running").await;
        assert_ne!(host_of(&stack, id).await, small_id);
    }
    let reserved: i64 = sqlx::query_scalar("SELECT reserved_memory_mib FROM hosts WHERE id = $1")
        .bind(small_id)
        .fetch_one(&stack.db)
        .await
        .unwrap();
    assert_eq!(reserved, 0);
    for id in &ids {
        stack.delete(id).await;
    }
    for id in &ids {
        stack.wait_state(id, "deleted").await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn quotas_hold_under_twenty_concurrent_creates_and_deleting_rows_do_not_count(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let org: String = sqlx::query_scalar("SELECT name FROM orgs")
        .fetch_one(&stack.db)
        .await
        .unwrap();
    assert!(berth_api::quota::set(&stack.db, &org, Some(3), None, None)
        .await
        .unwrap());
    let body = json!({"template": "base", "vcpus": 1, "memory_mib": 128});
    let results =
        join_all((0..20).map(|_| stack.call(Method::POST, "/v1/sandboxes", Some(body.clone()))))
            .await;
    let accepted: Vec<String> = results
        .iter()
        .filter(|(s, _)| *s == 202)
        .map(|(_, b)| b["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(accepted.len(), 3, "{results:?}");
    for (status, body) in results.iter().filter(|(s, _)| *s != 202) {
        assert_eq!(*status, 429, "{body}");
        assert_eq!(body["error"]["code"], "quota_exceeded");
        assert_eq!(body["error"]["limit"], "max_running");
    }
    // A sandbox being deleted frees its place at once, before its host confirms.
    stack.hosts[0].freeze();
    assert_eq!(stack.delete(&accepted[0]).await.0, 202);
    let (status, replacement) = stack
        .call(Method::POST, "/v1/sandboxes", Some(body.clone()))
        .await;
    assert_eq!(status, 202, "{replacement}");
    stack.hosts[0].thaw();
    let mut all = accepted.clone();
    all.push(replacement["id"].as_str().unwrap().to_owned());
    for id in &all[1..] {
        stack.wait_state(id, "running").await;
    }
    for id in &all {
        stack.delete(id).await;
    }
    for id in &all {
        stack.wait_state(id, "deleted").await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}
