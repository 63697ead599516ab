//! Cleanup that runs even when a test panics: what a hostd of a test made on this machine
//! (containers, network namespaces, veths, overlay mounts, its nftables table) is found by
//! the host's id and state dir and removed from `Drop`, synchronously.
//!
//! Every host a test starts is also written to `<test root>/hosts` (one line: host id,
//! nftables table, state dir), so `.ci/run` can check after the run that nothing of any of
//! them is left.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use berth_schemas::{HostId, SandboxId, Subjects};

use super::env::{run_quietly, unique};

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

/// The container ids `<runtime> --root <root> list` shows (no header).
fn containers(runtime: &str, root: &Path) -> Vec<String> {
    if !root.exists() {
        return Vec::new();
    }
    run_quietly(runtime, &["--root", &root.to_string_lossy(), "list"])
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

/// The sandboxes whose network (veth or namespace) carries `host`'s owner alias
/// (`berth:<host>:<sandbox>`, see hostd's `netns::owner_alias`).
fn networks_of(host: HostId) -> Vec<SandboxId> {
    let owned = |text: &str| -> Vec<SandboxId> {
        let marker = format!("alias berth:{host}:");
        text.lines()
            .filter_map(|l| {
                let rest = &l[l.find(&marker)? + marker.len()..];
                rest.split_whitespace().next()?.parse().ok()
            })
            .collect()
    };
    let mut found = owned(&run_quietly("ip", &["-o", "link", "show"]));
    for netns in run_quietly("ip", &["netns", "list"]).lines() {
        let Some(name) = netns.split_whitespace().next() else {
            continue;
        };
        if name.starts_with("berth-") {
            found.extend(owned(&run_quietly(
                "ip",
                &["-n", name, "-o", "link", "show", "lo"],
            )));
        }
    }
    found.sort_by_key(|s| s.as_uuid());
    found.dedup();
    found
}

/// Mount points at or below `dir`, deepest first.
fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    let table = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut points: Vec<PathBuf> = table
        .lines()
        .filter_map(|l| l.split(' ').nth(1))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points
}

/// Removes everything of `host` on this machine: its containers (runc and runsc roots in
/// `state_dir`), the networks marked as its own, the mounts below `state_dir` and its
/// nftables table. Returns what it removed. Call it only after the host's hostd stopped.
pub fn remove_host_leftovers(host: HostId, state_dir: &Path) -> Vec<String> {
    let mut removed = Vec::new();
    if state_dir.as_os_str().is_empty() {
        return removed;
    }
    for runtime in ["runc", "runsc"] {
        let root = state_dir.join(runtime);
        for id in containers(runtime, &root) {
            run_quietly(
                runtime,
                &["--root", &root.to_string_lossy(), "delete", "--force", &id],
            );
            removed.push(format!("{runtime} container {id}"));
        }
    }
    for sandbox in networks_of(host) {
        let names = berth_hostd::layout::SandboxNames::derive(host, sandbox);
        run_quietly("ip", &["link", "delete", &names.veth_host]);
        run_quietly("ip", &["netns", "delete", &names.netns]);
        removed.push(format!("network of {sandbox} ({})", names.netns));
    }
    for point in mounts_below(state_dir) {
        if nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH).is_ok() {
            removed.push(format!("mount {}", point.display()));
        }
    }
    let table = berth_hostd::layout::firewall_table(host);
    if run_quietly("nft", &["list", "tables"]).contains(&table) {
        run_quietly("nft", &["delete", "table", "inet", &table]);
        removed.push(format!("nftables table {table}"));
    }
    removed
}

/// Removes `dir` unless something is still mounted below it (a recursive delete through a
/// leaked overlay would delete the lower layers too).
pub fn remove_dir_unless_mounted(dir: &Path) {
    if mounts_below(dir).is_empty() {
        let _ = std::fs::remove_dir_all(dir);
    } else {
        eprintln!(
            "leaving {} in place: something is still mounted below it",
            dir.display()
        );
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
