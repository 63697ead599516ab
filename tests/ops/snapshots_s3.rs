//! Snapshots on a real S3 server (`s3s-fs`, as `.ci/run` installs it; `BERTH_S3S_FS`
//! overrides the path) behind a host: the server stopped mid-upload fails the snapshot, the
//! sandbox is untouched and nothing is reported ready; started again, the next snapshot is ready
//! and a clone of it runs.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};

use crate::support::http::running_sandbox;
use crate::support::{Stack, SETTLE_TIMEOUT};

/// Where `.ci/run` installs `s3s-fs`.
const S3S_FS_DEFAULT: &str = "/var/tmp/berth-tools/bin/s3s-fs";
const ACCESS_KEY: &str = "berth-test";
const SECRET_KEY: &str = "berth-test-secret";
const BUCKET: &str = "berth";

/// A real `s3s-fs` serving `root` on a loopback port; killed on drop.
struct S3 {
    child: Option<Child>,
    root: PathBuf,
    port: u16,
}

impl S3 {
    fn start(root: &Path, port: Option<u16>) -> S3 {
        let bin = std::env::var("BERTH_S3S_FS").unwrap_or_else(|_| S3S_FS_DEFAULT.to_owned());
        assert!(
            Path::new(&bin).is_file(),
            "this test needs s3s-fs at {bin}: `cargo install s3s-fs@0.14.1 --features binary \
             --locked --root /var/tmp/berth-tools`, as .ci/run does"
        );
        std::fs::create_dir_all(root.join(BUCKET)).unwrap();
        let port = port.unwrap_or_else(|| {
            TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        });
        let child = Command::new(&bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(started.elapsed() < SETTLE_TIMEOUT, "s3s-fs never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        S3 {
            child: Some(child),
            root: root.to_owned(),
            port,
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A host's environment for this server's bucket.
    fn env(&self) -> Vec<(String, String)> {
        [
            ("BERTH_OBJECT_STORE", format!("s3://{BUCKET}/snapshots")),
            ("AWS_ENDPOINT", format!("http://127.0.0.1:{}", self.port)),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Files the server holds below `dir` of its bucket (`snapshots/chunks`, …).
    fn files(&self, dir: &str) -> usize {
        walkdir(&self.root.join(BUCKET).join(dir))
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        self.kill();
    }
}

fn walkdir(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| {
            let path = e.path();
            if path.is_dir() {
                walkdir(&path)
            } else {
                1
            }
        })
        .sum()
}

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
        assert!(tokio::time::Instant::now() < deadline, "{body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_s3_server_stopped_mid_upload_fails_the_snapshot_and_never_the_sandbox(
    db: sqlx::PgPool,
) {
    let mut stack = Stack::start(db.clone(), 0).await;
    let mut s3 = S3::start(&stack.root.join("s3"), None);
    stack.add_host_env((None, None), &[], None, s3.env()).await;
    let id = running_sandbox(&stack).await;
    // 15 incompressible 4 MiB chunks: the upload takes many requests.
    let (status, out) = stack
        .exec(
            &id,
            &[
                "sh",
                "-c",
                "head -c 60000000 /dev/urandom > /root/big && echo kept > /root/f",
            ],
        )
        .await;
    assert_eq!((status, &out["exit_code"]), (200, &json!(0)), "{out}");
    let (status, body) = stack
        .call(Method::POST, &format!("/v1/sandboxes/{id}/snapshot"), None)
        .await;
    assert_eq!(status, 202, "{body}");
    let first = body["id"].as_str().unwrap().to_owned();
    // Stop the server as soon as the first chunk landed.
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    while s3.files("snapshots/chunks") == 0 {
        assert!(Instant::now() < deadline, "no chunk was ever uploaded");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    s3.kill();
    let failed = settled(&stack, &first).await;
    assert_eq!(failed["state"], "failed", "{failed}");
    assert!(failed.get("stored_bytes").is_none(), "{failed}");
    assert_eq!(
        s3.files("snapshots/manifests"),
        0,
        "no manifest: nothing durable"
    );
    assert_eq!(
        stack.state_of(&id).await,
        "running",
        "the sandbox is untouched"
    );
    let (status, out) = stack.exec(&id, &["cat", "/root/f"]).await;
    assert_eq!(
        (status, out["stdout"].as_str()),
        (200, Some("kept\n")),
        "{out}"
    );
    let ready: i64 = sqlx::query_scalar("SELECT count(*) FROM snapshots WHERE state = 'ready'")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(ready, 0, "nothing reported ready");

    // The server back: the next snapshot is ready, and a clone of it runs with the files.
    let _s3 = S3::start(&s3.root, Some(s3.port));
    let (status, body) = stack
        .call(Method::POST, &format!("/v1/sandboxes/{id}/snapshot"), None)
        .await;
    assert_eq!(status, 202, "{body}");
    let second = settled(&stack, body["id"].as_str().unwrap()).await;
    assert_eq!(second["state"], "ready", "{second}");
    let (status, clone) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/clone?wait=running&timeout=120s"),
            Some(json!({ "snapshot_id": second["id"] })),
        )
        .await;
    assert_eq!(status, 200, "{clone}");
    let (status, out) = stack
        .exec(clone["id"].as_str().unwrap(), &["cat", "/root/f"])
        .await;
    assert_eq!(
        (status, out["stdout"].as_str()),
        (200, Some("kept\n")),
        "{out}"
    );
    stack.teardown().await;
}
