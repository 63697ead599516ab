//! Key management and org deletion (an attack run's finding: no key could be revoked and no org
//! deleted): an org key lists, creates and revokes its own org's keys; a revoked key is refused
//! at once in every process, whatever its key cache holds; `berth admin delete-org` deletes an
//! org's sandboxes through their lifecycle and then refuses its keys; the list comes a page at a
//! time.

use std::time::Duration;

use reqwest::Method;
use serde_json::Value;
use sqlx::PgPool;

use crate::support::api_process::database_url;
use crate::support::inproc::{self, Api};
use crate::support::{eventually, Stack};

/// Long enough that only a revocation's notification, never the TTL, can clear a cached key.
const KEY_CACHE_TTL: Duration = Duration::from_secs(3600);

/// The status `key` gets for `GET /v1/sandboxes`.
async fn status_of(stack: &Stack, key: &str) -> u16 {
    stack
        .call_as(key, Method::GET, "/v1/sandboxes", None)
        .await
        .0
}

/// Creates a key through the API with `key`; (its id, the key).
async fn new_key(stack: &Stack, key: &str) -> (String, String) {
    let (status, made) = stack.call_as(key, Method::POST, "/v1/keys", None).await;
    assert_eq!(status, 201, "{made}");
    let secret = made["key"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("berth_"), "{made}");
    assert!(
        secret.starts_with(made["prefix"].as_str().unwrap()),
        "{made}"
    );
    assert!(made["revoked_at"].is_null(), "{made}");
    (made["id"].as_str().unwrap().to_owned(), secret)
}

/// Runs `berth admin <args>` against the stack's database; (success, stdout + stderr).
async fn admin(stack: &Stack, args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .arg("admin")
        .args(args)
        .env("DATABASE_URL", database_url(stack))
        .output()
        .await
        .expect("run berth admin");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_org_key_manages_its_own_keys_and_a_revoked_key_is_refused_at_once(db: PgPool) {
    let stack = Stack::start_configured(db, 0, Default::default(), |c| {
        c.limits.key_cache_ttl = KEY_CACHE_TTL;
    })
    .await;
    let (id2, key2) = new_key(&stack, &stack.key).await;
    assert_eq!(status_of(&stack, &key2).await, 200, "the new key works");

    // The list shows both keys, never a secret or a hash.
    let (status, list) = stack.call(Method::GET, "/v1/keys", None).await;
    assert_eq!(status, 200, "{list}");
    let keys = list["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 2, "{list}");
    assert!(list["next_cursor"].is_null(), "one page: {list}");
    assert!(keys.iter().any(|k| k["id"] == id2.as_str()), "{list}");
    let text = list.to_string();
    assert!(
        !text.contains(&key2) && !text.contains(&stack.key),
        "{text}"
    );
    for k in keys {
        let mut fields: Vec<&str> = k.as_object().unwrap().keys().map(String::as_str).collect();
        fields.sort();
        assert_eq!(fields, ["created_at", "id", "prefix", "revoked_at"], "{k}");
    }

    // Another org neither sees nor revokes it.
    let other = berth_api::auth::create_org(&stack.db, "keys-other-org")
        .await
        .unwrap()
        .1;
    let (status, theirs) = stack.call_as(&other, Method::GET, "/v1/keys", None).await;
    assert_eq!(status, 200);
    assert_eq!(theirs["keys"].as_array().unwrap().len(), 1, "{theirs}");
    let (status, body) = stack
        .call_as(&other, Method::DELETE, &format!("/v1/keys/{id2}"), None)
        .await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "not_found");
    for bad in ["nope", "00000000-0000-0000-0000-000000000000"] {
        let (status, _) = stack
            .call(Method::DELETE, &format!("/v1/keys/{bad}"), None)
            .await;
        assert_eq!(status, 404, "{bad}");
    }
    assert_eq!(
        status_of(&stack, &key2).await,
        200,
        "a refused revoke changed nothing"
    );

    // Revoked through the API: refused on the next request, with the key still cached for an
    // hour; a second revoke keeps the first time.
    let (status, revoked) = stack
        .call(Method::DELETE, &format!("/v1/keys/{id2}"), None)
        .await;
    assert_eq!(status, 200, "{revoked}");
    assert!(revoked["revoked_at"].is_string(), "{revoked}");
    let (status, body) = stack
        .call_as(&key2, Method::GET, "/v1/sandboxes", None)
        .await;
    assert_eq!(status, 401, "a revoked key still works: {body}");
    assert_eq!(body["error"]["code"], "unauthorized");
    let (_, again) = stack
        .call(Method::DELETE, &format!("/v1/keys/{id2}"), None)
        .await;
    assert_eq!(again["revoked_at"], revoked["revoked_at"]);

    // Revoked by another process (the operator's CLI): this process's cache forgets it on the
    // commit's notification, long before the cache's hour.
    let (id3, key3) = new_key(&stack, &stack.key).await;
    assert_eq!(status_of(&stack, &key3).await, 200, "cached now");
    let (ok, out) = admin(&stack, &["revoke-key", &id3]).await;
    assert!(ok, "{out}");
    eventually("a key revoked by the CLI is refused by the API", || async {
        status_of(&stack, &key3).await == 401
    })
    .await;
    let (ok, out) = admin(
        &stack,
        &["revoke-key", "00000000-0000-0000-0000-000000000000"],
    )
    .await;
    assert!(!ok, "{out}");

    // A key may revoke itself; the org's first key still works.
    let (id4, key4) = new_key(&stack, &stack.key).await;
    let (status, _) = stack
        .call_as(&key4, Method::DELETE, &format!("/v1/keys/{id4}"), None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(status_of(&stack, &key4).await, 401);
    assert_eq!(status_of(&stack, &stack.key).await, 200);
    let (_, list) = stack.call(Method::GET, "/v1/keys", None).await;
    let revoked: Vec<&Value> = list["keys"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|k| k["revoked_at"].is_string())
        .collect();
    assert_eq!(revoked.len(), 3, "{list}");

    // At most MAX_ACTIVE_KEYS working keys: one more is refused and writes nothing; a
    // revocation makes room.
    let cap = berth_api::service::keys::MAX_ACTIVE_KEYS as usize;
    let mut last = None;
    for _ in 1..cap {
        last = Some(new_key(&stack, &stack.key).await.0);
    }
    let (status, body) = stack.call(Method::POST, "/v1/keys", None).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "quota_exceeded");
    let (_, list) = stack.call(Method::GET, "/v1/keys?limit=500", None).await;
    assert_eq!(
        list["keys"].as_array().unwrap().len(),
        cap + 3,
        "a refused create wrote a key"
    );
    let last = last.unwrap();
    let (status, _) = stack
        .call(Method::DELETE, &format!("/v1/keys/{last}"), None)
        .await;
    assert_eq!(status, 200);
    new_key(&stack, &stack.key).await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn deleting_an_org_deletes_its_sandboxes_through_their_lifecycle_and_refuses_its_keys(
    db: PgPool,
) {
    let stack = Stack::start_configured(db, 1, Default::default(), |c| {
        c.limits.key_cache_ttl = KEY_CACHE_TTL;
    })
    .await;
    let org = berth_api::auth::authenticate(&stack.db, &stack.key)
        .await
        .unwrap()
        .unwrap()
        .org_id
        .unwrap();
    let name: String = sqlx::query_scalar("SELECT name FROM orgs WHERE id = $1")
        .bind(org)
        .fetch_one(&stack.db)
        .await
        .unwrap();
    let (_, spare) = new_key(&stack, &stack.key).await;
    let running = stack.create().await;
    stack.wait_state(&running, "running").await;
    let stopped = stack.create().await;
    stack.wait_state(&stopped, "running").await;
    assert_eq!(stack.request(&stopped, "stop").await.0, 202);
    stack.wait_state(&stopped, "stopped").await;
    // Another org's sandbox is not touched.
    let (_, bystander_key) = berth_api::auth::create_org(&stack.db, "bystander")
        .await
        .unwrap();
    let (status, bystander) = stack
        .call_as(
            &bystander_key,
            Method::POST,
            "/v1/sandboxes",
            Some(serde_json::json!({"template": "base", "vcpus": 1, "memory_mib": 256})),
        )
        .await;
    assert_eq!(status, 202, "{bystander}");
    let bystander = bystander["id"].as_str().unwrap().to_owned();

    let (ok, out) = admin(&stack, &["delete-org", &name]).await;
    assert!(ok, "{out}");
    assert!(
        out.contains("2 keys revoked, 2 sandboxes being deleted"),
        "{out}"
    );
    for key in [&stack.key, &spare] {
        eventually("the deleted org's keys are refused", || async {
            status_of(&stack, key).await == 401
        })
        .await;
    }
    let state_of = |id: String| {
        let db = stack.db.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT state FROM sandboxes WHERE id = $1::uuid")
                .bind(id)
                .fetch_one(&db)
                .await
                .unwrap()
        }
    };
    for id in [&running, &stopped] {
        eventually("the org's sandbox is deleted through its lifecycle", || {
            let id = id.clone();
            async move { state_of(id).await == "deleted" }
        })
        .await;
        stack.nothing_left(id).await;
        let reasons: Vec<String> = sqlx::query_scalar(
            "SELECT reason FROM events WHERE sandbox_id = $1::uuid AND to_state = 'stopping'
              ORDER BY id DESC LIMIT 1",
        )
        .bind(id)
        .fetch_all(&stack.db)
        .await
        .unwrap();
        assert_eq!(reasons, ["user_request"], "{id}");
    }
    let deleted_at: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT deleted_at FROM orgs WHERE id = $1")
            .bind(org)
            .fetch_one(&stack.db)
            .await
            .unwrap();
    assert!(deleted_at.is_some(), "the org is tombstoned");
    // The name stays taken; a second run finds nothing left to do.
    assert!(berth_api::auth::create_org(&stack.db, &name).await.is_err());
    let (ok, out) = admin(&stack, &["delete-org", &name]).await;
    assert!(ok, "{out}");
    assert!(out.contains("0 keys revoked, 0 sandboxes"), "{out}");
    let (ok, out) = admin(&stack, &["delete-org", "no-such-org"]).await;
    assert!(!ok, "{out}");

    assert_ne!(state_of(bystander.clone()).await, "deleted");
    let (status, _) = stack
        .call_as(
            &bystander_key,
            Method::DELETE,
            &format!("/v1/sandboxes/{bystander}"),
            None,
        )
        .await;
    assert_eq!(status, 202);
    eventually("the bystander's sandbox is deleted", || {
        let id = bystander.clone();
        async move { state_of(id).await == "deleted" }
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// A revocation forgets only the revoked key's cached lookup: an org revoking its own keys in a
/// loop never makes another org's cached key look itself up again (an attack run got 22 of 100
/// of another org's requests refused 429 `key_lookups_per_ip` that way, every process clearing
/// its whole cache on every revocation).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn one_orgs_revocations_never_cost_another_orgs_cached_key_a_lookup(db: PgPool) {
    let stack = Stack::start_configured(db, 0, Default::default(), |c| {
        c.limits.key_cache_ttl = KEY_CACHE_TTL;
        // Both orgs call from 127.0.0.1: two lookups, then one a second.
        c.limits.key_lookups_per_ip = berth_api::limits::Rate {
            per_second: 1,
            burst: 2,
        };
    })
    .await;
    let attacker = berth_api::auth::create_org(&stack.db, "keys-churn-org")
        .await
        .unwrap()
        .1;
    // Both keys looked up once, and cached.
    assert_eq!(status_of(&stack, &stack.key).await, 200);
    assert_eq!(status_of(&stack, &attacker).await, 200);
    for round in 0..5 {
        let (id, _) = new_key(&stack, &attacker).await;
        let (status, body) = stack
            .call_as(&attacker, Method::DELETE, &format!("/v1/keys/{id}"), None)
            .await;
        assert_eq!(status, 200, "{body}");
        // Time for the revocation's notification to reach the API process.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (status, body) = stack.call(Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(
            status, 200,
            "round {round}: the other org's cached key was looked up again: {body}"
        );
    }
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_key_list_comes_a_page_at_a_time_and_refuses_a_cursor_it_did_not_give(db: PgPool) {
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    let api = Api::new(db.clone(), nats, inproc::unique_subjects());
    let (org, other) = (inproc::org(&db).await, inproc::org(&db).await);
    let get = |key: &str, query: &str| {
        let (api, key, path) = (api.clone(), key.to_owned(), format!("/v1/keys{query}"));
        async move { api.call(&key, Method::GET, &path, None, None).await }
    };
    for _ in 0..4 {
        let made = api
            .call(&org.key, Method::POST, "/v1/keys", None, None)
            .await;
        assert_eq!(made.status, 201, "{}", made.body);
    }
    let all = get(&org.key, "").await;
    assert_eq!(all.status, 200, "{}", all.body);
    let ids = |page: &Value| -> Vec<String> {
        page["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let every = ids(&all.body);
    assert_eq!(every.len(), 5, "{}", all.body);
    assert!(all.body["next_cursor"].is_null());

    // Pages of two, oldest first, each starting after the last: every key once.
    let (mut seen, mut cursor) = (Vec::new(), None::<String>);
    let mut sizes = Vec::new();
    loop {
        let query = match &cursor {
            Some(c) => format!("?limit=2&cursor={c}"),
            None => "?limit=2".to_owned(),
        };
        let page = get(&org.key, &query).await;
        assert_eq!(page.status, 200, "{}", page.body);
        sizes.push(ids(&page.body).len());
        seen.extend(ids(&page.body));
        match page.body["next_cursor"].as_str() {
            Some(next) => {
                assert_eq!(Some(next), seen.last().map(String::as_str));
                cursor = Some(next.to_owned());
            }
            None => break,
        }
    }
    assert_eq!(sizes, [2, 2, 1]);
    assert_eq!(seen, every);
    let exact = get(&org.key, &format!("?limit=1&cursor={}", every[3])).await;
    assert_eq!(ids(&exact.body), [every[4].clone()]);
    assert!(exact.body["next_cursor"].is_null(), "the last page says so");

    // A cursor this API did not give the org: 400 naming it; so is a bad limit.
    let theirs = ids(&get(&other.key, "").await.body).remove(0);
    for (query, field) in [
        ("?cursor=nope".to_owned(), "cursor"),
        (format!("?cursor={}", uuid::Uuid::now_v7()), "cursor"),
        (format!("?cursor={theirs}"), "cursor"),
        ("?limit=0".to_owned(), "limit"),
        ("?limit=501".to_owned(), "limit"),
        ("?limit=two".to_owned(), "limit"),
        ("?page=2".to_owned(), "page"),
    ] {
        let reply = get(&org.key, &query).await;
        assert_eq!(reply.status, 400, "{query}: {}", reply.body);
        assert_eq!(reply.code(), "invalid_request", "{query}");
        assert_eq!(
            reply.body["error"]["field"], field,
            "{query}: {}",
            reply.body
        );
    }
    // The other org pages only its own key, with the org's cursor refused there too.
    let mine = get(&other.key, &format!("?cursor={}", every[0])).await;
    assert_eq!(mine.status, 400, "{}", mine.body);
    assert_eq!(ids(&get(&other.key, "?limit=1").await.body), [theirs]);
}

/// An attack run reported `POST /v1/keys` errors without the `field` every other validation
/// error carries; checked, they carry it wherever a field is to blame, pinned here. The route
/// takes no fields: one sent is refused naming it (`name`, `expires_at`, …), and so is a query
/// parameter; a body that is not a JSON object, or not JSON, blames no field (`field` absent),
/// nor does the org's key cap (429 `limit: max_keys`, `requests.rs`).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_key_request_names_the_field_to_blame(db: PgPool) {
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    let api = Api::new(db.clone(), nats, inproc::unique_subjects());
    let org = inproc::org(&db).await;
    for (path, body, field) in [
        ("/v1/keys", Some(r#"{"name":"ci"}"#), Some("name")),
        (
            "/v1/keys",
            Some(r#"{"expires_at":"2030-01-01T00:00:00Z"}"#),
            Some("expires_at"),
        ),
        (
            "/v1/keys",
            Some(r#"{"scopes":["sandboxes"],"name":"x"}"#),
            Some("scopes"),
        ),
        ("/v1/keys?name=ci", None, Some("name")),
        ("/v1/keys", Some("[]"), None),
        ("/v1/keys", Some("{"), None),
        ("/v1/keys", Some("{name: 1}"), None),
        ("/v1/keys", Some("{} {}"), None),
    ] {
        let reply = api.call(&org.key, Method::POST, path, None, body).await;
        assert_eq!(reply.status, 400, "{path} {body:?}: {}", reply.body);
        assert_eq!(reply.code(), "invalid_request", "{path} {body:?}");
        assert_eq!(
            reply.body["error"]["field"].as_str(),
            field,
            "{path} {body:?}: {}",
            reply.body
        );
    }
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM api_keys WHERE org_id = $1")
        .bind(org.id)
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(keys, 1, "a refused request made no key");
}
