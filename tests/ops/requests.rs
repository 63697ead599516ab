//! What the API makes of a request's body and headers, through the real router and Postgres (no
//! host needed). Each test pins what an attack run with only the README found:
//! `POST /v1/keys` read no body (20 MB of garbage got 201), `Idempotency-Key` was ignored on
//! `POST /v1/templates` and `POST /v1/keys` and taken twice on one request, snapshot, restore,
//! clone and fork bodies passed unknown fields or JSON arrays, 400s carried serde's raw text
//! without a `field` and 413s no `limit`, and an org could revoke its last key.

use axum::body::Body;
use axum::http::{header, Method, Request};
use berth_api::http::body::MAX_BODY_BYTES;
use berth_api::service::keys::{revoke_key, MAX_ACTIVE_KEYS};
use berth_api::service::templates::{ImagePuller, PullFailure, PulledImage};
use berth_api::service::ServiceError;
use futures::future::BoxFuture;
use futures::FutureExt;
use sqlx::PgPool;

use crate::support::inproc::{self, Api, Reply};

/// An id no sandbox or snapshot has.
const NOBODY: &str = "0b3e5c64-3b4e-4a3c-9a51-2b0f0e7d7a11";

async fn api(db: &PgPool) -> Api {
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    Api::new(db.clone(), nats, inproc::unique_subjects())
}

/// `POST path` with `body` as it is (any bytes) and `idempotency_keys` as headers, one each.
async fn post_raw(
    api: &Api,
    key: &str,
    path: &str,
    idempotency_keys: &[&str],
    body: impl Into<Body>,
) -> Reply {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(header::AUTHORIZATION, format!("Bearer {key}"))
        .header(header::CONTENT_TYPE, "application/json");
    for k in idempotency_keys {
        req = req.header("idempotency-key", *k);
    }
    api.send(req.body(body.into()).unwrap()).await
}

async fn org_keys(db: &PgPool, org: berth_schemas::OrgId) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM api_keys WHERE org_id = $1")
        .bind(org)
        .fetch_one(db)
        .await
        .unwrap()
}

/// A 400 `invalid_request` whose message reads as words: none of serde's or axum's text.
fn assert_worded_400(reply: &Reply, what: &str) {
    assert_eq!(
        (reply.status, reply.code()),
        (400, "invalid_request"),
        "{what}: {}",
        reply.body
    );
    let message = reply.body["error"]["message"].as_str().unwrap_or("");
    for internal in [
        "Failed to",
        "target type",
        "at line",
        "struct ",
        "u32",
        "invalid type",
    ] {
        assert!(!message.contains(internal), "{what}: {message}");
    }
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn post_keys_parses_its_body_and_every_json_route_answers_413_with_the_limit(db: PgPool) {
    let org = inproc::org(&db).await;
    let api = api(&db).await;
    for garbage in ["garbage", "[]", "{\"name\":", "{} {}", "\"x\""] {
        let reply = post_raw(&api, &org.key, "/v1/keys", &[], garbage).await;
        assert_worded_400(&reply, garbage);
    }
    let reply = post_raw(&api, &org.key, "/v1/keys", &[], r#"{"name": "ci"}"#).await;
    assert_worded_400(&reply, "an unknown field");
    assert_eq!(reply.body["error"]["field"], "name", "{}", reply.body);
    // 20 MB, as the attack sent: refused before it is read, with the limit.
    let huge = vec![b' '; 20 * 1024 * 1024];
    let reply = post_raw(&api, &org.key, "/v1/keys", &[], huge).await;
    assert_eq!(
        (reply.status, reply.code()),
        (413, "payload_too_large"),
        "{}",
        reply.body
    );
    assert_eq!(
        reply.body["error"]["limit"], MAX_BODY_BYTES,
        "{}",
        reply.body
    );
    assert_eq!(org_keys(&db, org.id).await, 1, "a refused body made a key");
    // No body and `{}` are what the route takes.
    for fine in ["", "{}", " { } "] {
        let reply = post_raw(&api, &org.key, "/v1/keys", &[], fine).await;
        assert_eq!(reply.status, 201, "{fine:?}: {}", reply.body);
        assert!(reply.body["key"].as_str().unwrap().starts_with("berth_"));
    }
    // Every JSON route has the same limit and says it.
    let over = format!(
        r#"{{"metadata": {{"k": "{}"}}}}"#,
        "x".repeat(MAX_BODY_BYTES)
    );
    for path in [
        "/v1/sandboxes".to_owned(),
        format!("/v1/sandboxes/{NOBODY}/snapshot"),
        format!("/v1/sandboxes/{NOBODY}/fork"),
        "/v1/webhooks".to_owned(),
    ] {
        let reply = post_raw(&api, &org.key, &path, &[], over.clone()).await;
        assert_eq!(reply.status, 413, "{path}: {}", reply.body);
        assert_eq!(reply.body["error"]["limit"], MAX_BODY_BYTES, "{path}");
        let message = reply.body["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains(&MAX_BODY_BYTES.to_string()), "{message}");
    }
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn snapshot_restore_clone_and_fork_refuse_unknown_fields_and_bodies_that_are_not_objects(
    db: PgPool,
) {
    let org = inproc::org(&db).await;
    let api = api(&db).await;
    let snapshot = format!("/v1/sandboxes/{NOBODY}/snapshot");
    let restore = format!("/v1/sandboxes/{NOBODY}/restore");
    let clone = format!("/v1/sandboxes/{NOBODY}/clone");
    let fork = format!("/v1/sandboxes/{NOBODY}/fork");
    let id = format!("\"{NOBODY}\"");
    let refused = [
        (&snapshot, r#"{"name": "x"}"#.to_owned(), Some("name")),
        (&snapshot, "[]".to_owned(), None),
        (&snapshot, "snapshot please".to_owned(), None),
        (
            &restore,
            format!(r#"{{"snapshot_id": {id}, "keep_files": true}}"#),
            Some("keep_files"),
        ),
        (&restore, format!("[{id}]"), None),
        (&restore, "{}".to_owned(), Some("snapshot_id")),
        (
            &clone,
            format!(r#"{{"snapshot_id": {id}, "vcpus": 4}}"#),
            Some("vcpus"),
        ),
        (&clone, format!("[{id}]"), None),
        (
            &fork,
            r#"{"count": 2, "template": "base"}"#.to_owned(),
            Some("template"),
        ),
        (&fork, "[2]".to_owned(), None),
        (&fork, "2".to_owned(), None),
        (&fork, r#"{"count": "two"}"#.to_owned(), Some("count")),
    ];
    for (path, body, field) in refused {
        let reply = post_raw(&api, &org.key, path, &[], body.clone()).await;
        assert_worded_400(&reply, &format!("{path} {body}"));
        assert_eq!(
            reply.body["error"]["field"].as_str(),
            field,
            "{path} {body}: {}",
            reply.body
        );
    }
    // What the routes take still reaches them (an unknown sandbox: 404).
    for (path, body) in [
        (&snapshot, String::new()),
        (&snapshot, "{}".to_owned()),
        (&restore, format!(r#"{{"snapshot_id": {id}}}"#)),
        (&clone, format!(r#"{{"snapshot_id": {id}}}"#)),
        (&fork, r#"{"count": 2}"#.to_owned()),
    ] {
        let reply = post_raw(&api, &org.key, path, &[], body.clone()).await;
        assert_eq!(reply.status, 404, "{path} {body}: {}", reply.body);
    }
}

/// The POSTs that take no fields (stop, pause, start, resume, archive and the operator's host
/// actions) read their body as the others do: `{}` or nothing, anything else is 400 before the
/// route looks for the sandbox or host.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn posts_without_fields_refuse_a_body_that_is_not_empty(db: PgPool) {
    let org = inproc::org(&db).await;
    let operator = berth_api::auth::create_admin_key(&db).await.unwrap();
    let api = api(&db).await;
    let mut posts: Vec<(&str, String)> = ["stop", "pause", "start", "resume", "archive"]
        .into_iter()
        .map(|verb| (org.key.as_str(), format!("/v1/sandboxes/{NOBODY}/{verb}")))
        .collect();
    for action in ["drain", "cordon", "uncordon"] {
        posts.push((operator.as_str(), format!("/v1/hosts/{NOBODY}/{action}")));
    }
    for (key, path) in &posts {
        for body in ["garbage", "[]", r#"{"force": true}"#] {
            let reply = post_raw(&api, key, path, &[], body).await;
            assert_worded_400(&reply, &format!("{path} {body}"));
        }
        let huge = vec![b' '; MAX_BODY_BYTES + 1];
        let reply = post_raw(&api, key, path, &[], huge).await;
        assert_eq!(reply.status, 413, "{path}: {}", reply.body);
        for body in ["", "{}"] {
            let reply = post_raw(&api, key, path, &[], body).await;
            assert_eq!(reply.status, 404, "{path} {body:?}: {}", reply.body);
        }
    }
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn json_errors_name_their_field_in_words(db: PgPool) {
    let org = inproc::org(&db).await;
    let api = api(&db).await;
    let cases = [
        ("/v1/sandboxes", r#"{"vcpus": "x"}"#, Some("vcpus"), "vcpus"),
        ("/v1/sandboxes", r#"{"vcpus": -1}"#, Some("vcpus"), "-1"),
        (
            "/v1/sandboxes",
            r#"{"colour": "blue"}"#,
            Some("colour"),
            "colour",
        ),
        (
            "/v1/sandboxes",
            r#"{"vcpus": 1,}"#,
            None,
            "line 1, column 13",
        ),
        ("/v1/sandboxes", "[]", None, "JSON object"),
        ("/v1/webhooks", r#"{"url": 5}"#, Some("url"), "a string"),
        (
            "/v1/webhooks",
            r#"{"secret": "s"}"#,
            Some("url"),
            "url is required",
        ),
        (
            "/v1/sandboxes/x/exec",
            r#"{"cmd": "ls"}"#,
            Some("cmd"),
            "a JSON array",
        ),
    ];
    for (path, body, field, says) in cases {
        let reply = post_raw(&api, &org.key, path, &[], body).await;
        assert_worded_400(&reply, body);
        assert_eq!(
            reply.body["error"]["field"].as_str(),
            field,
            "{body}: {}",
            reply.body
        );
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
    // A query that does not parse names its parameter too.
    let reply = api
        .call(
            &org.key,
            Method::GET,
            "/v1/sandboxes?limit=many",
            None,
            None,
        )
        .await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert_eq!(reply.body["error"]["field"], "limit", "{}", reply.body);
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn post_keys_honours_idempotency_key_without_storing_the_secret(db: PgPool) {
    let org = inproc::org(&db).await;
    let api = api(&db).await;
    let first = post_raw(&api, &org.key, "/v1/keys", &["k1"], "").await;
    assert_eq!(first.status, 201, "{}", first.body);
    let secret = first.body["key"].as_str().unwrap().to_owned();
    let again = post_raw(&api, &org.key, "/v1/keys", &["k1"], "").await;
    assert_eq!(again.status, 201, "{}", again.body);
    assert_eq!(
        again.body["id"], first.body["id"],
        "a retry made a second key"
    );
    assert_eq!(again.body["prefix"], first.body["prefix"]);
    assert!(again.body["key"].is_null(), "{}", again.body);
    assert_eq!(org_keys(&db, org.id).await, 2);
    let stored: String = sqlx::query_scalar("SELECT response::text FROM idempotency_keys")
        .fetch_one(&db)
        .await
        .unwrap();
    assert!(!stored.contains(&secret), "the secret was stored: {stored}");
    // The key with another body; two keys on one request.
    let reused = post_raw(&api, &org.key, "/v1/keys", &["k1"], "{}").await;
    assert_eq!(
        (reused.status, reused.code()),
        (422, "idempotency_key_reused"),
        "{}",
        reused.body
    );
    let twice = post_raw(&api, &org.key, "/v1/keys", &["k2", "k3"], "").await;
    assert_eq!((twice.status, twice.code()), (400, "invalid_request"));
    assert_eq!(
        twice.body["error"]["field"], "Idempotency-Key",
        "{}",
        twice.body
    );
    let twice = post_raw(&api, &org.key, "/v1/sandboxes", &["k4", "k4"], "{}").await;
    assert_eq!(twice.status, 400, "{}", twice.body);
    assert_eq!(twice.body["error"]["field"], "Idempotency-Key");
    assert_eq!(
        org_keys(&db, org.id).await,
        2,
        "a refused request made a key"
    );
}

/// A puller whose pull never ends: the template stays `pulling`.
pub(crate) struct NeverPulls;

impl ImagePuller for NeverPulls {
    fn pull(
        &self,
        _image: String,
        _progress: tokio::sync::mpsc::UnboundedSender<String>,
    ) -> BoxFuture<'static, Result<PulledImage, PullFailure>> {
        futures::future::pending().boxed()
    }

    fn remove(&self, _digest: String) -> BoxFuture<'static, Result<bool, String>> {
        async { Ok(false) }.boxed()
    }
}

/// The API on `db` with an image puller that never finishes (templates stay `pulling`).
pub(crate) async fn never_pulling_api(db: &PgPool) -> Api {
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    Api::with_state(
        db.clone(),
        nats,
        inproc::unique_subjects(),
        |_| {},
        |state| state.with_images(std::sync::Arc::new(NeverPulls)),
    )
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn post_templates_honours_idempotency_key_in_the_operators_scope(db: PgPool) {
    let operator = berth_api::auth::create_admin_key(&db).await.unwrap();
    let other_operator = berth_api::auth::create_admin_key(&db).await.unwrap();
    let api = never_pulling_api(&db).await;
    let body = r#"{"name": "node", "image": "registry.invalid/node:22"}"#;
    let first = post_raw(&api, &operator, "/v1/templates", &["t1"], body).await;
    assert_eq!(first.status, 202, "{}", first.body);
    assert_eq!(first.body["state"], "pulling");
    let again = post_raw(&api, &operator, "/v1/templates", &["t1"], body).await;
    assert_eq!((again.status, &again.body), (202, &first.body));
    // Another body under the key: refused, and nothing registered.
    let other = r#"{"name": "deno", "image": "registry.invalid/deno:2"}"#;
    let reused = post_raw(&api, &other_operator, "/v1/templates", &["t1"], other).await;
    assert_eq!(
        (reused.status, reused.code()),
        (422, "idempotency_key_reused"),
        "{}",
        reused.body
    );
    let names: Vec<String> =
        sqlx::query_scalar("SELECT name FROM templates WHERE image IS NOT NULL ORDER BY name")
            .fetch_all(&db)
            .await
            .unwrap();
    assert_eq!(names, ["node"]);
    let twice = post_raw(&api, &operator, "/v1/templates", &["t2", "t3"], other).await;
    assert_eq!(twice.status, 400, "{}", twice.body);
    assert_eq!(twice.body["error"]["field"], "Idempotency-Key");
    // An org's key of the same name is its own scope; garbage is a worded 400.
    let org = inproc::org(&db).await;
    let key = post_raw(&api, &org.key, "/v1/keys", &["t1"], "").await;
    assert_eq!(key.status, 201, "{}", key.body);
    let garbage = post_raw(&api, &operator, "/v1/templates", &[], "[\"node\"]").await;
    assert_worded_400(&garbage, "an array");
}

/// An `Idempotency-Key` compares bodies as JSON: the same fields in another order, with other
/// whitespace or other string escapes replay the first answer; another value or another field
/// is `422 idempotency_key_reused`, and registers nothing.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_idempotency_key_replays_the_same_json_in_any_spelling_and_refuses_another(db: PgPool) {
    let operator = berth_api::auth::create_admin_key(&db).await.unwrap();
    let api = never_pulling_api(&db).await;
    let first = r#"{"name":"node","image":"registry.invalid/node:22"}"#;
    let first = post_raw(&api, &operator, "/v1/templates", &["j1"], first).await;
    assert_eq!(first.status, 202, "{}", first.body);
    for same in [
        "{ \"image\" : \"registry.invalid/node:22\",\n  \"name\": \"node\" }",
        r#"{"name":"\u006eode","image":"registry.invalid/node:22"}"#,
    ] {
        let again = post_raw(&api, &operator, "/v1/templates", &["j1"], same).await;
        assert_eq!((again.status, &again.body), (202, &first.body), "{same}");
    }
    for other in [
        r#"{"image":"registry.invalid/node:23","name":"node"}"#,
        r#"{"name":"node","image":"registry.invalid/node:22","description":"x"}"#,
    ] {
        let reused = post_raw(&api, &operator, "/v1/templates", &["j1"], other).await;
        assert_eq!(
            (reused.status, reused.code()),
            (422, "idempotency_key_reused"),
            "{other}: {}",
            reused.body
        );
    }
    let templates: i64 =
        sqlx::query_scalar("SELECT count(*) FROM templates WHERE image IS NOT NULL")
            .fetch_one(&db)
            .await
            .unwrap();
    assert_eq!(templates, 1);
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_org_keeps_its_last_key_and_has_at_most_max_active_keys(db: PgPool) {
    let org = inproc::org(&db).await;
    let api = api(&db).await;
    let own: String = sqlx::query_scalar("SELECT id::text FROM api_keys WHERE org_id = $1")
        .bind(org.id)
        .fetch_one(&db)
        .await
        .unwrap();
    let revoke = |key: String, id: String| {
        let api = api.clone();
        async move {
            api.call(&key, Method::DELETE, &format!("/v1/keys/{id}"), None, None)
                .await
        }
    };
    let last = revoke(org.key.clone(), own.clone()).await;
    assert_eq!(
        (last.status, last.code()),
        (409, "last_key"),
        "{}",
        last.body
    );
    assert!(
        last.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("last"),
        "{}",
        last.body
    );
    // With a second key either may go, but two revocations at once leave one. (Through the
    // service: over HTTP each revocation's caller is one of the two keys, and the request
    // whose key the other revoked first is refused as 401 before it counts anything.)
    let made = post_raw(&api, &org.key, "/v1/keys", &[], "").await;
    let (second_id, second) = (
        made.body["id"].as_str().unwrap().to_owned(),
        made.body["key"].as_str().unwrap().to_owned(),
    );
    let (a, b) = tokio::join!(
        revoke_key(&db, org.id, second_id.parse().unwrap()),
        revoke_key(&db, org.id, own.parse().unwrap())
    );
    assert!(
        matches!(
            (&a, &b),
            (Ok(_), Err(ServiceError::LastKey(_))) | (Err(ServiceError::LastKey(_)), Ok(_))
        ),
        "{a:?} {b:?}"
    );
    let working: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM api_keys WHERE org_id = $1 AND revoked_at IS NULL",
    )
    .bind(org.id)
    .fetch_one(&db)
    .await
    .unwrap();
    assert_eq!(working, 1);
    let (survivor, revoked_id) = if a.is_ok() {
        (org.key.clone(), second_id)
    } else {
        (second, own)
    };
    // A revoked key revoked again is still 200 (not "the last").
    let again = revoke(survivor.clone(), revoked_id).await;
    assert_eq!(again.status, 200, "{}", again.body);

    // The cap: MAX_ACTIVE_KEYS working keys, one more is 429 and writes nothing.
    for _ in 1..MAX_ACTIVE_KEYS {
        let made = post_raw(&api, &survivor, "/v1/keys", &[], "").await;
        assert_eq!(made.status, 201, "{}", made.body);
    }
    let over = post_raw(&api, &survivor, "/v1/keys", &[], "").await;
    assert_eq!(
        (over.status, over.code()),
        (429, "quota_exceeded"),
        "{}",
        over.body
    );
    assert_eq!(over.body["error"]["limit"], "max_keys");
    assert_eq!(over.body["error"]["value"], MAX_ACTIVE_KEYS);
}
