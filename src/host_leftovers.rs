//! What a `berth hostd` child process leaves on this machine, and its removal: its containers
//! (runc and runsc roots in its state dir), the networks marked as its own, the mounts below
//! its state dir and its nftables table; and a free /16 for the sandbox addresses of a new one.
//! The end-to-end tests' hosts and `berth bench --failover`'s hosts are such children
//! ([`crate::hostd_child::HostdChild`]); both clean up through here, synchronously (from `Drop`
//! too).

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use berth_schemas::{HostId, SandboxId};

/// Runs `program args`, ignoring its stderr and exit status; its stdout (empty when it could
/// not run).
pub fn run_quietly(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .stderr(std::process::Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// The second octets of the /16s the hosts of this process hold.
fn pools_taken() -> MutexGuard<'static, BTreeSet<u8>> {
    static TAKEN: Mutex<BTreeSet<u8>> = Mutex::new(BTreeSet::new());
    TAKEN.lock().unwrap_or_else(|p| p.into_inner())
}

/// A random /16 in 10.64.0.0/10 for a new host's sandbox addresses that no other host of this
/// process holds and no interface of the machine has an address in (another process's
/// sandboxes). Two hosts on one machine with one pool would give two sandboxes one address
/// behind two veths, and one's agent calls would reach the other (an exec writing its files
/// into another sandbox). Give it back with [`release_address_pool`].
///
/// Errors: `None` when no /16 of the range is free.
pub fn free_address_pool() -> Option<Ipv4Addr> {
    let addresses = run_quietly("ip", &["-4", "-o", "addr", "show"]);
    let mut taken = pools_taken();
    for _ in 0..1024 {
        let octet = 64 + rand::random::<u8>() % 64;
        if !taken.contains(&octet) && !addresses.contains(&format!("inet 10.{octet}.")) {
            taken.insert(octet);
            return Some(Ipv4Addr::new(10, octet, 0, 0));
        }
    }
    None
}

/// Gives back a pool [`free_address_pool`] handed out.
pub fn release_address_pool(pool: Ipv4Addr) {
    pools_taken().remove(&pool.octets()[1]);
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
/// leaked overlay would delete the lower layers too); whether it is gone.
pub fn remove_dir_unless_mounted(dir: &Path) -> bool {
    if mounts_below(dir).is_empty() {
        let _ = std::fs::remove_dir_all(dir);
        !dir.exists()
    } else {
        eprintln!(
            "leaving {} in place: something is still mounted below it",
            dir.display()
        );
        false
    }
}
