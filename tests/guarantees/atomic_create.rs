//! Guarantee 1: placement, the sandbox row, its command and its event commit together or not
//! at all. A refused or failed create leaves nothing behind.

use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use crate::support::{inproc, Stack};

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
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
            json!({"disk_mib": 0}),
            400,
            "invalid_request",
            Some("disk_mib"),
        ),
        (
            json!({"disk_mib": 63}),
            400,
            "invalid_request",
            Some("disk_mib"),
        ),
        (
            json!({"disk_mib": 65_537}),
            400,
            "invalid_request",
            Some("disk_mib"),
        ),
        (
            json!({"disk_mib": "big"}),
            400,
            "invalid_request",
            Some("disk_mib"),
        ),
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
    for schema in ["CreateSandbox", "Sandbox"] {
        let disk = &doc["components"]["schemas"][schema]["properties"]["disk_mib"];
        assert!(disk.is_object(), "{schema} documents disk_mib");
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

/// Makes every insert into `events` fail in the test's own database: the create transaction's
/// last insert (after the row, the placement and the command).
const FAIL_EVENT_INSERTS: &str = "
    CREATE FUNCTION berth_test_fail_insert() RETURNS trigger AS $$
    BEGIN
        RAISE EXCEPTION 'insert refused by the test';
    END;
    $$ LANGUAGE plpgsql;
    CREATE TRIGGER berth_test_fail_events BEFORE INSERT ON events
        FOR EACH ROW EXECUTE FUNCTION berth_test_fail_insert();";

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_create_whose_transaction_fails_at_its_last_insert_leaves_no_row_command_event_or_reservation(
    db: PgPool,
) {
    let plane = inproc::Plane::start(db.clone()).await;
    let before = inproc::reserved(&db, plane.host).await;
    sqlx::raw_sql(FAIL_EVENT_INSERTS)
        .execute(&db)
        .await
        .unwrap();

    let reply = plane
        .api
        .call(
            &plane.org.key,
            axum::http::Method::POST,
            "/v1/sandboxes",
            Some("create-that-fails"),
            Some(inproc::SANDBOX),
        )
        .await;
    assert!(
        reply.status >= 500,
        "a failed transaction is a server error: {reply:?}"
    );

    for (what, table) in [
        ("sandbox row", "sandboxes"),
        ("command", "commands"),
        ("event", "events"),
        ("idempotency record", "idempotency_keys"),
    ] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&db)
            .await
            .unwrap();
        assert_eq!(n, 0, "a {what} of the failed create is left");
    }
    assert_eq!(
        inproc::reserved(&db, plane.host).await,
        before,
        "the host's reservation changed"
    );
    assert_eq!(
        berth_reconciler::pass::capacity_drift(&db).await.unwrap(),
        (0, 0)
    );

    // The same request once the database accepts events again: all of it commits.
    sqlx::raw_sql("DROP TRIGGER berth_test_fail_events ON events")
        .execute(&db)
        .await
        .unwrap();
    let id = plane.create().await;
    assert_eq!(inproc::commands_of(&db, id).await.len(), 1);
    assert_eq!(inproc::event_states(&db, id).await, ["provisioning"]);
    assert_eq!(inproc::reserved(&db, plane.host).await, (1, 256));
}

/// Concurrent creates with one `Idempotency-Key` all get the one sandbox they made: the key is
/// held for each request's transaction, so a later one waits for the first to commit and
/// replays its answer instead of failing placement against the first one's reservation (an
/// attacker saw 6 answers of 202 and 2 of 503 for one sandbox, before).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn concurrent_creates_with_one_key_all_get_the_one_sandbox(db: PgPool) {
    let plane = inproc::Plane::start(db).await;
    // The whole host's memory (memory is not overcommitted): only one of these fits.
    let body = format!(
        r#"{{"vcpus":1,"memory_mib":{}}}"#,
        inproc::HOST_CAPACITY.memory_mib
    );
    let replies = futures::future::join_all((0..8).map(|_| {
        plane.api.call(
            &plane.org.key,
            Method::POST,
            "/v1/sandboxes",
            Some("one-key-for-all"),
            Some(&body),
        )
    }))
    .await;
    let ids: std::collections::HashSet<String> = replies
        .iter()
        .map(|r| {
            assert_eq!(r.status, 202, "{}", r.body);
            r.body["id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(ids.len(), 1, "one key, one sandbox: {ids:?}");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes")
        .fetch_one(&plane.db)
        .await
        .unwrap();
    assert_eq!(rows, 1);
}
