//! Guarantee 7: one org never sees or touches another org's sandboxes.

use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use crate::support::Stack;

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn another_orgs_sandbox_is_not_found_on_every_route(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let (status, created) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"memory_mib": 256, "metadata": {"owner": "me"}})),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    let (_, other_key) = berth_api::auth::create_org(&stack.db, "other")
        .await
        .unwrap();
    let routes = [
        (Method::GET, format!("/v1/sandboxes/{id}"), None),
        (Method::POST, format!("/v1/sandboxes/{id}/stop"), None),
        (Method::POST, format!("/v1/sandboxes/{id}/pause"), None),
        (Method::POST, format!("/v1/sandboxes/{id}/start"), None),
        (Method::POST, format!("/v1/sandboxes/{id}/resume"), None),
        (
            Method::POST,
            format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": ["true"]})),
        ),
        (
            Method::POST,
            format!("/v1/sandboxes/{id}/exec/stream"),
            Some(json!({"cmd": ["true"]})),
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{id}/files?path=/etc/passwd"),
            None,
        ),
        (
            Method::PUT,
            format!("/v1/sandboxes/{id}/files?path=/root/x"),
            None,
        ),
        (Method::GET, format!("/v1/sandboxes/{id}/events"), None),
        (
            Method::PATCH,
            format!("/v1/sandboxes/{id}"),
            Some(json!({"metadata": {"taken": "yes"}})),
        ),
        (
            Method::POST,
            format!("/v1/sandboxes/{id}/renew"),
            Some(json!({"extend_seconds": 60})),
        ),
        (
            Method::GET,
            format!("/v1/sandboxes/{id}/wait?state=running&timeout=1s"),
            None,
        ),
        (
            Method::POST,
            format!("/v1/sandboxes/{id}/stop?wait=stopped&timeout=1s"),
            None,
        ),
        (Method::GET, format!("/v1/events?sandbox_id={id}"), None),
        (Method::DELETE, format!("/v1/sandboxes/{id}"), None),
    ];
    for (method, path, body) in routes {
        let (status, resp) = stack.call_as(&other_key, method.clone(), &path, body).await;
        assert_eq!(status, 404, "{method} {path}: {resp}");
        assert_eq!(resp["error"]["code"], "not_found");
    }
    for path in ["/v1/sandboxes", "/v1/sandboxes?metadata.owner=me"] {
        let (status, list) = stack.call_as(&other_key, Method::GET, path, None).await;
        assert_eq!(status, 200);
        assert_eq!(
            list["sandboxes"],
            json!([]),
            "the other org lists nothing: {path}"
        );
    }
    // The owner's sandbox was untouched by all of that.
    let running = stack.wait_state(&id, "running").await;
    assert_eq!(running["generation"], 1);
    assert_eq!(running["metadata"], json!({"owner": "me"}));
    assert_eq!(running["expires_at"], serde_json::Value::Null);

    let (status, _) = stack
        .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(status, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}
