//! Start elsewhere on the real stack (issue 14, `migrating`): a durable stopped sandbox whose
//! host is cordoned, full or killed for good starts on the other host with its files (on gVisor
//! its processes continue), and the old host's stale copy is deleted (when the killed host
//! comes back, too); a stop that is not durable is refused on a dead host (503) and starts at
//! home on a cordoned one; a delete while `migrating`; a migration that fails or times out
//! goes back `stopped` to its old host.

use std::time::Duration;

use berth_reconciler::pass::PassConfig;
use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use crate::archive::{events, stop_durably, walk};
use crate::resume::{count, run, COUNTER};
use crate::support::http::{host_of, running_gvisor_sandbox, running_sandbox};
use crate::support::{eventually, Stack};

/// Whether host `index` still holds a directory of sandbox `id`.
pub(crate) fn copy_on(stack: &Stack, index: usize, id: &str) -> bool {
    stack.hosts[index]
        .state_dir
        .join("sandboxes")
        .join(id)
        .exists()
}

/// Cordons host `index` with an operator key.
pub(crate) async fn cordon(stack: &Stack, index: usize) {
    let admin = berth_api::auth::create_admin_key(&stack.db).await.unwrap();
    let host = stack.hosts[index].host_id;
    let (status, body) = stack
        .call_as(
            &admin,
            Method::POST,
            &format!("/v1/hosts/{host}/cordon"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
}

/// Forgets the sandbox's durable stop in its row, as if its upload had failed.
async fn not_durable(stack: &Stack, id: &str) {
    sqlx::query(
        "UPDATE sandboxes SET durable_at = NULL, durable_snapshot = NULL WHERE id = $1::uuid",
    )
    .bind(id)
    .execute(&stack.db)
    .await
    .unwrap();
}

/// Asks `id` to start; the answer is 202 with the sandbox `state` (`starting` at home,
/// `migrating` elsewhere).
pub(crate) async fn start_as(stack: &Stack, id: &str, state: &str) {
    let (status, body) = stack.request(id, "start").await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], state, "{body}");
}

async fn generation(stack: &Stack, id: &str) -> i64 {
    sqlx::query_scalar("SELECT generation FROM sandboxes WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(&stack.db)
        .await
        .unwrap()
}

pub(crate) const FILES: &str = "echo kept > /root/f && head -c 3000000 /dev/urandom > /root/blob \
                     && md5sum /root/blob > /root/sum";
pub(crate) const CHECK: &str = "cat /root/f && md5sum -c /root/sum >/dev/null && echo intact";

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_durable_stopped_sandbox_on_a_cordoned_host_starts_on_the_other_host_and_a_non_durable_one_at_home(
    db: PgPool,
) {
    let mut stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, FILES).await;
    let home = running_sandbox(&stack).await;
    run(&stack, &home, "echo home > /root/f").await;
    let first = host_of(&stack, &id).await;
    assert_eq!(host_of(&stack, &home).await, first);
    stop_durably(&stack, &id).await;
    stop_durably(&stack, &home).await;
    not_durable(&stack, &home).await;
    stack.add_host().await;
    cordon(&stack, 0).await;

    let started = std::time::Instant::now();
    start_as(&stack, &id, "migrating").await;
    stack.wait_state(&id, "running").await;
    eprintln!(
        "runc migration of a 3 MB sandbox: start → running in {:?}",
        started.elapsed()
    );
    assert_ne!(host_of(&stack, &id).await, first, "placed elsewhere");
    assert_eq!(run(&stack, &id, CHECK).await, "kept\nintact\n");
    let history = events(&db, &id).await;
    let migrating = history
        .iter()
        .find(|(to, _, _)| to == "migrating")
        .expect("a migrating event");
    assert!(
        migrating
            .2
            .as_deref()
            .unwrap_or_default()
            .contains("cordoned"),
        "{migrating:?}"
    );
    assert_eq!(history.last().unwrap().0, "running");
    eventually("the old host's stale copy is deleted", || async {
        !copy_on(&stack, 0, &id)
    })
    .await;
    stack.assert_no_capacity_drift().await;

    // The documented answer for a stop that is not durable on a cordoned host: a cordoned
    // host still runs its own sandboxes, so it starts at home.
    start_as(&stack, &home, "starting").await;
    stack.wait_state(&home, "running").await;
    assert_eq!(host_of(&stack, &home).await, first);
    assert_eq!(run(&stack, &home, "cat /root/f").await, "home\n");
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_host_killed_for_good_refuses_a_non_durable_start_and_moves_a_durable_one_and_deletes_its_copy_when_back(
    db: PgPool,
) {
    let mut stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, FILES).await;
    let stuck = running_sandbox(&stack).await;
    let first = host_of(&stack, &id).await;
    stop_durably(&stack, &id).await;
    stop_durably(&stack, &stuck).await;
    not_durable(&stack, &stuck).await;
    stack.add_host().await;
    stack.hosts[0].stop(true).await;
    // Silent past the placement freshness window (15 s).
    eventually("the killed host's heartbeat goes stale", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT last_seen < now() - interval '16 seconds' FROM hosts WHERE id = $1",
        )
        .bind(first)
        .fetch_one(&stack.db)
        .await
        .unwrap()
    })
    .await;

    let before = generation(&stack, &stuck).await;
    let response = stack
        .http
        .post(stack.url(&format!("/v1/sandboxes/{stuck}/start")))
        .bearer_auth(&stack.key)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 503);
    assert!(response.headers().contains_key("retry-after"));
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("not durable"), "{body}");
    assert_eq!(stack.state_of(&stuck).await, "stopped", "nothing changed");
    assert_eq!(generation(&stack, &stuck).await, before);

    start_as(&stack, &id, "migrating").await;
    stack.wait_state(&id, "running").await;
    assert_ne!(host_of(&stack, &id).await, first);
    assert_eq!(run(&stack, &id, CHECK).await, "kept\nintact\n");
    stack.assert_no_capacity_drift().await;

    // The old host comes back: it deletes its stale copy (the queued delete is newer than
    // anything it applied) and runs nothing of the sandbox.
    assert!(
        copy_on(&stack, 0, &id),
        "the dead host's copy is still on its disk"
    );
    stack.restart_host(0).await;
    eventually("the returning host deletes its stale copy", || async {
        !copy_on(&stack, 0, &id)
    })
    .await;
    assert_eq!(stack.state_of(&id).await, "running");
    assert_eq!(run(&stack, &id, "cat /root/f").await, "kept\n");
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_gvisor_sandbox_stopped_with_its_memory_continues_its_processes_on_the_other_host(
    db: PgPool,
) {
    let mut stack = Stack::start(db.clone(), 1).await;
    let id = running_gvisor_sandbox(&stack).await;
    let first = host_of(&stack, &id).await;
    run(&stack, &id, COUNTER).await;
    let pid = run(&stack, &id, "cat /root/pid").await;
    let stopped = stop_durably(&stack, &id).await;
    assert_eq!(stopped["last_stop"], "memory", "{stopped}");
    stack.add_host().await;
    cordon(&stack, 0).await;
    let started = std::time::Instant::now();
    start_as(&stack, &id, "migrating").await;
    stack.wait_state(&id, "running").await;
    eprintln!(
        "gVisor memory migration: start → running in {:?}",
        started.elapsed()
    );
    assert_ne!(host_of(&stack, &id).await, first);
    // The same process, still counting.
    run(&stack, &id, &format!("kill -0 {}", pid.trim())).await;
    let counted = count(&stack, &id).await;
    eventually("the migrated counter counts on", || async {
        count(&stack, &id).await > counted
    })
    .await;
    eventually("the old host's stale copy is deleted", || async {
        !copy_on(&stack, 0, &id)
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_delete_while_migrating_converges_on_both_hosts_and_collects_the_stored_stop(db: PgPool) {
    let mut stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    let stopped = stop_durably(&stack, &id).await;
    let snapshot: uuid::Uuid =
        sqlx::query_scalar("SELECT durable_snapshot FROM sandboxes WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&stack.db)
            .await
            .unwrap();
    assert!(!stopped["durable_at"].is_null());
    let manifest = format!("{snapshot}.json");
    let objects = stack.object_store_dir();
    let stored = |name: &str| {
        walk(&objects)
            .iter()
            .any(|p| p.file_name().is_some_and(|n| n == name))
    };
    assert!(stored(&manifest), "the stop snapshot is in the store");
    stack.add_host().await;
    cordon(&stack, 0).await;
    // The new host does nothing until the delete is in.
    stack.hosts[1].freeze();
    start_as(&stack, &id, "migrating").await;
    let (status, body) = stack.request(&id, "start").await;
    assert_eq!(
        (status, &body["state"]),
        (200, &json!("migrating")),
        "{body}"
    );
    let (status, body) = stack.request(&id, "stop").await;
    assert_eq!(status, 409, "{body}");
    let (status, body) = stack.delete(&id).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], "stopping", "{body}");
    // The new host may still be fetching it: kept until the delete is answered (the boot over).
    tokio::time::sleep(berth_api::collector::COLLECT_EVERY * 2).await;
    assert!(stored(&manifest), "kept while the migration may fetch it");
    stack.hosts[1].thaw();
    stack.wait_state(&id, "deleted").await;
    eventually("its stored stop is collected", || async {
        !stored(&manifest)
    })
    .await;
    eventually("both hosts left nothing", || async {
        stack.leftovers(&id).is_empty()
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_migration_that_fails_or_times_out_goes_back_stopped_to_its_old_host(db: PgPool) {
    let config = PassConfig {
        interval: Duration::from_millis(100),
        archive_timeout: Duration::from_secs(10),
        ..PassConfig::default()
    };
    let mut stack = Stack::start_with(db.clone(), 1, config).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo kept > /root/f").await;
    let first = host_of(&stack, &id).await;
    stop_durably(&stack, &id).await;
    stack.add_host().await;
    cordon(&stack, 0).await;

    // Failed: the stop snapshot's manifest is gone from the store (put back afterwards).
    let snapshot: uuid::Uuid =
        sqlx::query_scalar("SELECT durable_snapshot FROM sandboxes WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&stack.db)
            .await
            .unwrap();
    let manifest = walk(&stack.object_store_dir())
        .into_iter()
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n == format!("{snapshot}.json").as_str())
        })
        .expect("the manifest");
    let aside = manifest.with_extension("aside");
    std::fs::rename(&manifest, &aside).unwrap();
    start_as(&stack, &id, "migrating").await;
    let back = stack.wait_state(&id, "stopped").await;
    assert_eq!(host_of(&stack, &id).await, first, "back on its old host");
    let last = events(&db, &id).await.pop().unwrap();
    assert_eq!(
        (last.0.as_str(), last.1.as_str()),
        ("stopped", "runtime_error")
    );
    assert!(
        last.2
            .as_deref()
            .unwrap_or_default()
            .contains(&snapshot.to_string()),
        "the reason names the missing snapshot: {last:?} {back}"
    );
    assert!(!back["durable_at"].is_null(), "still durable: {back}");
    stack.assert_no_capacity_drift().await;
    std::fs::rename(&aside, &manifest).unwrap();

    // Timed out: the new host is frozen.
    stack.hosts[1].freeze();
    start_as(&stack, &id, "migrating").await;
    let back = stack.wait_state(&id, "stopped").await;
    let reason = back["state_reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("timeout") && reason.contains("sandbox.migrate"),
        "{back}"
    );
    assert_eq!(host_of(&stack, &id).await, first, "back on its old host");
    stack.assert_no_capacity_drift().await;
    stack.hosts[1].thaw();
    // The late migrate is refused (or destroyed) by the delete the timeout sent the new host.
    eventually("the new host keeps nothing of it", || async {
        !copy_on(&stack, 1, &id) && !stack.container_exists(&id)
    })
    .await;
    // The late migrate's result changed nothing: the row stayed where the timeout put it.
    eventually("the late migrate was answered", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT bool_and(completed_at IS NOT NULL) FROM commands
              WHERE sandbox_id = $1::uuid AND host_id = $2",
        )
        .bind(&id)
        .bind(stack.hosts[1].host_id)
        .fetch_one(&db)
        .await
        .unwrap()
    })
    .await;
    assert_eq!(stack.state_of(&id).await, "stopped");
    assert_eq!(host_of(&stack, &id).await, first);
    assert_eq!(events(&db, &id).await.last().unwrap().0, "stopped");
    // Uncordoned, the old host starts it from its own disk.
    let admin = berth_api::auth::create_admin_key(&stack.db).await.unwrap();
    let host = stack.hosts[0].host_id;
    let (status, body) = stack
        .call_as(
            &admin,
            Method::POST,
            &format!("/v1/hosts/{host}/uncordon"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    start_as(&stack, &id, "starting").await;
    stack.wait_state(&id, "running").await;
    assert_eq!(host_of(&stack, &id).await, first);
    assert_eq!(run(&stack, &id, "cat /root/f").await, "kept\n");
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_durable_stopped_sandbox_whose_host_filled_up_starts_elsewhere_and_the_start_can_wait_for_running(
    db: PgPool,
) {
    let mut stack = Stack::start(db.clone(), 0).await;
    // The first host fits one sandbox: once another runs there, it is full.
    stack.add_host_with((Some(1), Some(256))).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, FILES).await;
    let first = host_of(&stack, &id).await;
    stop_durably(&stack, &id).await;
    let filler = running_sandbox(&stack).await;
    assert_eq!(host_of(&stack, &filler).await, first);
    stack.add_host().await;
    // Not durable (as if its upload had failed), its full host cannot take it back and it
    // cannot move: a passing condition, so 503 `unavailable`, never `no_capacity` (the other
    // host has room), and nothing changes.
    let durable: (Option<chrono::DateTime<chrono::Utc>>, Option<uuid::Uuid>) =
        sqlx::query_as("SELECT durable_at, durable_snapshot FROM sandboxes WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&stack.db)
            .await
            .unwrap();
    not_durable(&stack, &id).await;
    let before = generation(&stack, &id).await;
    let (status, body) = stack.request(&id, "start").await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("unavailable")),
        "{body}"
    );
    assert_eq!(generation(&stack, &id).await, before);
    sqlx::query("UPDATE sandboxes SET durable_at = $2, durable_snapshot = $3 WHERE id = $1::uuid")
        .bind(&id)
        .bind(durable.0)
        .bind(durable.1)
        .execute(&stack.db)
        .await
        .unwrap();
    let (status, body) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/start?wait=running&timeout=60s"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "running", "{body}");
    assert_ne!(host_of(&stack, &id).await, first, "placed elsewhere");
    assert_eq!(run(&stack, &id, CHECK).await, "kept\nintact\n");
    let history = events(&db, &id).await;
    let migrating = history
        .iter()
        .find(|(to, _, _)| to == "migrating")
        .expect("a migrating event");
    assert!(
        migrating.2.as_deref().unwrap_or_default().contains("full"),
        "{migrating:?}"
    );
    eventually("the full host's stale copy is deleted", || async {
        !copy_on(&stack, 0, &id)
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn hostd_killed_mid_migrate_converges_on_the_new_host_from_its_own_record(db: PgPool) {
    use berth_hostd::fault::{crash_at, Step, CRASH_AT_ENV};
    use berth_schemas::CommandKind;
    let mut stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, FILES).await;
    let first = host_of(&stack, &id).await;
    stop_durably(&stack, &id).await;
    // The new host dies once the migrate's record (with its address) is written: the
    // redelivered migrate keeps that record, its own, and finishes the bring-up.
    let crash = vec![(
        CRASH_AT_ENV.to_owned(),
        crash_at(CommandKind::Migrate, Step::Address),
    )];
    let crashing = stack.add_host_env((None, None), &[], None, crash).await;
    cordon(&stack, 0).await;
    start_as(&stack, &id, "migrating").await;
    crate::resume::restart_after_crash(&mut stack, crashing, "migrate:address").await;
    stack.wait_state(&id, "running").await;
    assert_ne!(host_of(&stack, &id).await, first);
    assert_eq!(run(&stack, &id, CHECK).await, "kept\nintact\n");
    eventually("the old host's stale copy is deleted", || async {
        !copy_on(&stack, 0, &id)
    })
    .await;
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    eventually("nothing of the sandbox is left", || async {
        stack.leftovers(&id).is_empty()
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}
