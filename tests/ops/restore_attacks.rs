//! What an attack run on issue 14 found (restore from backup, failover), as tests: a rollback
//! to an older backup stays rolled back when a backup in flight settles after it (and a
//! failover then boots the backup rolled back to); hostd killed mid restore converges;
//! restores raced against snapshots and backups of the same sandbox never deadlock into 500s.

use std::time::Duration;

use berth_reconciler::pass::PassConfig;
use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use crate::archive::get;
use crate::backups::{backup, run};
use crate::failover::{backed_up, restore};
use crate::support::http::{host_of, running_sandbox};
use crate::support::{eventually, Stack};

async fn creating(db: &PgPool, id: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM snapshots WHERE sandbox_id = $1::uuid AND state = 'creating'",
    )
    .bind(id)
    .fetch_one(db)
    .await
    .unwrap()
}

/// A user rolls the sandbox back to a good backup while a backup of the bad disk is in
/// flight; later the host is lost. The failover should boot the disk the user rolled back to,
/// never the one the user rolled back from. Failed before `restored_at` (migration 0036): the
/// backup in flight settled `ready` after the restore and became `last_backup_id`.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_failover_after_a_rollback_boots_the_backup_rolled_back_to(db: PgPool) {
    let config = PassConfig {
        interval: Duration::from_millis(200),
        host_lost_after: Duration::from_secs(3),
        failover_after: Duration::from_secs(2),
        inventory_grace: Duration::from_millis(500),
        ..PassConfig::default()
    };
    let mut stack = Stack::start_with(db.clone(), 1, config).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo good > /root/f").await;
    let good = backed_up(&stack, &id).await;
    run(&stack, &id, "echo corrupted > /root/f").await;
    let (status, body) = backup(&stack, &id).await;
    assert_eq!(status, 202, "{body}");
    let in_flight = body["id"].clone();
    let (status, body) = restore(&stack, &id, Some(json!({ "backup_id": good }))).await;
    assert_eq!(status, 202, "{body}");
    stack.wait_state(&id, "running").await;
    assert_eq!(run(&stack, &id, "cat /root/f").await["stdout"], "good\n");
    eventually("no backup in flight", || async {
        creating(&db, &id).await == 0
    })
    .await;
    let row = get(&stack, &id).await;
    assert_eq!(
        row["last_backup_id"],
        good.as_str(),
        "the backup rolled back to stays the newest, not {in_flight}: {row}"
    );
    // The one in flight is still a ready backup, restorable by name.
    let (status, b) = stack
        .call(
            Method::GET,
            &format!("/v1/snapshots/{}", in_flight.as_str().unwrap()),
            None,
        )
        .await;
    assert_eq!((status, b["state"].as_str()), (200, Some("ready")), "{b}");

    let lost = host_of(&stack, &id).await;
    stack.add_host().await;
    stack.hosts[0].freeze();
    eventually("failed over to the other host", || async {
        let row = get(&stack, &id).await;
        row["state"] == "running" && row["host_id"].as_str() != Some(&lost.to_string())
    })
    .await;
    let after = run(&stack, &id, "cat /root/f").await["stdout"].clone();
    stack.hosts[0].thaw();
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
    assert_eq!(
        after, "good\n",
        "the failover booted the disk the user had rolled back from"
    );
}

/// hostd killed (SIGKILL at `seeded`) mid restore-from-backup on the host it moves to; the
/// backup cannot be deleted meanwhile, and after the restart it converges with nothing left on
/// the old host and no capacity drift.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn hostd_killed_mid_restore_from_backup_converges_and_its_backup_is_kept(db: PgPool) {
    use berth_hostd::fault::{crash_at, Step, CRASH_AT_ENV};
    use berth_schemas::CommandKind;
    let mut stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo kept > /root/before").await;
    let good = backed_up(&stack, &id).await;
    run(&stack, &id, "echo later > /root/after").await;
    let crashing = stack
        .add_host_env(
            (None, None),
            &[],
            None,
            vec![(
                CRASH_AT_ENV.to_owned(),
                crash_at(CommandKind::Migrate, Step::Seeded),
            )],
        )
        .await;
    let admin = berth_api::auth::create_admin_key(&stack.db).await.unwrap();
    let old = stack.hosts[0].host_id.0;
    let (status, body) = stack
        .call_as(
            &admin,
            Method::POST,
            &format!("/v1/hosts/{old}/cordon"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = restore(&stack, &id, None).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(host_of(&stack, &id).await, stack.hosts[crashing].host_id.0);
    let child = stack.hosts[crashing].child.as_mut().unwrap();
    let exited = tokio::time::timeout(Duration::from_secs(120), child.wait()).await;
    assert!(exited.is_ok(), "hostd never crashed at seeded");
    stack.hosts[crashing].child = None;
    // While the host is down: the backup being booted is not deleted.
    let (status, body) = stack
        .call(Method::DELETE, &format!("/v1/snapshots/{good}"), None)
        .await;
    assert_eq!(status, 409, "{body}");
    stack.hosts[crashing].env.retain(|(k, _)| k != CRASH_AT_ENV);
    stack.restart_host(crashing).await;
    stack.wait_state(&id, "running").await;
    let out = run(
        &stack,
        &id,
        "cat /root/before; test -e /root/after && echo after-is-back || true",
    )
    .await;
    assert_eq!(out["stdout"], "kept\n", "{out}");
    eventually("the old host's copy is removed", || async {
        !stack.hosts[0]
            .state_dir
            .join("sandboxes")
            .join(&id)
            .exists()
    })
    .await;
    stack.assert_no_capacity_drift().await;
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    eventually("nothing of the sandbox is left", || async {
        stack.leftovers(&id).is_empty()
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// Restores from backup raced against snapshots and backups of the same sandbox, which name
/// the backup as their parent: every request gets a 2xx or a 409, never a 500 (an attack run
/// got `deadlock detected` in 10 of 6 rounds when the restore locked the backup `FOR UPDATE`).
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn restores_raced_against_snapshots_and_backups_never_deadlock(db: PgPool) {
    let stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    backed_up(&stack, &id).await;
    for round in 0..4 {
        let what = if round % 2 == 0 { "snapshot" } else { "backup" };
        let path = format!("/v1/sandboxes/{id}/{what}");
        let take = || stack.call(Method::POST, &path, None);
        let (a, b, c, d) = tokio::join!(
            restore(&stack, &id, None),
            take(),
            restore(&stack, &id, None),
            take()
        );
        for (status, body) in [a, b, c, d] {
            assert!(
                (200..300).contains(&status) || status == 409,
                "round {round} ({what}): {status} {body}"
            );
        }
        stack.wait_state(&id, "running").await;
        eventually("no snapshot in flight", || async {
            creating(&db, &id).await == 0
        })
        .await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}
