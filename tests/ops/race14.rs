//! Start and delete raced against the requests that lead into issue 14's transitional states
//! (`archiving`, `unarchiving`, `migrating`), each pair fired at once: whichever the database
//! orders first wins, and the other gets what the request × state table
//! (`berth_schemas::state`) answers in the state the first one left: a start during
//! `archiving` is 409, an archive of a `starting` sandbox is 409, a start during
//! `unarchiving` or `migrating` is `=` (one command only), a delete is accepted in every state
//! and an archived sandbox's delete is a tombstone at once. Each ends settled, with no
//! capacity drift, and each delete with nothing of the sandbox on any host and its stored stop
//! collected. (Single, unraced cases: `archive::a_delete_is_accepted_while_archiving_…`,
//! `migrate::a_delete_while_migrating_…`, the delete during `unarchiving` of
//! `archive::an_unarchive_whose_host_never_answers_…`.)

use serde_json::Value;
use sqlx::PgPool;

use crate::archive::stop_durably;
use crate::crash14::{converged_deleted, delete_leaves_nothing, durable_snapshot};
use crate::migrate::{copy_on, cordon, CHECK, FILES};
use crate::resume::run;
use crate::support::http::{host_of, running_sandbox};
use crate::support::{eventually, Stack};

/// A running sandbox with files, stopped durably.
async fn durably_stopped(stack: &Stack) -> String {
    let id = running_sandbox(stack).await;
    run(stack, &id, FILES).await;
    stop_durably(stack, &id).await;
    id
}

/// A sandbox with files, archived.
async fn archived(stack: &Stack) -> String {
    let id = durably_stopped(stack).await;
    assert_eq!(stack.request(&id, "archive").await.0, 202);
    stack.wait_state(&id, "archived").await;
    id
}

/// `POST /v1/sandboxes/{id}/start` and `DELETE /v1/sandboxes/{id}` at once.
async fn start_and_delete(stack: &Stack, id: &str) -> ((u16, Value), (u16, Value)) {
    tokio::join!(stack.request(id, "start"), stack.delete(id))
}

/// How many `kind` commands the sandbox was sent.
async fn commands(stack: &Stack, id: &str, kind: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM commands WHERE sandbox_id = $1::uuid AND kind = $2")
        .bind(id)
        .bind(kind)
        .fetch_one(&stack.db)
        .await
        .unwrap()
}

/// A 409 naming the state the sandbox was in.
fn conflict_in(answer: &(u16, Value), states: &[&str]) {
    let (status, body) = answer;
    assert_eq!(*status, 409, "{body}");
    let state = body["error"]["state"].as_str().unwrap_or_default();
    assert!(states.contains(&state), "409 in {state}: {body}");
}

/// A start or delete answered `=` or accepted: 200 or 202.
fn accepted(answer: &(u16, Value)) {
    let (status, body) = answer;
    assert!(*status == 200 || *status == 202, "{status} {body}");
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn start_and_delete_raced_against_an_archive_settle_as_the_table_says(db: PgPool) {
    let stack = Stack::start(db.clone(), 1).await;

    // archive × start: exactly one wins.
    let id = durably_stopped(&stack).await;
    let (archive, start) = tokio::join!(stack.request(&id, "archive"), stack.request(&id, "start"));
    eprintln!("archive × start: {} {}", archive.0, start.0);
    if archive.0 == 202 {
        assert_eq!(archive.1["state"], "archiving", "{}", archive.1);
        conflict_in(&start, &["archiving", "archived"]);
        stack.wait_state(&id, "archived").await;
        crate::archive::freed(&stack, &id).await;
        // Once archived the start the race refused unarchives.
        assert_eq!(stack.request(&id, "start").await.0, 202);
    } else {
        conflict_in(&archive, &["starting", "running"]);
        assert_eq!(start.0, 202, "{}", start.1);
    }
    stack.wait_state(&id, "running").await;
    assert_eq!(run(&stack, &id, CHECK).await, "kept\nintact\n");
    stack.assert_no_capacity_drift().await;
    delete_leaves_nothing(&stack, &id).await;

    // archive × delete: the delete is always accepted; an archive after it is 409.
    let id = durably_stopped(&stack).await;
    let snapshot = durable_snapshot(&stack, &id).await;
    let (archive, delete) = tokio::join!(stack.request(&id, "archive"), stack.delete(&id));
    eprintln!("archive × delete: {} {}", archive.0, delete.0);
    assert_eq!(delete.0, 202, "{}", delete.1);
    if archive.0 != 202 {
        conflict_in(&archive, &["stopping", "deleted"]);
    }
    converged_deleted(&stack, &id, snapshot).await;

    // start × delete while `archiving` (the archive already accepted).
    let id = durably_stopped(&stack).await;
    let snapshot = durable_snapshot(&stack, &id).await;
    assert_eq!(stack.request(&id, "archive").await.0, 202);
    let (start, delete) = start_and_delete(&stack, &id).await;
    eprintln!(
        "start × delete of {id}: {} {} ({})",
        start.0, delete.0, delete.1["state"]
    );
    assert_eq!(delete.0, 202, "{}", delete.1);
    conflict_in(&start, &["archiving", "stopping", "deleted"]);
    converged_deleted(&stack, &id, snapshot).await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn start_and_delete_raced_against_an_unarchive_settle_as_the_table_says(db: PgPool) {
    let stack = Stack::start(db.clone(), 1).await;

    // start × start of an archived sandbox: both answered, one unarchive sent.
    let id = archived(&stack).await;
    let (a, b) = tokio::join!(stack.request(&id, "start"), stack.request(&id, "start"));
    accepted(&a);
    accepted(&b);
    assert!(
        a.0 == 202 || b.0 == 202,
        "one of them unarchives: {a:?} {b:?}"
    );
    stack.wait_state(&id, "running").await;
    assert_eq!(commands(&stack, &id, "sandbox.unarchive").await, 1);
    assert_eq!(run(&stack, &id, CHECK).await, "kept\nintact\n");
    stack.assert_no_capacity_drift().await;
    delete_leaves_nothing(&stack, &id).await;

    // start × delete of an archived sandbox: the start unarchives and the delete stops it,
    // or the delete writes the tombstone at once and the start is refused.
    let id = archived(&stack).await;
    let snapshot = durable_snapshot(&stack, &id).await;
    let (start, delete) = start_and_delete(&stack, &id).await;
    eprintln!(
        "start × delete of {id}: {} {} ({})",
        start.0, delete.0, delete.1["state"]
    );
    assert_eq!(delete.0, 202, "{}", delete.1);
    if start.0 == 202 {
        assert_eq!(start.1["state"], "unarchiving", "{}", start.1);
        assert_eq!(delete.1["state"], "stopping", "{}", delete.1);
    } else {
        assert_eq!(delete.1["state"], "deleted", "at once: {}", delete.1);
        conflict_in(&start, &["deleted"]);
        assert_eq!(commands(&stack, &id, "sandbox.unarchive").await, 0);
    }
    converged_deleted(&stack, &id, snapshot).await;

    // start × delete while `unarchiving` (the unarchive already sent to the host).
    let id = archived(&stack).await;
    let snapshot = durable_snapshot(&stack, &id).await;
    let (status, body) = stack.request(&id, "start").await;
    assert_eq!(
        (status, body["state"].as_str()),
        (202, Some("unarchiving")),
        "{body}"
    );
    let (start, delete) = start_and_delete(&stack, &id).await;
    eprintln!("start × delete while unarchiving: {} {}", start.0, delete.0);
    assert_eq!(delete.0, 202, "{}", delete.1);
    if start.0 != 409 {
        accepted(&start);
    } else {
        conflict_in(&start, &["stopping"]);
    }
    converged_deleted(&stack, &id, snapshot).await;
    assert_eq!(commands(&stack, &id, "sandbox.unarchive").await, 1);
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn start_and_delete_raced_against_a_migration_settle_as_the_table_says(db: PgPool) {
    let mut stack = Stack::start(db.clone(), 1).await;
    let moving = durably_stopped(&stack).await;
    let deleted = durably_stopped(&stack).await;
    let in_flight = durably_stopped(&stack).await;
    let first = host_of(&stack, &moving).await;
    stack.add_host().await;
    cordon(&stack, 0).await;

    // start × start of a stopped sandbox whose host is cordoned: one migrates it, the other
    // answers `=`, one migrate sent.
    let (a, b) = tokio::join!(
        stack.request(&moving, "start"),
        stack.request(&moving, "start")
    );
    accepted(&a);
    accepted(&b);
    stack.wait_state(&moving, "running").await;
    assert_eq!(commands(&stack, &moving, "sandbox.migrate").await, 1);
    assert_ne!(host_of(&stack, &moving).await, first, "moved");
    assert_eq!(run(&stack, &moving, CHECK).await, "kept\nintact\n");
    eventually("the old host's stale copy is deleted", || async {
        !copy_on(&stack, 0, &moving)
    })
    .await;
    stack.assert_no_capacity_drift().await;
    delete_leaves_nothing(&stack, &moving).await;

    // start × delete: the start migrates and the delete follows it to both hosts, or the
    // delete stops it at home and the start is refused.
    let snapshot = durable_snapshot(&stack, &deleted).await;
    let (start, delete) = start_and_delete(&stack, &deleted).await;
    eprintln!("start × delete while migrating: {} {}", start.0, delete.0);
    assert_eq!(delete.0, 202, "{}", delete.1);
    if start.0 == 202 {
        assert_eq!(start.1["state"], "migrating", "{}", start.1);
    } else {
        conflict_in(&start, &["stopping", "deleted"]);
        assert_eq!(commands(&stack, &deleted, "sandbox.migrate").await, 0);
    }
    converged_deleted(&stack, &deleted, snapshot).await;
    assert!(!copy_on(&stack, 0, &deleted) && !copy_on(&stack, 1, &deleted));

    // start × delete while `migrating` (the migrate already sent to the new host).
    let snapshot = durable_snapshot(&stack, &in_flight).await;
    let (status, body) = stack.request(&in_flight, "start").await;
    assert_eq!(
        (status, body["state"].as_str()),
        (202, Some("migrating")),
        "{body}"
    );
    let (start, delete) = start_and_delete(&stack, &in_flight).await;
    eprintln!(
        "start × delete while migrating (sent): {} {}",
        start.0, delete.0
    );
    assert_eq!(delete.0, 202, "{}", delete.1);
    if start.0 != 409 {
        accepted(&start);
    } else {
        conflict_in(&start, &["stopping"]);
    }
    converged_deleted(&stack, &in_flight, snapshot).await;
    assert!(!copy_on(&stack, 0, &in_flight) && !copy_on(&stack, 1, &in_flight));
    assert_eq!(commands(&stack, &in_flight, "sandbox.migrate").await, 1);
    stack.teardown().await;
}

/// An archive, or a start, right after a stop lands while the stop's background capture reads
/// the disk (200 MB of it here): each settles with the files intact. `berth bench --storage`
/// saw 1 archive in 12 fail there (`disk.img still attached to loop`: the cancelled capture
/// was dropped with the disk still mounted, now it is let finish); this test exercises the
/// path but did not reproduce that interleaving in a run without the fix.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_command_right_after_a_stop_waits_for_its_capture_and_finds_the_disk_released(
    db: PgPool,
) {
    let stack = Stack::start(db, 1).await;
    for next in ["archive", "start"] {
        let id = running_sandbox(&stack).await;
        run(
            &stack,
            &id,
            "head -c 200000000 /dev/urandom > /root/big && md5sum /root/big > /root/sum",
        )
        .await;
        assert_eq!(stack.request(&id, "stop").await.0, 202);
        stack.wait_state(&id, "stopped").await;
        let (status, body) = stack.request(&id, next).await;
        assert_eq!(status, 202, "{next}: {body}");
        let settled = if next == "archive" {
            "archived"
        } else {
            "running"
        };
        let row = stack.wait_state(&id, settled).await;
        assert_eq!(row["state"], settled, "{next}: {row}");
        if next == "archive" {
            assert_eq!(stack.request(&id, "start").await.0, 202);
            stack.wait_state(&id, "running").await;
        }
        run(&stack, &id, "md5sum -c /root/sum >/dev/null").await;
        stack.assert_no_capacity_drift().await;
    }
    stack.teardown().await;
}
