//! A hostile tenant against the API's routes, through the real router and Postgres (no host
//! needed): what an attack run found and what was fixed, each pinned here.

use axum::http::Method;
use sqlx::PgPool;

use crate::support::inproc::{self, Api};

/// Found by an attack run: `/v1/events?sandboxid=…` (a misspelt filter) was accepted and
/// streamed every event of the org. Every list route (and the files routes) now refuses a
/// query parameter it does not read with 400 `invalid_request` naming it; the ones it reads
/// still work.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn every_list_route_refuses_a_query_parameter_it_does_not_read_naming_it(db: PgPool) {
    let org = inproc::org(&db).await;
    let admin = berth_api::auth::create_admin_key(&db).await.unwrap();
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    let api = Api::new(db.clone(), nats, inproc::unique_subjects());
    let some = "0b3e5c64-3b4e-4a3c-9a51-2b0f0e7d7a11";
    let refused = [
        (
            org.key.as_str(),
            "/v1/events?sandboxid=x".to_owned(),
            "sandboxid",
        ),
        (
            org.key.as_str(),
            "/v1/events?type=sandbox.running&types=x".to_owned(),
            "types",
        ),
        (
            org.key.as_str(),
            "/v1/sandboxes?sate=running".to_owned(),
            "sate",
        ),
        (
            org.key.as_str(),
            format!("/v1/sandboxes/{some}/events?since=1"),
            "since",
        ),
        (
            org.key.as_str(),
            format!("/v1/sandboxes/{some}/snapshots?limit=1"),
            "limit",
        ),
        (org.key.as_str(), "/v1/webhooks?limit=2".to_owned(), "limit"),
        (
            org.key.as_str(),
            format!("/v1/webhooks/{some}/deliveries?limt=2"),
            "limt",
        ),
        (
            org.key.as_str(),
            "/v1/templates?runtime=runc".to_owned(),
            "runtime",
        ),
        (org.key.as_str(), "/v1/keys?all=1".to_owned(), "all"),
        (
            org.key.as_str(),
            format!("/v1/sandboxes/{some}/files?path=/x&mode=1"),
            "mode",
        ),
        (admin.as_str(), "/v1/hosts?state=ready".to_owned(), "state"),
    ];
    for (key, path, param) in refused {
        let reply = api.call(key, Method::GET, &path, None, None).await;
        assert_eq!(reply.status, 400, "{path}: {}", reply.body);
        assert_eq!(reply.code(), "invalid_request", "{path}: {}", reply.body);
        assert_eq!(
            reply.body["error"]["field"], param,
            "{path}: {}",
            reply.body
        );
        let message = reply.body["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains(param), "{path}: {message}");
    }
    // What the routes read still works (an unknown id is answered as before).
    for (key, path, status) in [
        (org.key.as_str(), "/v1/templates".to_owned(), 200),
        (org.key.as_str(), "/v1/webhooks".to_owned(), 200),
        (org.key.as_str(), "/v1/keys".to_owned(), 200),
        (
            org.key.as_str(),
            "/v1/sandboxes?state=running&limit=5".to_owned(),
            200,
        ),
        (
            org.key.as_str(),
            format!("/v1/webhooks/{some}/deliveries?limit=2"),
            404,
        ),
        (
            org.key.as_str(),
            format!("/v1/sandboxes/{some}/snapshots"),
            404,
        ),
        (admin.as_str(), "/v1/hosts".to_owned(), 200),
    ] {
        let reply = api.call(key, Method::GET, &path, None, None).await;
        assert_eq!(reply.status, status, "{path}: {}", reply.body);
    }
}

/// Found by an attack run: `POST /v1/hosts/{id}/drain?live=true` drained without `live` (the
/// query was not read) and answered 200; the host actions now refuse any query parameter. And a
/// NUL byte (which Postgres text cannot hold) in a template's name or description or a
/// webhook's secret was a 500; it is a 404 for a name asked for, a 400 naming the field else.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn host_actions_refuse_a_query_and_a_nul_byte_is_refused_not_a_500(db: PgPool) {
    let org = inproc::org(&db).await;
    let admin = berth_api::auth::create_admin_key(&db).await.unwrap();
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    let api = Api::new(db.clone(), nats, inproc::unique_subjects());
    let some = "0b3e5c64-3b4e-4a3c-9a51-2b0f0e7d7a11";
    for (action, param) in [("drain", "live"), ("cordon", "bogus"), ("uncordon", "x")] {
        let path = format!("/v1/hosts/{some}/{action}?{param}=true");
        let reply = api.call(&admin, Method::POST, &path, None, None).await;
        assert_eq!(reply.status, 400, "{path}: {}", reply.body);
        assert_eq!(
            reply.body["error"]["field"], param,
            "{path}: {}",
            reply.body
        );
    }
    let drain = format!("/v1/hosts/{some}/drain");
    let reply = api
        .call(&admin, Method::POST, &drain, None, Some(r#"{"live":true}"#))
        .await;
    assert_eq!(reply.status, 404, "the body is read: {}", reply.body);

    for method in [Method::GET, Method::DELETE] {
        let reply = api
            .call(&admin, method.clone(), "/v1/templates/a%00b", None, None)
            .await;
        assert_eq!(reply.status, 404, "{method}: {}", reply.body);
    }
    let bad = [
        (
            admin.as_str(),
            "/v1/templates",
            r#"{"name":"ab","image":"registry.invalid/a:1","description":"x\u0000"}"#,
            "description",
        ),
        (
            org.key.as_str(),
            "/v1/webhooks",
            r#"{"url":"https://example.com/","secret":"0123456789abcdef\u0000","event_types":["sandbox.running"]}"#,
            "secret",
        ),
    ];
    // The template route needs an API that can pull (it is 503 `not_configured` before it reads
    // the body otherwise).
    let api = crate::requests::never_pulling_api(&db).await;
    for (key, path, body, field) in bad {
        let reply = api.call(key, Method::POST, path, None, Some(body)).await;
        assert_eq!(reply.status, 400, "{path}: {}", reply.body);
        assert_eq!(
            reply.body["error"]["field"], field,
            "{path}: {}",
            reply.body
        );
    }
}

/// Found by an attack run: any org key could register a template, which every org shares:
/// pull any image the API's machine reaches (a registry on the operator's network), fill its
/// template cache, and plant an image under a name other tenants create from. Only an
/// operator key registers one now; an org key is 403 and nothing is written.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_tenant_cannot_register_a_template_every_org_shares(db: PgPool) {
    let org = inproc::org(&db).await;
    let operator = berth_api::auth::create_admin_key(&db).await.unwrap();
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    let api = Api::new(db.clone(), nats, inproc::unique_subjects());
    let body = r#"{"name":"node","image":"registry.internal:5000/evil:1"}"#;
    let refused = api
        .call(&org.key, Method::POST, "/v1/templates", None, Some(body))
        .await;
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert_eq!(refused.code(), "forbidden");
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM templates WHERE name = 'node'")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(count, 0, "a refused template was written");
    // The operator passes the check (this router has no image cache: 503, nothing written).
    let operated = api
        .call(&operator, Method::POST, "/v1/templates", None, Some(body))
        .await;
    assert_eq!(operated.status, 503, "{}", operated.body);
    assert_eq!(operated.code(), "not_configured");
}

/// Found by an attack run: `POST …/snapshot`, `…/backup`, `…/exec` and `PATCH
/// /v1/sandboxes/{id}` took any query parameter and ignored it (`?kind=memory`, `?timeout_ms=`
/// did nothing, silently), as the host actions did. Every route that reads no query now refuses
/// one with 400 `invalid_request` naming it, before it does anything; without the query the
/// same request is answered as before (an unknown id: 404; a template this API cannot pull:
/// 503).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn routes_that_read_no_query_refuse_one_naming_it(db: PgPool) {
    let org = inproc::org(&db).await;
    let admin = berth_api::auth::create_admin_key(&db).await.unwrap();
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    let api = Api::new(db.clone(), nats, inproc::unique_subjects());
    let some = "0b3e5c64-3b4e-4a3c-9a51-2b0f0e7d7a11";
    let box_ = format!("/v1/sandboxes/{some}");
    let exec = r#"{"cmd":["true"]}"#;
    let webhook = r#"{"url":"http://127.0.0.1:9/","event_types":["sandbox.running"]}"#;
    let template = r#"{"name":"ab","image":"registry.invalid/a:1"}"#;
    // (key, method, path without its query, body, the parameter sent, the answer without it)
    let routes = [
        (
            &org.key,
            Method::POST,
            format!("{box_}/snapshot"),
            None,
            "kind",
            404,
        ),
        (
            &org.key,
            Method::POST,
            format!("{box_}/backup"),
            None,
            "x",
            404,
        ),
        (
            &org.key,
            Method::POST,
            format!("{box_}/exec"),
            Some(exec),
            "timeout_ms",
            404,
        ),
        (
            &org.key,
            Method::PATCH,
            box_.clone(),
            Some("{}"),
            "metadata",
            404,
        ),
        (&org.key, Method::GET, box_.clone(), None, "fields", 404),
        (
            &org.key,
            Method::POST,
            format!("{box_}/exec/stream"),
            Some(exec),
            "cmd",
            404,
        ),
        (
            &org.key,
            Method::POST,
            format!("{box_}/renew"),
            Some(r#"{"extend_seconds":60}"#),
            "extend_seconds",
            404,
        ),
        (
            &org.key,
            Method::POST,
            format!("{box_}/fork"),
            Some(r#"{"count":1}"#),
            "count",
            404,
        ),
        (
            &org.key,
            Method::POST,
            format!("{box_}/ports/8080/token"),
            None,
            "ttl_seconds",
            404,
        ),
        (
            &org.key,
            Method::GET,
            format!("/v1/snapshots/{some}"),
            None,
            "x",
            404,
        ),
        (
            &org.key,
            Method::DELETE,
            format!("/v1/snapshots/{some}"),
            None,
            "force",
            404,
        ),
        (
            &org.key,
            Method::GET,
            "/v1/templates/nope".to_owned(),
            None,
            "x",
            404,
        ),
        (
            &admin,
            Method::DELETE,
            "/v1/templates/nope".to_owned(),
            None,
            "force",
            404,
        ),
        (
            &admin,
            Method::POST,
            "/v1/templates".to_owned(),
            Some(template),
            "pull",
            503,
        ),
        (
            &org.key,
            Method::POST,
            "/v1/webhooks".to_owned(),
            Some(webhook),
            "secret",
            201,
        ),
        (
            &org.key,
            Method::GET,
            format!("/v1/webhooks/{some}"),
            None,
            "x",
            404,
        ),
        (
            &org.key,
            Method::DELETE,
            format!("/v1/webhooks/{some}"),
            None,
            "x",
            404,
        ),
    ];
    for (key, method, path, body, param, without) in routes {
        let with = format!("{path}?{param}=1");
        let reply = api.call(key, method.clone(), &with, None, body).await;
        assert_eq!(reply.status, 400, "{method} {with}: {}", reply.body);
        assert_eq!(reply.code(), "invalid_request", "{method} {with}");
        assert_eq!(reply.body["error"]["field"], param, "{method} {with}");
        let message = reply.body["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains("takes none"), "{method} {with}: {message}");
        let reply = api.call(key, method.clone(), &path, None, body).await;
        assert_eq!(reply.status, without, "{method} {path}: {}", reply.body);
    }
    // The routes with a query of their own refuse what it does not hold the same way.
    for (method, path, param) in [
        (
            Method::POST,
            format!("{box_}/stop?wait=stopped&live=1"),
            "live",
        ),
        (Method::DELETE, format!("{box_}?force=true"), "force"),
        (
            Method::GET,
            format!("{box_}/wait?state=running&since=1"),
            "since",
        ),
        (Method::POST, format!("{box_}/clone?count=2"), "count"),
    ] {
        let reply = api.call(&org.key, method.clone(), &path, None, None).await;
        assert_eq!(reply.status, 400, "{method} {path}: {}", reply.body);
        assert_eq!(reply.body["error"]["field"], param, "{method} {path}");
    }
    // Nothing was written by the refused requests: one webhook, the one made without a query.
    let webhooks: i64 = sqlx::query_scalar("SELECT count(*) FROM webhooks")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(webhooks, 1);
}

/// Found by an attack run: a sandbox archived and then deleted showed its old `host_id` again
/// (the row keeps naming the host its archive freed), although an archived one shows `null`.
/// A `deleted` sandbox holds nothing on any host, however it was deleted: `null`, in the read
/// and in the list; a stopped one still shows the host that keeps its disk.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_deleted_sandbox_shows_no_host_archived_first_or_not(db: PgPool) {
    use berth_schemas::CommandKind;
    let plane = inproc::Plane::start(db).await;

    let archived = crate::archive::archived_by_hand(&plane).await;
    plane.request(archived, "delete").await;
    let body = plane.shown(archived, "?state=deleted").await;
    assert_eq!(body["state"], "deleted", "{body}");
    assert!(
        body["host_id"].is_null(),
        "deleted after its archive: {body}"
    );
    let row_host: Option<uuid::Uuid> =
        sqlx::query_scalar("SELECT host_id FROM sandboxes WHERE id = $1")
            .bind(archived)
            .fetch_one(&plane.db)
            .await
            .unwrap();
    assert_eq!(
        row_host,
        Some(plane.host.as_uuid()),
        "the row still names the host its archive freed (what this test is about)"
    );

    // Stopped on its host, then deleted there: its host until the host reports it gone.
    let (id, _stop) = plane.stopped().await;
    let host = plane.host.to_string();
    assert_eq!(
        plane.shown(id, "").await["host_id"],
        host.as_str(),
        "stopped: its disk's host"
    );
    plane.request(id, "delete").await;
    assert_eq!(
        plane.shown(id, "").await["host_id"],
        host.as_str(),
        "being deleted there"
    );
    let delete = plane.latest(id).await;
    plane
        .deliver(&delete, inproc::succeeded(CommandKind::Delete))
        .await;
    let body = plane.shown(id, "?state=deleted").await;
    assert_eq!(body["state"], "deleted", "{body}");
    assert!(body["host_id"].is_null(), "deleted on its host: {body}");
}

/// Found by an attack run: a request with two `Authorization: Bearer` keys acted as the first
/// Berth key among them, so a proxy's own key appended after a client's acted as the client's.
/// Two different keys are refused, naming the header; a key beside a non-Berth bearer token or
/// `Basic` credentials still works.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_request_naming_two_keys_is_refused_not_served_as_either(db: PgPool) {
    let ours = inproc::org(&db).await;
    let theirs = inproc::org(&db).await;
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    let api = Api::new(db.clone(), nats, inproc::unique_subjects());
    let with = |values: &[String]| {
        let mut req = axum::http::Request::get("/v1/sandboxes");
        for v in values {
            req = req.header(axum::http::header::AUTHORIZATION, v);
        }
        req.body(axum::body::Body::empty()).unwrap()
    };
    let bearer = |key: &str| format!("Bearer {key}");
    for pair in [
        [bearer(&theirs.key), bearer(&ours.key)],
        [bearer(&ours.key), bearer(&theirs.key)],
    ] {
        let reply = api.send(with(&pair)).await;
        assert_eq!(reply.status, 400, "{}", reply.body);
        assert_eq!(reply.body["error"]["field"], "Authorization");
    }
    for alongside in ["Bearer not-a-berth-key", "Basic dXNlcjpwdw=="] {
        let reply = api
            .send(with(&[alongside.to_owned(), bearer(&ours.key)]))
            .await;
        assert_eq!(reply.status, 200, "beside {alongside}: {}", reply.body);
    }
}
