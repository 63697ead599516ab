//! Preview URLs (issue 15 items 1 and 2): real web servers inside runc and gVisor sandboxes,
//! reached through the proxy by host name and by path (on the proxy and on the API), over
//! HTTP/1.1, h2c, WebSocket and an event stream; who may reach them; waking stopped
//! sandboxes once; and that nothing but the host's forwarder reaches a sandbox's port.

use berth_schemas::preview::{self, Preamble, PreviewToken};
use berth_schemas::SandboxId;
use reqwest::header::HOST;
use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use super::preview_kit::*;
use crate::support::env::eventually;
use crate::support::stack::{Stack, PREVIEW_SECRET};

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_web_server_in_a_runc_sandbox_is_reached_by_host_name_and_by_path_and_streams(
    db: PgPool,
) {
    let stack = Stack::start(db, 1).await;
    let id = create_running(
        &stack,
        json!({"template": "base", "vcpus": 1, "memory_mib": 256}),
    )
    .await;
    let (_, sandbox) = stack
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(sandbox["auto_resume"], true, "{sandbox}");
    assert_eq!(sandbox["public_ports"], json!([]), "{sandbox}");
    start_busybox_httpd(&stack, &id, "hello from runc").await;
    wait_served(&stack, &id, 8000).await;

    // By host name, by path on the proxy, by path on the API.
    let (status, body, _) = get_by_host(&stack, &id, 8000, "/", Some(&stack.key)).await;
    assert_eq!((status, body.as_str()), (200, "hello from runc"));
    let path = format!("/v1/sandboxes/{id}/ports/8000/index.html");
    let on_proxy = format!("http://{}{path}", stack.proxy_addr);
    assert_eq!(
        get(&stack, &on_proxy, Some(&stack.key)).await,
        (200, "hello from runc".to_owned())
    );
    assert_eq!(
        get(&stack, &stack.url(&path), Some(&stack.key)).await,
        (200, "hello from runc".to_owned())
    );

    // The key never reaches the sandbox; the sandbox sees its own path and query.
    let (status, env, _) =
        get_by_host(&stack, &id, 8000, "/cgi-bin/env?a=1", Some(&stack.key)).await;
    assert_eq!(status, 200, "{env}");
    assert!(env.contains("query=a=1\n"), "{env}");
    assert!(env.contains("authorization=\n"), "{env}");
    let api_env = get(
        &stack,
        &stack.url(&format!("/v1/sandboxes/{id}/ports/8000/cgi-bin/env?b=2")),
        Some(&stack.key),
    )
    .await;
    assert!(api_env.1.contains("query=b=2\n"), "{api_env:?}");
    assert!(api_env.1.contains("authorization=\n"), "{api_env:?}");

    // A streamed response arrives as it is written: the second event is only written after
    // the test saw the first.
    let mut resp = open_stream(&stack, &id).await;
    let mut seen = String::new();
    read_stream_until(&mut resp, &mut seen, "data: one").await;
    assert!(!seen.contains("data: two"), "{seen}");
    sh(&stack, &id, "touch /tmp/go").await;
    read_stream_until(&mut resp, &mut seen, "data: two").await;

    // Who may: no key → 401, a bad key → 401, another org's key → 404 (as on every route),
    // an unknown sandbox → 404.
    assert_eq!(get_by_host(&stack, &id, 8000, "/", None).await.0, 401);
    assert_eq!(
        get_by_host(&stack, &id, 8000, "/", Some("bk_not_a_key"))
            .await
            .0,
        401
    );
    let (_, other_key) = berth_api::auth::create_org(&stack.db, "preview-intruder")
        .await
        .unwrap();
    assert_eq!(
        get_by_host(&stack, &id, 8000, "/", Some(&other_key))
            .await
            .0,
        404
    );
    assert_eq!(
        get(&stack, &stack.url(&path), Some(&other_key)).await.0,
        404
    );
    let unknown = SandboxId::new().to_string();
    let (status, page, headers) = get_by_host(&stack, &unknown, 8000, "/", Some(&stack.key)).await;
    assert_eq!(status, 404, "{page}");
    assert!(headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    assert!(page.contains("There is no sandbox"), "{page}");
    // Nothing listening: 502 with a page that says so.
    let (status, page, _) = get_by_host(&stack, &id, 9, "/", Some(&stack.key)).await;
    assert_eq!(status, 502, "{page}");
    assert!(page.contains("Nothing is listening on port 9"), "{page}");

    // A token: by query parameter and by header; stripped before the sandbox sees it.
    let granted = token_of(&stack, &id, 8000, Some(600)).await;
    let url = granted["url"].as_str().unwrap();
    let token = granted["token"].as_str().unwrap();
    assert!(
        url.starts_with(&format!(
            "http://8000-{id}.preview.test/?berth_preview_token="
        )),
        "{url}"
    );
    assert!(granted["expires_at"].is_string(), "{granted}");
    // The link (a page load) answers 303 to itself without the token and leaves the token as
    // a cookie (`ops::preview_abuse` tests the cookie's scope); the sandbox sees neither.
    let link = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .get(format!(
            "http://{}/cgi-bin/env?x=y&berth_preview_token={token}",
            stack.proxy_addr
        ))
        .header(HOST, preview_host(&id, 8000))
        .send()
        .await
        .unwrap();
    assert_eq!(link.status(), 303);
    assert_eq!(link.headers()["location"], "/cgi-bin/env?x=y");
    let cookie = link.headers()["set-cookie"].to_str().unwrap();
    let cookie = cookie.split(';').next().unwrap().to_owned();
    let env = stack
        .http
        .get(format!("http://{}/cgi-bin/env?x=y", stack.proxy_addr))
        .header(HOST, preview_host(&id, 8000))
        .header(reqwest::header::COOKIE, cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(env.status(), 200);
    let env = env.text().await.unwrap();
    assert!(env.contains("query=x=y\n"), "{env}");
    let by_header = stack
        .http
        .get(format!("http://{}/cgi-bin/env", stack.proxy_addr))
        .header(HOST, preview_host(&id, 8000))
        .header("x-berth-preview-token", token)
        .send()
        .await
        .unwrap();
    assert_eq!(by_header.status(), 200);
    assert!(by_header.text().await.unwrap().contains("token=\n"));
    // The token opens that port only, of that sandbox only; an expired or forged one is 401.
    let (status, _, _) = get_by_host(
        &stack,
        &id,
        8001,
        &format!("/?berth_preview_token={token}"),
        None,
    )
    .await;
    assert_eq!(status, 401);
    let key = preview::token_key(PREVIEW_SECRET);
    let expired = PreviewToken {
        sandbox: id.parse().unwrap(),
        port: 8000,
        expires: chrono::Utc::now().timestamp() - 10,
    }
    .sign(&key);
    let (status, page, _) = get_by_host(
        &stack,
        &id,
        8000,
        &format!("/?berth_preview_token={expired}"),
        None,
    )
    .await;
    assert_eq!(status, 401, "{page}");
    assert!(page.contains("expired"), "{page}");
    let forged = PreviewToken {
        sandbox: id.parse().unwrap(),
        port: 8000,
        expires: chrono::Utc::now().timestamp() + 600,
    }
    .sign(&preview::token_key(
        b"another secret of at least 32 bytes!!",
    ));
    let (status, _, _) = get_by_host(
        &stack,
        &id,
        8000,
        &format!("/?berth_preview_token={forged}"),
        None,
    )
    .await;
    assert_eq!(status, 401);
    // Another org cannot mint a token for it.
    let (status, _) = stack
        .call_as(
            &other_key,
            Method::POST,
            &format!("/v1/sandboxes/{id}/ports/8000/token"),
            None,
        )
        .await;
    assert_eq!(status, 404);

    // Every forwarded request counts as activity.
    sqlx::query(
        "UPDATE sandboxes SET last_activity_at = now() - interval '1 hour' WHERE id = $1::uuid",
    )
    .bind(&id)
    .execute(&stack.db)
    .await
    .unwrap();
    // The proxy stamps each sandbox at most every few seconds: wait for the next stamp.
    eventually("a forwarded request stamps activity", || async {
        let _ = get_by_host(&stack, &id, 8000, "/", Some(&stack.key)).await;
        sqlx::query_scalar::<_, bool>(
            "SELECT last_activity_at > now() - interval '10 minutes' FROM sandboxes WHERE id = $1::uuid",
        )
        .bind(&id)
        .fetch_one(&stack.db)
        .await
        .unwrap()
    })
    .await;

    // Nothing but the forwarder reaches the port: not another sandbox, even one whose egress
    // allow-list names every sandbox address; the forwarder itself refuses a connection
    // without this host's signed preamble.
    let address = sandbox_address(&stack, &id).await;
    let other = create_running(
        &stack,
        json!({"template": "base", "vcpus": 1, "memory_mib": 256,
               "network": {"egress": ["10.0.0.0/8"]}}),
    )
    .await;
    let (_, probe) = stack
        .exec(
            &other,
            &[
                "sh",
                "-c",
                &format!("busybox wget -q -T 3 -O - http://{address}:8000/ 2>&1; echo exit=$?"),
            ],
        )
        .await;
    let probe = probe["stdout"].as_str().unwrap_or("").to_owned();
    assert!(!probe.contains("hello from runc"), "{probe}");
    assert!(!probe.contains("exit=0"), "{probe}");
    let forwarder = forwarder_of(&stack, &id).await;
    assert_eq!(
        forwarder_reply(&forwarder, "GET / HTTP/1.1\r\n\r\n").await,
        "ERR unauthorized\n"
    );
    let preamble = Preamble {
        sandbox: id.parse().unwrap(),
        port: 8000,
        expires: chrono::Utc::now().timestamp() + 30,
    };
    let wrong_host_key = preview::forwarder_key(PREVIEW_SECRET, berth_schemas::HostId::new());
    assert_eq!(
        forwarder_reply(&forwarder, &preamble.encode(&wrong_host_key)).await,
        "ERR unauthorized\n"
    );
    let stale = Preamble {
        expires: chrono::Utc::now().timestamp() - 1,
        ..preamble
    };
    let host: uuid::Uuid = crate::support::http::host_of(&stack, &id).await;
    let host_key = preview::forwarder_key(PREVIEW_SECRET, berth_schemas::HostId(host));
    assert_eq!(
        forwarder_reply(&forwarder, &stale.encode(&host_key)).await,
        "ERR unauthorized\n"
    );
    assert_eq!(
        forwarder_reply(&forwarder, &preamble.encode(&host_key)).await,
        "OK\n"
    );

    // A deleted sandbox is 404 and stays deleted.
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    assert_eq!(
        get_by_host(&stack, &id, 8000, "/", Some(&stack.key))
            .await
            .0,
        404
    );
    assert_eq!(stack.state_of(&id).await, "deleted");
    stack.delete(&other).await;
    stack.wait_state(&other, "deleted").await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// The sandbox's address on its host.
async fn sandbox_address(stack: &Stack, id: &str) -> String {
    let (_, body) = stack
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    body["address"]
        .as_str()
        .expect("a running sandbox has an address")
        .to_owned()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_python_server_on_gvisor_answers_http_h2c_websocket_and_streams_through_the_proxy(
    db: PgPool,
) {
    // Built once per machine (debootstrap from apt's mirror); a no-op when cached.
    let cache = std::path::Path::new(berth_hostd::template::DEFAULT_TEMPLATE_CACHE);
    berth_hostd::template::build_cached("python", cache)
        .await
        .expect("build the python template");
    let stack = Stack::start(db, 1).await;
    let id = create_running(
        &stack,
        json!({"template": "python", "vcpus": 1, "memory_mib": 512, "public_ports": [8000]}),
    )
    .await;
    let (_, sandbox) = stack
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(sandbox["public_ports"], json!([8000]), "{sandbox}");
    sh(
        &stack,
        &id,
        &format!(
            "cat > /root/server.py <<'EOF'\n{PYTHON_SERVER}\nEOF\n\
             python3 /root/server.py 'hello from gvisor' </dev/null >/root/server.log 2>&1 &"
        ),
    )
    .await;
    wait_served(&stack, &id, 8000).await;
    let host = preview_host(&id, 8000);

    // A public port needs no key; another port of the same sandbox still does.
    let (status, body, _) = get_by_host(&stack, &id, 8000, "/", None).await;
    assert_eq!((status, body.as_str()), (200, "hello from gvisor"));
    assert_eq!(get_by_host(&stack, &id, 8001, "/", None).await.0, 401);

    // HTTP/2 without TLS (prior knowledge) to the proxy.
    assert_eq!(
        h2c_get(stack.proxy_addr, &host, &stack.key).await,
        (200, "hello from gvisor".to_owned())
    );

    // A WebSocket echo through the proxy.
    let (status_line, echoed) =
        websocket_echo(stack.proxy_addr, &host, &stack.key, "ping through berth").await;
    assert!(status_line.contains(" 101 "), "{status_line}");
    assert_eq!(echoed, "echo: ping through berth");

    // An event stream, by path on the API this time.
    let mut resp = stack
        .http
        .get(stack.url(&format!("/v1/sandboxes/{id}/ports/8000/events")))
        .bearer_auth(&stack.key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut seen = String::new();
    read_stream_until(&mut resp, &mut seen, "data: one").await;
    assert!(!seen.contains("data: two"), "{seen}");
    sh(&stack, &id, "touch /tmp/go").await;
    read_stream_until(&mut resp, &mut seen, "data: two").await;

    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_stopped_sandbox_is_woken_by_one_request_and_started_once_by_twenty(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    // gVisor keeps the web server's process across the stop (a memory snapshot). Each round
    // has a sandbox no request reached before its stop: Debian's 2022 runsc refuses to
    // checkpoint a TCP connection the server closed first (it lingers in TIME_WAIT), and that
    // stop would keep the disk only (README, "gVisor memory stops").
    for (round, requests) in [(1, 1usize), (2, 20)] {
        let id = create_running(
            &stack,
            json!({"template": "base-gvisor", "vcpus": 1, "memory_mib": 256}),
        )
        .await;
        start_busybox_httpd(&stack, &id, "awake").await;
        wait_listening(&stack, &id, 8000).await;
        assert_eq!(stack.request(&id, "stop").await.0, 202);
        let sandbox = stack.wait_state(&id, "stopped").await;
        assert_eq!(sandbox["last_stop"], "memory", "round {round}: {sandbox}");
        let before = start_commands(&stack, &id).await;
        let answers = futures::future::join_all(
            (0..requests).map(|_| get_by_host(&stack, &id, 8000, "/", Some(&stack.key))),
        )
        .await;
        for (status, body, _) in &answers {
            assert_eq!((*status, body.as_str()), (200, "awake"), "round {round}");
        }
        assert_eq!(stack.state_of(&id).await, "running");
        assert_eq!(
            start_commands(&stack, &id).await - before,
            1,
            "round {round}: {requests} requests started it once"
        );
        stack.delete(&id).await;
        stack.wait_state(&id, "deleted").await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn with_auto_resume_patched_off_a_request_gets_409_and_the_sandbox_stays_stopped(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = create_running(
        &stack,
        json!({"template": "base", "vcpus": 1, "memory_mib": 256}),
    )
    .await;
    // Turned off after create, by PATCH (the proxy's cached route must not keep the old value).
    let (status, body) = stack
        .call(
            Method::PATCH,
            &format!("/v1/sandboxes/{id}"),
            Some(json!({"auto_resume": false, "public_ports": [9000, 8000]})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["auto_resume"], false);
    assert_eq!(body["public_ports"], json!([8000, 9000]));
    let (status, body) = stack
        .call(
            Method::PATCH,
            &format!("/v1/sandboxes/{id}"),
            Some(json!({"public_ports": []})),
        )
        .await;
    assert_eq!(
        (status, body["public_ports"].clone()),
        (200, json!([])),
        "{body}"
    );
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    let (status, page, headers) = get_by_host(&stack, &id, 8000, "/", Some(&stack.key)).await;
    assert_eq!(status, 409, "{page}");
    assert_eq!(headers["x-berth-sandbox-state"], "stopped");
    assert!(page.contains("stopped"), "{page}");
    let path = format!("/v1/sandboxes/{id}/ports/8000/");
    assert_eq!(
        get(&stack, &stack.url(&path), Some(&stack.key)).await.0,
        409
    );
    assert_eq!(stack.state_of(&id).await, "stopped");
    assert_eq!(start_commands(&stack, &id).await, 0);
    // Bad input on create is refused.
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "base", "public_ports": [0]})),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

/// The agent's port (Berth's own, unauthenticated channel into the sandbox) is never exposed:
/// no preview token, no `public_ports` on create or PATCH, no compat endpoint (400 naming the
/// field), and the proxy (by host name and by path, even for the owner) and the host's
/// forwarder (even with a preamble signed by its own key) never open it.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_agents_port_is_refused_everywhere_a_port_is_exposed(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = create_running(
        &stack,
        json!({"template": "base", "vcpus": 1, "memory_mib": 128}),
    )
    .await;
    let agent = preview::AGENT_PORT;
    let refused = |(status, body): (u16, serde_json::Value), field: &str| {
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["code"], "invalid_request", "{body}");
        assert_eq!(body["error"]["field"], field, "{body}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains("agent"),
            "{body}"
        );
    };
    let token = format!("/v1/sandboxes/{id}/ports/{agent}/token");
    refused(
        stack.call(Method::POST, &token, Some(json!({}))).await,
        "port",
    );
    let patch = json!({"public_ports": [8000, agent]});
    let path = format!("/v1/sandboxes/{id}");
    refused(
        stack.call(Method::PATCH, &path, Some(patch)).await,
        "public_ports",
    );
    let create = json!({"template": "base", "public_ports": [agent]});
    refused(
        stack
            .call(Method::POST, "/v1/sandboxes", Some(create))
            .await,
        "public_ports",
    );
    let (_, row) = stack.call(Method::GET, &path, None).await;
    assert_eq!(row["public_ports"], json!([]), "{row}");
    let compat = stack
        .http
        .get(stack.url(&format!(
            "/compat/opensandbox/v1/sandboxes/{id}/endpoints/{agent}"
        )))
        .header("OPEN-SANDBOX-API-KEY", &stack.key)
        .send()
        .await
        .unwrap();
    assert_eq!(compat.status().as_u16(), 400);
    let body = compat.text().await.unwrap();
    assert!(body.contains("port") && body.contains("agent"), "{body}");

    // The owner's key opens every other port through the proxy, never this one.
    let (status, page, _) = get_by_host(&stack, &id, agent, "/", Some(&stack.key)).await;
    assert_eq!(status, 403, "{page}");
    assert!(page.contains("agent"), "{page}");
    let by_path = stack.url(&format!("/v1/sandboxes/{id}/ports/{agent}/"));
    assert_eq!(get(&stack, &by_path, Some(&stack.key)).await.0, 403);
    let host: uuid::Uuid = crate::support::http::host_of(&stack, &id).await;
    let host_key = preview::forwarder_key(PREVIEW_SECRET, berth_schemas::HostId(host));
    let preamble = Preamble {
        sandbox: id.parse().unwrap(),
        port: agent,
        expires: chrono::Utc::now().timestamp() + 30,
    };
    let forwarder = forwarder_of(&stack, &id).await;
    assert_eq!(
        forwarder_reply(&forwarder, &preamble.encode(&host_key)).await,
        "ERR unauthorized\n"
    );
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

/// A preview connection open at a gVisor stop used to make the checkpoint fail ("endpoint
/// cannot be saved in connected state"), so the stop kept the disk only, and the forwarder's
/// connection to the dead sandbox stayed open, its client hanging, and every later memory stop
/// of the sandbox waited for it (attack run). hostd now cuts a sandbox's forwarded connections
/// when its stop begins: the stream ends, and the stop keeps memory.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_gvisor_stop_cuts_an_open_preview_stream_and_keeps_memory(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = create_running(
        &stack,
        json!({"template": "base-gvisor", "vcpus": 1, "memory_mib": 256}),
    )
    .await;
    start_busybox_httpd(&stack, &id, "awake").await;
    wait_listening(&stack, &id, 8000).await;
    let mut resp = open_stream(&stack, &id).await;
    let mut seen = String::new();
    read_stream_until(&mut resp, &mut seen, "data: one").await;

    assert_eq!(stack.request(&id, "stop").await.0, 202);
    let stopped = stack.wait_state(&id, "stopped").await;
    assert_eq!(stopped["last_stop"], "memory", "{stopped}");
    let ended = tokio::time::timeout(crate::support::env::SETTLE_TIMEOUT, async {
        while let Ok(Some(_)) = resp.chunk().await {}
    })
    .await;
    assert!(ended.is_ok(), "the stream outlived the stop");
    // The server's process was kept: a request wakes the sandbox and it answers.
    let (status, body, _) = get_by_host(&stack, &id, 8000, "/", Some(&stack.key)).await;
    assert_eq!((status, body.as_str()), (200, "awake"));
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}
