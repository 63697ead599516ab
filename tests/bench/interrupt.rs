//! `berth bench` (the real-runtime mode) interrupted by SIGINT, as a terminal's Ctrl-C does:
//! it stops measuring, deletes every sandbox it made, removes its bundle dirs, and exits 130
//! with one line saying so (no backtrace). Once while its sandboxes run, once in the floors
//! phase (its raw-runc bundle dir exists).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::support::Stack;

/// How long the test waits for the bench to reach the moment it interrupts, and to exit after.
const PATIENCE: Duration = Duration::from_secs(180);

/// The bench on `stack`, the runc parts only, `--sandboxes n`.
fn bench(stack: &Stack, n: &str) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(["bench", "--sandboxes", n, "--burst", "2"])
        .args(["--gvisor-template", "", "--podman-pairs", "0"])
        .args(["--runsc-floor-samples", "0"])
        .args(["--api", &stack.base, "--key", &stack.key])
        .arg("--state-dir")
        .arg(&stack.root)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// Waits until `ready` holds (checked every 20 ms), then sends SIGINT; returns the bench's
/// stderr after it exited 130 with the one-line message.
async fn interrupt_when(
    child: tokio::process::Child,
    mut ready: impl AsyncFnMut() -> bool,
) -> String {
    let deadline = Instant::now() + PATIENCE;
    while !ready().await {
        assert!(Instant::now() < deadline, "the bench never got there");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    crate::interrupt(child, PATIENCE).await
}

/// Sandboxes of the stack not deleted.
async fn left(db: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE deleted_at IS NULL")
        .fetch_one(db)
        .await
        .unwrap()
}

/// The bench's files named by its pid in /var/tmp and the temp dir.
fn files_of(pid: u32) -> Vec<PathBuf> {
    let prefix = format!("berth-bench-{pid}-");
    [PathBuf::from("/var/tmp"), std::env::temp_dir()]
        .iter()
        .flat_map(|dir| std::fs::read_dir(dir).into_iter().flatten().flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect()
}

/// The JetStream floor's streams of the bench `pid` still on the server.
async fn floor_streams(pid: u32) -> Vec<String> {
    use futures::TryStreamExt;
    let nats = async_nats::connect(crate::support::nats_url())
        .await
        .unwrap();
    let names: Vec<String> = async_nats::jetstream::new(nats)
        .stream_names()
        .try_collect()
        .await
        .unwrap();
    let prefix = format!("BENCH_FLOOR_{pid}_");
    names
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_interrupted_bench_deletes_its_sandboxes_and_dirs_and_says_so(db: PgPool) {
    let stack = Stack::start(db.clone(), 1).await;

    // While a sandbox of its runs.
    let child = bench(&stack, "3");
    let pid = child.id().unwrap();
    let running = async || {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE state = 'running'")
            .fetch_one(&db)
            .await
            .unwrap();
        n > 0
    };
    let stderr = interrupt_when(child, running).await;
    assert!(stderr.contains("deleting this run's sandboxes"), "{stderr}");
    assert_eq!(left(&db).await, 0, "every sandbox is deleted: {stderr}");
    assert_eq!(files_of(pid), Vec::<PathBuf>::new());

    // In the floors phase: its raw-runc bundle exists.
    let child = bench(&stack, "1");
    let pid = child.id().unwrap();
    let bundle = PathBuf::from(format!("/var/tmp/berth-bench-{pid}-runc"));
    let stderr = interrupt_when(child, async || bundle.join("config.json").exists()).await;
    assert_eq!(files_of(pid), Vec::<PathBuf>::new(), "{stderr}");
    assert_eq!(left(&db).await, 0, "{stderr}");
    assert_eq!(floor_streams(pid).await, Vec::<String>::new(), "{stderr}");
    stack.teardown().await;
}
