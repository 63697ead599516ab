//! Adoption at start (an OCI host's; a sim host has nothing on the machine): what a previous
//! run of this hostd left is kept when a live record accounts for it and removed otherwise —
//! containers in its runtime roots ([`adopt`]), then overlay and disk mounts under its state dir,
//! network namespaces and veths marked as its own (`netns::owner_alias`), and stale nftables
//! elements, the firewall table being rebuilt from the records ([`sweep`]).
//!
//! # Guarantees
//! - Every live record is adopted: its container, if still running, is left running (never
//!   started twice). Containers no record accounts for are destroyed (DESIGN.md guarantee 5).
//! - Only this hostd's objects are touched: a container must be in its runtime roots; a
//!   mount must lie under its own sandboxes dir; a namespace or veth must carry an alias
//!   naming its host id. Objects of other hostd on the same machine, and unmarked ones, are
//!   left alone.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use berth_schemas::SandboxId;

use crate::error::HostdError;
use crate::firewall::Firewall;
use crate::host::Host;
use crate::layout::{SandboxNames, NETNS_DIR};
use crate::netns::{self, parse_owner_alias};
use crate::overlay;
use crate::record::{SandboxRecord, TOMBSTONE_RETENTION};
use crate::tool;

/// What one sweep removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    /// Overlay and disk mounts unmounted.
    pub mounts: usize,
    /// Network namespaces removed.
    pub netns: usize,
    /// Host-side veths removed.
    pub veths: usize,
}

/// Adopts what a previous run left: destroys containers no record accounts for, reports
/// the state of the others, purges old tombstones, then [`sweep`]s stray mounts, namespaces
/// and veths and rebuilds `firewall`'s table.
///
/// Errors: [`HostdError`] from a runtime's `list`, or from [`sweep`].
pub async fn adopt(host: &Host, firewall: &Firewall) -> Result<(), HostdError> {
    let purged = host.store.purge_tombstones(TOMBSTONE_RETENTION);
    let records = host.snapshot();
    let known: HashMap<String, &SandboxRecord> = records
        .iter()
        .map(|r| (host.names(r.sandbox_id).container_id, r))
        .collect();
    let mut containers = HashMap::new();
    for runtime in host.runtimes.all() {
        for (container_id, status) in runtime.list().await? {
            let owned = known
                .get(&container_id)
                .is_some_and(|r| r.runtime == runtime.name());
            if !owned {
                tracing::warn!(%container_id, runtime = runtime.name(), "destroying orphan container");
                if let Err(e) = runtime.destroy(&container_id).await {
                    tracing::warn!(%container_id, error = %e.report(), "orphan not destroyed");
                }
                continue;
            }
            containers.insert(container_id, status);
        }
    }
    for (container_id, record) in &known {
        let status = containers.get(container_id).copied();
        tracing::info!(
            sandbox_id = %record.sandbox_id,
            phase = ?record.phase,
            container = ?status,
            "adopted sandbox"
        );
    }
    let swept = sweep(host, firewall).await?;
    tracing::info!(
        sandboxes = records.len(),
        purged_tombstones = purged,
        swept_mounts = swept.mounts,
        swept_netns = swept.netns,
        swept_veths = swept.veths,
        "adoption done"
    );
    Ok(())
}

/// Sweeps strays (see the module docs), then rebuilds `firewall`'s table. A failure to
/// remove one object is logged and the sweep goes on.
///
/// Errors: [`HostdError`] when the mount table, the namespaces or the links can't be listed,
/// or the firewall can't be installed.
pub async fn sweep(host: &Host, firewall: &Firewall) -> Result<Swept, HostdError> {
    let records = host.snapshot();
    let live: HashSet<SandboxId> = records.iter().map(|r| r.sandbox_id).collect();
    let mut swept = Swept::default();

    // Overlay and disk mounts of sandboxes without a record (rootfs and disk dirs below our
    // sandboxes dir), newest first: an overlay before the disk that holds its upper dir.
    let sandboxes_dir = host.layout.sandboxes_dir();
    let table = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(HostdError::io("read /proc/self/mountinfo"))?;
    for point in overlay::mount_points(&table)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
    {
        if let Some(id) = stray_mount(&sandboxes_dir, &point, &live) {
            tracing::warn!(sandbox_id = %id, mount = %point.display(), "unmounting a stray mount");
            match tokio::task::spawn_blocking(move || overlay::unmount(&point)).await {
                Ok(Ok(())) => swept.mounts += 1,
                Ok(Err(e)) => tracing::warn!(error = %e.report(), "stray mount not unmounted"),
                Err(e) => tracing::warn!(error = %e, "unmount task failed"),
            }
        }
    }

    // Namespaces marked as ours (the alias on their `lo`).
    let mut strays: HashSet<SandboxId> = HashSet::new();
    if let Ok(entries) = std::fs::read_dir(NETNS_DIR) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with("berth-") {
                continue;
            }
            let Ok(out) = tool::run("ip", &["-n", &name, "-o", "link", "show", "lo"]).await else {
                continue;
            };
            if let Some((owner, sandbox)) = parse_owner_alias(&out.stdout) {
                let names = host.names(sandbox);
                if owner == host.host_id && !live.contains(&sandbox) && names.netns == name {
                    strays.insert(sandbox);
                }
            }
        }
    }
    // Host-side veths marked as ours.
    let links = tool::run("ip", &["-o", "link", "show"]).await?;
    for line in links.stdout.lines() {
        if let Some((owner, sandbox)) = parse_owner_alias(line) {
            if owner == host.host_id && !live.contains(&sandbox) {
                strays.insert(sandbox);
            }
        }
    }
    for sandbox in strays {
        let names: SandboxNames = host.names(sandbox);
        let had_veth = netns::host_link_exists(&names.veth_host);
        let had_netns = names.netns_path().exists();
        tracing::warn!(sandbox_id = %sandbox, netns = %names.netns, veth = %names.veth_host, "removing a stray network");
        match netns::teardown(&names).await {
            Ok(()) => {
                swept.veths += usize::from(had_veth);
                swept.netns += usize::from(had_netns);
            }
            Err(e) => {
                tracing::warn!(sandbox_id = %sandbox, error = %e.report(), "stray network not removed")
            }
        }
    }

    // Live sandboxes' veths get the current hardening too (a veth made by an older build).
    for record in &records {
        let veth = host.names(record.sandbox_id).veth_host;
        if record.link.is_some() && netns::host_link_exists(&veth) {
            if let Err(e) = netns::harden_host_side(&veth) {
                tracing::warn!(%veth, error = %e.report(), "veth not hardened");
            }
        }
    }
    let admitted: Vec<_> = records
        .iter()
        .filter_map(|r| crate::backend::oci::admission(host, r))
        .collect();
    firewall.install(&admitted).await?;
    Ok(swept)
}

/// The sandbox whose overlay or disk mount `point` is, when it lies directly in
/// `sandboxes_dir` as `<id>/rootfs` or `<id>/disk` and `id` is not live.
fn stray_mount(sandboxes_dir: &Path, point: &Path, live: &HashSet<SandboxId>) -> Option<SandboxId> {
    let rest = point.strip_prefix(sandboxes_dir).ok()?;
    let mut parts = rest.components();
    let id: SandboxId = parts.next()?.as_os_str().to_str()?.parse().ok()?;
    let leaf = parts.next()?.as_os_str();
    let ours = leaf == "rootfs" || leaf == "disk";
    (ours && parts.next().is_none() && !live.contains(&id)).then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_rootfs_and_disk_mounts_of_unknown_sandboxes_under_our_dir_are_strays() {
        let dir = Path::new("/state/sandboxes");
        let (known, unknown) = (SandboxId::new(), SandboxId::new());
        let live = HashSet::from([known]);
        let at = |id: SandboxId, leaf: &str| dir.join(id.to_string()).join(leaf);
        assert_eq!(
            stray_mount(dir, &at(unknown, "rootfs"), &live),
            Some(unknown)
        );
        assert_eq!(stray_mount(dir, &at(unknown, "disk"), &live), Some(unknown));
        assert_eq!(stray_mount(dir, &at(known, "rootfs"), &live), None);
        assert_eq!(stray_mount(dir, &at(known, "disk"), &live), None);
        assert_eq!(stray_mount(dir, &at(unknown, "upper"), &live), None);
        let elsewhere = Path::new("/other/sandboxes")
            .join(unknown.to_string())
            .join("rootfs");
        assert_eq!(stray_mount(dir, &elsewhere, &live), None);
    }
}
