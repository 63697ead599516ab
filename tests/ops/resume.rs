//! Restore, clone and fork on the real stack (issue 13 items 5–8): files written before a
//! snapshot come back and files written after it are gone, on runc and on gVisor (where the
//! snapshot's processes continue); a clone on another host fetches its content from the object
//! store; a gVisor fork's counter continues in every fork and the forks are independent; the
//! request × state refusals; a delete during `resuming`; hostd killed mid-clone, mid-snapshot
//! and mid-restore converges.

use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};

use crate::support::http::{host_of, running_sandbox};
use crate::support::{eventually, Stack, SETTLE_TIMEOUT};

/// Polls the snapshot until it leaves `creating`; returns it.
async fn settled(stack: &Stack, id: &str) -> Value {
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    loop {
        let (status, body) = stack
            .call(Method::GET, &format!("/v1/snapshots/{id}"), None)
            .await;
        assert_eq!(status, 200, "{body}");
        if body["state"] != "creating" {
            return body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "snapshot {id} never settled: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A ready snapshot of `sandbox`; returns its id.
/// Takes a snapshot of `sandbox` and waits until it is `ready`; its id.
pub(crate) async fn ready_snapshot(stack: &Stack, sandbox: &str) -> String {
    let (status, body) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{sandbox}/snapshot"),
            None,
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let snapshot = settled(stack, body["id"].as_str().unwrap()).await;
    // The public reason names no host path; the host's log line does (which file, which tree).
    let why = || -> Vec<String> {
        stack
            .hosts
            .iter()
            .flat_map(|h| h.log_lines("snapshot failed"))
            .collect()
    };
    assert_eq!(
        snapshot["state"],
        "ready",
        "{snapshot}\nhost logs: {:#?}",
        why()
    );
    snapshot["id"].as_str().unwrap().to_owned()
}

/// Runs `script` with `sh -c` in `sandbox`; asserts it exits 0 and returns its stdout.
pub(crate) async fn run(stack: &Stack, sandbox: &str, script: &str) -> String {
    let (status, out) = stack.exec(sandbox, &["sh", "-c", script]).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["exit_code"], 0, "{script}: {out}");
    out["stdout"].as_str().unwrap().to_owned()
}

async fn post(stack: &Stack, path: &str, body: Value) -> (u16, Value) {
    stack.call(Method::POST, path, Some(body)).await
}

async fn generation(stack: &Stack, id: &str) -> i64 {
    sqlx::query_scalar("SELECT generation FROM sandboxes WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(&stack.db)
        .await
        .unwrap()
}

async fn gvisor_sandbox(stack: &Stack) -> String {
    let (status, body) = post(
        stack,
        "/v1/sandboxes",
        json!({"template": "base-gvisor", "vcpus": 1, "memory_mib": 256}),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    id
}

/// A counter in the background: its value in `/root/n` (disk) each 50 ms, its pid in
/// `/root/pid`. Each value is written beside the file and renamed over it, so a read never
/// finds the file truncated mid-write (an empty read failed this test under load).
pub(crate) const COUNTER: &str =
    "(i=0; while :; do i=$((i+1)); echo $i > /root/n.new; mv /root/n.new /root/n; \
                       sleep 0.05; done) </dev/null >/dev/null 2>&1 & echo $! > /root/pid";

/// The value [`COUNTER`] last wrote in `id`.
pub(crate) async fn count(stack: &Stack, id: &str) -> u64 {
    run(stack, id, "cat /root/n").await.trim().parse().unwrap()
}

/// Restore on `stack`'s sandbox `id`: a file from before the snapshot stays, one from after it
/// goes, the generation moves on, the sandbox passes `resuming`.
async fn restore_drops_what_came_after(stack: &Stack, id: &str, snapshot: &str) {
    let before = generation(stack, id).await;
    let (status, body) = post(
        stack,
        &format!("/v1/sandboxes/{id}/restore"),
        json!({ "snapshot_id": snapshot }),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], "resuming", "{body}");
    stack.wait_state(id, "running").await;
    assert!(generation(stack, id).await > before, "generation bumped");
    let out = run(
        stack,
        id,
        "cat /root/before; test -e /root/after && echo after-is-back || true",
    )
    .await;
    assert_eq!(out, "kept\n", "restore keeps the first, drops the second");
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_runc_restore_keeps_files_from_before_its_snapshot_and_drops_later_ones(
    db: sqlx::PgPool,
) {
    let stack = Stack::start(db.clone(), 1).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo kept > /root/before").await;
    let snapshot = ready_snapshot(&stack, &id).await;
    run(&stack, &id, "echo later > /root/after").await;
    restore_drops_what_came_after(&stack, &id, &snapshot).await;

    // A stopped sandbox is restored too (its capacity reserved again), and refusals.
    run(&stack, &id, "echo later > /root/after").await;
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    restore_drops_what_came_after(&stack, &id, &snapshot).await;
    stack.assert_no_capacity_drift().await;

    let path = format!("/v1/sandboxes/{id}/restore");
    let unknown = berth_schemas::ids::SnapshotId::new().to_string();
    let (status, body) = post(&stack, &path, json!({ "snapshot_id": unknown })).await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = post(&stack, &path, json!({ "snapshot_id": 7 })).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = post(&stack, &path, json!({ "snapshot_id": snapshot, "x": 1 })).await;
    assert_eq!(status, 400, "unknown fields are refused: {body}");
    // Another sandbox's snapshot is not this one's.
    let other = running_sandbox(&stack).await;
    let (status, body) = post(
        &stack,
        &format!("/v1/sandboxes/{other}/restore"),
        json!({ "snapshot_id": snapshot }),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    // While resuming, a second restore conflicts; a stop too.
    let (status, body) = post(&stack, &path, json!({ "snapshot_id": snapshot })).await;
    assert_eq!(status, 202, "{body}");
    let (status, body) = post(&stack, &path, json!({ "snapshot_id": snapshot })).await;
    if status == 409 {
        assert_eq!(body["error"]["state"], "resuming", "{body}");
    } else {
        // The first restore already finished on this fast path: a new one is accepted.
        assert_eq!(status, 202, "{body}");
    }
    stack.wait_state(&id, "running").await;
    // An Idempotency-Key binds the sandbox the path names: the same key and body on another
    // sandbox is a reuse (422), never the first sandbox's stored answer (an attacker's find:
    // restore, clone and fork fingerprinted the path template, not the id).
    let keyed = |sandbox: &str| {
        stack
            .http
            .post(stack.url(&format!("/v1/sandboxes/{sandbox}/restore")))
            .bearer_auth(&stack.key)
            .header("Idempotency-Key", "restore-once")
            .json(&json!({ "snapshot_id": snapshot }))
            .send()
    };
    assert_eq!(keyed(&id).await.unwrap().status(), 202);
    stack.wait_state(&id, "running").await;
    let reused = keyed(&other).await.unwrap();
    let status = reused.status().as_u16();
    let body: Value = reused.json().await.unwrap();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (422, Some("idempotency_key_reused")),
        "{body}"
    );
    // A snapshot still creating cannot be restored from.
    let creating = berth_schemas::ids::SnapshotId::new();
    sqlx::query(
        "INSERT INTO snapshots (id, org_id, sandbox_id, host_id, state, template, runtime, vcpus, memory_mib, disk_mib, command_id)
         SELECT $1, org_id, id, host_id, 'creating', template, runtime, 1, 256, 64, gen_random_uuid() FROM sandboxes WHERE id = $2::uuid",
    )
    .bind(creating)
    .bind(&id)
    .execute(&db)
    .await
    .unwrap();
    let (status, body) = post(&stack, &path, json!({ "snapshot_id": creating })).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["state"], "creating", "{body}");
    // Being deleted: 409.
    assert_eq!(stack.delete(&id).await.0, 202);
    let (status, body) = post(&stack, &path, json!({ "snapshot_id": snapshot })).await;
    assert_eq!(status, 409, "{body}");
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_gvisor_restore_continues_the_snapshots_processes_and_drops_later_files(
    db: sqlx::PgPool,
) {
    let stack = Stack::start(db.clone(), 1).await;
    let id = gvisor_sandbox(&stack).await;
    run(&stack, &id, &format!("echo kept > /root/before; {COUNTER}")).await;
    let pid = run(&stack, &id, "cat /root/pid").await;
    let snapshot = ready_snapshot(&stack, &id).await;
    let (_, body) = stack
        .call(Method::GET, &format!("/v1/snapshots/{snapshot}"), None)
        .await;
    assert_eq!(body["holds"], "disk_and_memory", "{body}");
    run(&stack, &id, "echo later > /root/after").await;
    restore_drops_what_came_after(&stack, &id, &snapshot).await;
    // The counter of the snapshot runs on: same process, still counting.
    run(&stack, &id, &format!("kill -0 {}", pid.trim())).await;
    let first = count(&stack, &id).await;
    eventually("the restored counter counts on", || async {
        count(&stack, &id).await > first
    })
    .await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_gvisor_fork_continues_the_counter_in_every_fork_and_the_forks_are_independent(
    db: sqlx::PgPool,
) {
    let stack = Stack::start(db.clone(), 1).await;
    let id = gvisor_sandbox(&stack).await;
    run(&stack, &id, COUNTER).await;
    let pid = run(&stack, &id, "cat /root/pid").await;
    let (status, fork) = post(
        &stack,
        &format!("/v1/sandboxes/{id}/fork"),
        json!({"count": 2}),
    )
    .await;
    assert_eq!(status, 202, "{fork}");
    assert_eq!(fork["snapshot"]["state"], "creating", "{fork}");
    let forks: Vec<String> = fork["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            assert_eq!(s["state"], "resuming", "{s}");
            s["id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(forks.len(), 2);
    let mut addresses = Vec::new();
    for f in &forks {
        let running = stack.wait_state(f, "running").await;
        addresses.push(running["address"].as_str().unwrap().to_owned());
        run(&stack, f, &format!("kill -0 {}", pid.trim())).await;
        let first = count(&stack, f).await;
        eventually("the fork's counter counts on", || async {
            count(&stack, f).await > first
        })
        .await;
    }
    assert_ne!(addresses[0], addresses[1], "each fork has its own address");
    run(&stack, &forks[0], "echo mine > /root/only-in-0").await;
    let out = run(
        &stack,
        &forks[1],
        "test -e /root/only-in-0 && echo shared || echo independent",
    )
    .await;
    assert_eq!(out, "independent\n");
    let out = run(
        &stack,
        &id,
        "test -e /root/only-in-0 && echo shared || echo independent",
    )
    .await;
    assert_eq!(out, "independent\n");
    let snapshot = settled(&stack, fork["snapshot"]["id"].as_str().unwrap()).await;
    assert_eq!(snapshot["state"], "ready", "{snapshot}");
    // Out of range.
    for count in [0, 17] {
        let (status, body) = post(
            &stack,
            &format!("/v1/sandboxes/{id}/fork"),
            json!({ "count": count }),
        )
        .await;
        assert_eq!(status, 400, "{body}");
    }
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_clone_on_another_host_fetches_its_snapshot_from_the_object_store(db: sqlx::PgPool) {
    let mut stack = Stack::start(db.clone(), 0).await;
    // The first host fits one sandbox: the clone must go to the second.
    stack.add_host_with((Some(1), Some(256))).await;
    let id = running_sandbox(&stack).await;
    run(
        &stack,
        &id,
        "echo kept > /root/before && head -c 2000000 /dev/urandom > /root/blob && md5sum /root/blob > /root/sum",
    )
    .await;
    let snapshot = ready_snapshot(&stack, &id).await;
    run(&stack, &id, "echo later > /root/after").await;
    stack.add_host().await;
    let (status, clone) = post(
        &stack,
        &format!("/v1/sandboxes/{id}/clone"),
        json!({ "snapshot_id": snapshot }),
    )
    .await;
    assert_eq!(status, 202, "{clone}");
    assert_eq!(clone["state"], "resuming", "{clone}");
    let clone_id = clone["id"].as_str().unwrap().to_owned();
    assert_ne!(clone_id, id);
    stack.wait_state(&clone_id, "running").await;
    assert_ne!(host_of(&stack, &clone_id).await, host_of(&stack, &id).await);
    let out = run(
        &stack,
        &clone_id,
        "cat /root/before; md5sum -c /root/sum >/dev/null && echo intact; test -e /root/after && echo after || true",
    )
    .await;
    assert_eq!(out, "kept\nintact\n");
    // The second host fetched the chunks into its own cache.
    let cache = stack.hosts[1].state_dir.join("chunk-cache");
    let cached = std::fs::read_dir(&cache)
        .map(|d| d.count())
        .unwrap_or_default();
    assert!(cached > 0, "{} holds the fetched chunks", cache.display());

    // The create form: a clone of a snapshot, settings of its own; size fields refused.
    let (status, body) = post(
        &stack,
        "/v1/sandboxes",
        json!({ "snapshot_id": snapshot, "template": "base" }),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = post(
        &stack,
        "/v1/sandboxes",
        json!({ "snapshot_id": berth_schemas::ids::SnapshotId::new().to_string() }),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    // The source can go: its snapshot stays, and a delete during `resuming` is accepted.
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    let (status, body) = post(
        &stack,
        "/v1/sandboxes",
        json!({ "snapshot_id": snapshot, "metadata": {"from": "snapshot"} }),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], "resuming", "{body}");
    let doomed = body["id"].as_str().unwrap().to_owned();
    let (status, body) = stack.delete(&doomed).await;
    assert_eq!(status, 202, "{body}");
    stack.wait_state(&doomed, "deleted").await;
    eventually("the deleted clone left nothing", || async {
        stack.leftovers(&doomed).is_empty()
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// Waits until host `index` killed itself at its crash point, then starts it again without it.
pub(crate) async fn restart_after_crash(stack: &mut Stack, index: usize, what: &str) {
    let child = stack.hosts[index].child.as_mut().unwrap();
    let exited = tokio::time::timeout(SETTLE_TIMEOUT, child.wait()).await;
    assert!(exited.is_ok(), "hostd never crashed at {what}");
    stack.hosts[index].child = None;
    stack.hosts[index].env.clear();
    stack.restart_host(index).await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn hostd_killed_mid_clone_and_mid_snapshot_converges_without_orphans(db: sqlx::PgPool) {
    use berth_hostd::fault::{crash_at, Step, CRASH_AT_ENV};
    use berth_schemas::CommandKind;
    let mut stack = Stack::start(db.clone(), 0).await;
    // The first host fits one sandbox: the clone goes to the second, which crashes.
    stack.add_host_with((Some(1), Some(256))).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo kept > /root/before").await;
    let snapshot = ready_snapshot(&stack, &id).await;
    let crash = |kind, step| vec![(CRASH_AT_ENV.to_owned(), crash_at(kind, step))];
    let crashing = stack
        .add_host_env(
            (None, None),
            &[],
            None,
            crash(CommandKind::Clone, Step::Seeded),
        )
        .await;
    let (status, body) = post(
        &stack,
        &format!("/v1/sandboxes/{id}/clone"),
        json!({ "snapshot_id": snapshot }),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    let clone = body["id"].as_str().unwrap().to_owned();
    restart_after_crash(&mut stack, crashing, "clone:seeded").await;
    stack.wait_state(&clone, "running").await;
    assert_eq!(run(&stack, &clone, "cat /root/before").await, "kept\n");

    // Mid-snapshot: the snapshot is redelivered and finishes; the sandbox runs on.
    stack.hosts[crashing].stop(false).await;
    stack.hosts[crashing].env = crash(CommandKind::Snapshot, Step::Captured);
    stack.restart_host(crashing).await;
    let (status, body) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{clone}/snapshot"),
            None,
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let taken = body["id"].as_str().unwrap().to_owned();
    restart_after_crash(&mut stack, crashing, "snapshot:captured").await;
    let taken = settled(&stack, &taken).await;
    assert_eq!(taken["state"], "ready", "redelivered and finished: {taken}");
    stack.wait_state(&clone, "running").await;
    assert_eq!(run(&stack, &clone, "cat /root/before").await, "kept\n");

    for sandbox in [&clone, &id] {
        assert_eq!(stack.delete(sandbox).await.0, 202);
        stack.wait_state(sandbox, "deleted").await;
        eventually("nothing of the sandbox is left", || async {
            stack.leftovers(sandbox).is_empty()
        })
        .await;
    }
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

/// Containers in host `index`'s runc root.
fn containers(stack: &Stack, index: usize) -> Vec<String> {
    let out = std::process::Command::new("runc")
        .arg("--root")
        .arg(stack.hosts[index].runc_root())
        .args(["list", "-q"])
        .output()
        .unwrap();
    assert!(out.status.success(), "runc list: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn hostd_killed_mid_restore_converges_to_the_snapshot_without_orphans(db: sqlx::PgPool) {
    use berth_hostd::fault::{crash_at, Step, CRASH_AT_ENV};
    use berth_schemas::CommandKind;
    let mut stack = Stack::start(db.clone(), 1).await;
    let host = 0;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo kept > /root/before").await;
    let snapshot = ready_snapshot(&stack, &id).await;
    // The host kills itself (SIGKILL) mid-restore: once the disk is seeded (the old container
    // destroyed, the new one not booted), then once the new container exists (its agent not
    // yet asked).
    for step in [Step::Seeded, Step::Container] {
        let what = crash_at(CommandKind::Restore, step);
        stack.hosts[host].stop(false).await;
        // Its object store stays the stack's: the snapshot is there.
        stack.hosts[host].env.retain(|(k, _)| k != CRASH_AT_ENV);
        let env = (CRASH_AT_ENV.to_owned(), what.clone());
        stack.hosts[host].env.push(env);
        stack.restart_host(host).await;
        // A restarted host heartbeats before its agent responder is up: 503 until then.
        eventually("the restarted host answers exec", || async {
            let (status, _) = stack.exec(&id, &["true"]).await;
            status == 200
        })
        .await;
        run(&stack, &id, "echo later > /root/after").await;
        let before = generation(&stack, &id).await;
        let (status, body) = post(
            &stack,
            &format!("/v1/sandboxes/{id}/restore"),
            json!({ "snapshot_id": snapshot }),
        )
        .await;
        assert_eq!(status, 202, "{body}");
        assert_eq!(body["state"], "resuming", "{body}");
        let child = stack.hosts[host].child.as_mut().unwrap();
        let exited = tokio::time::timeout(SETTLE_TIMEOUT, child.wait()).await;
        assert!(exited.is_ok(), "hostd never crashed at {what}");
        stack.hosts[host].child = None;
        stack.hosts[host].env.retain(|(k, _)| k != CRASH_AT_ENV);
        stack.restart_host(host).await;

        // The redelivered restore starts again from the snapshot and finishes.
        stack.wait_state(&id, "running").await;
        assert!(
            generation(&stack, &id).await > before,
            "{what}: generation bumped"
        );
        let out = run(
            &stack,
            &id,
            "cat /root/before; test -e /root/after && echo after-is-back || true",
        )
        .await;
        assert_eq!(out, "kept\n", "{what}: running from the snapshot");
        let running = containers(&stack, host);
        assert_eq!(
            running.len(),
            1,
            "{what}: one container, the sandbox's: {running:?}"
        );
        assert!(stack.container_exists(&id), "{what}: {running:?}");
        stack.assert_no_capacity_drift().await;
    }

    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    eventually("nothing of the sandbox is left", || async {
        stack.leftovers(&id).is_empty()
    })
    .await;
    assert!(containers(&stack, host).is_empty(), "no orphan container");
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_clone_whose_host_never_answers_fails_with_a_reason_is_destroyed_and_starts_from_its_snapshot(
    db: sqlx::PgPool,
) {
    let config = berth_reconciler::pass::PassConfig {
        interval: Duration::from_millis(100),
        create_timeout: Duration::from_secs(30),
        ..berth_reconciler::pass::PassConfig::default()
    };
    let stack = Stack::start_with(db.clone(), 1, config).await;
    let id = running_sandbox(&stack).await;
    run(&stack, &id, "echo seeded > /root/seed").await;
    let snapshot = ready_snapshot(&stack, &id).await;
    stack.hosts[0].freeze();
    let (status, body) = post(
        &stack,
        &format!("/v1/sandboxes/{id}/clone"),
        json!({ "snapshot_id": snapshot }),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    let clone = body["id"].as_str().unwrap().to_owned();
    // Its snapshot cannot be deleted while the clone is resuming from it (an attacker deleted
    // one under three booting clones, and they failed on missing content).
    let (status, body) = stack
        .call(Method::DELETE, &format!("/v1/snapshots/{snapshot}"), None)
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("still resuming"),
        "{body}"
    );
    let failed = stack.wait_state(&clone, "failed-start").await;
    let reason = failed["state_reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("timeout") && reason.contains("sandbox.clone"),
        "{failed}"
    );
    stack.hosts[0].thaw();
    // The host clones late, then applies the compensation the timeout queued: a delete.
    eventually("the late clone's compensation is applied", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM commands WHERE sandbox_id = $1::uuid
                 AND kind = 'sandbox.delete' AND completed_at IS NOT NULL)",
        )
        .bind(&clone)
        .fetch_one(&db)
        .await
        .unwrap()
    })
    .await;
    assert!(!stack.container_exists(&clone), "destroyed");
    assert_eq!(stack.state_of(&clone).await, "failed-start");
    stack.assert_no_capacity_drift().await;

    // It never ran, so it has no disk of its own: a start boots it from its snapshot again,
    // with the snapshot's files (it booted the bare template without them).
    let (status, body) = stack.request(&clone, "start").await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["state"], "resuming", "{body}");
    stack.wait_state(&clone, "running").await;
    assert_eq!(run(&stack, &clone, "cat /root/seed").await, "seeded\n");
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}
