//! Templates pulled from OCI images, after their pull (issue 18 item 2's gaps): deleting one
//! (operator key; refused while a sandbox uses it or for a built-in; its unpacked root freed
//! from the machine's image cache), registry credentials refused without being echoed, a
//! registry's 401 as `failed` / `auth_failed`, and a pull whose process died swept to
//! `failed` / `pull_timed_out` by the reconciler's pass.

use std::path::PathBuf;
use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::support::inproc;
use crate::support::registry::{push_marked_image, Registry};
use crate::support::{unique, Stack, SETTLE_TIMEOUT};

/// Polls `GET /v1/templates/{name}` until it is no longer `pulling`.
async fn settled(stack: &Stack, name: &str) -> Value {
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    loop {
        let (status, body) = stack
            .call(Method::GET, &format!("/v1/templates/{name}"), None)
            .await;
        assert_eq!(status, 200, "{body}");
        if body["state"] != "pulling" {
            return body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still pulling: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Where the stack's API unpacks image `digest` (the machine's shared image cache).
fn image_dir(digest: &str) -> PathBuf {
    PathBuf::from(berth_hostd::template::DEFAULT_TEMPLATE_CACHE)
        .join(berth_hostd::template::IMAGE_CACHE_DIR)
        .join("images")
        .join(digest.trim_start_matches("sha256:"))
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_image_template_is_deleted_only_by_an_operator_once_unused_and_frees_its_root(
    db: PgPool,
) {
    let registry = Registry::start().await;
    let image = push_marked_image(&registry, "deleted", &format!("delete {}", unique()));
    let locked = Registry::start_with_auth().await;
    let stack = Stack::start(db, 1).await;
    let admin = berth_api::auth::create_admin_key(&stack.db).await.unwrap();

    // Credentials are refused, named, and never echoed.
    let secret = format!("pw-{}", unique());
    let (status, body) = stack
        .call_as(
            &admin,
            Method::POST,
            "/v1/templates",
            Some(
                json!({"name": format!("private-{}", unique()), "image": image,
                        "credentials": {"username": "berth", "password": secret}}),
            ),
        )
        .await;
    assert_eq!(
        (
            status,
            body["error"]["code"].as_str(),
            body["error"]["field"].as_str()
        ),
        (400, Some("invalid_request"), Some("credentials")),
        "{body}"
    );
    assert!(!body.to_string().contains(&secret), "{body}");
    // A registry that wants credentials: the pull fails as `auth_failed`.
    let name = format!("locked-{}", unique());
    let (status, body) = stack
        .call_as(
            &admin,
            Method::POST,
            "/v1/templates",
            Some(json!({"name": name, "image": locked.reference("x", "1")})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let failed = settled(&stack, &name).await;
    assert_eq!(
        (&failed["state"], &failed["error_code"]),
        (&json!("failed"), &json!("auth_failed")),
        "{failed}"
    );

    // A template and a sandbox of it.
    let name = format!("doomed-{}", unique());
    let (status, body) = stack
        .call_as(
            &admin,
            Method::POST,
            "/v1/templates",
            Some(json!({"name": name, "image": image, "runtime": "runc"})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let ready = settled(&stack, &name).await;
    assert_eq!(ready["state"], "ready", "{ready}");
    let root = image_dir(ready["image_digest"].as_str().unwrap());
    assert!(root.join("rootfs").is_dir(), "{}", root.display());
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": name, "vcpus": 1, "memory_mib": 256})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    // A snapshot of it: a clone would lay its files over this template's image.
    let snapshot = crate::resume::ready_snapshot(&stack, &id).await;

    let path = format!("/v1/templates/{name}");
    // An org's key may not delete a template every org shares.
    let (status, body) = stack.call(Method::DELETE, &path, None).await;
    assert_eq!((status, &body["error"]["code"]), (403, &json!("forbidden")));
    // In use: refused, and stopping the sandbox does not free it.
    let (status, body) = stack.call_as(&admin, Method::DELETE, &path, None).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (409, &json!("template_in_use")),
        "{body}"
    );
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    let (status, body) = stack.call_as(&admin, Method::DELETE, &path, None).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (409, &json!("template_in_use"))
    );
    // Built-in templates and unknown names.
    let (status, body) = stack
        .call_as(&admin, Method::DELETE, "/v1/templates/base", None)
        .await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (409, &json!("template_builtin")),
        "{body}"
    );
    let (status, _) = stack
        .call_as(
            &admin,
            Method::DELETE,
            "/v1/templates/no-such-template",
            None,
        )
        .await;
    assert_eq!(status, 404);

    // Once the sandbox is deleted (its tombstone still names the template) its snapshot still
    // holds the template (an attacker deleted the template under a ready snapshot and cloned
    // it onto another image of the same name); once the snapshot is deleted too: deleted, its
    // events with it, and its unpacked root freed.
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    let (status, body) = stack.call_as(&admin, Method::DELETE, &path, None).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (409, &json!("template_in_use")),
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("1 snapshot"),
        "{body}"
    );
    let (status, body) = stack
        .call(Method::DELETE, &format!("/v1/snapshots/{snapshot}"), None)
        .await;
    assert_eq!(status, 204, "{body}");
    let (status, body) = stack.call_as(&admin, Method::DELETE, &path, None).await;
    assert_eq!(status, 204, "{body}");
    let (status, _) = stack.call(Method::GET, &path, None).await;
    assert_eq!(status, 404);
    let events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM template_events WHERE template = $1")
            .bind(&name)
            .fetch_one(&stack.db)
            .await
            .unwrap();
    assert_eq!(events, 0);
    assert!(!root.exists(), "{} was not freed", root.display());
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": name})),
        )
        .await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (422, &json!("unknown_template"))
    );
    // The name may be pulled again: the image comes back from the registry.
    let (status, body) = stack
        .call_as(
            &admin,
            Method::POST,
            "/v1/templates",
            Some(json!({"name": name, "image": image, "runtime": "runc"})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(settled(&stack, &name).await["state"], "ready");
    assert!(root.join("rootfs").is_dir());
    let (status, _) = stack.call_as(&admin, Method::DELETE, &path, None).await;
    assert_eq!(status, 204);
    assert!(!root.exists());
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_pull_with_no_sign_of_life_past_its_timeout_is_failed_by_the_pass(db: PgPool) {
    // Two templates `pulling` as an API left them: one whose process died (nothing for two
    // minutes), one still making progress (an old start, a fresh layer event).
    for name in ["dead-pull", "live-pull"] {
        assert!(
            berth_store::templates::insert_image(&db, name, "", "runsc", "127.0.0.1:1/x:1")
                .await
                .unwrap()
        );
        sqlx::query(
            "UPDATE templates SET updated_at = now() - interval '2 minutes' WHERE name = $1",
        )
        .bind(name)
        .execute(&db)
        .await
        .unwrap();
    }
    sqlx::query(
        "INSERT INTO template_events (template, type, message, at)
         VALUES ('dead-pull', 'template.progress', 'layer 1', now() - interval '100 seconds'),
                ('live-pull', 'template.progress', 'layer 1', now())",
    )
    .execute(&db)
    .await
    .unwrap();
    let config = berth_reconciler::pass::PassConfig {
        template_pull_timeout: Duration::from_secs(60),
        ..inproc::eager_timeouts()
    };
    let lease = inproc::lease(&db).await;
    let report = berth_reconciler::pass::run_pass(&db, &config, &lease)
        .await
        .unwrap();
    assert_eq!(
        report.count(berth_reconciler::pass::Action::TemplatePullTimeout),
        1,
        "{report:?}"
    );
    let dead = berth_store::templates::get(&db, "dead-pull")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(dead.state.as_deref(), Some("failed"));
    assert_eq!(dead.error_code.as_deref(), Some("pull_timed_out"));
    assert!(dead.error_message.unwrap().contains("60 s"));
    let events = berth_store::templates::events(&db, "dead-pull")
        .await
        .unwrap();
    assert_eq!(events.last().unwrap().kind, "template.failed");
    let live = berth_store::templates::get(&db, "live-pull")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(live.state.as_deref(), Some("pulling"));

    // The dead pull's late result writes nothing; a second pass changes nothing.
    let late = berth_store::templates::PullOutcome::Pulled {
        pinned: "127.0.0.1:1/x@sha256:00".into(),
        digest: "sha256:00".into(),
        bytes: 1,
        entrypoint: vec![],
    };
    assert!(
        !berth_store::templates::finish_pull(&db, "dead-pull", &late)
            .await
            .unwrap()
    );
    let report = berth_reconciler::pass::run_pass(&db, &config, &lease)
        .await
        .unwrap();
    assert_eq!(
        report.count(berth_reconciler::pass::Action::TemplatePullTimeout),
        0
    );
}
