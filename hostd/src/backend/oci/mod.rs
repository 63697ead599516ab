//! The OCI backend: sandboxes as containers of an OCI runtime (runc, or runsc = gVisor whose
//! stop keeps memory) with an overlay root filesystem, a network namespace and veth each,
//! isolated by this hostd's nftables table, limited by cgroups, confined by a seccomp filter
//! ([`crate::seccomp`]) and, on runc, a user namespace ([`crate::isolation`]: the overlay's
//! lower dir is then the template's id-shifted copy and its upper dir is owned by the
//! sandbox's ids), reached through the in-sandbox agent ([`agent`]). Adoption at start is
//! [`crate::adopt`].

pub mod agent;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_schemas::wire::{AgentOp, AgentReply};
use berth_schemas::{HostId, SandboxId};
use futures::future::BoxFuture;
use futures::FutureExt;
use tracing::Instrument as _;

use crate::address::LinkAddresses;
use crate::agent::client;
use crate::agent::protocol::AGENT_PORT;
use crate::apply::step;
use crate::bundle::Bundles;
use crate::cleanup::CleanupStack;
use crate::disk::{blocking, remove_dir_if_present, remove_sandbox_dir, unmount};
use crate::error::HostdError;
use crate::fault::{crash_point, Step};
use crate::firewall::{Admission, Firewall};
use crate::host::{Backend, Host, OutputSender};
use crate::layout::firewall_table;
use crate::oci::{self, ContainerConfig};
use crate::record::{write_json_atomic, SandboxRecord};
use crate::runtime::cli::console_tail;
use crate::runtime::runsc::RUNSC;
use crate::runtime::{ContainerStatus, RunRequest, RuntimeDriver};
use crate::{isolation, netns, overlay, seccomp, volume, HostdConfig};

/// How long a started container's agent has to answer its first ping.
pub const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Pause between pings while waiting for the agent. A ping to an agent not yet listening is
/// refused at once, so polling often is cheap; at 100 ms the wait alone was up to a third of
/// create→running (`berth bench`).
const AGENT_POLL_INTERVAL: Duration = Duration::from_millis(10);

/// The first pause between pings; each doubles up to [`AGENT_POLL_INTERVAL`]. An agent
/// answers a few milliseconds after the runtime returns; a first pause of the whole interval
/// put half of it, on average, on every create (issue 16).
const FIRST_AGENT_POLL: Duration = Duration::from_millis(1);

/// While waiting for the agent, ask the runtime whether the container still runs every this
/// many pings, about every 500 ms (so a crashed boot fails fast with its console output).
const STATUS_CHECK_EVERY: u32 = 50;

/// The OCI backend of one hostd: its nftables table and the agent bundle it copies into
/// every sandbox.
pub struct OciBackend {
    /// This hostd's nftables table.
    pub firewall: Firewall,
    /// The agent bundle.
    pub bundles: Bundles,
}

impl OciBackend {
    /// The backend of host `host_id` configured by `config`.
    pub fn new(host_id: HostId, config: &HostdConfig) -> Self {
        let layout = crate::layout::StateLayout::new(&config.state_dir);
        Self {
            firewall: Firewall::new(firewall_table(host_id), &config.sandbox_egress_allow),
            bundles: Bundles::new(layout.agent_dir(), config.agent_binary.clone()),
        }
    }

    /// Admits a sandbox into the firewall table; when that fails (the table went missing,
    /// say), reinstalls the table from the live records plus `sandbox`.
    ///
    /// Errors: [`HostdError::Nft`] from the reinstall.
    async fn admit_to_firewall(&self, host: &Host, sandbox: &Admission) -> Result<(), HostdError> {
        let Err(first) = self.firewall.admit(sandbox).await else {
            return Ok(());
        };
        tracing::warn!(error = %first.report(), "firewall admit failed; reinstalling the table");
        let mut all: Vec<Admission> = host
            .snapshot()
            .iter()
            .filter_map(|r| admission(host, r))
            .filter(|a| a.veth != sandbox.veth)
            .collect();
        all.push(sandbox.clone());
        self.firewall.install(&all).await
    }

    /// The steps of [`Backend::bring_up`] (see there). What runs is looked at first, before
    /// anything is touched: a container that runs is adopted as it is ([`Self::adopt_running`]),
    /// one that exists but does not run is removed, and only then is the rest built. A start
    /// whose adopted container exits before its agent answers (it was dying) builds anew.
    async fn bring_up_oci(
        &self,
        host: &Arc<Host>,
        record: &mut SandboxRecord,
        fresh: bool,
        cleanup: &mut CleanupStack,
    ) -> Result<Ipv4Addr, HostdError> {
        let runtime = host.runtime_of(record)?;
        let container_id = host.names(record.sandbox_id).container_id;
        match runtime.status(&container_id).await? {
            // Its record has the address it runs with (written before the network was made).
            Some(ContainerStatus::Running) if record.link.is_some() => {
                match self.adopt_running(host, record, fresh, cleanup).await {
                    // A start raced the container's death: killed behind hostd's back, its
                    // init had not finished exiting when the runtime was asked, so it was
                    // still "running". It is gone now; a start boots it anew. (A create's
                    // undo steps are pushed already: it fails as it would have.)
                    Err(HostdError::ContainerExited { .. }) if !fresh => {
                        tracing::info!("the adopted container exited; booting it anew");
                        runtime.destroy(&container_id).await?;
                    }
                    adopted => return adopted,
                }
            }
            // Created, stopped or paused (a crash mid-start or mid-stop): it cannot be adopted,
            // and on gVisor it may hold its namespace's `eth0`, so it goes before the network is
            // touched.
            Some(status) => {
                tracing::info!(?status, "removing a container that does not run");
                runtime.destroy(&container_id).await?;
            }
            None => {}
        }
        self.build(host, record, fresh, cleanup, runtime).await
    }

    /// Bring-up of a sandbox whose container still runs (a create or start redelivered after
    /// hostd crashed once the container was up): nothing of the sandbox is touched — on gVisor
    /// its namespace's `eth0` belongs to the sandbox's own network stack, and giving the guest
    /// address back to the host kernel there would take the agent's traffic away from it.
    /// Only host-side state is made sure of (the address reservation and record, the firewall
    /// elements), the spent memory image removed, and the agent waited for. A fresh create
    /// still owns everything, so its undo steps are pushed.
    async fn adopt_running(
        &self,
        host: &Arc<Host>,
        record: &mut SandboxRecord,
        fresh: bool,
        cleanup: &mut CleanupStack,
    ) -> Result<Ipv4Addr, HostdError> {
        let id = record.sandbox_id;
        let names = host.names(id);
        let paths = host.layout.sandbox(id);
        let runtime = host.runtime_of(record)?;
        tracing::info!("the container runs; adopting it without touching the sandbox");
        if fresh {
            self.push_undo_all(host, record, cleanup, &runtime);
        }
        let link = host
            .claim_address(record, netns::foreign_slots(host.allocator.pool()))
            .await?;
        let admitted = Admission {
            veth: names.veth_host.clone(),
            link,
            egress: record.spec.network.egress.clone(),
        };
        self.admit_to_firewall(host, &admitted).await?;
        // It runs, so it was booted or restored: an image left is spent.
        remove_dir_if_present(&paths.snapshot()).await?;
        let address = SocketAddr::new(link.sandbox.into(), AGENT_PORT);
        wait_for_agent(&*runtime, address, &names.container_id, paths.console_log()).await?;
        Ok(link.sandbox)
    }

    /// [`Backend::hand_over`] on the OCI backend: the create's egress admitted (the pooled
    /// sandbox had none: its elements are a subset), the agent pinged, the entrypoint started.
    /// A pooled sandbox whose agent does not answer (its container died in the pool) is built
    /// anew as a fresh create, which removes what does not run first.
    async fn hand_over_oci(
        &self,
        host: &Arc<Host>,
        record: &mut SandboxRecord,
        cleanup: &mut CleanupStack,
    ) -> Result<Ipv4Addr, HostdError> {
        let (runtime, link) = (host.runtime_of(record)?, record.link);
        let address = link.map(|l| SocketAddr::new(l.sandbox.into(), AGENT_PORT));
        let answers = match address {
            Some(address) => client::ping(address).await.is_ok(),
            None => false,
        };
        let (Some(link), Some(address), true) = (link, address, answers) else {
            tracing::info!("the warm sandbox does not answer; building it anew");
            ::metrics::counter!(crate::warm::WARM_HANDOVERS, "result" => "rebuilt").increment(1);
            return self.bring_up_oci(host, record, true, cleanup).await;
        };
        self.push_undo_all(host, record, cleanup, &runtime);
        let admitted = Admission {
            veth: host.names(record.sandbox_id).veth_host,
            link,
            egress: record.spec.network.egress.clone(),
        };
        self.admit_to_firewall(host, &admitted)
            .instrument(step("network"))
            .await?;
        start_entrypoint(address, &record.spec).await?;
        ::metrics::counter!(crate::warm::WARM_HANDOVERS, "result" => "handed_over").increment(1);
        Ok(link.sandbox)
    }

    /// Pushes the undo of everything a fresh create owns (for [`Self::adopt_running`], which
    /// builds nothing but must remove it all when the adopted sandbox fails).
    fn push_undo_all(
        &self,
        host: &Arc<Host>,
        record: &SandboxRecord,
        cleanup: &mut CleanupStack,
        runtime: &Arc<dyn RuntimeDriver>,
    ) {
        let id = record.sandbox_id;
        let names = host.names(id);
        let paths = host.layout.sandbox(id);
        {
            let (host, paths) = (host.clone(), paths.clone());
            cleanup.push("sandbox dir and address", move || async move {
                host.forget(id);
                host.allocator.release(id);
                remove_sandbox_dir(&paths).await
            });
        }
        if let Some(admitted) = admission(host, record) {
            let (names, firewall) = (names.clone(), self.firewall.clone());
            cleanup.push("network", move || async move {
                firewall.remove(&admitted).await?;
                netns::teardown(&names).await
            });
        }
        {
            let paths = paths.clone();
            cleanup.push("disk mount", move || async move {
                volume::release(&paths).await
            });
        }
        let rootfs = paths.rootfs();
        cleanup.push(
            "overlay mount",
            move || async move { unmount(rootfs).await },
        );
        let (runtime, container_id) = (runtime.clone(), names.container_id);
        cleanup.push("container", move || async move {
            runtime.destroy(&container_id).await
        });
    }

    /// Builds and boots a sandbox no container of which exists: address, network and disk,
    /// overlay and spec, then the container (restored from its memory image where there is
    /// one), then waits for the agent. Each part that exists already is kept.
    async fn build(
        &self,
        host: &Arc<Host>,
        record: &mut SandboxRecord,
        fresh: bool,
        cleanup: &mut CleanupStack,
        runtime: Arc<dyn RuntimeDriver>,
    ) -> Result<Ipv4Addr, HostdError> {
        let id = record.sandbox_id;
        let names = host.names(id);
        let paths = host.layout.sandbox(id);
        let ids = runtime.user_namespace();
        let mut lower = host
            .templates
            .ensure_for(&record.spec.template, record.spec.image.as_deref())
            .instrument(step("template"))
            .await?;
        if let Some(ids) = ids {
            lower = blocking(move || isolation::shifted_template(&lower, ids)).await?;
        }
        let bundle = self.bundles.ensure().await?;
        let seccomp = seccomp::host_profile(match runtime.name() {
            RUNSC => seccomp::Target::Gvisor,
            _ => seccomp::Target::Linux,
        })?;

        if fresh {
            let (host, paths) = (host.clone(), paths.clone());
            cleanup.push("sandbox dir and address", move || async move {
                host.forget(id);
                host.allocator.release(id);
                remove_sandbox_dir(&paths).await
            });
        }
        let link = host
            .claim_address(record, netns::foreign_slots(host.allocator.pool()))
            .await?;
        crash_point(Step::Address);

        let admitted = Admission {
            veth: names.veth_host.clone(),
            link,
            egress: record.spec.network.egress.clone(),
        };
        if fresh || !names.netns_path().exists() {
            let (names, firewall, admitted) =
                (names.clone(), self.firewall.clone(), admitted.clone());
            cleanup.push("network", move || async move {
                firewall.remove(&admitted).await?;
                netns::teardown(&names).await
            });
        }
        let disk_mib = record.spec.disk_mib;
        if fresh || (disk_mib > 0 && !overlay::is_mounted(&paths.disk_mount())?) {
            let paths = paths.clone();
            cleanup.push("disk mount", move || async move {
                volume::release(&paths).await
            });
        }
        // The network and the disk are independent; both undo steps are pushed already.
        // The firewall matches the veth by name, so it is admitted while the veth is made (no
        // container runs behind it yet either way).
        let network = async {
            let namespace = async {
                netns::ensure(&names, &link, &netns::owner_alias(host.host_id, id)).await?;
                if ids.is_some() {
                    let netns_path = names.netns_path();
                    blocking(move || isolation::allow_ping_sockets(&netns_path)).await?;
                }
                Ok::<_, HostdError>(())
            };
            let (namespace, admitted) =
                tokio::join!(namespace, self.admit_to_firewall(host, &admitted));
            namespace.and(admitted)
        }
        .instrument(step("network"));
        let disk = volume::ensure(&paths, disk_mib).instrument(step("disk"));
        let (network, disk) = tokio::join!(network, disk);
        network?;
        disk?;
        crash_point(Step::Network);

        let container_id = names.container_id.clone();
        let rootfs = paths.rootfs();
        if let Some(ids) = ids {
            // The upper dir must be the sandbox's own: new, or written before sandboxes had a
            // user namespace (then shifted once, unmounted, as no container runs on it). It
            // lies on the sandbox's disk, mounted above.
            let (upper, rootfs) = (volume::overlay_dirs(&paths, disk_mib).0, rootfs.clone());
            blocking(move || {
                if !isolation::owns_upper(&upper, ids)? {
                    overlay::unmount(&rootfs)?;
                    isolation::own_upper(&upper, ids)?;
                }
                Ok(())
            })
            .await?;
        }
        if fresh || !overlay::is_mounted(&rootfs)? {
            let rootfs = rootfs.clone();
            cleanup.push(
                "overlay mount",
                move || async move { unmount(rootfs).await },
            );
        }
        let (upper, work) = volume::overlay_dirs(&paths, disk_mib);
        let merged = rootfs.clone();
        blocking(move || overlay::mount_overlay(&lower, &upper, &work, &merged))
            .instrument(step("overlay"))
            .await?;

        let write_spec = || -> Result<(), HostdError> {
            let spec = oci::build_spec(&ContainerConfig {
                rootfs: &rootfs,
                hostname: &names.container_id,
                netns_path: names.netns_path(),
                agent: &bundle,
                resources: record.spec.resources,
                cgroups_path: &names.cgroup,
                user_namespace: ids,
                seccomp: &seccomp,
                pids_limit: runtime.pids_limit(),
                preload_statx_shim: runtime.name() == RUNSC,
            })?;
            write_json_atomic(&paths.oci_config(), &spec)
        };
        // A memory snapshot restores against the spec it was taken with.
        let snapshot = paths.snapshot();
        let restorable = runtime.memory_snapshot() && snapshot.is_dir();
        if !(restorable && paths.oci_config().is_file()) {
            write_spec()?;
        }
        crash_point(Step::Mounted);

        {
            let (runtime, container_id) = (runtime.clone(), container_id.clone());
            cleanup.push("container", move || async move {
                runtime.destroy(&container_id).await
            });
        }
        // Each boot's console starts empty, so a failed boot quotes only its own output.
        let console_log = paths.console_log();
        std::fs::File::create(&console_log)
            .map_err(HostdError::io(format!("create {}", console_log.display())))?;
        remove_file_if_present(&crate::console::rotated(&console_log))?;
        let pid_file = paths.init_pid();
        let request = RunRequest {
            container_id: &container_id,
            bundle: paths.dir(),
            console_log: &console_log,
            pid_file: &pid_file,
        };
        let mut restored = false;
        if restorable {
            let started = Instant::now();
            match runtime
                .restore(request, &snapshot)
                .instrument(step("restore"))
                .await
            {
                Ok(()) => {
                    restored = true;
                    tracing::info!(elapsed = ?started.elapsed(), "memory snapshot restored");
                }
                Err(error) => {
                    tracing::warn!(error = %error.report(), "restore failed; booting from disk");
                    runtime.destroy(&container_id).await?;
                    // The failed restore's runsc took `eth0`'s addresses already (see
                    // `runtime::runsc`): without them the boot's agent is never reachable.
                    netns::ensure(&names, &link, &netns::owner_alias(host.host_id, id)).await?;
                    write_spec()?;
                }
            }
        }
        if !restored {
            runtime.run(request).instrument(step("boot")).await?;
        }
        crash_point(Step::Container);
        // The image is spent: a later start must not resume stale memory over a newer disk.
        remove_dir_if_present(&snapshot).await?;
        let address = SocketAddr::new(link.sandbox.into(), AGENT_PORT);
        wait_for_agent(&*runtime, address, &container_id, paths.console_log())
            .instrument(step("agent"))
            .await?;
        // A memory restore brought the entrypoint's process back with the rest.
        if !restored {
            start_entrypoint(address, &record.spec).await?;
        }
        Ok(link.sandbox)
    }
}

/// How long starting a sandbox's entrypoint may take (the `sh` that puts it in the background
/// returns at once).
pub const ENTRYPOINT_START_TIMEOUT_MS: u64 = 10_000;

/// Starts the spec's entrypoint, if it has one, in the background through the agent: `sh`
/// runs it detached with the spec's env, stdin and output on `/dev/null`, and returns. What
/// the program does next (even failing at once) is the sandbox's, as a container's main
/// process would be; only a failure to start `sh` fails the boot.
///
/// Errors: [`HostdError::Agent`] when the agent does not run it or `sh` exits non-zero.
async fn start_entrypoint(
    address: SocketAddr,
    spec: &berth_schemas::wire::SandboxSpec,
) -> Result<(), HostdError> {
    if spec.entrypoint.is_empty() {
        return Ok(());
    }
    let mut argv: Vec<String> = ["sh", "-c", "\"$@\" </dev/null >/dev/null 2>&1 &", "sh"]
        .map(str::to_owned)
        .to_vec();
    argv.extend(spec.entrypoint.iter().cloned());
    let failed = |reason: String| HostdError::Agent { address, reason };
    match client::exec_with(
        address,
        argv,
        spec.env.clone(),
        None,
        Vec::new(),
        ENTRYPOINT_START_TIMEOUT_MS,
    )
    .await?
    {
        client::ExecResult::Finished(out) if out.exit_code == 0 => {
            tracing::info!(entrypoint = ?spec.entrypoint, "entrypoint started");
            Ok(())
        }
        client::ExecResult::Finished(out) => Err(failed(format!(
            "the entrypoint did not start: exit {}: {}",
            out.exit_code,
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
        client::ExecResult::Refused(why) => {
            Err(failed(format!("the entrypoint did not start: {why}")))
        }
    }
}

impl Backend for OciBackend {
    fn adopt<'a>(&'a self, host: &'a Host) -> BoxFuture<'a, Result<(), HostdError>> {
        crate::adopt::adopt(host, &self.firewall).boxed()
    }

    fn bring_up<'a>(
        &'a self,
        host: &'a Arc<Host>,
        record: &'a mut SandboxRecord,
        fresh: bool,
        cleanup: &'a mut CleanupStack,
    ) -> BoxFuture<'a, Result<Ipv4Addr, HostdError>> {
        self.bring_up_oci(host, record, fresh, cleanup).boxed()
    }

    fn hand_over<'a>(
        &'a self,
        host: &'a Arc<Host>,
        record: &'a mut SandboxRecord,
        cleanup: &'a mut CleanupStack,
    ) -> BoxFuture<'a, Result<Ipv4Addr, HostdError>> {
        self.hand_over_oci(host, record, cleanup).boxed()
    }

    fn tear_down<'a>(
        &'a self,
        host: &'a Host,
        sandbox: SandboxId,
        record: Option<&'a SandboxRecord>,
    ) -> BoxFuture<'a, Result<(), HostdError>> {
        async move {
            let names = host.names(sandbox);
            let paths = host.layout.sandbox(sandbox);
            // The mounts and the network are independent: undone at once.
            let mounts = async {
                unmount(paths.rootfs()).await?;
                volume::release(&paths).await
            };
            let network = async {
                let firewall = async {
                    match record.and_then(|r| admission(host, r)) {
                        Some(admitted) => self.firewall.remove(&admitted).await,
                        None => Ok(()),
                    }
                };
                let (firewall, namespace) = tokio::join!(firewall, netns::remove_namespace(&names));
                firewall.and(namespace)
            };
            let (mounts, network) = tokio::join!(mounts, network);
            mounts.and(network)
        }
        .boxed()
    }

    fn network_gone(&self, host: &Host, sandbox: SandboxId) -> BoxFuture<'static, ()> {
        let names = host.names(sandbox);
        async move { netns::veth_gone(&names).await }.boxed()
    }

    fn answers<'a>(
        &'a self,
        host: &'a Host,
        sandbox: SandboxId,
        link: LinkAddresses,
    ) -> BoxFuture<'a, bool> {
        async move {
            match host.gates.enter(sandbox) {
                Some(_permit) => {
                    let target = crate::agent::kept::Target {
                        gates: host.gates.clone(),
                        sandbox,
                        address: SocketAddr::new(link.sandbox.into(), AGENT_PORT),
                    };
                    crate::agent::kept::ping(&target).await.is_ok()
                }
                // Being stopped: its agent is left alone; it answered until now.
                None => true,
            }
        }
        .boxed()
    }

    fn agent<'a>(
        &'a self,
        host: &'a Host,
        sandbox: SandboxId,
        address: SocketAddr,
        op: AgentOp,
        output: Option<OutputSender>,
    ) -> BoxFuture<'a, AgentReply> {
        agent::run(host, sandbox, address, op, output).boxed()
    }

    fn tty<'a>(
        &'a self,
        host: &'a Host,
        sandbox: SandboxId,
        address: SocketAddr,
        spec: berth_schemas::wire::ExecSpec,
        size: berth_schemas::wire::TtySize,
        output: OutputSender,
        input: crate::agent::client::TtyInputReceiver,
    ) -> BoxFuture<'a, AgentReply> {
        agent::tty(host, sandbox, address, spec, size, output, input).boxed()
    }

    fn shut_down<'a>(&'a self, host: &'a Host) -> BoxFuture<'a, ()> {
        async move {
            // Sandboxes outlive hostd and keep their table; a hostd holding none leaves no
            // table behind (the next start installs it again).
            if host.snapshot().is_empty() {
                if let Err(e) = self.firewall.uninstall().await {
                    tracing::warn!(error = %e.report(), "firewall table not removed");
                }
            }
        }
        .boxed()
    }
}

/// Removes a file; succeeds when it is already gone.
fn remove_file_if_present(path: &std::path::Path) -> Result<(), HostdError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(HostdError::io(format!("remove {}", path.display()))(e))
        }
        _ => Ok(()),
    }
}

/// What the firewall holds of a record's sandbox (its veth, link and egress policy), once the
/// record has an address.
pub fn admission(host: &Host, record: &SandboxRecord) -> Option<Admission> {
    Some(Admission {
        veth: host.names(record.sandbox_id).veth_host,
        link: record.link?,
        egress: record.spec.network.egress.clone(),
    })
}

/// Pings until the agent answers, the container dies, or [`AGENT_READY_TIMEOUT`] passes.
async fn wait_for_agent(
    runtime: &dyn RuntimeDriver,
    address: SocketAddr,
    container_id: &str,
    console_log: PathBuf,
) -> Result<(), HostdError> {
    let deadline = Instant::now() + AGENT_READY_TIMEOUT;
    let mut polls = 0u32;
    let mut pause = FIRST_AGENT_POLL;
    loop {
        if client::ping(address).await.is_ok() {
            return Ok(());
        }
        polls += 1;
        if polls.is_multiple_of(STATUS_CHECK_EVERY)
            && runtime.status(container_id).await? != Some(ContainerStatus::Running)
        {
            return Err(HostdError::ContainerExited {
                container_id: container_id.to_owned(),
                console_tail: console_tail(&console_log),
            });
        }
        if Instant::now() >= deadline {
            return Err(HostdError::AgentTimeout {
                address,
                waited: AGENT_READY_TIMEOUT,
            });
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(AGENT_POLL_INTERVAL);
    }
}
