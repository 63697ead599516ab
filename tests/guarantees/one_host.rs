//! Guarantee 5: no sandbox runs on two hosts; no container exists that no row accounts for
//! (orphans are swept on hostd start and by inventory in heartbeats). Lost hosts, killed
//! hostd and dead guests converge without duplicates.

use std::time::Duration;

use berth_reconciler::pass::{self, PassConfig};
use berth_store::leases;
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::http::host_of;
use crate::support::{eventually, Stack};

async fn host_state(stack: &Stack, host: Uuid) -> String {
    sqlx::query_scalar("SELECT state FROM hosts WHERE id = $1")
        .bind(host)
        .fetch_one(&stack.db)
        .await
        .unwrap()
}

/// Waits until host `host`'s last heartbeat is older than `age` (database clock).
async fn wait_silent(stack: &Stack, host: Uuid, age: Duration) {
    eventually("the host went silent", || async {
        let silent: bool = sqlx::query_scalar(
            "SELECT last_seen < now() - make_interval(secs => $2) FROM hosts WHERE id = $1",
        )
        .bind(host)
        .bind(age.as_secs_f64())
        .fetch_one(&stack.db)
        .await
        .unwrap();
        silent
    })
    .await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_silent_host_is_lost_its_sandboxes_fail_and_it_comes_back_ready_without_duplicates(
    db: PgPool,
) {
    let config = PassConfig {
        interval: Duration::from_millis(100),
        host_lost_after: Duration::from_secs(2),
        failover_after: Duration::from_secs(1),
        inventory_grace: Duration::from_millis(500),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db, 2, config).await;
    // Spread placement puts one on each host.
    let a = stack.create().await;
    let b = stack.create().await;
    stack.wait_state(&a, "running").await;
    stack.wait_state(&b, "running").await;
    let host_a = host_of(&stack, &a).await;
    assert_ne!(host_a, host_of(&stack, &b).await, "placement spreads");
    let index = stack
        .hosts
        .iter()
        .position(|h| h.host_id.as_uuid() == host_a)
        .unwrap();

    stack.hosts[index].freeze();
    eventually("the silent host is lost", || async {
        host_state(&stack, host_a).await == "lost"
    })
    .await;
    let failed = stack.wait_state(&a, "failed-start").await;
    assert!(
        failed["state_reason"]
            .as_str()
            .unwrap()
            .contains("host_lost"),
        "{failed}"
    );
    assert_eq!(
        stack.state_of(&b).await,
        "running",
        "the other host's sandbox is untouched"
    );
    stack.assert_no_capacity_drift().await;

    stack.hosts[index].thaw();
    eventually("the host is ready again", || async {
        host_state(&stack, host_a).await == "ready"
    })
    .await;
    // Its container still ran; no row wants it running, so it is stopped (its disk stays).
    eventually("the stranded container is stopped", || async {
        !stack.container_exists(&a)
    })
    .await;
    assert_eq!(stack.state_of(&a).await, "failed-start");
    assert!(
        stack.hosts[index]
            .state_dir
            .join("sandboxes")
            .join(&a)
            .exists(),
        "the disk is kept"
    );
    // A sandbox that once ran starts again from its disk, on its host.
    assert_eq!(stack.request(&a, "start").await.0, 202);
    stack.wait_state(&a, "running").await;
    for id in [&a, &b] {
        assert_eq!(stack.delete(id).await.0, 202);
        stack.wait_state(id, "deleted").await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn when_every_host_is_silent_at_once_a_pass_changes_nothing(db: PgPool) {
    // The stack's own reconciler passes once at start and then not for an hour.
    let idle = PassConfig {
        interval: Duration::from_secs(3600),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db, 1, idle).await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let host = host_of(&stack, &id).await;

    let config = PassConfig {
        host_lost_after: Duration::from_millis(500),
        failover_after: Duration::ZERO,
        inventory_grace: Duration::ZERO,
        ..PassConfig::default()
    };
    let test_lease = leases::acquire(
        &stack.db,
        "test-pass",
        Uuid::now_v7(),
        Duration::from_secs(60),
    )
    .await
    .unwrap()
    .unwrap();
    stack.hosts[0].freeze();
    wait_silent(&stack, host, Duration::from_millis(700)).await;
    let report = pass::run_pass(&stack.db, &config, &test_lease)
        .await
        .unwrap();
    stack.hosts[0].thaw();

    assert!(report.all_hosts_silent);
    assert!(report.actions.is_empty(), "{report:?}");
    assert_eq!(host_state(&stack, host).await, "ready");
    assert_eq!(stack.state_of(&id).await, "running");
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_hostd_killed_mid_create_and_restarted_converges_without_duplicates(db: PgPool) {
    let mut stack = Stack::start(db, 1).await;
    let ids = vec![
        stack.create().await,
        stack.create().await,
        stack.create().await,
    ];
    // The creates are in flight; the host dies without a chance to tidy up.
    stack.hosts[0].stop(true).await;
    stack.restart_host(0).await;
    for id in &ids {
        stack.wait_state(id, "running").await;
        let (status, out) = stack.exec(id, &["echo", "ok"]).await;
        assert_eq!(
            (status, out["stdout"].as_str()),
            (200, Some("ok\n")),
            "{out}"
        );
    }
    let containers = std::process::Command::new("runc")
        .arg("--root")
        .arg(stack.hosts[0].runc_root())
        .args(["list", "-q"])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&containers.stdout).lines().count();
    assert_eq!(listed, 3, "one container per sandbox");
    for id in &ids {
        stack.delete(id).await;
    }
    for id in &ids {
        stack.wait_state(id, "deleted").await;
        stack.nothing_left(id).await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_running_sandbox_whose_guest_dies_becomes_failed_start_and_can_start_again(db: PgPool) {
    let config = PassConfig {
        interval: Duration::from_millis(100),
        inventory_grace: Duration::from_millis(500),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db, 1, config).await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let (_, out) = stack.exec(&id, &["sh", "-c", "echo kept > /root/f"]).await;
    assert_eq!(out["exit_code"], 0);
    // Kill the agent that serves this very exec: the guest stops answering.
    let _ = stack.exec(&id, &["sh", "-c", "kill -9 $PPID"]).await;
    let failed = stack.wait_state(&id, "failed-start").await;
    assert!(
        failed["state_reason"].as_str().unwrap().contains("guest"),
        "{failed}"
    );
    stack.assert_no_capacity_drift().await;
    assert_eq!(stack.request(&id, "start").await.0, 202);
    stack.wait_state(&id, "running").await;
    let (_, out) = stack.exec(&id, &["cat", "/root/f"]).await;
    assert_eq!(out["stdout"], "kept\n", "its disk survived");
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_hostd_killed_with_three_sandboxes_running_leaves_no_orphan_and_rows_converge(
    db: PgPool,
) {
    let mut stack = Stack::start(db, 1).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(stack.create().await);
    }
    for id in &ids {
        stack.wait_state(id, "running").await;
        let (_, out) = stack
            .exec(id, &["sh", "-c", "echo kept > /root/note"])
            .await;
        assert_eq!(out["exit_code"], 0, "{out}");
    }

    // kill -9: no shutdown path runs. While it is down, one sandbox is deleted and one stopped.
    stack.hosts[0].stop(true).await;
    let (status, body) = stack.delete(&ids[0]).await;
    assert_eq!(status, 202, "{body}");
    let (status, body) = stack.request(&ids[1], "stop").await;
    assert_eq!(status, 202, "{body}");
    // A stray this hostd made and no record accounts for: an overlay mount of a sandbox dir.
    let stray = stack.hosts[0]
        .state_dir
        .join("sandboxes")
        .join(berth_schemas::SandboxId::new().to_string());
    for dir in ["rootfs", "lower"] {
        std::fs::create_dir_all(stray.join(dir)).unwrap();
    }
    nix::mount::mount(
        Some("tmpfs"),
        &stray.join("rootfs"),
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=1m"),
    )
    .unwrap();

    stack.restart_host(0).await;
    stack.wait_state(&ids[0], "deleted").await;
    let stopped = stack.wait_state(&ids[1], "stopped").await;
    assert_eq!(stopped["last_stop"], "disk");
    let running = stack.wait_state(&ids[2], "running").await;
    assert!(running["address"].is_string());

    // No orphan: the deleted sandbox left nothing, the stray mount is gone, one container runs.
    stack.nothing_left(&ids[0]).await;
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    assert!(
        !mounts.contains(&stray.to_string_lossy().into_owned()),
        "the stray mount survived the restart"
    );
    let runc = std::process::Command::new("runc")
        .arg("--root")
        .arg(stack.hosts[0].runc_root())
        .args(["list", "-q"])
        .output()
        .unwrap();
    let containers: Vec<String> = String::from_utf8_lossy(&runc.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(containers, [ids[2].clone()], "containers after the restart");
    let (_, out) = stack.exec(&ids[2], &["cat", "/root/note"]).await;
    assert_eq!(out["stdout"], "kept\n");

    // The stopped one starts again with its disk.
    stack.request(&ids[1], "start").await;
    stack.wait_state(&ids[1], "running").await;
    let (_, out) = stack.exec(&ids[1], &["cat", "/root/note"]).await;
    assert_eq!(out["stdout"], "kept\n");
    eventually("capacity settles", || async {
        berth_reconciler::pass::capacity_drift(&stack.db)
            .await
            .unwrap()
            == (0, 0)
    })
    .await;
    for id in &ids[1..] {
        stack.delete(id).await;
        stack.wait_state(id, "deleted").await;
        stack.nothing_left(id).await;
    }
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_sandbox_placed_on_another_host_is_destroyed_on_the_old_one(db: PgPool) {
    // Fast passes that judge inventory 1 s after a row changes; hosts are never lost here.
    let pass = PassConfig {
        interval: Duration::from_millis(200),
        inventory_grace: Duration::from_secs(1),
        ..PassConfig::default()
    };
    let stack = Stack::start_with(db, 2, pass).await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let old = host_of(&stack, &id).await;
    let new = stack
        .hosts
        .iter()
        .map(|h| h.host_id.as_uuid())
        .find(|h| *h != old)
        .expect("a second host");
    let old_root = stack
        .hosts
        .iter()
        .find(|h| h.host_id.as_uuid() == old)
        .expect("the old host")
        .runc_root();

    // The row now names the other host (as a failover placement writes it), its reservation
    // moved with it; the old host's inventory still lists the container.
    let mut tx = stack.db.begin().await.unwrap();
    sqlx::query(
        "UPDATE hosts h SET reserved_vcpus = h.reserved_vcpus + d.sign * s.vcpus,
                            reserved_memory_mib = h.reserved_memory_mib + d.sign * s.memory_mib
           FROM sandboxes s, (VALUES ($2::uuid, -1), ($3::uuid, 1)) AS d(host, sign)
          WHERE s.id = $1::uuid AND h.id = d.host",
    )
    .bind(&id)
    .bind(old)
    .bind(new)
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query("UPDATE sandboxes SET host_id = $2, updated_at = now() WHERE id = $1::uuid")
        .bind(&id)
        .bind(new)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    stack.assert_no_capacity_drift().await;

    eventually("the old host is sent a delete", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM commands
              WHERE sandbox_id = $1::uuid AND host_id = $2 AND kind = 'sandbox.delete'",
        )
        .bind(&id)
        .bind(old)
        .fetch_one(&stack.db)
        .await
        .unwrap()
            > 0
    })
    .await;
    eventually("the container is gone from the old host", || async {
        let out = std::process::Command::new("runc")
            .arg("--root")
            .arg(&old_root)
            .arg("list")
            .output()
            .unwrap();
        !String::from_utf8_lossy(&out.stdout).contains(&id)
    })
    .await;
    eventually("nothing of the sandbox is left on any host", || async {
        stack.leftovers(&id).is_empty()
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}
