//! Where things live: the paths under `<state_dir>` and the kernel-visible names (netns, veth,
//! cgroup) of each sandbox.
//!
//! # Layout of `<state_dir>`
//! ```text
//! host-id                         stable host id (created once)
//! runc/, runsc/                   runtime --root dirs (per hostd, so container ids only need
//!                                 to be unique per host)
//! templates/<name>/rootfs/        read-only lower dirs of the overlays
//! agent/<fingerprint>/            agent bundle: `berth` + its shared libraries
//! sandboxes/<id>/record.json      the local record (generation fence, results, address)
//! sandboxes/<id>/disk.img         the sandbox's writable disk: a sparse ext4 image of
//!                                 `disk_mib` (survives stop; see `volume`)
//! sandboxes/<id>/disk/            its loop mount, holding the overlay's writable half
//!                                 `upper/` and `work/` (mounted while running)
//! sandboxes/<id>/{upper,work}/    the writable half of a sandbox without a disk limit (a
//!                                 record from before `disk_mib`)
//! sandboxes/<id>/rootfs/          the merged overlay (mounted while running)
//! sandboxes/<id>/config.json      the OCI runtime spec; the sandbox dir is the OCI bundle
//! sandboxes/<id>/console.log      the container's stdout and stderr, capped (see `console`)
//! sandboxes/<id>/console.log.1    the one rotated console log kept
//! sandboxes/<id>/snapshot/        runsc checkpoint image between a memory stop and a start
//! tombstones/<id>.json            the record of a deleted (or never created) sandbox
//! ```
//!
//! # Names
//! Network namespaces, veth devices and cgroups are global to the machine, and `berth dev`
//! runs several hostd in one root network namespace, so their names derive from a hash of
//! (host id, sandbox id): two hostd never pick the same name, even for the same sandbox.
//! A veth name must fit `IFNAMSIZ` (15 bytes).

use std::path::{Path, PathBuf};

use berth_schemas::{HostId, SandboxId};
use sha2::{Digest, Sha256};

/// Hex characters of the (host, sandbox) hash used in kernel-visible names: 40 bits, so a
/// collision between two sandboxes on one machine has odds of about 1 in 10^12 per pair.
pub const NAME_TAG_HEX_LEN: usize = 10;

/// Linux's `IFNAMSIZ - 1`: the longest interface name.
pub const MAX_INTERFACE_NAME_LEN: usize = 15;

/// Where `ip netns add` puts the namespace handles.
pub const NETNS_DIR: &str = "/var/run/netns";

/// The nftables table of one hostd (`inet berth_<tag>`), named from a hash of its host id.
pub fn firewall_table(host: HostId) -> String {
    let digest = hex::encode(Sha256::digest(host.as_uuid().as_bytes()));
    format!("berth_{}", &digest[..NAME_TAG_HEX_LEN])
}

/// The paths under one hostd's state dir.
#[derive(Debug, Clone)]
pub struct StateLayout {
    root: PathBuf,
}

impl StateLayout {
    /// The layout below `state_dir`.
    pub fn new(state_dir: &Path) -> Self {
        Self {
            root: state_dir.to_path_buf(),
        }
    }

    /// The state dir itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<state_dir>/host-id`.
    pub fn host_id_file(&self) -> PathBuf {
        self.root.join("host-id")
    }

    /// `<state_dir>/runc`: the `runc --root` of this hostd.
    pub fn runc_root(&self) -> PathBuf {
        self.root.join("runc")
    }

    /// `<state_dir>/runsc`: the `runsc --root` of this hostd.
    pub fn runsc_root(&self) -> PathBuf {
        self.root.join("runsc")
    }

    /// `<state_dir>/templates`.
    pub fn templates_dir(&self) -> PathBuf {
        self.root.join("templates")
    }

    /// `<state_dir>/agent`.
    pub fn agent_dir(&self) -> PathBuf {
        self.root.join("agent")
    }

    /// `<state_dir>/sandboxes`.
    pub fn sandboxes_dir(&self) -> PathBuf {
        self.root.join("sandboxes")
    }

    /// `<state_dir>/tombstones`.
    pub fn tombstones_dir(&self) -> PathBuf {
        self.root.join("tombstones")
    }

    /// `<state_dir>/tombstones/<id>.json`.
    pub fn tombstone(&self, id: SandboxId) -> PathBuf {
        self.tombstones_dir().join(format!("{id}.json"))
    }

    /// The paths of one sandbox.
    pub fn sandbox(&self, id: SandboxId) -> SandboxPaths {
        SandboxPaths {
            dir: self.sandboxes_dir().join(id.to_string()),
        }
    }
}

/// The paths of one sandbox, all below `<state_dir>/sandboxes/<id>/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxPaths {
    dir: PathBuf,
}

impl SandboxPaths {
    /// The sandbox dir; also the OCI bundle dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The sandbox's record file.
    pub fn record(&self) -> PathBuf {
        self.dir.join("record.json")
    }

    /// The overlay's upper dir of a sandbox without a disk limit: its own writes, kept
    /// across stops. A limited sandbox's is inside [`SandboxPaths::disk_mount`] (see
    /// [`crate::volume::overlay_dirs`]).
    pub fn upper(&self) -> PathBuf {
        self.dir.join("upper")
    }

    /// The overlay's work dir of a sandbox without a disk limit.
    pub fn work(&self) -> PathBuf {
        self.dir.join("work")
    }

    /// The sandbox's disk image (sparse ext4, `disk_mib` MiB).
    pub fn disk_image(&self) -> PathBuf {
        self.dir.join("disk.img")
    }

    /// Where the disk image is mounted; holds the overlay's upper and work dirs.
    pub fn disk_mount(&self) -> PathBuf {
        self.dir.join("disk")
    }

    /// The merged overlay, and the container's root.
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }

    /// The OCI bundle's `config.json`.
    pub fn oci_config(&self) -> PathBuf {
        self.dir.join("config.json")
    }

    /// Where the runtime writes the pid of the container's init or sandbox process
    /// ([`crate::runtime::RunRequest::pid_file`]), rewritten by each boot.
    pub fn init_pid(&self) -> PathBuf {
        self.dir.join("init.pid")
    }

    /// Where the container's stdout and stderr go (through `console`'s capped writer).
    pub fn console_log(&self) -> PathBuf {
        self.dir.join("console.log")
    }

    /// The memory snapshot of a stopped sandbox (runsc checkpoint image); present only between
    /// a memory stop and the next start.
    pub fn snapshot(&self) -> PathBuf {
        self.dir.join("snapshot")
    }

    /// Where a memory stop's checkpoint writes its image, renamed to
    /// [`SandboxPaths::snapshot`] once whole: a checkpoint cut short (hostd killed) leaves
    /// only this, which no start restores from.
    pub fn snapshot_partial(&self) -> PathBuf {
        self.dir.join("snapshot.partial")
    }
}

/// The machine-global names of one sandbox's kernel objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxNames {
    /// The runc container id: the sandbox id (the runc root is per hostd).
    pub container_id: String,
    /// The network namespace (`ip netns` name).
    pub netns: String,
    /// The host-side veth in the root network namespace. Its peer is `eth0` in `netns`.
    pub veth_host: String,
    /// The cgroup path, relative to hostd's own cgroup (runc's convention for a relative
    /// `cgroupsPath`).
    pub cgroup: String,
}

impl SandboxNames {
    /// Derives every name from `(host, sandbox)`; see the module docs.
    pub fn derive(host: HostId, sandbox: SandboxId) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(host.as_uuid().as_bytes());
        hasher.update(sandbox.as_uuid().as_bytes());
        let digest = hex::encode(hasher.finalize());
        let tag = &digest[..NAME_TAG_HEX_LEN];
        Self {
            container_id: sandbox.to_string(),
            netns: format!("berth-{tag}"),
            veth_host: format!("bv{tag}"),
            cgroup: format!("berth-{tag}"),
        }
    }

    /// `/var/run/netns/<netns>`: what the OCI spec's network namespace `path` points at.
    pub fn netns_path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.netns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn names_fit_the_kernel_interface_name_limit() {
        let names = SandboxNames::derive(HostId::new(), SandboxId::new());
        assert!(names.veth_host.len() <= MAX_INTERFACE_NAME_LEN);
        assert!(names.veth_host.chars().all(|c| c.is_ascii_alphanumeric()));
    }

    #[test]
    fn the_same_sandbox_on_two_hosts_gets_different_names() {
        let sandbox = SandboxId(Uuid::from_bytes([7; 16]));
        let a = SandboxNames::derive(HostId(Uuid::from_bytes([1; 16])), sandbox);
        let b = SandboxNames::derive(HostId(Uuid::from_bytes([2; 16])), sandbox);
        assert_ne!(a.netns, b.netns);
        assert_ne!(a.veth_host, b.veth_host);
        assert_ne!(a.cgroup, b.cgroup);
    }

    #[test]
    fn names_are_stable_for_the_same_pair() {
        let (h, s) = (HostId::new(), SandboxId::new());
        assert_eq!(SandboxNames::derive(h, s), SandboxNames::derive(h, s));
    }

    #[test]
    fn sandbox_ids_created_in_the_same_millisecond_get_different_names() {
        // UUIDv7 ids share their leading (timestamp) hex digits; the hash spreads them.
        let h = HostId::new();
        let a = SandboxNames::derive(h, SandboxId::new());
        let b = SandboxNames::derive(h, SandboxId::new());
        assert_ne!(a.veth_host, b.veth_host);
    }
}
