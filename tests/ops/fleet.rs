//! Running a fleet: reconciler leadership and takeover, operators draining and cordoning
//! hosts (and a fleet they took out of service answering `unavailable`, not `no_capacity`),
//! the hosts' schedulable capacity, the per-host start cap, and automatic stop and delete of
//! idle sandboxes.

use std::time::Duration;

use berth_reconciler::pass::{self, PassConfig};
use berth_reconciler::ReconcilerConfig;
use berth_store::leases;
use futures::future::join_all;
use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::archive::archived_by_hand;
use crate::support::inproc::{self, Plane};
use crate::support::{eventually, Stack};

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn one_of_two_reconcilers_leads_and_the_other_takes_over_when_it_dies(db: PgPool) {
    berth_store::MIGRATOR.run(&db).await.unwrap();
    let mut config = ReconcilerConfig::new(berth_schemas::Subjects::new("unused").unwrap());
    config.lease_ttl = Duration::from_secs(1);
    config.pass.interval = Duration::from_millis(100);
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
    let stop = CancellationToken::new();
    let task_a = tokio::spawn(berth_reconciler::lead(
        config.clone(),
        db.clone(),
        a,
        None,
        stop.clone(),
    ));
    let task_b = tokio::spawn(berth_reconciler::lead(
        config.clone(),
        db.clone(),
        b,
        None,
        stop.clone(),
    ));

    let holder = || async {
        sqlx::query_as::<_, (Uuid, i64)>(
            "SELECT holder, term FROM leases WHERE name = 'reconciler'",
        )
        .fetch_optional(&db)
        .await
        .unwrap()
    };
    eventually("someone leads", || async { holder().await.is_some() }).await;
    let (leader, term) = holder().await.unwrap();
    assert!(leader == a || leader == b);
    // kill -9 the leader: its loop stops without giving the lease up.
    if leader == a {
        task_a.abort()
    } else {
        task_b.abort()
    }
    let standby = if leader == a { b } else { a };
    eventually("the standby takes over", || async {
        holder().await.map(|(h, _)| h) == Some(standby)
    })
    .await;
    let (_, new_term) = holder().await.unwrap();
    assert!(new_term > term, "a takeover bumps the term");

    // The deposed leader's term no longer commits anything.
    let deposed = leases::Lease {
        name: berth_reconciler::LEASE_NAME,
        holder: leader,
        term,
    };
    let mut tx = db.begin().await.unwrap();
    assert!(!deposed.check(&mut tx).await.unwrap());
    drop(tx);
    let report = pass::run_pass(&db, &PassConfig::default(), &deposed)
        .await
        .unwrap();
    assert!(
        report.deposed,
        "a deposed leader's pass stops at its first write"
    );
    stop.cancel();
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn operators_drain_cordon_and_uncordon_hosts_and_org_keys_cannot(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let admin = berth_api::auth::create_admin_key(&stack.db).await.unwrap();
    let host = stack.hosts[0].host_id;
    let (status, hosts) = stack.call_as(&admin, Method::GET, "/v1/hosts", None).await;
    assert_eq!(status, 200, "{hosts}");
    assert_eq!(hosts[0]["id"], host.to_string());
    let (status, body) = stack.call(Method::GET, "/v1/hosts", None).await;
    assert_eq!((status, &body["error"]["code"]), (403, &json!("forbidden")));
    let (status, body) = stack
        .call_as(&admin, Method::GET, "/v1/sandboxes", None)
        .await;
    assert_eq!(status, 403, "an operator key manages no sandboxes: {body}");

    let stopped = stack.create().await;
    stack.wait_state(&stopped, "running").await;
    assert_eq!(stack.request(&stopped, "stop").await.0, 202);
    stack.wait_state(&stopped, "stopped").await;

    for (action, state) in [("drain", "draining"), ("cordon", "cordoned")] {
        let (status, body) = stack
            .call_as(
                &admin,
                Method::POST,
                &format!("/v1/hosts/{host}/{action}"),
                None,
            )
            .await;
        assert_eq!(
            (status, body["state"].as_str()),
            (200, Some(state)),
            "{body}"
        );
        let (status, body) = stack
            .call(Method::POST, "/v1/sandboxes", Some(json!({})))
            .await;
        assert_eq!(
            (status, &body["error"]["code"]),
            (503, &json!("unavailable")),
            "no new placements when {state}: {body}"
        );
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("no host accepts new sandboxes"),
            "{message}"
        );
    }
    // Its own stopped sandbox still starts there: its disk lives there.
    assert_eq!(stack.request(&stopped, "start").await.0, 202);
    stack.wait_state(&stopped, "running").await;

    let (status, body) = stack
        .call_as(
            &admin,
            Method::POST,
            &format!("/v1/hosts/{host}/uncordon"),
            None,
        )
        .await;
    assert_eq!((status, body["state"].as_str()), (200, Some("ready")));
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let (status, _) = stack
        .call_as(
            &admin,
            Method::POST,
            &format!("/v1/hosts/{}/drain", Uuid::now_v7()),
            None,
        )
        .await;
    assert_eq!(status, 404);
    for id in [&stopped, &id] {
        stack.delete(id).await;
        stack.wait_state(id, "deleted").await;
    }
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn creates_beyond_a_hosts_start_cap_wait_in_the_outbox_and_all_run(db: PgPool) {
    let stack = Stack::start_configured(db, 1, PassConfig::default(), |c| {
        c.max_concurrent_starts = 1;
    })
    .await;
    let body = json!({"template": "base", "vcpus": 1, "memory_mib": 128});
    let created =
        join_all((0..4).map(|_| stack.call(Method::POST, "/v1/sandboxes", Some(body.clone()))))
            .await;
    let ids: Vec<String> = created
        .iter()
        .map(|(s, b)| {
            assert_eq!(*s, 202, "queued, not refused: {b}");
            b["id"].as_str().unwrap().to_owned()
        })
        .collect();
    for id in &ids {
        stack.wait_state(id, "running").await;
    }
    // With a cap of one, each create was published only after the previous one completed.
    let times: Vec<(chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT published_at, completed_at FROM commands WHERE kind = 'sandbox.create' ORDER BY published_at",
    )
    .fetch_all(&stack.db)
    .await
    .unwrap();
    assert_eq!(times.len(), 4);
    for pair in times.windows(2) {
        assert!(
            pair[1].0 >= pair[0].1,
            "a create was published while another was in flight: {pair:?}"
        );
    }
    for id in &ids {
        stack.delete(id).await;
    }
    for id in &ids {
        stack.wait_state(id, "deleted").await;
    }
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn idle_sandboxes_auto_stop_and_stopped_ones_auto_delete(db: PgPool) {
    let config = PassConfig {
        interval: Duration::from_millis(100),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db, 1, config).await;
    let body = json!({"template": "base", "auto_stop_minutes": 1, "auto_delete_minutes": 1});
    let (status, created) = stack.call(Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(status, 202, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    assert_eq!(
        stack.state_of(&id).await,
        "running",
        "fresh activity keeps it running"
    );

    // A minute and a half without activity.
    sqlx::query(
        "UPDATE sandboxes SET last_activity_at = now() - interval '90 seconds' WHERE id = $1::uuid",
    )
    .bind(&id)
    .execute(&stack.db)
    .await
    .unwrap();
    stack.wait_state(&id, "stopped").await;
    // Stopped for a minute and a half.
    sqlx::query(
        "UPDATE sandboxes SET updated_at = now() - interval '90 seconds' WHERE id = $1::uuid",
    )
    .bind(&id)
    .execute(&stack.db)
    .await
    .unwrap();
    stack.wait_state(&id, "deleted").await;
    let reasons: Vec<(String, String)> = sqlx::query_as(
        "SELECT to_state, reason FROM events WHERE sandbox_id = $1::uuid ORDER BY id",
    )
    .bind(&id)
    .fetch_all(&stack.db)
    .await
    .unwrap();
    let reasons: Vec<(&str, &str)> = reasons
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    assert_eq!(
        reasons,
        [
            ("provisioning", "user_request"),
            ("running", "host_report"),
            ("stopping", "auto_stop"),
            ("stopped", "host_report"),
            ("stopping", "auto_delete"),
            ("deleted", "host_report"),
        ]
    );
    stack.nothing_left(&id).await;
    stack.teardown().await;
}

/// Auto-stop measures idleness from `last_activity_at`; reading or writing a sandbox's files is
/// activity, as an exec is (it used to be only the exec).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn reading_or_writing_files_counts_as_activity_for_auto_stop(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let body = json!({"template": "base", "auto_stop_minutes": 60});
    let (status, created) = stack.call(Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(status, 202, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    let idle_for = |stack: &Stack, id: String| {
        let db = stack.db.clone();
        async move {
            sqlx::query_scalar::<_, f64>(
                "SELECT EXTRACT(EPOCH FROM now() - last_activity_at)::float8
                   FROM sandboxes WHERE id = $1::uuid",
            )
            .bind(id)
            .fetch_one(&db)
            .await
            .unwrap()
        }
    };
    let url = stack.url(&format!("/v1/sandboxes/{id}/files?path=/root/note"));
    let put = |stack: &Stack| {
        stack
            .http
            .put(url.clone())
            .bearer_auth(&stack.key)
            .body("noted")
            .send()
    };
    let get = |stack: &Stack| stack.http.get(url.clone()).bearer_auth(&stack.key).send();
    for (route, call) in [("PUT", 0), ("GET", 1)] {
        sqlx::query(
            "UPDATE sandboxes SET last_activity_at = now() - interval '2 hours' WHERE id = $1::uuid",
        )
        .bind(&id)
        .execute(&stack.db)
        .await
        .unwrap();
        assert!(idle_for(&stack, id.clone()).await > 3600.0);
        let response = if call == 0 {
            put(&stack).await
        } else {
            get(&stack).await
        }
        .unwrap();
        assert_eq!(response.status(), 200, "{route} files");
        let idle = idle_for(&stack, id.clone()).await;
        assert!(
            idle < 600.0,
            "{route} /files stamped last_activity_at (idle {idle} s after it)"
        );
    }
    stack.teardown().await;
}

/// `(status, body, Retry-After)` of `method path` (JSON `body`) with `key` on `plane`'s API.
async fn call(
    plane: &Plane,
    key: &str,
    method: Method,
    path: &str,
    body: &str,
) -> (u16, serde_json::Value, Option<String>) {
    let (reply, retry_after) = plane
        .api
        .call_with_retry_after(key, method, path, body)
        .await;
    (reply.status, reply.body, retry_after)
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_placement_with_every_host_cordoned_or_draining_is_unavailable_and_a_full_fleet_no_capacity(
    db: PgPool,
) {
    let plane = Plane::start(db).await;
    let archived = archived_by_hand(&plane).await;
    let small = berth_schemas::wire::Resources {
        vcpus: 1,
        memory_mib: 256,
    };
    let (b, c) = (berth_schemas::HostId::new(), berth_schemas::HostId::new());
    for host in [b, c] {
        inproc::heartbeat(&plane.db, host, small).await;
    }
    let admin = berth_api::auth::create_admin_key(&plane.db).await.unwrap();
    for (host, action) in [(plane.host, "cordon"), (b, "cordon"), (c, "drain")] {
        let path = format!("/v1/hosts/{host}/{action}");
        let (status, body, _) = call(&plane, &admin, Method::POST, &path, "{}").await;
        assert_eq!(status, 200, "{body}");
    }

    // Nothing takes new sandboxes: a start of the archived sandbox (it must be placed) and a
    // create both say so, with when to retry; nothing is written or reserved.
    let start = format!("/v1/sandboxes/{archived}/start");
    for (path, body) in [(start.as_str(), "{}"), ("/v1/sandboxes", inproc::SANDBOX)] {
        let (status, body, retry_after) =
            call(&plane, &plane.org.key, Method::POST, path, body).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (503, Some("unavailable")),
            "{path}: {body}"
        );
        assert_eq!(retry_after.as_deref(), Some("30"), "{path}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("no host accepts new sandboxes: 2 cordoned, 1 draining"),
            "{message}"
        );
    }
    assert_eq!(inproc::row(&plane.db, archived).await.state, "archived");
    plane.assert_capacity_released().await;

    // A host that takes new sandboxes but has no room for this one: `no_capacity`, as before.
    let path = format!("/v1/hosts/{b}/uncordon");
    assert_eq!(call(&plane, &admin, Method::POST, &path, "{}").await.0, 200);
    let big = r#"{"vcpus":1,"memory_mib":512}"#;
    let (status, body, _) = call(&plane, &plane.org.key, Method::POST, "/v1/sandboxes", big).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("no_capacity")),
        "{body}"
    );
    // The archived sandbox fits there: its start places it.
    let (status, body, _) = call(&plane, &plane.org.key, Method::POST, &start, "{}").await;
    assert_eq!(
        (status, body["state"].as_str()),
        (202, Some("unarchiving")),
        "{body}"
    );
    assert_eq!(body["host_id"], b.to_string());
}

/// `GET /v1/hosts/{id}` of `plane`'s host with the operator key `admin`.
async fn host_shown(plane: &Plane, admin: &str) -> serde_json::Value {
    let path = format!("/v1/hosts/{}", plane.host);
    let (status, one, _) = call(plane, admin, Method::GET, &path, "").await;
    assert_eq!(status, 200, "{one}");
    one
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn hosts_show_the_schedulable_capacity_placement_reserves_against(db: PgPool) {
    let plane = Plane::start(db).await;
    let admin = berth_api::auth::create_admin_key(&plane.db).await.unwrap();
    plane.create().await;
    let (status, hosts, _) = call(&plane, &admin, Method::GET, "/v1/hosts", "").await;
    assert_eq!(status, 200, "{hosts}");
    let one = host_shown(&plane, &admin).await;
    for host in [&hosts[0], &one] {
        let cap = inproc::HOST_CAPACITY;
        assert_eq!(host["capacity_vcpus"], cap.vcpus, "physical: {host}");
        assert_eq!(host["capacity_memory_mib"], cap.memory_mib, "{host}");
        assert_eq!(host["schedulable_vcpus"], cap.vcpus * 4, "vCPUs ×4: {host}");
        assert_eq!(
            host["schedulable_memory_mib"], cap.memory_mib,
            "memory ×1: {host}"
        );
        assert_eq!(
            host["overcommit"],
            json!({"cpu": 4.0, "memory": 1.0}),
            "{host}"
        );
        assert_eq!(host["reserved_vcpus"], 1, "{host}");
    }
    // Placement reserves up to the schedulable figure, not the physical one.
    for _ in 1..inproc::HOST_CAPACITY.vcpus * 4 {
        plane
            .api
            .create(&plane.org.key, r#"{"vcpus":1,"memory_mib":64}"#)
            .await;
    }
    let (status, body, _) = call(
        &plane,
        &plane.org.key,
        Method::POST,
        "/v1/sandboxes",
        inproc::SANDBOX,
    )
    .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("no_capacity")),
        "{body}"
    );
    let one = host_shown(&plane, &admin).await;
    assert_eq!(one["reserved_vcpus"], one["schedulable_vcpus"], "{one}");
    // Operators only.
    let (status, _, _) = call(&plane, &plane.org.key, Method::GET, "/v1/hosts", "").await;
    assert_eq!(status, 403);
}
