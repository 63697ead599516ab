//! A sandbox's settings after create (issue 15 items 3 and 4): `PATCH /v1/sandboxes/{id}`
//! (metadata merge, timers, expiry), expiry applied by the reconciler's pass with both
//! actions, renew, and the metadata filter of the list. The lifecycle parts run on the real
//! stack (runc); validation and listing through the API router with a host row.

use std::time::Duration;

use axum::http::Method as AxumMethod;
use berth_reconciler::pass::PassConfig;
use chrono::{DateTime, Utc};
use reqwest::Method;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::support::inproc::{self, Plane};
use crate::support::{Stack, SETTLE_TIMEOUT};

/// A pass every 100 ms, so expiry and auto-stop are applied soon after they are due.
fn quick_passes() -> PassConfig {
    PassConfig {
        interval: Duration::from_millis(100),
        ..PassConfig::default()
    }
}

/// `(type, to_state, reason, message, at)` of every event of the sandbox, in order.
async fn events(
    db: &PgPool,
    id: &str,
) -> Vec<(String, String, String, Option<String>, DateTime<Utc>)> {
    sqlx::query_as(
        "SELECT type, to_state, reason, message, at FROM events WHERE sandbox_id = $1::uuid
          ORDER BY at, id",
    )
    .bind(id)
    .fetch_all(db)
    .await
    .unwrap()
}

/// Polls the sandbox until it is in `state`, for at most `extra` longer than usual.
async fn wait_state_longer(stack: &Stack, id: &str, state: &str, extra: Duration) -> Value {
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT + extra;
    loop {
        let (status, body) = stack
            .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await;
        assert_eq!(status, 200, "{body}");
        if body["state"] == state {
            return body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "sandbox {id} never reached {state}; last seen {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn time(v: &Value) -> DateTime<Utc> {
    v.as_str()
        .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
        .map(|t| t.with_timezone(&Utc))
        .unwrap_or_else(|| panic!("not a time: {v}"))
}

/// The peer bug this pins: turning keep-alive off (auto-stop on) must arm the idle timer, and
/// from now — not from an activity hours old (which would stop it at once) and not never.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn patching_auto_stop_from_off_to_one_minute_rearms_it_from_now_and_stops_the_sandbox(
    db: PgPool,
) {
    let stack = Stack::start_with(db, 1, quick_passes()).await;
    let (status, created) = stack
        .call(
            Method::POST,
            "/v1/sandboxes?wait=running",
            Some(json!({"template": "base", "memory_mib": 256})),
        )
        .await;
    assert_eq!(status, 200, "{created}");
    assert_eq!(created["auto_stop_minutes"], Value::Null);
    let id = created["id"].as_str().unwrap().to_owned();
    // Idle for two hours with auto-stop off: nothing stops it.
    sqlx::query(
        "UPDATE sandboxes SET last_activity_at = now() - interval '2 hours' WHERE id = $1::uuid",
    )
    .bind(&id)
    .execute(&stack.db)
    .await
    .unwrap();

    let (status, patched) = stack
        .call(
            Method::PATCH,
            &format!("/v1/sandboxes/{id}"),
            Some(json!({"auto_stop_minutes": 1})),
        )
        .await;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["auto_stop_minutes"], 1);
    assert_eq!(patched["state"], "running");
    assert_eq!(
        patched["generation"], created["generation"],
        "no new generation"
    );
    let idle: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM now() - last_activity_at)::float8 FROM sandboxes
          WHERE id = $1::uuid",
    )
    .bind(&id)
    .fetch_one(&stack.db)
    .await
    .unwrap();
    assert!(
        idle < 60.0,
        "the PATCH re-armed the idle clock (idle {idle} s)"
    );

    let stopped = wait_state_longer(&stack, &id, "stopped", Duration::from_secs(60)).await;
    assert_eq!(stopped["auto_stop_minutes"], 1);
    let log = events(&stack.db, &id).await;
    let updated = log
        .iter()
        .find(|e| e.0 == "sandbox.updated")
        .expect("a sandbox.updated event");
    assert_eq!(
        (updated.1.as_str(), updated.2.as_str(), updated.3.as_deref()),
        ("running", "user_request", Some("auto_stop_minutes"))
    );
    let auto_stop = log
        .iter()
        .find(|e| e.2 == "auto_stop")
        .expect("an auto_stop event");
    assert_eq!(auto_stop.1, "stopping");
    assert!(
        auto_stop.4 >= updated.4 + chrono::Duration::seconds(60),
        "stopped a minute after the PATCH, not at once: patched {}, stopping {}",
        updated.4,
        auto_stop.4
    );
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_sandbox_expires_by_stop_or_by_delete_with_reason_expired(db: PgPool) {
    let stack = Stack::start_with(db, 1, quick_passes()).await;
    let (status, to_stop) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"memory_mib": 256, "timeout_seconds": 2})),
        )
        .await;
    assert_eq!(status, 202, "{to_stop}");
    assert_eq!(to_stop["on_expiry"], "stop", "stop is the default action");
    assert!(to_stop["expires_at"].is_string(), "{to_stop}");
    // Far enough ahead that a slow request on a loaded machine still sends it in the future;
    // microseconds, as Postgres keeps them.
    let soon = (Utc::now() + chrono::Duration::seconds(10))
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let (status, to_delete) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"memory_mib": 256, "expires_at": soon, "on_expiry": "delete"})),
        )
        .await;
    assert_eq!(status, 202, "{to_delete}");
    assert_eq!(to_delete["on_expiry"], "delete");
    assert_eq!(time(&to_delete["expires_at"]), time(&json!(soon)));

    let stop_id = to_stop["id"].as_str().unwrap().to_owned();
    let delete_id = to_delete["id"].as_str().unwrap().to_owned();
    let stopped = stack.wait_state(&stop_id, "stopped").await;
    assert_eq!(stopped["expires_at"], Value::Null, "an expiry fires once");
    stack.wait_state(&delete_id, "deleted").await;
    for (id, to) in [(&stop_id, "stopping"), (&delete_id, "stopping")] {
        let log = events(&stack.db, id).await;
        // The transition the expiry made (a stop's `sandbox.updated`, auto_resume off, carries
        // reason `expired` too: checked in ops::preview_abuse).
        let expired: Vec<_> = log
            .iter()
            .filter(|e| e.2 == "expired" && e.0 != "sandbox.updated")
            .collect();
        assert_eq!(expired.len(), 1, "{log:?}");
        assert_eq!(expired[0].1, to);
        assert!(expired[0].3.as_deref().unwrap().starts_with("expired at "));
    }
    let deleting: bool =
        sqlx::query_scalar("SELECT deleted_at IS NOT NULL FROM sandboxes WHERE id = $1::uuid")
            .bind(&delete_id)
            .fetch_one(&stack.db)
            .await
            .unwrap();
    assert!(deleting, "on_expiry delete is a delete");

    // A stopped sandbox started again runs on: its expiry was spent.
    let (status, _) = stack.request(&stop_id, "start").await;
    assert_eq!(status, 202);
    stack.wait_state(&stop_id, "running").await;
    let (status, out) = stack.exec(&stop_id, &["echo", "on"]).await;
    assert_eq!((status, out["stdout"].as_str()), (200, Some("on\n")));
    stack.delete(&stop_id).await;
    stack.wait_state(&stop_id, "deleted").await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_renew_pushes_the_expiry_out_and_the_sandbox_stops_only_then(db: PgPool) {
    let stack = Stack::start_with(db, 1, quick_passes()).await;
    let (status, created) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"memory_mib": 256, "timeout_seconds": 20})),
        )
        .await;
    assert_eq!(status, 202, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    let first = time(&created["expires_at"]);
    let (status, renewed) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/renew"),
            Some(json!({"extend_seconds": 10})),
        )
        .await;
    assert_eq!(status, 200, "{renewed}");
    let pushed = time(&renewed["expires_at"]);
    assert_eq!(pushed, first + chrono::Duration::seconds(10));

    stack.wait_state(&id, "stopped").await;
    let log = events(&stack.db, &id).await;
    let renew_event = log
        .iter()
        .find(|e| e.0 == "sandbox.updated")
        .expect("renew event");
    assert!(renew_event
        .3
        .as_deref()
        .unwrap()
        .starts_with("renewed: expires_at "));
    let expired = log
        .iter()
        .find(|e| e.2 == "expired")
        .expect("expired event");
    assert!(
        expired.4 >= pushed,
        "stopped at the renewed expiry ({pushed}), not the first ({first}): {}",
        expired.4
    );

    // Renewing a deleted sandbox is refused with its state.
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    let (status, body) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/renew"),
            Some(json!({"extend_seconds": 10})),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["state"], "deleted");
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_patch_merges_metadata_deletes_null_keys_and_is_idempotent(db: PgPool) {
    let plane = Plane::start(db).await;
    let key = &plane.org.key;
    let body = r#"{"vcpus":1,"memory_mib":256,"metadata":{"team":"ml","stale":"x","env":"dev"}}"#;
    let id = plane.api.create(key, body).await;
    let path = format!("/v1/sandboxes/{id}");
    let patch = r#"{"metadata":{"env":"prod","stale":null,"owner":"ada"},"auto_delete_minutes":30,"on_expiry":"delete"}"#;
    let reply = plane
        .api
        .call(key, AxumMethod::PATCH, &path, Some("patch-1"), Some(patch))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.body["metadata"],
        json!({"team": "ml", "env": "prod", "owner": "ada"})
    );
    assert_eq!(reply.body["auto_delete_minutes"], 30);
    assert_eq!(reply.body["on_expiry"], "delete");
    assert_eq!(
        reply.body["state"], "provisioning",
        "a settings change is no transition"
    );
    assert_eq!(reply.body["generation"], 1);

    // The same key and body: the stored answer, nothing written again.
    let again = plane
        .api
        .call(key, AxumMethod::PATCH, &path, Some("patch-1"), Some(patch))
        .await;
    assert_eq!(again, reply);
    let other = plane
        .api
        .call(
            key,
            AxumMethod::PATCH,
            &path,
            Some("patch-1"),
            Some(r#"{"metadata":{}}"#),
        )
        .await;
    assert_eq!(
        (other.status, other.code()),
        (422, "idempotency_key_reused")
    );
    let updates: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT type, to_state, message FROM events WHERE sandbox_id = $1 AND type = 'sandbox.updated'",
    )
    .bind(id)
    .fetch_all(&plane.db)
    .await
    .unwrap();
    assert_eq!(
        updates,
        [(
            "sandbox.updated".to_owned(),
            "provisioning".to_owned(),
            Some("metadata, auto_delete_minutes, on_expiry".to_owned())
        )]
    );

    // Clearing with null, and an empty patch that changes nothing.
    let reply = plane
        .api
        .call(
            key,
            AxumMethod::PATCH,
            &path,
            None,
            Some(r#"{"auto_delete_minutes":null}"#),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.body["auto_delete_minutes"], Value::Null);
    let empty = plane
        .api
        .call(key, AxumMethod::PATCH, &path, None, Some("{}"))
        .await;
    assert_eq!(empty.status, 200);
    assert_eq!(empty.body["metadata"], reply.body["metadata"]);
    let count: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM events WHERE sandbox_id = $1 AND type = 'sandbox.updated'",
    )
    .bind(id)
    .fetch_one(&plane.db)
    .await
    .unwrap();
    assert_eq!(count, 2, "the empty patch wrote no event");
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn bad_patches_and_renewals_are_refused_and_change_nothing(db: PgPool) {
    let plane = Plane::start(db).await;
    let key = &plane.org.key;
    let id = plane
        .api
        .create(key, r#"{"memory_mib":256,"metadata":{"a":"1"}}"#)
        .await;
    let path = format!("/v1/sandboxes/{id}");
    let past = (Utc::now() - chrono::Duration::minutes(1)).to_rfc3339();
    let full: serde_json::Map<String, Value> =
        (0..64).map(|i| (format!("k{i}"), json!("v"))).collect();
    for (body, field) in [
        (json!({"vcpus": 2}), None),
        (json!({"auto_stop_minutes": -1}), Some("auto_stop_minutes")),
        (
            json!({"auto_delete_minutes": 0}),
            Some("auto_delete_minutes"),
        ),
        (json!({"expires_at": past}), Some("expires_at")),
        (json!({"on_expiry": "archive"}), Some("on_expiry")),
        (json!({"metadata": {"k": 7}}), Some("metadata")),
        (
            json!({"metadata": {"k": "v".repeat(300)}}),
            Some("metadata"),
        ),
        // 64 new keys beside the one it has: 65 after the merge.
        (json!({"metadata": full}), Some("metadata")),
    ] {
        let reply = plane
            .api
            .call(key, AxumMethod::PATCH, &path, None, Some(&body.to_string()))
            .await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{body}: {}",
            reply.body
        );
        if field.is_some() {
            assert_eq!(reply.body["error"]["field"].as_str(), field, "{body}");
        }
    }
    for body in [
        json!({}),
        json!({"extend_seconds": -5}),
        json!({"expires_at": past}),
        json!({"extend_seconds": 5, "expires_at": past}),
        json!({"days": 1}),
    ] {
        let reply = plane
            .api
            .call(
                key,
                AxumMethod::POST,
                &format!("{path}/renew"),
                None,
                Some(&body.to_string()),
            )
            .await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{body}: {}",
            reply.body
        );
    }
    for body in [
        json!({"timeout_seconds": 0}),
        json!({"timeout_seconds": 5, "expires_at": (Utc::now() + chrono::Duration::hours(1)).to_rfc3339()}),
        json!({"expires_at": past}),
        json!({"on_expiry": "pause"}),
    ] {
        let reply = plane
            .api
            .call(
                key,
                AxumMethod::POST,
                "/v1/sandboxes",
                None,
                Some(&body.to_string()),
            )
            .await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{body}: {}",
            reply.body
        );
    }
    let unchanged = plane
        .api
        .call(key, AxumMethod::GET, &path, None, None)
        .await;
    assert_eq!(unchanged.body["metadata"], json!({"a": "1"}));
    assert_eq!(unchanged.body["expires_at"], Value::Null);
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM events WHERE sandbox_id = $1")
        .bind(id)
        .fetch_one(&plane.db)
        .await
        .unwrap();
    assert_eq!(events, 1, "only the create's event");

    // Another org's sandbox is not found; a sandbox being deleted is a conflict.
    let other = inproc::org(&plane.db).await;
    for (method, route, body) in [
        (AxumMethod::PATCH, path.clone(), r#"{"metadata":{"x":"y"}}"#),
        (
            AxumMethod::POST,
            format!("{path}/renew"),
            r#"{"extend_seconds":60}"#,
        ),
    ] {
        let reply = plane
            .api
            .call(&other.key, method.clone(), &route, None, Some(body))
            .await;
        assert_eq!(
            (reply.status, reply.code()),
            (404, "not_found"),
            "{method} {route}"
        );
    }
    plane.request(id, "delete").await;
    for (method, route, body) in [
        (AxumMethod::PATCH, path.clone(), r#"{"metadata":{"x":"y"}}"#),
        (
            AxumMethod::POST,
            format!("{path}/renew"),
            r#"{"extend_seconds":60}"#,
        ),
    ] {
        let reply = plane
            .api
            .call(key, method.clone(), &route, None, Some(body))
            .await;
        assert_eq!(
            (reply.status, reply.code()),
            (409, "conflict"),
            "{method} {route}"
        );
        assert_eq!(reply.body["error"]["state"], "stopping");
    }
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_list_filters_by_every_metadata_pair_given_within_the_org(db: PgPool) {
    let plane = Plane::start(db).await;
    let key = &plane.org.key;
    let ml_prod = plane
        .api
        .create(
            key,
            r#"{"memory_mib":256,"metadata":{"team":"ml","env":"prod"}}"#,
        )
        .await;
    let ml_dev = plane
        .api
        .create(
            key,
            r#"{"memory_mib":256,"metadata":{"team":"ml","env":"dev"}}"#,
        )
        .await;
    plane
        .api
        .create(key, r#"{"memory_mib":256,"metadata":{"team":"web"}}"#)
        .await;
    let other = inproc::org(&plane.db).await;
    plane
        .api
        .create(
            &other.key,
            r#"{"memory_mib":256,"metadata":{"team":"ml","env":"prod"}}"#,
        )
        .await;
    let ids = |reply: &inproc::Reply| -> Vec<String> {
        reply.body["sandboxes"]
            .as_array()
            .unwrap_or_else(|| panic!("{}", reply.body))
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let list = |q: &'static str| plane.api.call(key, AxumMethod::GET, q, None, None);
    assert_eq!(
        ids(&list("/v1/sandboxes?metadata.team=ml").await),
        [ml_dev.to_string(), ml_prod.to_string()]
    );
    assert_eq!(
        ids(&list("/v1/sandboxes?metadata.team=ml&metadata.env=prod").await),
        [ml_prod.to_string()]
    );
    assert!(ids(&list("/v1/sandboxes?metadata.team=ops").await).is_empty());
    assert_eq!(
        ids(&list("/v1/sandboxes?metadata.team=ml&limit=1").await),
        [ml_dev.to_string()]
    );
    for bad in [
        "/v1/sandboxes?colour=red",
        "/v1/sandboxes?metadata.team=ml&metadata.team=web",
        "/v1/sandboxes?metadata.=x",
        "/v1/sandboxes?limit=many",
    ] {
        let reply = list(bad).await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{bad}: {}",
            reply.body
        );
    }
}
