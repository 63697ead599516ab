//! Waiting without polling (issue 15 item 5): `GET /v1/sandboxes/{id}/wait` and `?wait=` on
//! a create and the lifecycle requests answer on the transition (woken by the database's
//! notification), with 409 and the state when the sandbox settles where it cannot get, and
//! with 408 when the timeout passes first. On the real stack: runc sandboxes of a real
//! `berth hostd`, frozen (SIGSTOP) where a test needs a transition held in flight.

use std::time::Duration;

use berth_reconciler::pass::PassConfig;
use reqwest::Method;
use sqlx::PgPool;

use crate::support::{Stack, SETTLE_TIMEOUT};

const BODY: &str = r#"{"template": "base", "memory_mib": 256}"#;

fn body() -> serde_json::Value {
    serde_json::from_str(BODY).unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_create_with_wait_running_answers_the_running_sandbox_ready_for_exec(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let (status, created) = stack
        .call(
            Method::POST,
            "/v1/sandboxes?wait=running&timeout=90s",
            Some(body()),
        )
        .await;
    assert_eq!(status, 200, "{created}");
    assert_eq!(created["state"], "running");
    assert!(created["address"].is_string(), "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    let (status, out) = stack.exec(&id, &["echo", "ready"]).await;
    assert_eq!((status, out["stdout"].as_str()), (200, Some("ready\n")));

    // Bad wait parameters are refused before anything is written.
    for bad in [
        "/v1/sandboxes?wait=starting",
        "/v1/sandboxes?wait=running&timeout=10m",
        "/v1/sandboxes?wait=running&timeout=soon",
        "/v1/sandboxes?timeout=5s",
        "/v1/sandboxes?wiat=running",
        // A create settles as running: waiting for another state is refused.
        "/v1/sandboxes?wait=stopped",
    ] {
        let (status, reply) = stack.call(Method::POST, bad, Some(body())).await;
        assert_eq!(status, 400, "{bad}: {reply}");
        assert_eq!(reply["error"]["code"], "invalid_request");
    }
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes")
        .fetch_one(&stack.db)
        .await
        .unwrap();
    assert_eq!(count, 1, "no refused create wrote a sandbox");
    // A lifecycle request that waits for a state it does not lead to is refused before it does
    // anything (it used to stop the sandbox and answer 409).
    for (path, settles) in [
        (format!("/v1/sandboxes/{id}/stop?wait=running"), "stopped"),
        (format!("/v1/sandboxes/{id}/start?wait=stopped"), "running"),
        (format!("/v1/sandboxes/{id}?wait=running"), "deleted"),
    ] {
        let method = if path.contains("/stop") || path.contains("/start") {
            Method::POST
        } else {
            Method::DELETE
        };
        let (status, reply) = stack.call(method, &path, None).await;
        assert_eq!(status, 400, "{path}: {reply}");
        assert_eq!(reply["error"]["field"], "wait", "{reply}");
        assert!(
            reply["error"]["message"]
                .as_str()
                .unwrap()
                .contains(settles),
            "{reply}"
        );
    }
    let row = crate::support::inproc::row(&stack.db, id.parse().unwrap()).await;
    assert_eq!(
        (row.state.as_str(), row.generation),
        ("running", 1),
        "a refused wait changed the sandbox"
    );

    let (status, deleted) = stack
        .call(
            Method::DELETE,
            &format!("/v1/sandboxes/{id}?wait=deleted"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted["state"], "deleted");
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_wait_returns_on_the_transition_it_was_waiting_for(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stack.create().await;
    let (status, running) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/wait?state=running&timeout=90s"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{running}");
    assert_eq!(running["state"], "running");

    // Hold the stop in flight: the host is frozen, so the sandbox stays `stopping`.
    stack.hosts[0].freeze();
    let (status, stopping) = stack.request(&id, "stop").await;
    assert_eq!(
        (status, stopping["state"].as_str()),
        (202, Some("stopping"))
    );
    let waiter = {
        let (http, url, key) = (
            stack.http.clone(),
            stack.url(&format!(
                "/v1/sandboxes/{id}/wait?state=stopped&timeout=120s"
            )),
            stack.key.clone(),
        );
        tokio::spawn(async move {
            let reply = http.get(url).bearer_auth(key).send().await.unwrap();
            (
                reply.status().as_u16(),
                reply.json::<serde_json::Value>().await.unwrap(),
            )
        })
    };
    // Nothing can answer it while the host holds the stop: the row stays `stopping`.
    assert_eq!(stack.state_of(&id).await, "stopping");
    assert!(
        !waiter.is_finished(),
        "the wait answered before the transition"
    );
    stack.hosts[0].thaw();
    let (status, stopped) = waiter.await.unwrap();
    assert_eq!(status, 200, "{stopped}");
    assert_eq!(stopped["state"], "stopped");

    // `?wait=` on a lifecycle request: start, answered once it runs again.
    let (status, started) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/start?wait=running"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{started}");
    assert_eq!(started["state"], "running");
    let (status, out) = stack.exec(&id, &["true"]).await;
    assert_eq!(status, 200, "{out}");
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_wait_times_out_with_408_and_the_state_while_the_host_holds_the_transition(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    stack.hosts[0].freeze();
    let (status, body) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/stop?wait=stopped&timeout=2s"),
            None,
        )
        .await;
    assert_eq!(status, 408, "{body}");
    assert_eq!(body["error"]["code"], "timeout");
    assert_eq!(body["error"]["state"], "stopping");
    assert_eq!(body["error"]["sandbox_id"], id.as_str());
    let (status, body) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/wait?state=stopped&timeout=0s"),
            None,
        )
        .await;
    assert_eq!(
        (status, body["error"]["state"].as_str()),
        (408, Some("stopping"))
    );
    // The stop was accepted all along; it completes once the host is back.
    stack.hosts[0].thaw();
    let (status, body) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/wait?state=stopped&timeout=90s"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

/// A create whose host never answers times out in the reconciler (`failed-start`): the create
/// waiting for `running` learns at that moment that it never will.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_wait_answers_409_when_the_sandbox_settles_where_it_cannot_reach_the_target(db: PgPool) {
    let config = PassConfig {
        interval: Duration::from_millis(100),
        create_timeout: Duration::from_secs(3),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db, 1, config).await;
    stack.hosts[0].freeze();
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes?wait=running&timeout=120s",
            Some(body()),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "conflict");
    assert_eq!(body["error"]["state"], "failed-start");
    let id = body["error"]["sandbox_id"]
        .as_str()
        .expect("the created id")
        .to_owned();
    assert_eq!(stack.state_of(&id).await, "failed-start");
    stack.hosts[0].thaw();

    // Settled states answer at once: failed-start is not stopped either; a deleted sandbox
    // never runs.
    let (status, body) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/wait?state=stopped"),
            None,
        )
        .await;
    assert_eq!(
        (status, body["error"]["state"].as_str()),
        (409, Some("failed-start"))
    );
    stack.delete(&id).await;
    let (status, body) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/wait?state=running"),
            None,
        )
        .await;
    assert_eq!(status, 409, "{body}");
    let (status, body) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/wait?state=deleted&timeout=90s"),
            None,
        )
        .await;
    assert_eq!((status, body["state"].as_str()), (200, Some("deleted")));
    let (status, body) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/wait?state=paused"),
            None,
        )
        .await;
    assert_eq!(
        (status, body["error"]["field"].as_str()),
        (400, Some("state"))
    );
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// Through the API router with a host row and a synthesized host result: an org's waits past
/// `max_concurrent_waits` are refused before the request they follow changes anything, and
/// the one holding the slot answers when the result arrives.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn waits_past_the_orgs_cap_are_refused_before_anything_changes(db: PgPool) {
    use crate::support::inproc::{self, Api};
    use axum::http::Method as M;
    use berth_schemas::{CommandKind, HostId};

    inproc::heartbeat(&db, HostId::new(), inproc::HOST_CAPACITY).await;
    let nats = async_nats::connect(crate::support::nats_url())
        .await
        .unwrap();
    let api = Api::configured(db.clone(), nats, crate::support::unique_subjects(), |c| {
        c.limits.org_max_waits = 1
    });
    let org = inproc::org(&db).await;
    let id = api.create(&org.key, inproc::SANDBOX).await;
    let wait = format!("/v1/sandboxes/{id}/wait?state=running&timeout=120s");
    let spawn_first = || {
        let (api, key, wait) = (api.clone(), org.key.clone(), wait.clone());
        tokio::spawn(async move { api.call(&key, M::GET, &wait, None, None).await })
    };
    let probe = format!("/v1/sandboxes/{id}/wait?state=running&timeout=0s");
    // A probe (timeout 0 s: 408 at once while provisioning) is refused once the first wait
    // holds the org's only slot; a probe that took the slot first makes the first one 429,
    // and it is sent again.
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    let mut first = spawn_first();
    loop {
        if first.is_finished() {
            let early = first.await.unwrap();
            assert_eq!(early.status, 429, "the first wait answered: {}", early.body);
            first = spawn_first();
        }
        let reply = api.call(&org.key, M::GET, &probe, None, None).await;
        assert!(matches!(reply.status, 408 | 429), "{}", reply.body);
        if reply.status == 429 && !first.is_finished() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the first wait never held the slot"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let refused = api
        .call(
            &org.key,
            M::POST,
            "/v1/sandboxes?wait=running",
            None,
            Some(inproc::SANDBOX),
        )
        .await;
    assert_eq!(
        (refused.status, refused.code()),
        (429, "too_many_concurrent")
    );
    assert_eq!(refused.body["error"]["limit"], "max_concurrent_waits");
    let sandboxes: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(sandboxes, 1, "the refused create wrote nothing");
    assert!(
        !first.is_finished(),
        "the first wait answered while provisioning"
    );

    // The host reports the create: the waiting request answers with the running sandbox.
    let create = inproc::commands_of(&db, id).await.pop().unwrap();
    berth_reconciler::results::apply(
        &db,
        &inproc::result_for(&create, inproc::succeeded(CommandKind::Create)),
    )
    .await
    .unwrap();
    let answered = first.await.unwrap();
    assert_eq!(answered.status, 200, "{}", answered.body);
    assert_eq!(answered.body["state"], "running");
    // Its slot is free again.
    let again = api.call(&org.key, M::GET, &probe, None, None).await;
    assert_eq!(
        (again.status, again.body["state"].as_str()),
        (200, Some("running"))
    );
}

/// A wait for a state the sandbox's own timers will bring (auto-stop or a stop expiry to
/// `stopped`; a delete expiry to `deleted`) holds until its timeout (408) instead of answering
/// 409 at once; once the timer is cleared, the same wait is 409 again. On the router with a
/// synthesized host result.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_wait_for_a_state_the_sandboxs_timers_will_bring_holds(db: PgPool) {
    use crate::support::inproc::{self, Plane};
    use axum::http::Method as M;
    use berth_schemas::CommandKind;

    let plane = Plane::start(db).await;
    let id = plane.create().await;
    let create = plane.latest(id).await;
    plane
        .deliver(&create, inproc::succeeded(CommandKind::Create))
        .await;
    let key = plane.org.key.clone();
    let wait = |state: &str| format!("/v1/sandboxes/{id}/wait?state={state}&timeout=1s");
    let patch = |body: String| {
        let (api, key) = (plane.api.clone(), key.clone());
        async move {
            let reply = api
                .call(
                    &key,
                    M::PATCH,
                    &format!("/v1/sandboxes/{id}"),
                    None,
                    Some(&body),
                )
                .await;
            assert_eq!(reply.status, 200, "{body}: {}", reply.body);
        }
    };
    let status_of = |path: String| {
        let (api, key) = (plane.api.clone(), key.clone());
        async move { api.call(&key, M::GET, &path, None, None).await.status }
    };
    assert_eq!(
        status_of(wait("stopped")).await,
        409,
        "no timer: impossible"
    );
    patch(r#"{"auto_stop_minutes": 60}"#.to_owned()).await;
    assert_eq!(
        status_of(wait("stopped")).await,
        408,
        "auto-stop will stop it"
    );
    assert_eq!(status_of(wait("deleted")).await, 409, "nothing deletes it");
    let in_a_day = (chrono::Utc::now() + chrono::Duration::days(1)).to_rfc3339();
    patch(format!(
        r#"{{"auto_stop_minutes": null, "expires_at": "{in_a_day}", "on_expiry": "delete"}}"#
    ))
    .await;
    assert_eq!(
        status_of(wait("deleted")).await,
        408,
        "its expiry deletes it"
    );
    assert_eq!(
        status_of(wait("stopped")).await,
        409,
        "a delete expiry never stops it"
    );
    patch(r#"{"expires_at": null}"#.to_owned()).await;
    assert_eq!(status_of(wait("deleted")).await, 409, "no timer left");
}
