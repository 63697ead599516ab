//! `berth sandbox snapshot`, `fork`, `restore`, `backup` and `restore-backup` against a real
//! stack with one runc host: a snapshot waited until ready, a restore that drops what came
//! after it, a fork into two running sandboxes that hold the snapshot's files, a backup and a
//! restore from it, and the refusals' exit codes.

use serde_json::Value;
use sqlx::PgPool;

use crate::kit::{ok, User};
use crate::support::Stack;

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_cli_snapshots_restores_and_forks_a_sandbox(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let user = User::of(&stack);
    let id = ok(&user, &["sandbox", "create", "--memory-mib", "256"])
        .await
        .trim()
        .to_owned();
    let write = |path: &str| format!("echo x > {path}");
    ok(
        &user,
        &[
            "sandbox",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            &write("/root/before"),
        ],
    )
    .await;

    // The snapshot is waited for and its id printed alone.
    let out = ok(&user, &["sandbox", "snapshot", &id]).await;
    let snapshot = out.trim().to_owned();
    assert_eq!(out, format!("{snapshot}\n"));
    let (status, body) = stack
        .call(
            reqwest::Method::GET,
            &format!("/v1/snapshots/{snapshot}"),
            None,
        )
        .await;
    assert_eq!(
        (status, body["state"].as_str()),
        (200, Some("ready")),
        "{body}"
    );

    // Restore drops what came after it.
    ok(
        &user,
        &[
            "sandbox",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            &write("/root/after"),
        ],
    )
    .await;
    let out = ok(&user, &["sandbox", "restore", &id, &snapshot]).await;
    assert_eq!(out, format!("{id} running\n"));
    let out = ok(
        &user,
        &[
            "sandbox",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "ls /root/before /root/after 2>&1 || true",
        ],
    )
    .await;
    assert!(
        out.contains("/root/before") && out.contains("No such file"),
        "{out}"
    );

    // A fork prints its new sandboxes, running, each with the snapshot's files.
    let out = ok(&user, &["sandbox", "fork", &id, "-n", "2"]).await;
    let forks: Vec<&str> = out.lines().collect();
    assert_eq!(forks.len(), 2, "{out}");
    for fork in &forks {
        assert_ne!(*fork, id);
        assert_eq!(stack.state_of(fork).await, "running");
        ok(
            &user,
            &["sandbox", "exec", fork, "--", "cat", "/root/before"],
        )
        .await;
    }
    let json: Value =
        serde_json::from_str(&ok(&user, &["sandbox", "fork", &id, "--no-wait", "--json"]).await)
            .expect("JSON");
    assert_eq!(json["sandboxes"].as_array().unwrap().len(), 1, "{json}");
    assert!(json["snapshot"]["id"].is_string(), "{json}");

    // Refusals: a fork of 17 (64: invalid), a restore from an unknown snapshot (66: not found).
    let run = user.run(&["sandbox", "fork", &id, "-n", "17"]).await;
    assert_eq!(run.code, 64, "{}", run.stderr);
    let unknown = berth_schemas::ids::SnapshotId::new().to_string();
    let run = user.run(&["sandbox", "restore", &id, &unknown]).await;
    assert_eq!(run.code, 66, "{}", run.stderr);
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_cli_backs_up_a_sandbox_shows_it_and_restores_from_it(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let user = User::of(&stack);
    let id = ok(&user, &["sandbox", "create", "--memory-mib", "256"])
        .await
        .trim()
        .to_owned();
    // Without a backup: a conflict (409: exit 75, try again later).
    let run = user.run(&["sandbox", "restore-backup", &id]).await;
    assert_eq!(run.code, 75, "{}", run.stderr);
    assert!(run.stderr.contains("no ready backup"), "{}", run.stderr);
    let exec = |script: &'static str| {
        let id = id.clone();
        let user = &user;
        async move { ok(user, &["sandbox", "exec", &id, "--", "sh", "-c", script]).await }
    };
    exec("echo kept > /root/f").await;
    let out = ok(&user, &["sandbox", "backup", &id]).await;
    let backup = out.trim().to_owned();
    assert_eq!(out, format!("{backup}\n"));
    exec("echo later > /root/g").await;
    let detail = ok(&user, &["sandbox", "get", &id]).await;
    assert!(
        detail.contains("last_backup_id:") && detail.contains(&backup),
        "{detail}"
    );
    let out = ok(
        &user,
        &["sandbox", "restore-backup", &id, "--backup", &backup],
    )
    .await;
    assert_eq!(out, format!("{id} running\n"));
    let out = exec("cat /root/f; ls /root/g 2>&1 || true").await;
    assert!(
        out.contains("kept") && out.contains("No such file"),
        "{out}"
    );
    stack.teardown().await;
}
