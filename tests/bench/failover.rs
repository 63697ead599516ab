//! `berth bench --failover` with one sample and a pass every 200 ms: a private control plane,
//! two real `berth hostd` children, a backed-up sandbox whose host is frozen until it runs on
//! the other host from its backup; the table has every failover row with real numbers, and the
//! run leaves nothing behind (its database, streams, hostd processes, state dirs).

use std::path::Path;
use std::process::Stdio;

use crate::storage::files_below;
use crate::support::cleanup::fresh_dir;
use crate::support::env::nats_url;

/// The rows the table must have, by the start of their name, and whether each has a floor.
const ROWS: &[(&str, bool)] = &[
    (
        "failover: due → restoring (waits for the next pass, every 200ms)",
        false,
    ),
    ("failover: restoring → running on the other host", true),
    ("failover: due → running on the other host", true),
    (
        "returning host: SIGCONT → stale copy destroyed, host ready",
        false,
    ),
    ("raw runc run", false),
];

#[tokio::test]
async fn the_failover_mode_measures_a_real_failover_and_leaves_nothing_behind() {
    let database_url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let dir = fresh_dir("failbench");
    let runs = dir.join("runs");
    let child = failover_bench(&dir, &database_url)
        .args(["--failover-host-lost-after", "3s", "--failover-after", "2s"])
        .spawn()
        .unwrap();
    let tag = format!("benchfail{}", child.id().unwrap());
    let out = child.wait_with_output().await.unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("Figures run from the moment the failover is due"),
        "{stdout}"
    );
    for floor in crate::assert_one_sample_table(&stdout, ROWS) {
        assert_eq!(floor, "raw runc run");
    }

    // Nothing left: no database, no streams, no hostd process, no state dir.
    assert_dropped(&database_url, &tag).await;
    let nats = async_nats::connect(nats_url()).await.unwrap();
    let streams: Vec<String> = {
        use futures::TryStreamExt;
        async_nats::jetstream::new(nats)
            .stream_names()
            .try_collect()
            .await
            .unwrap()
    };
    let stem = tag.to_uppercase();
    assert!(
        !streams.iter().any(|s| s.to_uppercase().starts_with(&stem)),
        "streams of {tag} are deleted: {streams:?}"
    );
    assert_eq!(
        processes_naming(&runs),
        Vec::<String>::new(),
        "no hostd is left"
    );
    assert!(!runs.exists(), "the run dirs are removed");
    assert_eq!(files_below(&dir), 0, "nothing is left in {}", dir.display());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `berth bench --failover` with one sample and a pass every 200 ms, its run dirs in
/// `dir/runs` and its state dir `dir/state`, on `database_url`'s server; output piped.
fn failover_bench(dir: &Path, database_url: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_berth"));
    command
        .args(["bench", "--failover", "--sandboxes", "1"])
        .args(["--failover-pass-interval", "200ms"])
        .arg("--failover-dir")
        .arg(dir.join("runs"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("DATABASE_URL", database_url)
        .env("NATS_URL", nats_url())
        .env_remove("BERTH_OBJECT_STORE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Asserts the run's database `tag` was dropped from `database_url`'s server.
async fn assert_dropped(database_url: &str, tag: &str) {
    let db = sqlx::PgPool::connect(database_url).await.unwrap();
    let databases: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
        .bind(tag)
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(databases, 0, "database {tag} is dropped");
    db.close().await;
}

/// The command lines of the processes that name `dir` in theirs.
fn processes_naming(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
        .filter(|cmdline| cmdline.contains(&needle))
        .collect()
}

/// SIGINT (a terminal's Ctrl-C) while the hostd children run: the run ends with one line and
/// exit 130 (no backtrace, even with `RUST_BACKTRACE=1`), and leaves nothing: no run dir (logs
/// and object store included), no database, no hostd.
#[tokio::test]
async fn an_interrupted_failover_run_says_so_in_one_line_and_leaves_nothing() {
    let database_url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let dir = fresh_dir("failbench-int");
    let runs = dir.join("runs");
    let child = failover_bench(&dir, &database_url)
        .env("RUST_BACKTRACE", "1")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let tag = format!("benchfail{pid}");
    let last_log = runs.join(&tag).join("host1.log");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !last_log.exists() {
        assert!(std::time::Instant::now() < deadline, "no hostd started");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let stderr = crate::interrupt(child, std::time::Duration::from_secs(120)).await;
    assert!(!runs.exists(), "the run dir is removed: {stderr}");
    assert_eq!(processes_naming(&runs), Vec::<String>::new());
    assert_dropped(&database_url, &tag).await;
    assert_eq!(files_below(&dir), 0, "nothing is left in {}", dir.display());
    std::fs::remove_dir_all(&dir).unwrap();
}
