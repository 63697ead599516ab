//! The OCI runtime spec (`config.json`) of a sandbox container, built with the `oci-spec` crate.
//!
//! Source: the OCI runtime specification (config.md, config-linux.md) and runc's `runc spec`
//! defaults, which `oci_spec::runtime::Spec::default()` mirrors. From those defaults this
//! changes: the process (the agent, see `bundle`), the namespaces (pid, ipc, uts, mount, and
//! the sandbox's pre-made network namespace by path), the mounts (no cgroup fs, plus the agent
//! bundle read-only at `/.berth`), capabilities (Docker's default set), cgroup limits from the
//! sandbox's resources, the hostname, and a writable root.

use std::path::{Path, PathBuf};

use berth_schemas::wire::Resources;
use oci_spec::runtime::{
    Capability, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxDeviceCgroupBuilder,
    LinuxMemoryBuilder, LinuxNamespace, LinuxNamespaceBuilder, LinuxNamespaceType,
    LinuxPidsBuilder, LinuxResourcesBuilder, Mount, MountBuilder, ProcessBuilder, RootBuilder,
    Spec, UserBuilder,
};

use crate::bundle::{AgentBundle, AGENT_MOUNT};
use crate::error::HostdError;

/// The most processes (threads included) one sandbox may have.
pub const PIDS_LIMIT: i64 = 1024;

/// The CFS period the CPU quota is expressed against, in microseconds.
pub const CPU_PERIOD_US: u64 = 100_000;

/// Bytes per MiB.
const MIB: i64 = 1024 * 1024;

/// The open-file limit of the container process: runc's default, which also fits under the
/// hard limit of a hostd that runs without `CAP_SYS_RESOURCE` headroom (raising it above the
/// caller's hard limit fails the container's init).
pub const NOFILE_LIMIT: u64 = 1024;

/// The `PATH` of the container process (and, through the agent, of every exec).
pub const GUEST_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Docker's default capability set: enough for a root user to manage files and processes
/// inside the sandbox, without host-affecting ones (`SYS_ADMIN`, `NET_ADMIN`, `SYS_MODULE`, …).
const CAPABILITIES: &[Capability] = &[
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fsetid,
    Capability::Fowner,
    Capability::Mknod,
    Capability::NetRaw,
    Capability::Setgid,
    Capability::Setuid,
    Capability::Setfcap,
    Capability::Setpcap,
    Capability::NetBindService,
    Capability::SysChroot,
    Capability::Kill,
    Capability::AuditWrite,
];

/// What one container's spec is made from.
#[derive(Debug, Clone)]
pub struct ContainerConfig<'a> {
    /// The merged overlay (absolute).
    pub rootfs: &'a Path,
    /// The container's hostname.
    pub hostname: &'a str,
    /// The network namespace to join (`/var/run/netns/<name>`).
    pub netns_path: PathBuf,
    /// The agent bundle, bind-mounted read-only and run as the container's process.
    pub agent: &'a AgentBundle,
    /// The sandbox's CPU and memory limits.
    pub resources: Resources,
    /// The cgroup path; relative paths are relative to the runtime's own cgroup.
    pub cgroups_path: &'a str,
}

/// Builds the runtime spec.
///
/// Errors: [`HostdError::Oci`] when a builder refuses a value.
pub fn build_spec(cfg: &ContainerConfig<'_>) -> Result<Spec, HostdError> {
    let caps: oci_spec::runtime::Capabilities = CAPABILITIES.iter().copied().collect();
    let process = ProcessBuilder::default()
        .terminal(false)
        .user(UserBuilder::default().uid(0u32).gid(0u32).build()?)
        .args(cfg.agent.argv())
        .env(vec![format!("PATH={GUEST_PATH}"), "HOME=/root".to_owned()])
        .cwd("/")
        .no_new_privileges(true)
        .capabilities(
            LinuxCapabilitiesBuilder::default()
                .bounding(caps.clone())
                .effective(caps.clone())
                .permitted(caps)
                .build()?,
        )
        .rlimits(vec![oci_spec::runtime::PosixRlimitBuilder::default()
            .typ(oci_spec::runtime::PosixRlimitType::RlimitNofile)
            .hard(NOFILE_LIMIT)
            .soft(NOFILE_LIMIT)
            .build()?])
        .build()?;

    let namespaces = [
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
    ]
    .into_iter()
    .map(|typ| LinuxNamespaceBuilder::default().typ(typ).build())
    .chain(std::iter::once(
        LinuxNamespaceBuilder::default()
            .typ(LinuxNamespaceType::Network)
            .path(cfg.netns_path.clone())
            .build(),
    ))
    .collect::<Result<Vec<LinuxNamespace>, _>>()?;

    let mut resources = LinuxResourcesBuilder::default()
        .devices(vec![LinuxDeviceCgroupBuilder::default()
            .allow(false)
            .access("rwm")
            .build()?])
        .pids(LinuxPidsBuilder::default().limit(PIDS_LIMIT).build()?);
    if cfg.resources.memory_mib > 0 {
        let bytes = i64::from(cfg.resources.memory_mib) * MIB;
        resources = resources.memory(LinuxMemoryBuilder::default().limit(bytes).build()?);
    }
    if cfg.resources.vcpus > 0 {
        let quota = i64::from(cfg.resources.vcpus) * CPU_PERIOD_US as i64;
        resources = resources.cpu(
            LinuxCpuBuilder::default()
                .quota(quota)
                .period(CPU_PERIOD_US)
                .build()?,
        );
    }
    let linux = LinuxBuilder::default()
        .namespaces(namespaces)
        .resources(resources.build()?)
        .cgroups_path(PathBuf::from(cfg.cgroups_path));
    // Keep the default masked and read-only paths (/proc/kcore, /proc/sys, …).
    let defaults = oci_spec::runtime::Linux::default();
    let linux = linux
        .masked_paths(defaults.masked_paths().clone().unwrap_or_default())
        .readonly_paths(defaults.readonly_paths().clone().unwrap_or_default())
        .build()?;

    let spec = oci_spec::runtime::SpecBuilder::default()
        .version("1.0.2")
        .root(
            RootBuilder::default()
                .path(cfg.rootfs)
                .readonly(false)
                .build()?,
        )
        .process(process)
        .hostname(cfg.hostname)
        .mounts(mounts(cfg.agent)?)
        .linux(linux)
        .build()?;
    Ok(spec)
}

/// The default mounts minus the cgroup fs (a sandbox has no use for it), plus the agent bundle.
fn mounts(agent: &AgentBundle) -> Result<Vec<Mount>, HostdError> {
    let mut mounts: Vec<Mount> = oci_spec::runtime::get_default_mounts()
        .into_iter()
        .filter(|m| m.destination() != Path::new("/sys/fs/cgroup"))
        .collect();
    mounts.push(
        MountBuilder::default()
            .destination(AGENT_MOUNT)
            .typ("bind")
            .source(agent.dir.clone())
            .options(vec![
                "rbind".to_owned(),
                "ro".to_owned(),
                "nosuid".to_owned(),
                "nodev".to_owned(),
            ])
            .build()?,
    );
    Ok(mounts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent() -> AgentBundle {
        AgentBundle {
            dir: "/state/agent/abc".into(),
            loader: Some("ld-linux-x86-64.so.2".into()),
        }
    }

    fn spec(resources: Resources) -> Spec {
        let agent = agent();
        build_spec(&ContainerConfig {
            rootfs: Path::new("/state/sandboxes/s/rootfs"),
            hostname: "sb",
            netns_path: "/var/run/netns/berth-0123456789".into(),
            agent: &agent,
            resources,
            cgroups_path: "berth-0123456789",
        })
        .unwrap()
    }

    fn two_cpus_512_mib() -> Resources {
        Resources {
            vcpus: 2,
            memory_mib: 512,
        }
    }

    #[test]
    fn the_container_joins_the_prepared_network_namespace_and_gets_its_own_others() {
        let s = spec(two_cpus_512_mib());
        let ns = s.linux().as_ref().unwrap().namespaces().as_ref().unwrap();
        let types: Vec<_> = ns.iter().map(|n| n.typ()).collect();
        assert_eq!(
            types,
            [
                LinuxNamespaceType::Pid,
                LinuxNamespaceType::Ipc,
                LinuxNamespaceType::Uts,
                LinuxNamespaceType::Mount,
                LinuxNamespaceType::Network
            ]
        );
        assert_eq!(
            ns[4].path().as_deref(),
            Some(Path::new("/var/run/netns/berth-0123456789"))
        );
        assert!(ns[..4].iter().all(|n| n.path().is_none()));
    }

    #[test]
    fn limits_come_from_the_sandbox_resources() {
        let s = spec(two_cpus_512_mib());
        let r = s.linux().as_ref().unwrap().resources().as_ref().unwrap();
        assert_eq!(r.memory().as_ref().unwrap().limit(), Some(512 * MIB));
        let cpu = r.cpu().as_ref().unwrap();
        assert_eq!(cpu.quota(), Some(200_000));
        assert_eq!(cpu.period(), Some(CPU_PERIOD_US));
        assert_eq!(r.pids().as_ref().unwrap().limit(), PIDS_LIMIT);
    }

    #[test]
    fn zero_resources_mean_no_memory_or_cpu_limit() {
        let s = spec(Resources::default());
        let r = s.linux().as_ref().unwrap().resources().as_ref().unwrap();
        assert!(r.memory().is_none() && r.cpu().is_none());
    }

    #[test]
    fn the_agent_bundle_is_mounted_read_only_and_runs_as_the_process() {
        let s = spec(two_cpus_512_mib());
        let mounts = s.mounts().as_ref().unwrap();
        let berth = mounts
            .iter()
            .find(|m| m.destination() == Path::new(AGENT_MOUNT))
            .unwrap();
        assert_eq!(
            berth.source().as_deref(),
            Some(Path::new("/state/agent/abc"))
        );
        assert!(berth.options().as_ref().unwrap().contains(&"ro".to_owned()));
        let dests: Vec<_> = mounts.iter().map(|m| m.destination().clone()).collect();
        for d in ["/proc", "/dev", "/dev/pts", "/dev/shm", "/sys"] {
            assert!(dests.contains(&PathBuf::from(d)), "{d} missing");
        }
        assert!(!dests.contains(&PathBuf::from("/sys/fs/cgroup")));
        let process = s.process().as_ref().unwrap();
        assert_eq!(process.args().as_ref().unwrap(), &agent().argv());
        assert!(!process.terminal().unwrap_or(true));
    }

    #[test]
    fn the_spec_serializes_with_hostname_root_and_cgroup_path() {
        let json = serde_json::to_value(spec(two_cpus_512_mib())).unwrap();
        assert_eq!(json["hostname"], "sb");
        assert_eq!(json["root"]["path"], "/state/sandboxes/s/rootfs");
        assert_eq!(json["linux"]["cgroupsPath"], "berth-0123456789");
        assert_eq!(json["ociVersion"], "1.0.2");
    }
}
