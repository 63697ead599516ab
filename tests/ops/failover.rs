//! Restore from backup and failover on the real stack (issue 14, `restoring`):
//! `POST /v1/sandboxes/{id}/restore-from-backup` cold-boots a backup's disk on a new placement
//! (files written after it are gone, memory is not restored, the old host's copy is deleted),
//! and refuses what it cannot do; a host silent past the lost and failover thresholds has its
//! running sandboxes restored from their backups on the other host, the rest fail
//! `host_lost`, and when the host comes back it destroys or stops what it still runs.

use std::time::Duration;

use berth_reconciler::pass::PassConfig;
use reqwest::Method;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::archive::{events, get};
use crate::backups::{backup, run, settled};
use crate::resume::{count, COUNTER};
use crate::support::http::{host_of, running_gvisor_sandbox, running_sandbox};
use crate::support::{eventually, Stack};

#[path = "failover_deferred.rs"]
mod deferred;

/// Takes a backup of `id` and waits until it is ready; its id.
pub(crate) async fn backed_up(stack: &Stack, id: &str) -> String {
    let (status, body) = backup(stack, id).await;
    assert_eq!(status, 202, "{body}");
    let backup_id = body["id"].as_str().unwrap().to_owned();
    assert_eq!(settled(stack, &backup_id).await["state"], "ready");
    backup_id
}

pub(crate) async fn restore(stack: &Stack, id: &str, body: Option<Value>) -> (u16, Value) {
    stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/restore-from-backup"),
            body,
        )
        .await
}

/// Whether host `index` still holds a directory of sandbox `id`.
fn copy_on(stack: &Stack, index: usize, id: &str) -> bool {
    stack.hosts[index]
        .state_dir
        .join("sandboxes")
        .join(id)
        .exists()
}

fn index_of(stack: &Stack, host: uuid::Uuid) -> usize {
    stack
        .hosts
        .iter()
        .position(|h| h.host_id.as_uuid() == host)
        .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_restore_from_backup_boots_the_backups_disk_on_a_new_placement_and_refuses_what_it_cannot(
    db: PgPool,
) {
    let stack = Stack::start(db.clone(), 2).await;
    let id = running_sandbox(&stack).await;

    // No backup yet: nothing to restore, and nothing changes.
    let (status, body) = restore(&stack, &id, None).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "snapshot_unavailable", "{body}");
    assert_eq!(stack.state_of(&id).await, "running");

    run(&stack, &id, "echo backed-up > /root/kept").await;
    let backup_id = backed_up(&stack, &id).await;
    run(&stack, &id, "echo later > /root/after").await;
    let (status, snap) = stack
        .call(Method::POST, &format!("/v1/sandboxes/{id}/snapshot"), None)
        .await;
    assert_eq!(status, 202, "{snap}");
    let snap_id = snap["id"].as_str().unwrap().to_owned();
    settled(&stack, &snap_id).await;

    // Bad input: a user snapshot is not a backup; an unknown backup; an unknown field.
    let (status, body) = restore(&stack, &id, Some(json!({"backup_id": snap_id}))).await;
    assert_eq!(status, 409, "{body}");
    let unknown = "00000000-0000-0000-0000-000000000000";
    let (status, body) = restore(&stack, &id, Some(json!({"backup_id": unknown}))).await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = restore(&stack, &id, Some(json!({"snapshot_id": backup_id}))).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(stack.state_of(&id).await, "running", "nothing changed");

    // The restore: `restoring` at once, then running on a new placement from the backup.
    let old_host = host_of(&stack, &id).await;
    let (status, body) = restore(&stack, &id, Some(json!({"backup_id": backup_id}))).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], "restoring", "{body}");
    let ran = stack.wait_state(&id, "running").await;
    assert_eq!(ran["last_backup_id"], backup_id.as_str(), "{ran}");
    assert_eq!(
        run(&stack, &id, "cat /root/kept").await["stdout"],
        "backed-up\n"
    );
    let (_, after) = stack
        .exec(
            &id,
            &[
                "sh",
                "-c",
                "test -e /root/after && echo present || echo gone",
            ],
        )
        .await;
    assert_eq!(
        after["stdout"], "gone\n",
        "files written after the backup are gone"
    );
    let history = events(&db, &id).await;
    assert!(
        history
            .iter()
            .any(|(to, reason, _)| to == "restoring" && reason == "user_request"),
        "{history:?}"
    );
    // The old host's copy is deleted when it was another host.
    let new_host = host_of(&stack, &id).await;
    if new_host != old_host {
        let old = index_of(&stack, old_host);
        eventually("the old host deletes its copy", || async {
            !copy_on(&stack, old, &id)
        })
        .await;
    }
    stack.assert_no_capacity_drift().await;

    // From stopped too. While it restores (both hosts frozen, so the host placement picked
    // cannot have booted it yet): a repeat is answered as it is, a stop, a snapshot restore
    // and an archive conflict, and the backup it boots cannot be deleted.
    let (status, _) = stack.request(&id, "stop").await;
    assert_eq!(status, 202);
    stack.wait_state(&id, "stopped").await;
    for host in &stack.hosts {
        host.freeze();
    }
    let (status, body) = restore(&stack, &id, None).await;
    assert_eq!(
        (status, &body["state"]),
        (202, &json!("restoring")),
        "{body}"
    );
    let (status, again) = restore(&stack, &id, None).await;
    assert_eq!(
        (status, &again["state"]),
        (202, &json!("restoring")),
        "{again}"
    );
    assert_eq!(
        again["generation"], body["generation"],
        "a repeat changes nothing"
    );
    assert_eq!(stack.request(&id, "stop").await.0, 409);
    assert_eq!(stack.request(&id, "archive").await.0, 409);
    let (status, _) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/restore"),
            Some(json!({"snapshot_id": snap_id})),
        )
        .await;
    assert_eq!(status, 409);
    let (status, body) = stack
        .call(Method::DELETE, &format!("/v1/snapshots/{backup_id}"), None)
        .await;
    assert_eq!(status, 409, "a backup being booted is not deleted: {body}");
    for host in &stack.hosts {
        host.thaw();
    }
    stack.wait_state(&id, "running").await;
    assert_eq!(
        run(&stack, &id, "cat /root/kept").await["stdout"],
        "backed-up\n"
    );
    stack.assert_no_capacity_drift().await;

    // A delete converges and leaves nothing on either host.
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    for index in 0..stack.hosts.len() {
        eventually("no copy is left", || async { !copy_on(&stack, index, &id) }).await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_lost_hosts_backed_up_sandbox_runs_elsewhere_from_its_backup_and_the_rest_fail_host_lost(
    db: PgPool,
) {
    let config = PassConfig {
        interval: Duration::from_millis(200),
        host_lost_after: Duration::from_secs(3),
        failover_after: Duration::from_secs(2),
        inventory_grace: Duration::from_millis(500),
        backup_unit: Duration::from_secs(2),
        ..PassConfig::default()
    };
    let due_after = config.host_lost_after + config.failover_after;
    let mut stack = Stack::start_with(db.clone(), 1, config).await;
    let backed = running_sandbox(&stack).await;
    let bare = running_sandbox(&stack).await;
    run(&stack, &backed, "echo safe > /root/kept").await;
    // Backed up every `backup_interval_min` (2 s units here): wait for one that holds the file.
    let (status, body) = stack
        .call(
            Method::PATCH,
            &format!("/v1/sandboxes/{backed}"),
            Some(json!({"backup_interval_min": 1})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    eventually("a periodic backup is ready", || async {
        !get(&stack, &backed).await["last_backup_id"].is_null()
    })
    .await;
    let lost = host_of(&stack, &backed).await;
    stack.add_host().await;

    stack.hosts[0].freeze();
    let failed = stack.wait_state(&bare, "failed-start").await;
    assert!(
        failed["state_reason"]
            .as_str()
            .unwrap()
            .contains("host_lost"),
        "{failed}"
    );
    let ran = stack.wait_state(&backed, "running").await;
    // The failover's own time: from when the pass may fail the host over (its last heartbeat
    // plus the lost and failover delays) to the restoring event, and on to running elsewhere.
    let (to_restoring, to_running): (f64, f64) = sqlx::query_as(
        "SELECT extract(epoch FROM r.at - h.last_seen)::float8 - $3,
                extract(epoch FROM n.at - r.at)::float8
           FROM hosts h, events r, events n
          WHERE h.id = $1 AND r.sandbox_id = $2::uuid AND r.to_state = 'restoring'
            AND n.sandbox_id = r.sandbox_id AND n.to_state = 'running' AND n.id > r.id",
    )
    .bind(lost)
    .bind(&backed)
    .bind(due_after.as_secs_f64())
    .fetch_one(&db)
    .await
    .unwrap();
    eprintln!(
        "failover: due → restoring {:.0} ms (pass every 200 ms), restoring → running elsewhere \
         {:.0} ms",
        to_restoring * 1000.0,
        to_running * 1000.0
    );
    assert_ne!(host_of(&stack, &backed).await, lost, "{ran}");
    assert_eq!(
        run(&stack, &backed, "cat /root/kept").await["stdout"],
        "safe\n"
    );
    let history = events(&db, &backed).await;
    assert!(
        history
            .iter()
            .any(|(to, reason, _)| to == "restoring" && reason == "host_lost"),
        "{history:?}"
    );
    stack.assert_no_capacity_drift().await;

    // The lost host comes back: it destroys its copy of the sandbox that moved (its delete is
    // newer than anything it applied) and stops the failed one's container, keeping its disk.
    stack.hosts[0].thaw();
    eventually(
        "the returning host deletes the moved sandbox's copy",
        || async { !copy_on(&stack, 0, &backed) },
    )
    .await;
    eventually("the failed sandbox's container is stopped", || async {
        !container_on(&stack, 0, &bare)
    })
    .await;
    assert!(
        copy_on(&stack, 0, &bare),
        "the failed sandbox's disk is kept"
    );
    assert_eq!(stack.state_of(&backed).await, "running");
    assert_eq!(
        run(&stack, &backed, "cat /root/kept").await["stdout"],
        "safe\n"
    );
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// Whether host `index`'s runc lists a container of sandbox `id`.
fn container_on(stack: &Stack, index: usize, id: &str) -> bool {
    let out = std::process::Command::new("runc")
        .arg("--root")
        .arg(stack.hosts[index].runc_root())
        .args(["list", "-q"])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&out.stdout);
    listed.contains(id) || listed.contains(&id.replace('-', "")[..12])
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_gvisor_restore_from_backup_keeps_the_disk_and_not_the_processes(db: PgPool) {
    let stack = Stack::start(db.clone(), 1).await;
    let id = running_gvisor_sandbox(&stack).await;
    run(&stack, &id, COUNTER).await;
    let counted = count(&stack, &id).await;
    eventually("the counter counts", || async {
        count(&stack, &id).await > counted
    })
    .await;
    run(&stack, &id, "echo on-disk > /root/kept").await;
    backed_up(&stack, &id).await;

    // Restored on its own host (the only one): the stale copy is removed first, the backup's
    // disk cold-booted.
    let (status, body) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/restore-from-backup?wait=running"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "running", "{body}");
    assert_eq!(
        run(&stack, &id, "cat /root/kept").await["stdout"],
        "on-disk\n"
    );
    // Nothing counts any more: the counter lived in memory only (a pid proves nothing: a
    // cold-booted gVisor sandbox hands out the same small pids again).
    let first = count(&stack, &id).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        count(&stack, &id).await,
        first,
        "memory is not restored from a backup"
    );
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn start_and_delete_raced_against_a_restore_from_backup_converge_with_nothing_left(
    db: PgPool,
) {
    let stack = Stack::start(db.clone(), 2).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo x > /root/kept").await;
    let backup_id = backed_up(&stack, &id).await;

    // Start and restore at once: whichever commits second sees the other's state. A start of
    // a running or restoring sandbox changes nothing, so the restore always goes through.
    let (restored, started) = tokio::join!(restore(&stack, &id, None), stack.request(&id, "start"));
    assert_eq!(restored.0, 202, "{}", restored.1);
    assert_eq!(
        started.0, 200,
        "a start of a running or restoring one: {}",
        started.1
    );
    stack.wait_state(&id, "running").await;
    assert_eq!(run(&stack, &id, "cat /root/kept").await["stdout"], "x\n");
    stack.assert_no_capacity_drift().await;

    // Restore and delete at once: the delete always wins in the end, whichever order they
    // commit in (a restore of a sandbox being deleted is 409).
    let (restored, deleted) = tokio::join!(restore(&stack, &id, None), stack.delete(&id));
    assert!(
        restored.0 == 202 || restored.0 == 409,
        "restore racing a delete: {} {}",
        restored.0,
        restored.1
    );
    assert_eq!(deleted.0, 202, "{}", deleted.1);
    stack.wait_state(&id, "deleted").await;
    for index in 0..stack.hosts.len() {
        eventually("no copy is left on any host", || async {
            !copy_on(&stack, index, &id) && !container_on(&stack, index, &id)
        })
        .await;
    }
    stack.assert_no_capacity_drift().await;
    // The backup outlives its sandbox, as every snapshot does.
    assert_eq!(settled(&stack, &backup_id).await["state"], "ready");
    stack.teardown().await;
}
