//! Clone and fork requests against the control plane alone (the API router, results delivered
//! by hand, no hostd): a failed clone's start boots from its snapshot again and is refused
//! once that snapshot is gone; a clone's source must be settled (409 with its state) and not
//! deleted (404); a fork's children take the parent's `expires_at`; a fork over capacity is a
//! 503 with `Retry-After` worded for its count.

use axum::http::Method;
use berth_schemas::wire::{Resources, ResultOutcome, SnapshotStored};
use berth_schemas::{CommandKind, HostId, SandboxId};
use serde_json::Value;

use crate::support::inproc::{self, Api, Org, Plane};

/// A running sandbox of [`inproc::SANDBOX`]'s size (its create delivered as succeeded).
async fn running(plane: &Plane) -> SandboxId {
    let id = plane.create().await;
    let create = plane.latest(id).await;
    plane.deliver(&create, inproc::succeeded(create.kind)).await;
    assert_eq!(inproc::row(&plane.db, id).await.state, "running");
    id
}

/// A ready snapshot of running sandbox `id` (its host's report delivered); its id.
async fn ready_snapshot(plane: &Plane, id: SandboxId) -> String {
    let reply = call(
        plane,
        Method::POST,
        &format!("/v1/sandboxes/{id}/snapshot"),
        None,
    )
    .await;
    assert_eq!(reply.status, 202, "{}", reply.body);
    let command = plane.latest(id).await;
    assert_eq!(command.kind, CommandKind::Snapshot);
    plane
        .deliver(
            &command,
            ResultOutcome::Snapshotted(SnapshotStored {
                memory: false,
                logical_bytes: 0,
                stored_bytes: 0,
                new_bytes: 0,
                paused_ms: 1,
                chunks: Vec::new(),
            }),
        )
        .await;
    let snapshot = reply.body["id"].as_str().unwrap().to_owned();
    let got = call(
        plane,
        Method::GET,
        &format!("/v1/snapshots/{snapshot}"),
        None,
    )
    .await;
    assert_eq!(got.body["state"], "ready", "{}", got.body);
    snapshot
}

async fn call(plane: &Plane, method: Method, path: &str, body: Option<&str>) -> inproc::Reply {
    plane
        .api
        .call(&plane.org.key, method, path, None, body)
        .await
}

/// `POST /v1/sandboxes/{source}/clone` of `snapshot`.
async fn clone(plane: &Plane, source: SandboxId, snapshot: &str) -> inproc::Reply {
    call(
        plane,
        Method::POST,
        &format!("/v1/sandboxes/{source}/clone"),
        Some(&format!(r#"{{"snapshot_id":"{snapshot}"}}"#)),
    )
    .await
}

fn id_of(body: &Value) -> SandboxId {
    body["id"].as_str().unwrap().parse().unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_failed_clones_start_boots_from_its_snapshot_again_and_is_refused_once_it_is_gone(
    db: sqlx::PgPool,
) {
    let plane = Plane::start(db.clone()).await;
    let source = running(&plane).await;
    let snapshot = ready_snapshot(&plane, source).await;
    let reply = clone(&plane, source, &snapshot).await;
    assert_eq!(reply.status, 202, "{}", reply.body);
    let cloned = id_of(&reply.body);
    let first = plane.latest(cloned).await;
    assert_eq!(first.kind, CommandKind::Clone);
    plane.deliver(&first, inproc::failed()).await;
    assert_eq!(inproc::row(&plane.db, cloned).await.state, "failed-start");

    // The start boots from the snapshot again: never a `sandbox.start`, which boots the bare
    // template with none of the snapshot's files.
    let reply = plane.api.lifecycle(&plane.org.key, cloned, "start").await;
    assert_eq!(reply.status, 202, "{}", reply.body);
    assert_eq!(reply.body["state"], "resuming", "{}", reply.body);
    let again = plane.latest(cloned).await;
    assert_eq!(again.kind, CommandKind::Clone, "{again:?}");
    assert_eq!(
        again.command.snapshot.map(|o| o.snapshot_id.to_string()),
        Some(snapshot.clone())
    );
    assert!(again.generation > first.generation);
    let row = inproc::row(&plane.db, cloned).await;
    assert!(row.holds_capacity, "the boot holds its capacity again");

    // It fails again; its snapshot is deleted meanwhile: a start is refused with a clear code,
    // and nothing is written.
    plane.deliver(&again, inproc::failed()).await;
    assert_eq!(inproc::row(&plane.db, cloned).await.state, "failed-start");
    let deleted = call(
        &plane,
        Method::DELETE,
        &format!("/v1/snapshots/{snapshot}"),
        None,
    )
    .await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    let refused = plane.api.lifecycle(&plane.org.key, cloned, "start").await;
    assert_eq!(refused.status, 409, "{}", refused.body);
    assert_eq!(refused.code(), "snapshot_unavailable", "{}", refused.body);
    assert_eq!(refused.body["error"]["state"], "failed-start");
    assert!(
        refused.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&snapshot),
        "{}",
        refused.body
    );
    assert_eq!(
        plane.latest(cloned).await.id,
        again.id,
        "no command written"
    );
    assert_eq!(
        plane
            .api
            .lifecycle(&plane.org.key, cloned, "delete")
            .await
            .status,
        202
    );

    // A clone that ran once has a disk of its own: its start after a failure is a start.
    let snapshot = ready_snapshot(&plane, source).await;
    let ran = id_of(&clone(&plane, source, &snapshot).await.body);
    let boot = plane.latest(ran).await;
    plane.deliver(&boot, inproc::succeeded(boot.kind)).await;
    plane.request(ran, "stop").await;
    let stop = plane.latest(ran).await;
    plane.deliver(&stop, inproc::succeeded(stop.kind)).await;
    plane.request(ran, "start").await;
    let start = plane.latest(ran).await;
    plane.deliver(&start, inproc::failed()).await;
    assert_eq!(inproc::row(&plane.db, ran).await.state, "failed-start");
    plane.request(ran, "start").await;
    assert_eq!(plane.latest(ran).await.kind, CommandKind::Start);
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_clone_needs_a_settled_source_and_a_deleted_one_is_not_found(db: sqlx::PgPool) {
    let plane = Plane::start(db.clone()).await;
    let source = running(&plane).await;
    let snapshot = ready_snapshot(&plane, source).await;

    // Stopping: a transition in flight.
    plane.request(source, "stop").await;
    let reply = clone(&plane, source, &snapshot).await;
    assert_eq!(reply.status, 409, "{}", reply.body);
    assert_eq!(reply.body["error"]["state"], "stopping", "{}", reply.body);
    assert!(
        reply.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("stopping"),
        "{}",
        reply.body
    );
    // Stopped: settled, accepted.
    let stop = plane.latest(source).await;
    plane.deliver(&stop, inproc::succeeded(stop.kind)).await;
    assert_eq!(clone(&plane, source, &snapshot).await.status, 202);

    // Being deleted: 409; deleted: 404, as the sandbox's other routes answer.
    plane.request(source, "delete").await;
    let reply = clone(&plane, source, &snapshot).await;
    assert_eq!(reply.status, 409, "{}", reply.body);
    assert!(
        reply.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("being deleted"),
        "{}",
        reply.body
    );
    let delete = plane.latest(source).await;
    plane.deliver(&delete, inproc::succeeded(delete.kind)).await;
    assert_eq!(inproc::row(&plane.db, source).await.state, "deleted");
    let reply = clone(&plane, source, &snapshot).await;
    assert_eq!(reply.status, 404, "{}", reply.body);
    assert_eq!(reply.code(), "not_found");

    // The snapshot itself still clones through a create, as the README says.
    let reply = call(
        &plane,
        Method::POST,
        "/v1/sandboxes",
        Some(&format!(r#"{{"snapshot_id":"{snapshot}"}}"#)),
    )
    .await;
    assert_eq!(reply.status, 202, "{}", reply.body);
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_forks_children_take_the_parents_expiry(db: sqlx::PgPool) {
    let plane = Plane::start(db.clone()).await;
    let parent = running(&plane).await;
    let reply = call(
        &plane,
        Method::POST,
        &format!("/v1/sandboxes/{parent}/renew"),
        Some(r#"{"extend_seconds":86400}"#),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let reply = call(
        &plane,
        Method::PATCH,
        &format!("/v1/sandboxes/{parent}"),
        Some(r#"{"on_expiry":"delete"}"#),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let expires_at = reply.body["expires_at"].clone();
    assert!(expires_at.is_string(), "{}", reply.body);
    let reply = call(
        &plane,
        Method::POST,
        &format!("/v1/sandboxes/{parent}/fork"),
        Some(r#"{"count":2}"#),
    )
    .await;
    assert_eq!(reply.status, 202, "{}", reply.body);
    let children = reply.body["sandboxes"].as_array().unwrap();
    assert_eq!(children.len(), 2);
    for child in children {
        let got = call(
            &plane,
            Method::GET,
            &format!("/v1/sandboxes/{}", child["id"].as_str().unwrap()),
            None,
        )
        .await;
        assert_eq!(
            got.body["expires_at"], expires_at,
            "a child escapes its parent's deadline: {}",
            got.body
        );
        assert_eq!(got.body["on_expiry"], "delete", "{}", got.body);
    }
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_fork_over_capacity_is_a_503_with_retry_after_worded_for_its_count(db: sqlx::PgPool) {
    // One host with room for four sandboxes of 256 MiB: the parent and three children.
    let host = HostId::new();
    inproc::heartbeat(
        &db,
        host,
        Resources {
            vcpus: 4,
            memory_mib: 1024,
        },
    )
    .await;
    let nats = async_nats::connect(inproc::nats_url()).await.unwrap();
    let plane = Plane {
        api: Api::new(db.clone(), nats, inproc::unique_subjects()),
        org: inproc::org(&db).await,
        db: db.clone(),
        host,
    };
    let Org { key, .. } = plane.org.clone();
    let parent = running(&plane).await;
    let fork = |count: u32| {
        let (api, key) = (plane.api.clone(), key.clone());
        async move {
            api.call_with_retry_after(
                &key,
                Method::POST,
                &format!("/v1/sandboxes/{parent}/fork"),
                &format!(r#"{{"count":{count}}}"#),
            )
            .await
        }
    };
    let (reply, retry_after) = fork(4).await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(reply.code(), "no_capacity");
    let message = reply.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("all 4 sandboxes of this fork") && message.contains("room for 3"),
        "{message}"
    );
    let secs: u64 = retry_after
        .expect("a fork over capacity says when to retry")
        .parse()
        .unwrap();
    assert!(secs >= 1, "{secs}");
    // All or nothing: no snapshot, no child, only the parent's reservation.
    let snapshots: i64 = sqlx::query_scalar("SELECT count(*) FROM snapshots")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(snapshots, 0);
    assert_eq!(inproc::reserved(&db, host).await, (1, 256));
    // Three fit.
    let (reply, _) = fork(3).await;
    assert_eq!(reply.status, 202, "{}", reply.body);
}
