//! Files and exec through the API into a real sandbox: a 1 MiB file round trip, exec with
//! env, cwd and stdin, streamed exec, and templates imported from a rootfs tarball.

use std::time::Duration;

use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;

use crate::support::Stack;

/// Bytes of the file of the round trip: 1 MiB and a bit, so it spans several NATS messages.
const ROUND_TRIP_BYTES: usize = (1 << 20) + 12_345;

/// Deterministic, incompressible-looking bytes.
pub(crate) fn pattern(len: usize) -> Vec<u8> {
    let mut x: u32 = 0x9e37_79b9;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 24) as u8
        })
        .collect()
}

fn files_url(stack: &Stack, id: &str, path: &str) -> String {
    stack.url(&format!("/v1/sandboxes/{id}/files?path={path}"))
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_one_mib_file_round_trips_through_the_api_and_exec_takes_env_cwd_and_stdin(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;

    let data = pattern(ROUND_TRIP_BYTES);
    let put = stack
        .http
        .put(files_url(&stack, &id, "/root/data/blob.bin"))
        .bearer_auth(&stack.key)
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    let written: serde_json::Value = put.json().await.unwrap();
    assert_eq!(written["size"], ROUND_TRIP_BYTES as u64, "{written}");

    let got = stack
        .http
        .get(files_url(&stack, &id, "/root/data/blob.bin"))
        .bearer_auth(&stack.key)
        .send()
        .await
        .unwrap();
    assert_eq!(got.status(), 200);
    assert_eq!(got.headers()["content-type"], "application/octet-stream");
    let back = got.bytes().await.unwrap();
    assert_eq!(back.len(), data.len());
    assert!(back.as_ref() == data.as_slice(), "the bytes differ");
    // The sandbox sees the same file.
    let (_, out) = stack.exec(&id, &["wc", "-c", "/root/data/blob.bin"]).await;
    assert!(
        out["stdout"]
            .as_str()
            .unwrap()
            .starts_with(&ROUND_TRIP_BYTES.to_string()),
        "{out}"
    );

    // A directory reads as a JSON listing, without the upload's temporary file.
    let (status, listing) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/root/data"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{listing}");
    let entries = listing["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{listing}");
    assert_eq!(entries[0]["name"], "blob.bin");
    assert_eq!(entries[0]["type"], "file");
    assert_eq!(entries[0]["size"], ROUND_TRIP_BYTES as u64);

    // A PUT onto a directory, or with a name too long to write aside first, is refused
    // before anything is written: no temporary sibling is left behind.
    for (path, why) in [
        ("/root/data".to_owned(), "a directory"),
        (format!("/root/data/{}", "n".repeat(250)), "a name too long"),
    ] {
        let put = stack
            .http
            .put(files_url(&stack, &id, &path))
            .bearer_auth(&stack.key)
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(put.status(), 400, "a PUT onto {why}");
    }
    let (_, listing) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/root"),
            None,
        )
        .await;
    let names: Vec<&str> = listing["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(
        names.iter().all(|n| !n.contains("berth-upload")),
        "{names:?}"
    );

    // Missing paths are 404, relative ones 400.
    let (status, body) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/nope"),
            None,
        )
        .await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=etc"),
            None,
        )
        .await;
    assert_eq!(status, 400, "{body}");

    // Exec with env, cwd and stdin.
    let (status, out) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({
                "cmd": ["sh", "-c", "echo $GREETING; pwd; cat"],
                "env": {"GREETING": "hello"},
                "cwd": "/root/data",
                "stdin": "piped in",
            })),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["stdout"], "hello\n/root/data\npiped in");
    assert_eq!(out["oom_killed"], false);

    // A memory hog is killed, and the exec says so.
    let (status, out) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": ["dd", "if=/dev/zero", "of=/dev/null", "bs=400M", "count=1"]})),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["exit_code"], 137, "{out}");
    assert_eq!(out["oom_killed"], true, "{out}");

    // Files of a stopped sandbox are a conflict.
    stack.request(&id, "stop").await;
    stack.wait_state(&id, "stopped").await;
    let (status, body) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/"),
            None,
        )
        .await;
    assert_eq!(status, 409, "{body}");
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_template_imported_from_a_rootfs_tarball_runs_sandboxes(db: PgPool) {
    // A root filesystem: the host's static busybox, a shell link and a marker file.
    let work = std::env::temp_dir().join(format!("berth-import-{}", uuid::Uuid::new_v4()));
    let rootfs = work.join("rootfs");
    for dir in ["bin", "etc", "proc", "sys", "dev", "tmp", "root"] {
        std::fs::create_dir_all(rootfs.join(dir)).unwrap();
    }
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    std::fs::write(rootfs.join("etc/imported"), "from a tarball\n").unwrap();
    let tarball = work.join("rootfs.tar.gz");
    let status = std::process::Command::new("tar")
        .arg("-C")
        .arg(&rootfs)
        .arg("-czf")
        .arg(&tarball)
        .arg(".")
        .status()
        .unwrap();
    assert!(status.success());

    let name = format!(
        "imported-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let cache = std::path::Path::new(berth_hostd::template::DEFAULT_TEMPLATE_CACHE);
    berth_hostd::template::import_rootfs(&name, &tarball, "runc", "test import", cache).unwrap();
    let stack = Stack::start(db, 1).await;
    berth_api::templates::register(&stack.db, &name, "test import", "runc")
        .await
        .unwrap();

    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": name, "vcpus": 1, "memory_mib": 128})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    let (_, out) = stack.exec(&id, &["cat", "/etc/imported"]).await;
    assert_eq!(out["stdout"], "from a tarball\n", "{out}");
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
    let _ = std::fs::remove_dir_all(cache.join(&name));
    let _ = std::fs::remove_dir_all(&work);
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_streamed_exec_sends_output_while_the_process_runs(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let started = std::time::Instant::now();
    let mut response = stack
        .http
        .post(stack.url(&format!("/v1/sandboxes/{id}/exec/stream")))
        .bearer_auth(&stack.key)
        .json(&json!({"cmd": ["sh", "-c", "echo one; sleep 2; echo two >&2; exit 3"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/x-ndjson");
    let mut text = String::new();
    let mut first_line_at = None;
    while let Some(chunk) = response.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
        if first_line_at.is_none() && text.contains('\n') {
            first_line_at = Some(started.elapsed());
        }
    }
    let ended_at = started.elapsed();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines,
        [
            json!({"stdout": "one\n"}),
            json!({"stderr": "two\n"}),
            json!({"exit_code": 3, "timed_out": false, "oom_killed": false}),
        ]
    );
    assert!(
        ended_at - first_line_at.unwrap() >= Duration::from_secs(1),
        "the first line came only at the end ({first_line_at:?} of {ended_at:?})"
    );

    // A sandbox that is not running is refused before anything streams.
    stack.request(&id, "stop").await;
    stack.wait_state(&id, "stopped").await;
    let (status, body) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec/stream"),
            Some(json!({"cmd": ["true"]})),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}
