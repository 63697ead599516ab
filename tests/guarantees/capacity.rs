//! Guarantee 4: host capacity reserved = sum of the resources of the sandboxes placed there
//! that hold capacity, at every commit; and placement never goes beyond it.

use berth_schemas::SandboxId;
use futures::future::join_all;
use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use crate::support::http::host_of;
use crate::support::{inproc, Stack};

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
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

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
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

/// Guarantee 4 at one step: the host's reservation equals the summed resources of the
/// sandboxes placed there that hold capacity, and the drift gauge's query agrees.
async fn assert_reserved_is_the_sum(plane: &inproc::Plane, step: &str) {
    let held: (i64, i64) = sqlx::query_as(
        "SELECT COALESCE(sum(vcpus), 0)::int8, COALESCE(sum(memory_mib), 0)::int8
           FROM sandboxes WHERE host_id = $1 AND holds_capacity",
    )
    .bind(plane.host)
    .fetch_one(&plane.db)
    .await
    .unwrap();
    assert_eq!(
        inproc::reserved(&plane.db, plane.host).await,
        held,
        "reserved (vcpus, memory_mib) after {step}"
    );
    assert_eq!(
        berth_reconciler::pass::capacity_drift(&plane.db)
            .await
            .unwrap(),
        (0, 0),
        "drift after {step}"
    );
}

/// Delivers the host's report on the sandbox's newest command.
async fn report(plane: &inproc::Plane, id: SandboxId, succeeded: bool) {
    let command = plane.latest(id).await;
    let outcome = if succeeded {
        inproc::succeeded(command.kind)
    } else {
        inproc::failed()
    };
    plane.deliver(&command, outcome).await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn guarantee_4_reserved_capacity_equals_the_sum_over_capacity_holding_sandboxes_at_every_step(
    db: PgPool,
) {
    let plane = inproc::Plane::start(db).await;
    assert_reserved_is_the_sum(&plane, "nothing").await;
    let a = plane.create().await;
    assert_reserved_is_the_sum(&plane, "create a").await;
    let b = plane
        .api
        .create(&plane.org.key, r#"{"vcpus":2,"memory_mib":512}"#)
        .await;
    assert_reserved_is_the_sum(&plane, "create b").await;
    let c = plane.create().await;
    assert_reserved_is_the_sum(&plane, "create c").await;

    // (request or none, sandbox, whether the host reports success)
    let steps: [(Option<&str>, SandboxId, bool); 12] = [
        (None, a, true),
        (None, b, false),
        (None, c, true),
        (Some("stop"), a, true),
        (Some("start"), a, true),
        (Some("start"), b, false),
        (Some("stop"), c, false),
        (Some("delete"), c, true),
        (Some("pause"), a, true),
        (Some("resume"), a, true),
        (Some("delete"), a, true),
        (Some("delete"), b, true),
    ];
    for (request, id, succeeded) in steps {
        let name = format!("{} of {id}", request.unwrap_or("create"));
        if let Some(verb) = request {
            plane.request(id, verb).await;
            assert_reserved_is_the_sum(&plane, &format!("{name} accepted")).await;
        }
        report(&plane, id, succeeded).await;
        let outcome = if succeeded { "succeeded" } else { "failed" };
        assert_reserved_is_the_sum(&plane, &format!("{name} {outcome}")).await;
    }
    plane.assert_capacity_released().await;
}
