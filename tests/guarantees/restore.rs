//! Guarantee 6: a memory restore keeps processes and open files; a disk-only stop keeps files
//! only.

use std::time::Duration;

use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use crate::support::http::running_sandbox;
use crate::support::Stack;

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn files_written_before_each_of_five_stops_are_there_after_each_start(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = running_sandbox(&stack).await;
    for cycle in 0..5 {
        let (status, out) = stack
            .exec(
                &id,
                &[
                    "sh",
                    "-c",
                    &format!("echo cycle{cycle} > /root/file{cycle}"),
                ],
            )
            .await;
        assert_eq!(
            (status, &out["exit_code"]),
            (200, &serde_json::json!(0)),
            "{out}"
        );
        assert_eq!(stack.request(&id, "stop").await.0, 202);
        stack.wait_state(&id, "stopped").await;
        assert_eq!(stack.request(&id, "start").await.0, 202);
        stack.wait_state(&id, "running").await;
        let (_, out) = stack.exec(&id, &["sh", "-c", "cat /root/file*"]).await;
        let expected: String = (0..=cycle).map(|c| format!("cycle{c}\n")).collect();
        assert_eq!(out["stdout"], expected, "after start {cycle}");
    }
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_gvisor_sandbox_stopped_through_the_api_keeps_its_processes(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    // The API lists the templates hostd knows, with the runtimes hostd uses for them.
    let (_, templates) = stack.call(Method::GET, "/v1/templates", None).await;
    for t in berth_hostd::template::TEMPLATES {
        let row = templates
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == t.name)
            .unwrap_or_else(|| panic!("{} is not in {templates}", t.name));
        assert_eq!(row["runtime"], t.runtime, "{row}");
    }
    let host_runtimes: Vec<String> = sqlx::query_scalar("SELECT unnest(runtimes) FROM hosts")
        .fetch_all(&stack.db)
        .await
        .unwrap();
    assert!(
        host_runtimes.contains(&"runsc".to_owned()),
        "{host_runtimes:?}"
    );

    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "base-gvisor", "vcpus": 1, "memory_mib": 256})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    let (_, out) = stack
        .exec(
            &id,
            &[
                "sh",
                "-c",
                "sh -c 'i=0; while :; do i=$((i+1)); echo $i > /root/count.new; mv /root/count.new /root/count; sleep 0.1; done' </dev/null >/dev/null 2>&1 & echo $!",
            ],
        )
        .await;
    let pid = out["stdout"].as_str().unwrap().trim().to_owned();
    tokio::time::sleep(Duration::from_millis(500)).await;

    stack.request(&id, "stop").await;
    let stopped = stack.wait_state(&id, "stopped").await;
    assert_eq!(stopped["last_stop"], "memory", "{stopped}");
    stack.request(&id, "start").await;
    stack.wait_state(&id, "running").await;
    let (_, out) = stack.exec(&id, &["kill", "-0", &pid]).await;
    assert_eq!(out["exit_code"], 0, "the counter was not kept: {out}");
    // A loaded machine runs gVisor's ptrace platform slowly: give the counter time to move
    // (0 while the file does not exist yet).
    let count = || async {
        stack.exec(&id, &["cat", "/root/count"]).await.1["stdout"]
            .as_str()
            .unwrap_or("")
            .trim()
            .parse::<u64>()
            .unwrap_or(0)
    };
    let before = count().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut after = before;
    while after <= before && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = count().await;
    }
    assert!(after > before, "not counting: {before} → {after}");

    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    assert_eq!(stack.leftovers(&id), Vec::<String>::new());
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_python_sandbox_runs_python3_and_keeps_its_interpreter_across_a_stop(db: PgPool) {
    // Built once per machine (debootstrap from apt's mirror); a no-op when cached.
    let cache = std::path::Path::new(berth_hostd::template::DEFAULT_TEMPLATE_CACHE);
    berth_hostd::template::build_cached("python", cache)
        .await
        .expect("build the python template");
    let stack = Stack::start(db, 1).await;
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "python", "vcpus": 1, "memory_mib": 512})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    let (status, out) = stack
        .exec(&id, &["python3", "-c", "print(sum(range(10)))"])
        .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["stdout"], "45\n", "{out}");

    // A python process holding state in memory survives a stop/start.
    let (_, out) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({
                "cmd": ["sh", "-c", "python3 -c \"import time\nx = 0\nwhile True:\n    x += 1\n    open('/root/x', 'w').write(str(x))\n    time.sleep(0.1)\n\" </dev/null >/dev/null 2>&1 & echo $!"],
            })),
        )
        .await;
    let pid = out["stdout"].as_str().unwrap().trim().to_owned();
    tokio::time::sleep(Duration::from_millis(800)).await;
    stack.request(&id, "stop").await;
    let stopped = stack.wait_state(&id, "stopped").await;
    assert_eq!(stopped["last_stop"], "memory", "{stopped}");
    stack.request(&id, "start").await;
    stack.wait_state(&id, "running").await;
    // Debian minbase has no kill binary; the shell's builtin does.
    let (_, out) = stack
        .exec(&id, &["sh", "-c", &format!("kill -0 {pid}")])
        .await;
    assert_eq!(
        out["exit_code"], 0,
        "the python process was not kept: {out}"
    );

    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    assert_eq!(stack.leftovers(&id), Vec::<String>::new());
    stack.teardown().await;
}
