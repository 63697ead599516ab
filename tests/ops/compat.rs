//! The OpenSandbox compatibility surface (issue 18 item 1): the real `opensandbox` Python SDK
//! (1.1.1, installed by `.ci/run` in the venv at `BERTH_SDK_VENV`, default
//! `/var/tmp/berth-venv`) driven unchanged through `tests/compat/opensandbox_sdk.py` against
//! the end-to-end stack; and the surface's abuse: missing and wrong keys, another org's
//! sandbox, one sandbox's execd token on another, malformed bodies.

use std::path::PathBuf;

use reqwest::Method;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::support::registry::{push_marked_image, Registry};
use crate::support::{eventually, unique, Stack};

/// Where `.ci/run` makes the SDK's venv.
const DEFAULT_VENV: &str = "/var/tmp/berth-venv";
const MOUNT: &str = "/compat/opensandbox";
const TOKEN: &str = "x-berth-execd-token";

fn venv_python() -> PathBuf {
    let venv = std::env::var("BERTH_SDK_VENV").unwrap_or_else(|_| DEFAULT_VENV.to_owned());
    let python = PathBuf::from(venv).join("bin/python3");
    assert!(
        python.exists(),
        "{} is missing: the SDK test needs `python3 -m venv {DEFAULT_VENV} && \
         {DEFAULT_VENV}/bin/pip install opensandbox==1.1.1` (.ci/run does it)",
        python.display()
    );
    python
}

/// An OpenSandbox request: `key` in `OPEN-SANDBOX-API-KEY` when given, `headers` added.
async fn call(
    stack: &Stack,
    method: Method,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = stack
        .http
        .request(method, stack.url(&format!("{MOUNT}{path}")));
    if let Some(key) = key {
        req = req.header("OPEN-SANDBOX-API-KEY", key);
    }
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    if let Some(body) = body {
        req = req.json(&body);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, value)
}

/// Every refusal of the surface is `{code, message}`, both strings, nothing else.
fn assert_error(status: u16, body: &Value, want_status: u16, want_code: &str) {
    assert_eq!(status, want_status, "{body}");
    assert_eq!(body["code"], want_code, "{body}");
    assert!(body["message"].is_string(), "{body}");
    assert_eq!(body.as_object().map(|o| o.len()), Some(2), "{body}");
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_opensandbox_sdk_drives_sandboxes_unchanged_from_create_to_kill(db: PgPool) {
    let python = venv_python();
    let registry = Registry::start().await;
    let mark = format!("compat {}", unique());
    let oci_image = push_marked_image(&registry, "compat", &mark);
    let stack = Stack::start(db, 1).await;
    let domain = format!(
        "{}{MOUNT}",
        stack
            .base
            .trim_start_matches("http://")
            .trim_end_matches('/')
    );
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/compat/opensandbox_sdk.py");
    let output = tokio::process::Command::new(&python)
        .arg(&script)
        .env("OPEN_SANDBOX_DOMAIN", &domain)
        .env("OPEN_SANDBOX_API_KEY", &stack.key)
        .env("BERTH_RUN", unique())
        .env("BERTH_OCI_IMAGE", &oci_image)
        .env("BERTH_OCI_MARK", &mark)
        .env(
            "BERTH_OCI_MISSING",
            registry.reference("no-such-image", "1"),
        )
        .output()
        .await
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.trim_end().ends_with("ok"),
        "the SDK script failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
    let live: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE state <> 'deleted'")
        .fetch_one(&stack.db)
        .await
        .unwrap();
    assert_eq!(live, 0, "the script killed every sandbox it made");
    // The image became a template, pulled once and pinned; the unknown one failed with its code.
    let (state, pinned): (String, Option<String>) =
        sqlx::query_as("SELECT state, image_pinned FROM templates WHERE image = $1")
            .bind(&oci_image)
            .fetch_one(&stack.db)
            .await
            .unwrap();
    assert_eq!(state, "ready");
    assert!(pinned.is_some_and(|p| p.contains("@sha256:")));
    let code: Option<String> =
        sqlx::query_scalar("SELECT error_code FROM templates WHERE image LIKE '%no-such-image%'")
            .fetch_one(&stack.db)
            .await
            .unwrap();
    assert_eq!(code.as_deref(), Some("unknown_image"));
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn keys_orgs_execd_tokens_and_malformed_bodies_are_refused_with_code_and_message(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let key = stack.key.clone();
    let (_, other_key) = berth_api::auth::create_org(&stack.db, "compat-intruder")
        .await
        .unwrap();
    let create = json!({"templateId": "base", "timeout": 600,
                        "resourceLimits": {"cpu": "1", "memory": "256Mi"}});

    // No key, a wrong key, a Bearer key instead of the SDK's header: 401 before any route or
    // id is looked at.
    for (path, method) in [
        ("/v1/sandboxes", Method::GET),
        ("/v1/sandboxes", Method::POST),
        ("/v1/sandboxes/not-an-id", Method::GET),
        ("/v1/no-such-route", Method::GET),
    ] {
        let (status, body) = call(&stack, method.clone(), path, None, &[], None).await;
        assert_error(status, &body, 401, "unauthorized");
        let (status, body) = call(&stack, method.clone(), path, Some("bk_wrong"), &[], None).await;
        assert_error(status, &body, 401, "unauthorized");
        let bearer = format!("Bearer {key}");
        let (status, body) = call(
            &stack,
            method,
            path,
            None,
            &[("authorization", bearer.as_str())],
            None,
        )
        .await;
        assert_error(status, &body, 401, "unauthorized");
    }

    // Two sandboxes of the org, one of another org.
    let (status, a) = call(
        &stack,
        Method::POST,
        "/v1/sandboxes",
        Some(&key),
        &[],
        Some(create.clone()),
    )
    .await;
    assert_eq!(status, 202, "{a}");
    assert_eq!(a["status"]["state"], "Pending", "{a}");
    assert!(
        a.get("expiresAt").is_some() && !a["expiresAt"].is_null(),
        "{a}"
    );
    let a = a["id"].as_str().unwrap().to_owned();
    let (status, b) = call(
        &stack,
        Method::POST,
        "/v1/sandboxes",
        Some(&key),
        &[],
        Some(create.clone()),
    )
    .await;
    assert_eq!(status, 202, "{b}");
    let b = b["id"].as_str().unwrap().to_owned();
    // Without a timeout there is no expiry: omitted, never null.
    let (status, never) = call(
        &stack,
        Method::POST,
        "/v1/sandboxes",
        Some(&other_key),
        &[],
        Some(json!({"templateId": "base", "timeout": null,
                    "resourceLimits": {"cpu": "1", "memory": "256Mi"}})),
    )
    .await;
    assert_eq!(status, 202, "{never}");
    assert!(never.get("expiresAt").is_none(), "{never}");
    let theirs = never["id"].as_str().unwrap().to_owned();

    // Another org's sandbox is not found on every route, and nothing changes.
    for (method, path, body) in [
        (Method::GET, format!("/v1/sandboxes/{a}"), None),
        (Method::POST, format!("/v1/sandboxes/{a}/pause"), None),
        (Method::POST, format!("/v1/sandboxes/{a}/resume"), None),
        (Method::DELETE, format!("/v1/sandboxes/{a}"), None),
        (
            Method::GET,
            format!("/v1/sandboxes/{a}/endpoints/44772"),
            None,
        ),
        (
            Method::POST,
            format!("/v1/sandboxes/{a}/renew-expiration"),
            Some(
                json!({"expiresAt": (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339()}),
            ),
        ),
    ] {
        let (status, body) = call(&stack, method, &path, Some(&other_key), &[], body).await;
        assert_error(status, &body, 404, "not_found");
    }
    let (status, listed) = call(
        &stack,
        Method::GET,
        "/v1/sandboxes",
        Some(&other_key),
        &[],
        None,
    )
    .await;
    assert_eq!(status, 200, "{listed}");
    let ids: Vec<&str> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![theirs.as_str()], "an org lists only its own");
    let deleted: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT deleted_at FROM sandboxes WHERE id = $1::uuid")
            .bind(&a)
            .fetch_one(&stack.db)
            .await
            .unwrap();
    assert!(deleted.is_none(), "another org's kill changed nothing");

    // Execd tokens: each sandbox's opens it alone.
    let token_of = |id: String| {
        let stack = &stack;
        let key = key.clone();
        async move {
            let (status, ep) = call(
                stack,
                Method::GET,
                &format!("/v1/sandboxes/{id}/endpoints/44772"),
                Some(&key),
                &[],
                None,
            )
            .await;
            assert_eq!(status, 200, "{ep}");
            assert!(
                ep["endpoint"]
                    .as_str()
                    .unwrap()
                    .ends_with(&format!("{MOUNT}/execd/{id}")),
                "{ep}"
            );
            assert!(
                !ep["endpoint"].as_str().unwrap().contains("://"),
                "no scheme: {ep}"
            );
            ep["headers"][TOKEN].as_str().unwrap().to_owned()
        }
    };
    let token_a = token_of(a.clone()).await;
    let token_b = token_of(b.clone()).await;
    assert_ne!(token_a, token_b);
    assert_eq!(
        token_of(a.clone()).await,
        token_a,
        "a sandbox keeps its token"
    );
    let (status, egress) = call(
        &stack,
        Method::GET,
        &format!("/v1/sandboxes/{a}/endpoints/18080"),
        Some(&key),
        &[],
        None,
    )
    .await;
    assert_eq!(status, 200, "the egress port answers too: {egress}");
    for (path, headers) in [
        (format!("/execd/{b}/ping"), vec![(TOKEN, token_a.as_str())]),
        (format!("/execd/{a}/ping"), vec![]),
        (format!("/execd/{a}/ping"), vec![(TOKEN, "")]),
        (
            format!("/execd/{a}/ping"),
            vec![("open-sandbox-api-key", key.as_str())],
        ),
        (format!("/execd/{a}/ping"), vec![(TOKEN, key.as_str())]),
        (
            "/execd/not-an-id/ping".to_owned(),
            vec![(TOKEN, token_a.as_str())],
        ),
        (
            format!("/execd/{theirs}/ping"),
            vec![(TOKEN, token_a.as_str())],
        ),
    ] {
        let (status, body) = call(&stack, Method::GET, &path, None, &headers, None).await;
        assert_error(status, &body, 401, "unauthorized");
    }
    let (status, body) = call(
        &stack,
        Method::POST,
        &format!("/execd/{b}/command"),
        None,
        &[(TOKEN, token_a.as_str())],
        Some(json!({"command": "id"})),
    )
    .await;
    assert_error(status, &body, 401, "unauthorized");
    let download = format!("/execd/{b}/files/download?path=/etc/passwd");
    let (status, body) = call(
        &stack,
        Method::GET,
        &download,
        None,
        &[(TOKEN, token_a.as_str())],
        None,
    )
    .await;
    assert_error(status, &body, 401, "unauthorized");
    // Its own token opens it: ping answers once it runs.
    stack.wait_state(&a, "running").await;
    let (status, body) = call(
        &stack,
        Method::GET,
        &format!("/execd/{a}/ping"),
        None,
        &[(TOKEN, token_a.as_str())],
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");

    // Malformed and unsupported bodies: 400 naming what, and nothing written.
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM sandboxes")
            .fetch_one(&stack.db)
            .await
            .unwrap()
    };
    let before = count().await;
    for (body, code) in [
        (Value::String("{not json".into()), "invalid_request"),
        (
            json!({"templateId": "base", "timeout": 600, "gpu": true}),
            "invalid_request",
        ),
        (
            json!({"image": {"uri": "has space:1"}, "timeout": 600,
                "entrypoint": ["tail", "-f", "/dev/null"]}),
            "invalid_request",
        ),
        (
            json!({"image": {"uri": "127.0.0.1:1/x:1", "auth": {"username": "u"}},
                   "timeout": 600}),
            "invalid_request",
        ),
        (
            json!({"templateId": "no-such-template", "timeout": 600}),
            "unknown_template",
        ),
        (
            json!({"templateId": "base", "timeout": 10}),
            "invalid_request",
        ),
        (
            json!({"templateId": "base", "timeout": 600, "resourceLimits": {"gpu": "1"}}),
            "invalid_request",
        ),
        (
            json!({"templateId": "base", "timeout": 600, "resourceLimits": {"memory": "lots"}}),
            "invalid_request",
        ),
        (
            json!({"templateId": "base", "timeout": 600, "secureAccess": true}),
            "invalid_request",
        ),
        (
            json!({"templateId": "base", "timeout": 600, "volumes": [{"name": "v"}]}),
            "invalid_request",
        ),
        (
            json!({"image": {"uri": "base"}, "templateId": "base", "timeout": 600}),
            "invalid_request",
        ),
        (
            json!({"templateId": "base", "timeout": 600, "env": {"A=B": "x"}}),
            "invalid_request",
        ),
        (
            json!({"templateId": "base", "timeout": 600, "metadata": {"n": 1}}),
            "invalid_request",
        ),
    ] {
        let req = stack
            .http
            .post(stack.url(&format!("{MOUNT}/v1/sandboxes")))
            .header("OPEN-SANDBOX-API-KEY", &key)
            .header("content-type", "application/json");
        let req = match &body {
            Value::String(raw) => req.body(raw.clone()),
            other => req.body(other.to_string()),
        };
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let answer: Value = resp.json().await.unwrap();
        assert_error(status, &answer, 400, code);
    }
    assert_eq!(count().await, before, "a refused create writes nothing");
    let past = (chrono::Utc::now() - chrono::Duration::minutes(1)).to_rfc3339();
    for renewal in [
        json!({"expiresAt": past}),
        json!({"expiresAt": "tomorrow"}),
        json!({}),
    ] {
        let (status, body) = call(
            &stack,
            Method::POST,
            &format!("/v1/sandboxes/{a}/renew-expiration"),
            Some(&key),
            &[],
            Some(renewal),
        )
        .await;
        assert_error(status, &body, 400, "invalid_request");
    }
    let (status, body) = call(
        &stack,
        Method::GET,
        "/v1/sandboxes?state=Sleeping",
        Some(&key),
        &[],
        None,
    )
    .await;
    assert_error(status, &body, 400, "invalid_request");
    let a_token = [(TOKEN, token_a.as_str())];
    for bad in [
        json!({"command": "id", "uid": 1000}),
        json!({}),
        json!({"command": "id", "shell": "bash"}),
        json!({"command": "id", "timeout": 600_001}),
    ] {
        let (status, body) = call(
            &stack,
            Method::POST,
            &format!("/execd/{a}/command"),
            None,
            &a_token,
            Some(bad),
        )
        .await;
        assert_error(status, &body, 400, "invalid_request");
    }
    let upload = stack.url(&format!("{MOUNT}/execd/{a}/files/upload"));
    let multipart = |parts: &[(&str, &str)]| {
        let mut body = String::new();
        for (name, content) in parts {
            body.push_str(&format!(
                "--XyZ\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\n\r\n{content}\r\n"
            ));
        }
        body.push_str("--XyZ--\r\n");
        body
    };
    for (content_type, body) in [
        ("application/json", "{}".to_owned()),
        (
            "multipart/form-data; boundary=XyZ",
            multipart(&[("file", "data")]),
        ),
        (
            "multipart/form-data; boundary=XyZ",
            multipart(&[
                ("metadata", r#"{"path":"/tmp/x","mode":999}"#),
                ("file", "x"),
            ]),
        ),
        (
            "multipart/form-data; boundary=XyZ",
            multipart(&[("metadata", r#"{"path":"/tmp/x"}"#)]),
        ),
        (
            "multipart/form-data; boundary=XyZ",
            multipart(&[("other", "x")]),
        ),
    ] {
        let resp = stack
            .http
            .post(&upload)
            .header(TOKEN, token_a.as_str())
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let answer: Value = resp.json().await.unwrap();
        assert_error(status, &answer, 400, "invalid_request");
    }
    let (status, body) = call(
        &stack,
        Method::GET,
        &format!("/execd/{a}/files/download?path=/tmp/none"),
        None,
        &a_token,
        None,
    )
    .await;
    assert_error(status, &body, 404, "not_found");

    // Killed: its token opens nothing more.
    let (status, body) = call(
        &stack,
        Method::DELETE,
        &format!("/v1/sandboxes/{a}"),
        Some(&key),
        &[],
        None,
    )
    .await;
    assert_eq!(status, 204, "{body}");
    let (status, body) = call(
        &stack,
        Method::GET,
        &format!("/execd/{a}/ping"),
        None,
        &a_token,
        None,
    )
    .await;
    assert_error(status, &body, 404, "not_found");
    stack.delete(&b).await;
    let (status, body) = call(
        &stack,
        Method::DELETE,
        &format!("/v1/sandboxes/{theirs}"),
        Some(&other_key),
        &[],
        None,
    )
    .await;
    assert_eq!(status, 204, "{body}");
    for id in [&a, &b, &theirs] {
        eventually(&format!("{id} deleted"), || async {
            let state: String =
                sqlx::query_scalar("SELECT state FROM sandboxes WHERE id = $1::uuid")
                    .bind(id)
                    .fetch_one(&stack.db)
                    .await
                    .unwrap();
            state == "deleted"
        })
        .await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}
