//! The reconciler's leader and pass, and the scheduler's placement and quotas, against the real
//! Postgres, NATS and `berth hostd` processes. All timing is configured in milliseconds.

mod common;

use std::time::Duration;

use berth_reconciler::lease;
use berth_reconciler::pass::{self, PassConfig};
use berth_reconciler::ReconcilerConfig;
use common::{eventually, Stack};
use futures::future::join_all;
use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

async fn host_of(stack: &Stack, id: &str) -> Uuid {
    sqlx::query_scalar("SELECT host_id FROM sandboxes WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(&stack.db)
        .await
        .unwrap()
}

async fn host_state(stack: &Stack, host: Uuid) -> String {
    sqlx::query_scalar("SELECT state FROM hosts WHERE id = $1")
        .bind(host)
        .fetch_one(&stack.db)
        .await
        .unwrap()
}

/// Waits until host `host`'s last heartbeat is older than `age` (database clock).
async fn wait_silent(stack: &Stack, host: Uuid, age: Duration) {
    eventually("the host went silent", || async {
        let silent: bool = sqlx::query_scalar(
            "SELECT last_seen < now() - make_interval(secs => $2) FROM hosts WHERE id = $1",
        )
        .bind(host)
        .bind(age.as_secs_f64())
        .fetch_one(&stack.db)
        .await
        .unwrap();
        silent
    })
    .await;
}

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn a_silent_host_is_lost_its_sandboxes_fail_and_it_comes_back_ready_without_duplicates(
    db: PgPool,
) {
    let config = PassConfig {
        interval: Duration::from_millis(100),
        host_lost_after: Duration::from_secs(2),
        failover_after: Duration::from_secs(1),
        inventory_grace: Duration::from_millis(500),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db, 2, config).await;
    // Spread placement puts one on each host.
    let a = stack.create().await;
    let b = stack.create().await;
    stack.wait_state(&a, "running").await;
    stack.wait_state(&b, "running").await;
    let host_a = host_of(&stack, &a).await;
    assert_ne!(host_a, host_of(&stack, &b).await, "placement spreads");
    let index = stack
        .hosts
        .iter()
        .position(|h| h.host_id.as_uuid() == host_a)
        .unwrap();

    stack.hosts[index].freeze();
    eventually("the silent host is lost", || async {
        host_state(&stack, host_a).await == "lost"
    })
    .await;
    let failed = stack.wait_state(&a, "failed-start").await;
    assert!(
        failed["state_reason"]
            .as_str()
            .unwrap()
            .contains("host_lost"),
        "{failed}"
    );
    assert_eq!(
        stack.state_of(&b).await,
        "running",
        "the other host's sandbox is untouched"
    );
    stack.assert_no_capacity_drift().await;

    stack.hosts[index].thaw();
    eventually("the host is ready again", || async {
        host_state(&stack, host_a).await == "ready"
    })
    .await;
    // Its container still ran; no row wants it running, so it is stopped (its disk stays).
    eventually("the stranded container is stopped", || async {
        !stack.container_exists(&a)
    })
    .await;
    assert_eq!(stack.state_of(&a).await, "failed-start");
    assert!(
        stack.hosts[index]
            .state_dir
            .join("sandboxes")
            .join(&a)
            .exists(),
        "the disk is kept"
    );
    // A sandbox that once ran starts again from its disk, on its host.
    assert_eq!(stack.request(&a, "start").await.0, 202);
    stack.wait_state(&a, "running").await;
    for id in [&a, &b] {
        assert_eq!(stack.delete(id).await.0, 202);
        stack.wait_state(id, "deleted").await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn when_every_host_is_silent_at_once_a_pass_changes_nothing(db: PgPool) {
    // The stack's own reconciler passes once at start and then not for an hour.
    let idle = PassConfig {
        interval: Duration::from_secs(3600),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db, 1, idle).await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let host = host_of(&stack, &id).await;

    let config = PassConfig {
        host_lost_after: Duration::from_millis(500),
        failover_after: Duration::ZERO,
        inventory_grace: Duration::ZERO,
        ..PassConfig::default()
    };
    let test_lease = lease::acquire(
        &stack.db,
        "test-pass",
        Uuid::now_v7(),
        Duration::from_secs(60),
    )
    .await
    .unwrap()
    .unwrap();
    stack.hosts[0].freeze();
    wait_silent(&stack, host, Duration::from_millis(700)).await;
    let report = pass::run_pass(&stack.db, &config, &test_lease)
        .await
        .unwrap();
    stack.hosts[0].thaw();

    assert!(report.all_hosts_silent);
    assert!(report.actions.is_empty(), "{report:?}");
    assert_eq!(host_state(&stack, host).await, "ready");
    assert_eq!(stack.state_of(&id).await, "running");
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn one_of_two_reconcilers_leads_and_the_other_takes_over_when_it_dies(db: PgPool) {
    berth_schemas::db::MIGRATOR.run(&db).await.unwrap();
    let mut config = ReconcilerConfig::new(berth_schemas::Subjects::new("unused").unwrap());
    config.lease_ttl = Duration::from_secs(1);
    config.pass.interval = Duration::from_millis(100);
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
    let stop = CancellationToken::new();
    let task_a = tokio::spawn(berth_reconciler::lead(
        config.clone(),
        db.clone(),
        a,
        stop.clone(),
    ));
    let task_b = tokio::spawn(berth_reconciler::lead(
        config.clone(),
        db.clone(),
        b,
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
    let deposed = lease::Lease {
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

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn a_hostd_killed_mid_create_and_restarted_converges_without_duplicates(db: PgPool) {
    let mut stack = Stack::start(db, 1).await;
    let ids = vec![
        stack.create().await,
        stack.create().await,
        stack.create().await,
    ];
    // The creates are in flight; the host dies without a chance to tidy up.
    stack.hosts[0].stop(true).await;
    stack.restart_host(0).await;
    for id in &ids {
        stack.wait_state(id, "running").await;
        let (status, out) = stack.exec(id, &["echo", "ok"]).await;
        assert_eq!(
            (status, out["stdout"].as_str()),
            (200, Some("ok\n")),
            "{out}"
        );
    }
    let containers = std::process::Command::new("runc")
        .arg("--root")
        .arg(stack.hosts[0].runc_root())
        .args(["list", "-q"])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&containers.stdout).lines().count();
    assert_eq!(listed, 3, "one container per sandbox");
    for id in &ids {
        stack.delete(id).await;
    }
    for id in &ids {
        stack.wait_state(id, "deleted").await;
        assert!(stack.leftovers(id).is_empty());
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
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
            (503, &json!("no_capacity")),
            "no new placements when {state}"
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

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
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

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
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
    assert!(stack.leftovers(&id).is_empty());
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn a_running_sandbox_whose_guest_dies_becomes_failed_start_and_can_start_again(db: PgPool) {
    let config = PassConfig {
        interval: Duration::from_millis(100),
        inventory_grace: Duration::from_millis(500),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db, 1, config).await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let (_, out) = stack.exec(&id, &["sh", "-c", "echo kept > /root/f"]).await;
    assert_eq!(out["exit_code"], 0);
    // Kill the agent that serves this very exec: the guest stops answering.
    let _ = stack.exec(&id, &["sh", "-c", "kill -9 $PPID"]).await;
    let failed = stack.wait_state(&id, "failed-start").await;
    assert!(
        failed["state_reason"].as_str().unwrap().contains("guest"),
        "{failed}"
    );
    stack.assert_no_capacity_drift().await;
    assert_eq!(stack.request(&id, "start").await.0, 202);
    stack.wait_state(&id, "running").await;
    let (_, out) = stack.exec(&id, &["cat", "/root/f"]).await;
    assert_eq!(out["stdout"], "kept\n", "its disk survived");
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}
