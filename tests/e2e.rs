//! End-to-end: the whole path from `POST /v1/sandboxes` to a real runc container and back,
//! against the real Postgres, NATS and `berth hostd` processes.

mod common;

use common::Stack;
use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn a_sandbox_runs_stops_keeps_its_files_starts_and_is_deleted_without_a_trace(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stack.create().await;
    let running = stack.wait_state(&id, "running").await;
    assert!(running["address"].is_string(), "{running}");
    assert_eq!(running["host_id"], stack.hosts[0].host_id.to_string());
    let live = stack.leftovers(&id);
    for part in ["container", "netns", "veth", "dir", "mount"] {
        assert!(
            live.iter().any(|l| l.contains(part)),
            "a running sandbox has its {part}: {live:?}"
        );
    }

    let (status, out) = stack.exec(&id, &["echo", "hello"]).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["stdout"], "hello\n");
    assert_eq!(out["exit_code"], 0);
    let (_, out) = stack
        .exec(&id, &["sh", "-c", "echo kept > /root/note; exit 3"])
        .await;
    assert_eq!(out["exit_code"], 3, "{out}");

    let (status, body) = stack
        .call(Method::POST, &format!("/v1/sandboxes/{id}/stop"), None)
        .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], "stopping");
    let stopped = stack.wait_state(&id, "stopped").await;
    assert_eq!(stopped["last_stop"], "disk");
    let (status, body) = stack.exec(&id, &["true"]).await;
    assert_eq!(status, 409, "exec on a stopped sandbox: {body}");
    assert_eq!(body["error"]["code"], "conflict");

    let (status, body) = stack
        .call(Method::POST, &format!("/v1/sandboxes/{id}/start"), None)
        .await;
    assert_eq!(status, 202, "{body}");
    stack.wait_state(&id, "running").await;
    let (_, out) = stack.exec(&id, &["cat", "/root/note"]).await;
    assert_eq!(
        out["stdout"], "kept\n",
        "the file written before the stop survives it"
    );

    let (status, body) = stack
        .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(status, 202, "{body}");
    assert!(body["deleted_at"].is_string());
    stack.wait_state(&id, "deleted").await;
    assert_eq!(stack.leftovers(&id), Vec::<String>::new());

    let events: Vec<String> =
        sqlx::query_scalar("SELECT to_state FROM events WHERE sandbox_id = $1::uuid ORDER BY id")
            .bind(&id)
            .fetch_all(&stack.db)
            .await
            .unwrap();
    assert_eq!(
        events,
        [
            "provisioning",
            "running",
            "stopping",
            "stopped",
            "starting",
            "running",
            "stopping",
            "deleted"
        ]
    );
    let reserved: (i32, i64) =
        sqlx::query_as("SELECT reserved_vcpus, reserved_memory_mib FROM hosts")
            .fetch_one(&stack.db)
            .await
            .unwrap();
    assert_eq!(reserved, (0, 0), "a deleted sandbox holds no capacity");
    stack.teardown().await;
}

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

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn another_orgs_sandbox_is_not_found_on_every_route(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stack.create().await;
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
        (Method::GET, format!("/v1/events?sandbox_id={id}"), None),
        (Method::DELETE, format!("/v1/sandboxes/{id}"), None),
    ];
    for (method, path, body) in routes {
        let (status, resp) = stack.call_as(&other_key, method.clone(), &path, body).await;
        assert_eq!(status, 404, "{method} {path}: {resp}");
        assert_eq!(resp["error"]["code"], "not_found");
    }
    let (status, list) = stack
        .call_as(&other_key, Method::GET, "/v1/sandboxes", None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(list["sandboxes"], json!([]), "the other org lists nothing");
    // The owner's sandbox was untouched by all of that.
    let running = stack.wait_state(&id, "running").await;
    assert_eq!(running["generation"], 1);

    let (status, _) = stack
        .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(status, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn listing_is_paginated_newest_first_and_filters_by_state(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(stack.create().await);
    }
    for id in &ids {
        stack.wait_state(id, "running").await;
    }
    let (status, page1) = stack.call(Method::GET, "/v1/sandboxes?limit=2", None).await;
    assert_eq!(status, 200, "{page1}");
    let got: Vec<&str> = page1["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(got, [ids[2].as_str(), ids[1].as_str()]);
    let cursor = page1["next_cursor"].as_str().unwrap();
    let (_, page2) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes?limit=2&cursor={cursor}"),
            None,
        )
        .await;
    assert_eq!(page2["sandboxes"].as_array().unwrap().len(), 1);
    assert_eq!(page2["sandboxes"][0]["id"], ids[0].as_str());
    assert!(page2["next_cursor"].is_null());

    let (status, _) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/stop", ids[0]),
            None,
        )
        .await;
    assert_eq!(status, 202);
    stack.wait_state(&ids[0], "stopped").await;
    let (_, stopped) = stack
        .call(Method::GET, "/v1/sandboxes?state=stopped", None)
        .await;
    assert_eq!(stopped["sandboxes"].as_array().unwrap().len(), 1);
    let (status, bad) = stack
        .call(Method::GET, "/v1/sandboxes?state=paused", None)
        .await;
    assert_eq!(status, 400, "{bad}");
    assert_eq!(bad["error"]["field"], "state");

    for id in &ids {
        stack
            .call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await;
    }
    for id in &ids {
        stack.wait_state(id, "deleted").await;
    }
    let (_, live) = stack.call(Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(
        live["sandboxes"],
        json!([]),
        "tombstones are not listed by default"
    );
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn exec_edge_cases_answer_at_once_with_a_clear_result(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let path = format!("/v1/sandboxes/{id}/exec");
    let exec = |cmd: serde_json::Value| {
        stack.call(
            Method::POST,
            &path,
            Some(json!({ "cmd": cmd, "timeout_ms": 20_000 })),
        )
    };

    // Output beyond one message is cut at the cap, not lost to a transport error.
    let (status, out) = exec(json!([
        "sh",
        "-c",
        "head -c 3000000 /dev/zero | tr '\\0' a"
    ]))
    .await;
    assert_eq!(
        status,
        200,
        "{}",
        &out.to_string()[..200.min(out.to_string().len())]
    );
    let cap = berth_hostd::agent::protocol::MAX_CAPTURED_OUTPUT;
    assert_eq!(out["stdout"].as_str().unwrap().len(), cap);
    let (status, out) = exec(json!([
        "sh",
        "-c",
        "head -c 700000 /dev/zero | tr '\\0' a; head -c 700000 /dev/zero | tr '\\0' b >&2"
    ]))
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        out["stdout"].as_str().unwrap().len() + out["stderr"].as_str().unwrap().len(),
        2 * cap
    );

    // A background child that keeps the pipes open neither swallows nor delays the output.
    let (status, out) = exec(json!(["sh", "-c", "sleep 60 & echo started"])).await;
    assert_eq!(
        (status, out["stdout"].as_str(), out["timed_out"].as_bool()),
        (200, Some("started\n"), Some(false)),
        "{out}"
    );

    // A missing program is the user's mistake: exit 127, like a shell.
    let (status, out) = exec(json!(["/nonexistent"])).await;
    assert_eq!(
        (status, out["exit_code"].as_i64()),
        (200, Some(127)),
        "{out}"
    );

    // Requests that cannot travel are refused up front, naming the field.
    let big = "x".repeat(600 * 1024);
    let (status, out) = exec(json!(["echo", big])).await;
    assert_eq!(
        (status, out["error"]["field"].as_str()),
        (400, Some("cmd")),
        "{}",
        out["error"]
    );
    let (status, out) = exec(json!([""])).await;
    assert_eq!((status, out["error"]["field"].as_str()), (400, Some("cmd")));

    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}
