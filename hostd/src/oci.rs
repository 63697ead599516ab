//! The OCI runtime spec (`config.json`) of a sandbox container, built with the `oci-spec` crate.
//!
//! Source: the OCI runtime specification (config.md, config-linux.md) and runc's `runc spec`
//! defaults, which `oci_spec::runtime::Spec::default()` mirrors. From those defaults this
//! changes: the process (the agent, see `bundle`), the namespaces (pid, ipc, uts, mount, the
//! sandbox's pre-made network namespace by path, and for runc a user namespace, see
//! [`crate::isolation`]), the mounts (no cgroup fs, plus the agent bundle read-only at
//! `/.berth`; in a user namespace `/sys` is an empty read-only tmpfs), capabilities (Docker's
//! default set without `CAP_NET_RAW`), the seccomp filter of [`crate::seccomp`], masked and
//! read-only paths (Docker's, [`MASKED_PATHS`], [`READONLY_PATHS`]), `noNewPrivileges`, cgroup
//! limits from the sandbox's resources, the hostname, and a writable root.

use std::path::{Path, PathBuf};

use berth_schemas::wire::Resources;
use oci_spec::runtime::{
    Capability, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxDeviceCgroupBuilder,
    LinuxIdMappingBuilder, LinuxMemoryBuilder, LinuxNamespace, LinuxNamespaceBuilder,
    LinuxNamespaceType, LinuxPidsBuilder, LinuxResourcesBuilder, LinuxSeccomp, Mount, MountBuilder,
    ProcessBuilder, RootBuilder, Spec, UserBuilder,
};

use crate::bundle::{AgentBundle, AGENT_MOUNT};
use crate::error::HostdError;
use crate::isolation::IdRange;

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

/// Docker's default capability set without `CAP_NET_RAW`: enough for a root user to manage
/// files and processes inside the sandbox, without host-affecting ones (`SYS_ADMIN`,
/// `NET_ADMIN`, `SYS_MODULE`, …) and without raw sockets (packets with forged headers; `ping`
/// can use an unprivileged ICMP socket instead, see [`crate::isolation::allow_ping_sockets`]).
pub const CAPABILITIES: &[Capability] = &[
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fsetid,
    Capability::Fowner,
    Capability::Mknod,
    Capability::Setgid,
    Capability::Setuid,
    Capability::Setfcap,
    Capability::Setpcap,
    Capability::NetBindService,
    Capability::SysChroot,
    Capability::Kill,
    Capability::AuditWrite,
];

/// Paths covered so they read empty (files: `/dev/null` bound over them; dirs: an empty
/// read-only tmpfs): kernel memory, keyrings, timers and scheduler state that leak other
/// tenants' activity, firmware tables. Source: Docker's defaults (moby `oci/defaults.go`,
/// which runc's `runc spec` follows), including `/sys/devices/virtual/powercap` (RAPL energy
/// counters, a side channel: CVE-2020-8694).
pub const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/sys/devices/virtual/powercap",
    "/sys/firmware",
];

/// Paths bound read-only over themselves: kernel tunables and triggers. Source: Docker's and
/// runc's defaults.
pub const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
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
    /// The host ids of the container's ids when it gets a user namespace (runc); `None` keeps
    /// the runtime's own (runsc: gVisor runs unprivileged in a user namespace of its own).
    pub user_namespace: Option<IdRange>,
    /// The seccomp filter ([`crate::seccomp::host_profile`]).
    pub seccomp: &'a LinuxSeccomp,
    /// The host cgroup's `pids.max` ([`crate::runtime::RuntimeDriver::pids_limit`]).
    pub pids_limit: i64,
    /// Preload the bundle's statx shim ([`crate::bundle::GUEST_PRELOAD_FILE`]) into the agent
    /// and every process it starts (gVisor sandboxes: see the shim's source).
    pub preload_statx_shim: bool,
}

/// The container process's environment: `PATH`, `HOME`, and `LD_PRELOAD` of the statx shim
/// when `preload` (the agent passes `LD_PRELOAD` on to what it runs).
pub fn guest_env(preload: bool) -> Vec<String> {
    let mut env = vec![format!("PATH={GUEST_PATH}"), "HOME=/root".to_owned()];
    if preload {
        env.push(format!(
            "LD_PRELOAD={}/{}",
            crate::bundle::AGENT_MOUNT,
            crate::bundle::GUEST_PRELOAD_FILE
        ));
    }
    env
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
        .env(guest_env(cfg.preload_statx_shim))
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

    let mut own = vec![
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
    ];
    if cfg.user_namespace.is_some() {
        own.push(LinuxNamespaceType::User);
    }
    let namespaces = own
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
        .pids(LinuxPidsBuilder::default().limit(cfg.pids_limit).build()?);
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
    let mut linux = LinuxBuilder::default()
        .namespaces(namespaces)
        .resources(resources.build()?)
        .cgroups_path(PathBuf::from(cfg.cgroups_path))
        .seccomp(cfg.seccomp.clone())
        .masked_paths(
            MASKED_PATHS
                .iter()
                .map(|p| (*p).to_owned())
                .collect::<Vec<_>>(),
        )
        .readonly_paths(
            READONLY_PATHS
                .iter()
                .map(|p| (*p).to_owned())
                .collect::<Vec<_>>(),
        );
    if let Some(ids) = cfg.user_namespace {
        let map = || {
            LinuxIdMappingBuilder::default()
                .container_id(0u32)
                .host_id(ids.host_base)
                .size(ids.size)
                .build()
        };
        linux = linux.uid_mappings(vec![map()?]).gid_mappings(vec![map()?]);
    }
    let linux = linux.build()?;

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
        .mounts(mounts(cfg.agent, cfg.user_namespace.is_some())?)
        .linux(linux)
        .build()?;
    Ok(spec)
}

/// The default mounts minus the cgroup fs (a sandbox has no use for it), plus the agent bundle.
/// In a user namespace, `/sys` is an empty read-only tmpfs: the kernel lets a user namespace
/// mount sysfs only over a network namespace it owns, and the sandbox's is the host's (made
/// by hostd); binding the host's `/sys` instead (runc's rootless default) would show the
/// host's devices and cgroups.
fn mounts(agent: &AgentBundle, user_namespace: bool) -> Result<Vec<Mount>, HostdError> {
    let mut mounts: Vec<Mount> = oci_spec::runtime::get_default_mounts()
        .into_iter()
        .filter(|m| m.destination() != Path::new("/sys/fs/cgroup"))
        .collect();
    if user_namespace {
        for m in mounts.iter_mut() {
            if m.destination() == Path::new("/sys") {
                *m = MountBuilder::default()
                    .destination("/sys")
                    .typ("tmpfs")
                    .source("tmpfs")
                    .options(
                        ["ro", "nosuid", "nodev", "noexec", "size=4k", "mode=0555"]
                            .map(str::to_owned)
                            .to_vec(),
                    )
                    .build()?;
            }
        }
    }
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

    fn spec_with(resources: Resources, user_namespace: Option<IdRange>) -> Spec {
        let agent = agent();
        let seccomp = crate::seccomp::profile(
            &crate::seccomp::arch_family("x86_64").unwrap(),
            (6, 1),
            crate::seccomp::Target::Linux,
        )
        .unwrap();
        build_spec(&ContainerConfig {
            rootfs: Path::new("/state/sandboxes/s/rootfs"),
            hostname: "sb",
            netns_path: "/var/run/netns/berth-0123456789".into(),
            agent: &agent,
            resources,
            cgroups_path: "berth-0123456789",
            user_namespace,
            seccomp: &seccomp,
            pids_limit: PIDS_LIMIT,
            preload_statx_shim: false,
        })
        .unwrap()
    }

    fn spec(resources: Resources) -> Spec {
        spec_with(resources, Some(crate::isolation::SANDBOX_IDS))
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
                LinuxNamespaceType::User,
                LinuxNamespaceType::Network
            ]
        );
        assert_eq!(
            ns[5].path().as_deref(),
            Some(Path::new("/var/run/netns/berth-0123456789"))
        );
        assert!(ns[..5].iter().all(|n| n.path().is_none()));
    }

    #[test]
    fn sandbox_root_maps_to_the_unprivileged_range_and_sys_is_an_empty_tmpfs() {
        let s = spec(two_cpus_512_mib());
        let linux = s.linux().as_ref().unwrap();
        for maps in [linux.uid_mappings(), linux.gid_mappings()] {
            let m = &maps.as_ref().unwrap()[0];
            assert_eq!(
                (m.container_id(), m.host_id(), m.size()),
                (0, 1 << 30, 65536)
            );
        }
        let sys = s
            .mounts()
            .as_ref()
            .unwrap()
            .iter()
            .find(|m| m.destination() == Path::new("/sys"))
            .unwrap();
        assert_eq!(sys.typ().as_deref(), Some("tmpfs"));
        assert!(sys.options().as_ref().unwrap().contains(&"ro".to_owned()));

        // Without a user namespace (runsc) there are no mappings and /sys is sysfs.
        let g = spec_with(two_cpus_512_mib(), None);
        let linux = g.linux().as_ref().unwrap();
        assert!(linux.uid_mappings().is_none() && linux.gid_mappings().is_none());
        let types: Vec<_> = linux
            .namespaces()
            .as_ref()
            .unwrap()
            .iter()
            .map(|n| n.typ())
            .collect();
        assert!(!types.contains(&LinuxNamespaceType::User));
        let sys = g
            .mounts()
            .as_ref()
            .unwrap()
            .iter()
            .find(|m| m.destination() == Path::new("/sys"))
            .unwrap();
        assert_eq!(sys.typ().as_deref(), Some("sysfs"));
    }

    #[test]
    fn seccomp_masked_paths_no_new_privileges_and_no_net_raw_are_always_set() {
        for s in [
            spec(two_cpus_512_mib()),
            spec_with(two_cpus_512_mib(), None),
        ] {
            let linux = s.linux().as_ref().unwrap();
            let seccomp = linux.seccomp().as_ref().unwrap();
            assert_eq!(
                seccomp.default_action(),
                oci_spec::runtime::LinuxSeccompAction::ScmpActErrno
            );
            let masked = linux.masked_paths().as_ref().unwrap();
            for p in [
                "/proc/kcore",
                "/proc/keys",
                "/proc/timer_list",
                "/sys/firmware",
            ] {
                assert!(masked.contains(&p.to_owned()), "{p} not masked");
            }
            let ro = linux.readonly_paths().as_ref().unwrap();
            for p in ["/proc/sys", "/proc/sysrq-trigger"] {
                assert!(ro.contains(&p.to_owned()), "{p} not read-only");
            }
            let process = s.process().as_ref().unwrap();
            assert_eq!(process.no_new_privileges(), Some(true));
            let caps = process.capabilities().as_ref().unwrap();
            for set in [caps.bounding(), caps.effective(), caps.permitted()] {
                let set = set.as_ref().unwrap();
                assert!(!set.contains(&Capability::NetRaw));
                assert!(!set.contains(&Capability::SysAdmin));
                assert!(set.contains(&Capability::Chown));
            }
        }
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
