//! Drain moves sandboxes, on the real stack (issue 14): `POST /v1/hosts/{id}/drain {"live":
//! true}` moves a host's running sandboxes to the other host (stop with memory, upload, start
//! elsewhere: three gVisor counters keep counting; runc sandboxes keep their files) and archives
//! its stopped ones, a bounded number at a time, with the progress on `GET /v1/hosts/{id}`.
//! Failure paths: no other host has room (the sandboxes stay as they are, counted failed with
//! their reason, and a drain again once there is room moves them); a sandbox deleted or started
//! by its user mid-drain; an uncordon ends the drive (the move in flight finishes, the rest stay
//! untouched).

use std::time::Duration;

use berth_reconciler::pass::PassConfig;
use reqwest::Method;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::archive::events;
use crate::resume::{count, run, COUNTER};
use crate::support::http::{host_of, running_gvisor_sandbox, running_sandbox};
use crate::support::{eventually, Stack};

/// Passes often enough that a drain moves within seconds.
fn quick(drain_parallel: i64) -> PassConfig {
    PassConfig {
        interval: Duration::from_millis(200),
        drain_parallel,
        ..PassConfig::default()
    }
}

/// An operator `method` on `/v1/hosts/{host}{path}` with `body`; the answer (200 expected).
async fn operator(
    stack: &Stack,
    method: Method,
    host: uuid::Uuid,
    path: &str,
    body: Option<Value>,
) -> Value {
    let admin = berth_api::auth::create_admin_key(&stack.db).await.unwrap();
    let (status, answer) = stack
        .call_as(&admin, method, &format!("/v1/hosts/{host}{path}"), body)
        .await;
    assert_eq!(status, 200, "{answer}");
    answer
}

/// Drains host `index` (live or not); the host as the answer shows it.
async fn drain(stack: &Stack, index: usize, live: bool) -> Value {
    let host = stack.hosts[index].host_id.0;
    operator(
        stack,
        Method::POST,
        host,
        "/drain",
        Some(json!({ "live": live })),
    )
    .await
}

/// Host `index` as `GET /v1/hosts/{id}` shows it.
async fn host(stack: &Stack, index: usize) -> Value {
    operator(stack, Method::GET, stack.hosts[index].host_id.0, "", None).await
}

/// Polls host `index`'s `drain` until `done` holds; returns it then, or panics naming `what`
/// after two minutes.
async fn drain_until(
    stack: &Stack,
    index: usize,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let drain = host(stack, index).await["drain"].clone();
        if done(&drain) {
            return drain;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never happened: {what}: {drain}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until host `index`'s drain has nothing left or moving; its `drain` then.
async fn drained(stack: &Stack, index: usize) -> Value {
    drain_until(stack, index, "the drain has nothing left or moving", |d| {
        d["left"] == 0 && d["moving"] == 0
    })
    .await
}

async fn generation(stack: &Stack, id: &str) -> i64 {
    sqlx::query_scalar("SELECT generation FROM sandboxes WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(&stack.db)
        .await
        .unwrap()
}

async fn state(stack: &Stack, id: &str) -> String {
    let (_, body) = stack
        .call(Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    body["state"].as_str().unwrap_or_default().to_owned()
}

/// Whether a `drain` event of `id` has a message containing `text`.
async fn drain_event(db: &PgPool, id: &str, to: &str, text: &str) -> bool {
    events(db, id).await.iter().any(|(state, reason, message)| {
        state == to && reason == "drain" && message.as_deref().unwrap_or_default().contains(text)
    })
}

/// From the drain's `stopping` event of `id` to its last `running` event (database clock),
/// and the seconds between its events meanwhile (`stopping` → `stopped` → `migrating`: the
/// upload and a pass → `running`).
async fn downtime(db: &PgPool, id: &str) -> (Duration, Vec<f64>) {
    let at: Vec<f64> = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM at)::float8 FROM events
          WHERE sandbox_id = $1::uuid AND snapshot_id IS NULL
            AND at >= (SELECT min(at) FROM events WHERE sandbox_id = $1::uuid
                         AND to_state = 'stopping' AND reason = 'drain')
          ORDER BY at",
    )
    .bind(id)
    .fetch_all(db)
    .await
    .unwrap();
    let steps = at.windows(2).map(|w| w[1] - w[0]).collect();
    (Duration::from_secs_f64(at[at.len() - 1] - at[0]), steps)
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_live_drain_moves_three_running_gvisor_sandboxes_whose_counters_keep_counting_on_the_new_host(
    db: PgPool,
) {
    let mut stack = Stack::start_with(db.clone(), 1, quick(4)).await;
    let mut sandboxes = Vec::new();
    for _ in 0..3 {
        let id = running_gvisor_sandbox(&stack).await;
        run(&stack, &id, COUNTER).await;
        let pid = run(&stack, &id, "cat /root/pid").await.trim().to_owned();
        sandboxes.push((id, pid));
    }
    let first = host_of(&stack, &sandboxes[0].0).await;
    stack.add_host().await;

    let started = std::time::Instant::now();
    let answer = drain(&stack, 0, true).await;
    assert_eq!(answer["state"], "draining", "{answer}");
    assert_eq!(answer["drain"]["live"], true, "{answer}");
    assert_eq!(answer["drain"]["left"], 3, "{answer}");
    let progress = drained(&stack, 0).await;
    for (id, _) in &sandboxes {
        stack.wait_state(id, "running").await;
    }
    eprintln!(
        "live drain of three gVisor sandboxes: drain → all running elsewhere in {:?}",
        started.elapsed()
    );
    assert_eq!(progress["failed"], 0, "{progress}");
    assert_eq!(progress["failures"], json!([]), "{progress}");
    for (id, _) in &sandboxes {
        let (down, steps) = downtime(&db, id).await;
        eprintln!("  {id}: down {down:?} (stop → running elsewhere; between events {steps:.2?} s)");
    }
    for (id, pid) in &sandboxes {
        assert_ne!(host_of(&stack, id).await, first, "{id} moved");
        assert!(drain_event(&db, id, "stopping", "stopped to move it off host").await);
        assert!(drain_event(&db, id, "migrating", "moved off host").await);
        // The same process, still counting on the new host.
        run(&stack, id, &format!("kill -0 {pid}")).await;
        let counted = count(&stack, id).await;
        eventually("the moved counter counts on", || async {
            count(&stack, id).await > counted
        })
        .await;
    }
    let list = {
        let admin = berth_api::auth::create_admin_key(&stack.db).await.unwrap();
        stack
            .call_as(&admin, Method::GET, "/v1/hosts", None)
            .await
            .1
    };
    let shown = list
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["id"] == stack.hosts[0].host_id.0.to_string())
        .unwrap();
    assert_eq!(shown["drain"]["left"], 0, "{list}");
    assert_eq!(shown["sandboxes"], 0, "{list}");
    let other = list
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["id"] == stack.hosts[1].host_id.0.to_string())
        .unwrap();
    assert!(other["drain"].is_null(), "{list}");
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_live_drain_moves_a_runc_sandbox_with_its_files_and_archives_a_stopped_one(db: PgPool) {
    let mut stack = Stack::start_with(db.clone(), 1, quick(4)).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo kept > /root/f").await;
    let stopped = running_sandbox(&stack).await;
    run(&stack, &stopped, "echo asleep > /root/f").await;
    assert_eq!(stack.request(&stopped, "stop").await.0, 202);
    stack.wait_state(&stopped, "stopped").await;
    let first = host_of(&stack, &id).await;
    stack.add_host().await;

    let answer = drain(&stack, 0, true).await;
    assert_eq!(answer["drain"]["left"], 2, "{answer}");
    assert_eq!(answer["drain"]["staying"], 0, "{answer}");
    let progress = drained(&stack, 0).await;
    assert_eq!(progress["failed"], 0, "{progress}");
    stack.wait_state(&id, "running").await;
    assert_ne!(host_of(&stack, &id).await, first);
    // runc keeps the disk only: the files, not the processes.
    assert_eq!(run(&stack, &id, "cat /root/f").await, "kept\n");
    let archived = stack.wait_state(&stopped, "archived").await;
    assert!(
        drain_event(&db, &stopped, "archiving", "archived off host").await,
        "{archived}"
    );
    // A start brings it back on a host in service, with its files.
    assert_eq!(stack.request(&stopped, "start").await.0, 202);
    stack.wait_state(&stopped, "running").await;
    assert_ne!(host_of(&stack, &stopped).await, first);
    assert_eq!(run(&stack, &stopped, "cat /root/f").await, "asleep\n");
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// A stack of one host with a running sandbox and a stopped one on it: `(stack, running,
/// stopped)`.
async fn one_running_one_stopped(db: &PgPool) -> (Stack, String, String) {
    let stack = Stack::start_with(db.clone(), 1, quick(4)).await;
    let id = running_sandbox(&stack).await;
    let stopped = running_sandbox(&stack).await;
    assert_eq!(stack.request(&stopped, "stop").await.0, 202);
    stack.wait_state(&stopped, "stopped").await;
    (stack, id, stopped)
}

/// A drain that is not live archives the stopped sandbox and leaves the running one where it
/// is, counted as `staying` (the host is not empty when the drain is done).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_drain_that_is_not_live_archives_the_stopped_one_and_counts_the_running_one_staying(
    db: PgPool,
) {
    let (mut stack, id, stopped) = one_running_one_stopped(&db).await;
    let first = host_of(&stack, &id).await;
    stack.add_host().await;

    let answer = drain(&stack, 0, false).await;
    assert_eq!(answer["drain"]["live"], false, "{answer}");
    assert_eq!(
        (&answer["drain"]["left"], &answer["drain"]["staying"]),
        (&json!(1), &json!(1)),
        "{answer}"
    );
    let progress = drained(&stack, 0).await;
    assert_eq!(progress["failed"], 0, "{progress}");
    assert_eq!(progress["staying"], 1, "the running one stays: {progress}");
    stack.wait_state(&stopped, "archived").await;
    assert_eq!(state(&stack, &id).await, "running");
    assert_eq!(host_of(&stack, &id).await, first);
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_drain_without_room_elsewhere_leaves_its_sandboxes_as_they_are_counted_failed_until_drained_again(
    db: PgPool,
) {
    let (mut stack, id, stopped) = one_running_one_stopped(&db).await;
    let before = generation(&stack, &id).await;
    let first = host_of(&stack, &id).await;
    // The other host is too small for a 256 MiB sandbox.
    stack.add_host_with((Some(1), Some(128))).await;

    drain(&stack, 0, true).await;
    let progress = drain_until(&stack, 0, "the moves fail for want of room", |d| {
        d["failed"] == 2
    })
    .await;
    assert_eq!(progress["left"], 0, "{progress}");
    assert_eq!(progress["moving"], 0, "{progress}");
    let mut failed: Vec<&str> = (0..2)
        .map(|i| progress["failures"][i]["sandbox_id"].as_str().unwrap())
        .collect();
    failed.sort_unstable();
    let mut expected = vec![id.as_str(), stopped.as_str()];
    expected.sort_unstable();
    assert_eq!(failed, expected, "{progress}");
    for i in 0..2 {
        assert_eq!(
            progress["failures"][i]["reason"], "no other host has room for it",
            "{progress}"
        );
    }
    // Left as they were: the running one never stopped, the stopped one not archived, and
    // neither is tried again on later passes.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(state(&stack, &id).await, "running");
    assert_eq!(generation(&stack, &id).await, before);
    assert_eq!(host_of(&stack, &id).await, first);
    assert_eq!(state(&stack, &stopped).await, "stopped");

    // Room appears; draining again retries the failed move.
    stack.add_host().await;
    let answer = drain(&stack, 0, true).await;
    assert_eq!(answer["drain"]["failed"], 0, "{answer}");
    let progress = drained(&stack, 0).await;
    assert_eq!(progress["failed"], 0, "{progress}");
    stack.wait_state(&id, "running").await;
    assert_ne!(host_of(&stack, &id).await, first);
    stack.wait_state(&stopped, "archived").await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_sandbox_deleted_or_started_by_its_user_mid_drain_is_not_fought_over(db: PgPool) {
    let mut stack = Stack::start_with(db.clone(), 1, quick(4)).await;
    let deleted = running_sandbox(&stack).await;
    let started = running_sandbox(&stack).await;
    // A larger disk makes the upload after the stop take a moment, so the user's start may
    // come before the stop is durable (then it lands at home).
    run(
        &stack,
        &started,
        "head -c 40000000 /dev/urandom > /root/blob",
    )
    .await;
    let first = host_of(&stack, &started).await;
    stack.add_host().await;

    drain(&stack, 0, true).await;
    // Started as soon as the drain's stop settled (a start while `stopping` is 409).
    eventually("the drain stopped it", || async {
        state(&stack, &started).await == "stopped"
    })
    .await;
    let (status, body) = stack.request(&started, "start").await;
    // 202 (at home, or migrating), or 200 when the drive had just migrated it.
    assert!(status == 202 || status == 200, "{status} {body}");
    let (status, body) = stack
        .call(Method::DELETE, &format!("/v1/sandboxes/{deleted}"), None)
        .await;
    assert!(status == 202 || status == 200, "{status} {body}");
    stack.wait_state(&deleted, "deleted").await;
    stack.wait_state(&started, "running").await;
    let progress = drained(&stack, 0).await;
    // The user's start either moved it (its stop was durable) or landed at home before it
    // could move: then the drain does not stop it a second time, it counts it failed.
    if host_of(&stack, &started).await == first {
        assert_eq!(progress["failed"], 1, "{progress}");
        assert_eq!(
            progress["failures"][0]["reason"],
            "it was started or changed on its own host before it moved",
            "{progress}"
        );
        eprintln!("the user's start landed at home (not durable yet)");
    } else {
        assert_eq!(progress["failed"], 0, "{progress}");
        eprintln!("the user's start moved it (durable)");
    }
    let moves: i64 =
        sqlx::query_scalar("SELECT count(*) FROM drain_moves WHERE sandbox_id = $1::uuid")
            .bind(&deleted)
            .fetch_one(&db)
            .await
            .unwrap();
    assert_eq!(moves, 0, "the deleted sandbox's move is forgotten");
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_uncordon_ends_the_drive_the_move_in_flight_finishes_and_the_rest_stay_untouched(
    db: PgPool,
) {
    let mut stack = Stack::start_with(db.clone(), 1, quick(1)).await;
    let mut sandboxes = Vec::new();
    for _ in 0..3 {
        let id = running_sandbox(&stack).await;
        sandboxes.push((id.clone(), generation(&stack, &id).await));
    }
    let first = host_of(&stack, &sandboxes[0].0).await;
    stack.add_host().await;

    drain(&stack, 0, true).await;
    let progress = drain_until(&stack, 0, "one move in flight", |d| d["moving"] == 1).await;
    assert_eq!(
        progress["left"], 2,
        "at most drain_parallel at a time: {progress}"
    );
    let answer = operator(&stack, Method::POST, first, "/uncordon", Some(json!({}))).await;
    assert_eq!(answer["state"], "ready", "{answer}");
    eventually("the move in flight finishes", || async {
        host(&stack, 0).await["drain"].is_null()
    })
    .await;
    let mut untouched = 0;
    for (id, before) in &sandboxes {
        stack.wait_state(id, "running").await;
        if generation(&stack, id).await == *before {
            assert_eq!(host_of(&stack, id).await, first);
            untouched += 1;
        }
    }
    assert_eq!(untouched, 2, "only the move in flight went on");
    tokio::time::sleep(Duration::from_secs(1)).await;
    for (id, _) in &sandboxes {
        assert_eq!(state(&stack, id).await, "running");
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}
