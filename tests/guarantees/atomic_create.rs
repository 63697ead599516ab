//! Guarantee 1: placement, the sandbox row, its command and its event commit together or not
//! at all. A refused or failed create leaves nothing behind.

use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use crate::support::Stack;

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn bad_input_gets_a_clear_error_and_writes_nothing(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let cases = [
        (json!({"template": "nope"}), 422, "unknown_template", None),
        (json!({"vcpus": 0}), 400, "invalid_request", Some("vcpus")),
        (
            json!({"memory_mib": 10_000_000}),
            400,
            "invalid_request",
            Some("memory_mib"),
        ),
        (
            json!({"vcpus": "two"}),
            400,
            "invalid_request",
            Some("vcpus"),
        ),
        (json!({"colour": "blue"}), 400, "invalid_request", None),
        (
            json!({"metadata": {"a": 1}}),
            400,
            "invalid_request",
            Some("metadata"),
        ),
        (
            json!({"metadata": {"k": "a\u{0}b"}}),
            400,
            "invalid_request",
            Some("metadata"),
        ),
        (
            json!({"template": "ba\u{0}se"}),
            400,
            "invalid_request",
            Some("template"),
        ),
    ];
    for (body, status, code, field) in cases {
        let (got, resp) = stack
            .call(Method::POST, "/v1/sandboxes", Some(body.clone()))
            .await;
        assert_eq!(got, status, "{body} → {resp}");
        assert_eq!(resp["error"]["code"], code, "{body} → {resp}");
        if let Some(field) = field {
            assert_eq!(resp["error"]["field"], field, "{body} → {resp}");
        }
    }
    let malformed = stack
        .http
        .post(stack.url("/v1/sandboxes"))
        .bearer_auth(&stack.key)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(malformed.status(), 400);

    for key in ["", "berth_wrong", "Bearer"] {
        let (status, body) = stack
            .call_as(key, Method::POST, "/v1/sandboxes", Some(json!({})))
            .await;
        assert_eq!(status, 401, "{body}");
        assert_eq!(body["error"]["code"], "unauthorized");
    }
    let unauthenticated = stack
        .http
        .get(stack.url("/v1/sandboxes"))
        .send()
        .await
        .unwrap();
    assert_eq!(unauthenticated.status(), 401);
    let lowercase = stack
        .http
        .get(stack.url("/v1/sandboxes"))
        .header("authorization", format!("bearer {}", stack.key))
        .send()
        .await
        .unwrap();
    assert_eq!(
        lowercase.status(),
        200,
        "the auth scheme is case-insensitive"
    );
    // axum's own rejections answer in the error shape too.
    let (status, body) = stack.call(Method::PATCH, "/v1/sandboxes", None).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (405, Some("method_not_allowed")),
        "{body}"
    );
    let doc: serde_json::Value = stack
        .http
        .get(stack.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for param in doc["paths"]["/v1/sandboxes"]["get"]["parameters"]
        .as_array()
        .unwrap()
    {
        assert_eq!(param["in"], "query", "{param}");
    }

    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"vcpus": 32, "memory_mib": 65536})),
        )
        .await;
    assert_eq!(status, 503, "more than any host has: {body}");
    assert_eq!(body["error"]["code"], "no_capacity");

    let written: i64 = sqlx::query_scalar("SELECT (SELECT count(*) FROM sandboxes) + (SELECT count(*) FROM commands) + (SELECT count(*) FROM events)")
        .fetch_one(&stack.db)
        .await
        .unwrap();
    assert_eq!(written, 0, "bad input wrote nothing");
    let reserved: i64 =
        sqlx::query_scalar("SELECT COALESCE(sum(reserved_vcpus), 0)::int8 FROM hosts")
            .fetch_one(&stack.db)
            .await
            .unwrap();
    assert_eq!(reserved, 0);
    stack.teardown().await;
}
