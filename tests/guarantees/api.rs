//! The public API end to end: a sandbox's whole life, listing and exec edge cases, against
//! the real Postgres, NATS and `berth hostd` processes.

use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use crate::support::Stack;

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_sandbox_runs_stops_keeps_its_files_starts_and_is_deleted_without_a_trace(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stack.create().await;
    let running = stack.wait_state(&id, "running").await;
    assert!(running["address"].is_string(), "{running}");
    assert_eq!(running["host_id"], stack.hosts[0].host_id.to_string());
    assert_eq!(running["disk_mib"], berth_api::model::DEFAULT_DISK_MIB);
    let live = stack.leftovers(&id);
    for part in ["container", "netns", "veth", "dir", "mount", "loop device"] {
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

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
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

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
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

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_sandbox_keeps_the_disk_it_asked_for_or_the_default_and_every_command_carries_it(
    db: PgPool,
) {
    use crate::support::inproc::{self, Plane};
    let plane = Plane::start(db).await;
    let asked = plane
        .api
        .create(
            &plane.org.key,
            r#"{"vcpus":1,"memory_mib":256,"disk_mib":128}"#,
        )
        .await;
    let defaulted = plane.create().await;
    for (id, disk_mib) in [
        (asked, 128),
        (defaulted, berth_api::model::DEFAULT_DISK_MIB),
    ] {
        let reply = plane
            .api
            .call(
                &plane.org.key,
                Method::GET,
                &format!("/v1/sandboxes/{id}"),
                None,
                None,
            )
            .await;
        assert_eq!(reply.body["disk_mib"], disk_mib, "{}", reply.body);
        let create = plane.latest(id).await;
        let spec = create
            .command
            .spec
            .as_ref()
            .expect("a create carries a spec");
        assert_eq!(spec.disk_mib, disk_mib);
    }
    // A start after a stop carries the same disk to the host.
    let create = plane.latest(asked).await;
    plane.deliver(&create, inproc::succeeded(create.kind)).await;
    plane.request(asked, "stop").await;
    let stop = plane.latest(asked).await;
    plane.deliver(&stop, inproc::succeeded(stop.kind)).await;
    plane.request(asked, "start").await;
    let start = plane.latest(asked).await;
    assert_eq!(start.kind, berth_schemas::CommandKind::Start);
    assert_eq!(
        start.command.spec.expect("a start carries a spec").disk_mib,
        128
    );
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_sandbox_created_with_64_mib_of_disk_gets_enospc_past_it_and_leaves_nothing_when_deleted(
    db: PgPool,
) {
    let stack = Stack::start(db, 1).await;
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "base", "disk_mib": 64})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["disk_mib"], 64);
    let id = body["id"].as_str().expect("an id").to_owned();
    stack.wait_state(&id, "running").await;
    let (status, out) = stack
        .exec(
            &id,
            &["dd", "if=/dev/zero", "of=/big", "bs=1M", "count=114"],
        )
        .await;
    assert_eq!(status, 200, "{out}");
    assert_ne!(out["exit_code"], 0, "{out}");
    assert!(
        out["stderr"]
            .as_str()
            .is_some_and(|e| e.contains("No space left")),
        "{out}"
    );
    let (status, body) = stack.delete(&id).await;
    assert_eq!(status, 202, "{body}");
    stack.wait_state(&id, "deleted").await;
    assert_eq!(stack.leftovers(&id), Vec::<String>::new());
    stack.teardown().await;
}

/// A create's `network` policy: refused with the field and the reason when malformed, stored
/// normalized, shown in the sandbox JSON, and carried in the command's spec to the host
/// (which enforces it: `hostd::egress`).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_network_policy_is_validated_stored_returned_and_carried_to_the_host(db: PgPool) {
    use berth_schemas::network::{Egress, Network};

    use crate::support::inproc::{commands_of, Plane};

    let plane = Plane::start(db.clone()).await;
    let key = plane.org.key.clone();
    let bad = [
        (json!({"egress": ["10.0.0.0/33"]}), "10.0.0.0/33"),
        (json!({"egress": ["ten.0.0.0/8"]}), "ten.0.0.0/8"),
        (json!({"egress": ["fd00::/8"]}), "IPv6"),
        (json!({"egress": "everything"}), "\"public\", \"none\""),
        (json!({"egress": "none", "ingress": "all"}), "ingress"),
        (json!(["10.0.0.0/8"]), "object"),
        (json!({"egress": ["169.254.169.254"]}), "169.254.0.0/16"),
        (
            json!({"egress": ["0.0.0.0/0"]}),
            "which no sandbox may reach",
        ),
    ];
    for (network, says) in bad {
        let body = json!({ "network": network }).to_string();
        let reply = plane
            .api
            .call(&key, Method::POST, "/v1/sandboxes", None, Some(&body))
            .await;
        assert_eq!(reply.status, 400, "{body} → {}", reply.body);
        assert_eq!(reply.code(), "invalid_request", "{}", reply.body);
        assert_eq!(reply.body["error"]["field"], "network", "{}", reply.body);
        let message = reply.body["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains(says), "{body} → {message}");
    }
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(count, 0, "a refused create wrote a row");

    let default = plane.api.create(&key, "{}").await;
    let listed = plane
        .api
        .create(
            &key,
            r#"{"network": {"egress": ["10.1.2.3/16", "192.0.2.7", "10.1.0.0/24"]}}"#,
        )
        .await;
    let none = plane
        .api
        .create(&key, r#"{"network": {"egress": "none"}}"#)
        .await;
    let cases = [
        (default, json!({"egress": "public"}), Egress::Public),
        (
            listed,
            json!({"egress": ["10.1.0.0/16", "192.0.2.7/32"]}),
            Egress::Allow(vec![
                "10.1.0.0/16".parse().unwrap(),
                "192.0.2.7/32".parse().unwrap(),
            ]),
        ),
        (none, json!({"egress": "none"}), Egress::None),
    ];
    for (id, shown, egress) in cases {
        let reply = plane
            .api
            .call(
                &key,
                Method::GET,
                &format!("/v1/sandboxes/{id}"),
                None,
                None,
            )
            .await;
        assert_eq!(reply.body["network"], shown, "{}", reply.body);
        let create = &commands_of(&db, id).await[0].command;
        let spec = create.spec.as_ref().expect("a create carries its spec");
        assert_eq!(spec.network, Network { egress });
    }
}

/// Without the operator's permission a tenant's allow-list cannot name a private network: the
/// create is refused naming the range, and nothing is written (found by a break-it run: any
/// tenant reached the metadata address and the operator's private networks by listing them).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_tenant_cannot_list_private_networks_without_the_operators_permission(db: PgPool) {
    use crate::support::inproc::{self, Api};

    let org = inproc::org(&db).await;
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    let api = Api::configured(db.clone(), nats, inproc::unique_subjects(), |c| {
        c.sandbox_egress_private = false;
    });
    for list in [
        json!(["10.99.98.0/30"]),
        json!(["192.168.0.0/16"]),
        json!(["100.64.0.1"]),
    ] {
        let body = json!({ "network": { "egress": list } }).to_string();
        let reply = api
            .call(&org.key, Method::POST, "/v1/sandboxes", None, Some(&body))
            .await;
        assert_eq!(reply.status, 400, "{body} → {}", reply.body);
        assert_eq!(reply.body["error"]["field"], "network", "{}", reply.body);
        assert!(
            reply.body["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("private range"),
            "{}",
            reply.body
        );
    }
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(count, 0, "a refused create wrote a row");
}

/// A preview token is refused (409) for a sandbox being deleted or deleted: it would open
/// nothing, and a link handed out for a tombstone misleads whoever gets it.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn no_preview_token_for_a_deleted_sandbox(db: PgPool) {
    use crate::support::inproc;
    use axum::http::Method as M;
    use berth_schemas::HostId;

    inproc::heartbeat(&db, HostId::new(), inproc::HOST_CAPACITY).await;
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    let api = inproc::Api::configured(db.clone(), nats, inproc::unique_subjects(), |c| {
        c.preview.secret = Some(std::sync::Arc::new(vec![7u8; 32]));
    });
    let org = inproc::org(&db).await;
    let id = api.create(&org.key, inproc::SANDBOX).await;
    let token = format!("/v1/sandboxes/{id}/ports/8000/token");
    let granted = api.call(&org.key, M::POST, &token, None, None).await;
    assert_eq!(granted.status, 200, "{}", granted.body);
    assert_eq!(api.lifecycle(&org.key, id, "delete").await.status, 202);
    let refused = api.call(&org.key, M::POST, &token, None, None).await;
    assert_eq!(refused.status, 409, "{}", refused.body);
    assert_eq!(refused.body["error"]["code"], "conflict");
}
