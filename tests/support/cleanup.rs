//! Cleanup that runs even when a test panics: what a hostd of a test made on this machine
//! (containers, network namespaces, veths, overlay mounts, its nftables table) is found by
//! the host's id and state dir and removed from `Drop`, synchronously.
//!
//! Every host a test starts is also written to `<test root>/hosts` (one line: host id,
//! nftables table, state dir), so `.ci/run` can check after the run that nothing of any of
//! them is left.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use berth_schemas::{HostId, Subjects};

#[allow(unused_imports)]
pub use berth::host_leftovers::{remove_dir_unless_mounted, remove_host_leftovers};

use super::env::unique;

/// Environment variable naming the directory below which tests keep their state; default
/// [`DEFAULT_TEST_ROOT`]. `.ci/run` sets one per run.
pub const TEST_ROOT_ENV: &str = "BERTH_TEST_ROOT";
/// Where tests keep their state when [`TEST_ROOT_ENV`] is unset.
pub const DEFAULT_TEST_ROOT: &str = "/var/tmp/berth-tests";

/// The directory below which this run's tests keep their state.
pub fn test_root() -> PathBuf {
    std::env::var_os(TEST_ROOT_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_TEST_ROOT))
}

/// A fresh directory `<test root>/<kind>-<12 hex>`.
pub fn fresh_dir(kind: &str) -> PathBuf {
    let dir = test_root().join(format!("{kind}-{}", unique()));
    std::fs::create_dir_all(&dir).expect("create a test state dir");
    dir
}

/// Notes that `host` runs with `state_dir`, for the check at the end of `.ci/run`.
pub fn register_host(host: HostId, state_dir: &Path) {
    let table = berth_hostd::layout::firewall_table(host);
    let line = format!("{host} {table} {}\n", state_dir.display());
    let path = test_root().join("hosts");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = f.write_all(line.as_bytes());
    }
}

/// Deletes the JetStream streams of `subjects`, from a thread of its own, so it works from
/// `Drop` during a panic (inside or outside a runtime).
pub fn delete_streams_blocking(subjects: &Subjects) {
    let subjects = subjects.clone();
    let _ = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            let connect = async_nats::connect(super::env::nats_url());
            if let Ok(Ok(nats)) =
                tokio::time::timeout(std::time::Duration::from_secs(10), connect).await
            {
                let js = async_nats::jetstream::new(nats);
                berth_schemas::streams::delete_streams(&js, &subjects).await;
            }
        });
    })
    .join();
}

/// Drops the test database `name` (closing its connections), from a thread of its own, so it
/// works from `Drop` during a panic. `#[sqlx::test]` drops a database only after a test that
/// passed.
pub fn drop_database_blocking(name: &str) {
    let statement = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
    let _ = std::thread::spawn(move || {
        let Ok(url) = std::env::var("DATABASE_URL") else {
            return;
        };
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            use sqlx::Connection as _;
            if let Ok(mut conn) = sqlx::PgConnection::connect(&url).await {
                let _ = sqlx::query(&statement).execute(&mut conn).await;
            }
        });
    })
    .join();
}
