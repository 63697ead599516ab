//! The host: what this hostd holds (records, addresses, templates, the runtimes, the agent
//! gates), the [`Backend`] that holds everything a real host and a sim host do differently,
//! and what others may read of it (exec targets, heartbeat snapshots).
//!
//! The [`Backend`] trait lives here, beside the [`Host`] it extends, so the host depends on
//! no implementation: `backend::oci` and `backend::sim` import this module, never the other
//! way round.
//!
//! # Guarantees
//! - On open, every live record's address is reserved again (adoption of its container is
//!   the backend's, see `adopt`).
//! - The in-memory record table mirrors the files: a record is written to disk first, then
//!   to memory. The table's lock is never held across I/O.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};

use berth_schemas::wire::{
    AgentFailure, AgentOp, AgentReply, GuestStatus, InventoryItem, Resources,
};
use berth_schemas::{HostId, SandboxId};
use futures::future::BoxFuture;

use crate::address::{AddressPool, Allocator, LinkAddresses, Slot};
use crate::agent::protocol::AGENT_PORT;
use crate::cleanup::CleanupStack;
use crate::error::HostdError;
use crate::gate::{AgentGates, Permit};
use crate::layout::{SandboxNames, StateLayout};
use crate::record::{Phase, RecordStore, SandboxRecord};
use crate::runtime::{ContainerStatus, RuntimeDriver, Runtimes};
use crate::template::Templates;
use crate::HostdConfig;

/// Chunks of a streamed exec's output (`(fd, bytes)`), as they come from the agent. Bounded:
/// while it is full, hostd stops reading the agent's connection, so a slow consumer slows
/// the process (its pipe fills) instead of growing a buffer.
pub type OutputSender = tokio::sync::mpsc::Sender<(u8, Vec<u8>)>;

/// Everything a real host and a sim host do differently: the machine-facing half of each
/// use case. The use cases (`apply`, `nats`) call these and never ask which backend runs.
///
/// Implementations: `backend::oci::OciBackend` (OCI runtime, netns, overlay, nftables,
/// cgroups, the in-sandbox agent) and `backend::sim::SimBackend` (control-plane load only).
pub trait Backend: Send + Sync + 'static {
    /// Adopts what a previous run of this hostd left (containers, mounts, networks, the
    /// firewall table) before the first command is applied.
    ///
    /// Errors: [`HostdError`] when what is there cannot be listed.
    fn adopt<'a>(&'a self, host: &'a Host) -> BoxFuture<'a, Result<(), HostdError>>;

    /// Makes the sandbox of `record` run and returns its address. Each step pushes its undo
    /// onto `cleanup` *before* acting when this attempt owns what it builds: everything for
    /// a `fresh` create, only what was missing for a start. `record.link` is set (and the
    /// record written) once the address is reserved.
    ///
    /// Errors: any step's; the caller runs `cleanup`.
    fn bring_up<'a>(
        &'a self,
        host: &'a Arc<Host>,
        record: &'a mut SandboxRecord,
        fresh: bool,
        cleanup: &'a mut CleanupStack,
    ) -> BoxFuture<'a, Result<Ipv4Addr, HostdError>>;

    /// Hands a warm pool sandbox ([`crate::warm`]) over to the create whose spec `record`
    /// now holds (of the pool's shape, so its limits and disk are right already): what the
    /// create sets beyond the shape (its network policy, its entrypoint) is applied and its
    /// address returned. Pushes the undo of everything the sandbox holds onto `cleanup`, as a
    /// fresh create does. The default builds it as a fresh create ([`Backend::bring_up`]).
    ///
    /// Errors: any step's; the caller runs `cleanup`.
    fn hand_over<'a>(
        &'a self,
        host: &'a Arc<Host>,
        record: &'a mut SandboxRecord,
        cleanup: &'a mut CleanupStack,
    ) -> BoxFuture<'a, Result<Ipv4Addr, HostdError>> {
        self.bring_up(host, record, true, cleanup)
    }

    /// Removes what the sandbox holds besides its container, address and dir (network,
    /// mount, firewall elements), whether or not it exists; `record` is the sandbox's record
    /// (its address and network policy), when there is one. What the kernel finishes
    /// removing after this returns (a namespace's veth pair) is awaited by
    /// [`Backend::network_gone`].
    ///
    /// Errors: any step's; the delete is retried.
    fn tear_down<'a>(
        &'a self,
        host: &'a Host,
        sandbox: SandboxId,
        record: Option<&'a SandboxRecord>,
    ) -> BoxFuture<'a, Result<(), HostdError>>;

    /// Resolves once the network [`Backend::tear_down`] removed is gone from the machine, so
    /// its address may be handed out again. The default: at once (nothing outlives the
    /// tear-down).
    fn network_gone(&self, host: &Host, sandbox: SandboxId) -> BoxFuture<'static, ()> {
        let _ = (host, sandbox);
        Box::pin(async {})
    }

    /// Whether the agent of a sandbox whose container runs answers, for heartbeats.
    fn answers<'a>(
        &'a self,
        host: &'a Host,
        sandbox: SandboxId,
        link: LinkAddresses,
    ) -> BoxFuture<'a, bool>;

    /// Carries out one agent operation for a running sandbox whose agent listens at
    /// `address` (the caller holds its gate permit). A streamed exec sends its output to
    /// `output` as it arrives.
    fn agent<'a>(
        &'a self,
        host: &'a Host,
        sandbox: SandboxId,
        address: SocketAddr,
        op: AgentOp,
        output: Option<OutputSender>,
    ) -> BoxFuture<'a, AgentReply>;

    /// Runs a terminal session ([`AgentOp::Tty`]) for a running sandbox whose agent listens
    /// at `address` (the caller holds its gate permit): output to `output`, input from
    /// `input`; answers with the exit. The default refuses: a backend without containers has
    /// no terminal to offer.
    #[allow(clippy::too_many_arguments)]
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
        let _ = (host, sandbox, address, spec, size, output, input);
        Box::pin(async {
            AgentReply::Failed(berth_schemas::wire::AgentFailure::Agent(
                "this runtime offers no terminal sessions".into(),
            ))
        })
    }

    /// Tidies up when hostd stops (sandboxes keep running).
    fn shut_down<'a>(&'a self, host: &'a Host) -> BoxFuture<'a, ()>;
}

/// Everything one hostd owns.
pub struct Host {
    /// This host's stable id (see [`crate::host_id`]).
    pub host_id: HostId,
    /// Where its files live.
    pub layout: StateLayout,
    /// Its sandbox records on disk.
    pub store: RecordStore,
    /// Sandbox addresses.
    pub allocator: Arc<Allocator>,
    /// The templates it knows.
    pub templates: Templates,
    /// The runtimes this host offers; each record names the one its sandbox uses.
    pub runtimes: Runtimes,
    /// Agent calls in flight per sandbox (drained before a memory snapshot).
    pub gates: Arc<AgentGates>,
    /// Everything a real host and a sim host do differently.
    pub backend: Arc<dyn Backend>,
    /// The sequence of this host's heartbeats, which its results echo.
    pub heartbeat_seq: HeartbeatSeq,
    /// Where snapshots go, and this host's cache of their chunks.
    pub snapshots: SnapshotStorage,
    /// The background stop uploads, by sandbox, so a sandbox's next command cancels its own.
    pub uploads: crate::apply::archive::UploadCancels,
    /// Sandboxes booted ahead of creates ([`crate::warm`]).
    pub warm: crate::warm::WarmPool,
    records: Mutex<HashMap<SandboxId, SandboxRecord>>,
    /// Each sandbox's OOM counter file, found once ([`Host::oom_counter`]).
    oom_counters: Mutex<HashMap<SandboxId, std::path::PathBuf>>,
}

/// A host's side of snapshot storage: the object store, the bounded chunk cache
/// (`<state dir>/chunk-cache`) and the staging dir snapshots are captured into before upload
/// (`<state dir>/snapshot-staging`, emptied at start: a capture a crash interrupted is gone, and
/// its snapshot fails by timeout).
#[derive(Debug, Clone)]
pub struct SnapshotStorage {
    /// The object store.
    pub objects: berth_storage::Objects,
    /// Chunks this host holds.
    pub cache: Arc<berth_storage::ChunkCache>,
    /// Where captures are staged (same filesystem as the cache, so chunks move by rename).
    pub staging: std::path::PathBuf,
}

/// How often hostd sweeps its chunk cache against the object store.
pub const CACHE_SWEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(600);

/// Sweeps the host's chunk cache every `interval` until `stop` ([`SnapshotStorage::sweep_cache`]).
pub async fn sweep_cache_every(
    host: Arc<Host>,
    interval: std::time::Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        match host.snapshots.sweep_cache().await {
            Ok(freed) => tracing::info!(bytes_freed = freed, "chunk cache swept"),
            Err(e) => tracing::warn!(error = %e, "chunk cache not swept"),
        }
    }
}

impl SnapshotStorage {
    /// Drops from the host's chunk cache every chunk the object store no longer holds: a chunk
    /// leaves the store only once no snapshot row references it (a snapshot delete's claimed
    /// removal, `berth_store::chunks`), so this sweeps the local copies no row references.
    /// The cache stays LRU-bounded in between. Returns the bytes freed.
    ///
    /// Errors: [`berth_storage::StorageError::Store`] when the store cannot be listed (nothing
    /// is dropped then).
    pub async fn sweep_cache(&self) -> Result<u64, berth_storage::StorageError> {
        let stored: std::collections::HashSet<String> = self
            .objects
            .list("chunks")
            .await?
            .into_iter()
            .filter_map(|(key, _)| {
                let name = key.rsplit('/').next()?;
                Some(name.strip_suffix(".zst").unwrap_or(name).to_owned())
            })
            .collect();
        Ok(self.cache.sweep(&|hash| stored.contains(hash)))
    }

    fn open(layout: &StateLayout, config: &HostdConfig) -> Result<Self, HostdError> {
        let staging = layout.root().join("snapshot-staging");
        let _ = std::fs::remove_dir_all(&staging);
        Ok(Self {
            objects: berth_storage::Objects::open(&config.object_store)?,
            cache: Arc::new(berth_storage::ChunkCache::open(
                &layout.root().join("chunk-cache"),
                config.chunk_cache_bytes,
            )?),
            staging,
        })
    }
}

/// The sequence of a host's heartbeats ([`berth_schemas::wire::Heartbeat::seq`]): each takes
/// `max(previous + 1, now in Unix milliseconds)`, so it rises within a process and, as long as
/// the host's clock does not go back by more than a restart takes, across restarts too.
#[derive(Debug, Default)]
pub struct HeartbeatSeq(std::sync::atomic::AtomicU64);

impl HeartbeatSeq {
    /// Takes the next sequence number for a heartbeat sent at `now_ms` (Unix milliseconds). A
    /// heartbeat takes it before observing its inventory, so a result that read
    /// [`HeartbeatSeq::current`] after its command was applied is older than every heartbeat
    /// with a greater number.
    pub fn next(&self, now_ms: u64) -> u64 {
        use std::sync::atomic::Ordering;
        let prev = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |prev| {
                Some(prev.saturating_add(1).max(now_ms))
            })
            .unwrap_or_else(|prev| prev);
        prev.saturating_add(1).max(now_ms)
    }

    /// The newest number taken (0 before the first heartbeat).
    pub fn current(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Host {
    /// Loads the live records of `config.state_dir` and reserves their addresses.
    ///
    /// Errors: [`HostdError::Io`] when the state dir cannot be read.
    pub fn open(
        host_id: HostId,
        config: &HostdConfig,
        runtimes: Runtimes,
        backend: Arc<dyn Backend>,
    ) -> Result<Self, HostdError> {
        let layout = StateLayout::new(&config.state_dir);
        let store = RecordStore::new(layout.clone());
        let allocator = Arc::new(Allocator::new(AddressPool::new(config.address_pool)));
        let mut records = HashMap::new();
        for record in store.load_live()? {
            if let Some(link) = record.link {
                allocator.restore(record.sandbox_id, link);
            }
            records.insert(record.sandbox_id, record);
        }
        let snapshots = SnapshotStorage::open(&layout, config)?;
        Ok(Self {
            host_id,
            snapshots,
            templates: Templates::new(layout.templates_dir(), config.template_cache.clone()),
            layout,
            store,
            allocator,
            runtimes,
            gates: AgentGates::new(),
            backend,
            heartbeat_seq: HeartbeatSeq::default(),
            uploads: Default::default(),
            warm: crate::warm::WarmPool::new(&config.warm_pool, config.capacity.memory_mib),
            records: Mutex::new(records),
            oom_counters: Mutex::default(),
        })
    }

    /// The kernel-visible names of a sandbox of this host.
    pub fn names(&self, sandbox: SandboxId) -> SandboxNames {
        SandboxNames::derive(self.host_id, sandbox)
    }

    /// A copy of every live record.
    pub fn snapshot(&self) -> Vec<SandboxRecord> {
        self.table().values().cloned().collect()
    }

    /// A copy of the sandbox's live record.
    pub fn live(&self, sandbox: SandboxId) -> Option<SandboxRecord> {
        self.table().get(&sandbox).cloned()
    }

    /// Writes the live record to disk, then to memory.
    ///
    /// Errors: [`HostdError::Io`].
    pub fn put(&self, record: &SandboxRecord) -> Result<(), HostdError> {
        self.store.save(record)?;
        self.table().insert(record.sandbox_id, record.clone());
        Ok(())
    }

    /// Drops the sandbox from memory (its files are the caller's business).
    pub fn forget(&self, sandbox: SandboxId) {
        self.table().remove(&sandbox);
    }

    /// The runtime driver of a record.
    ///
    /// Errors: [`HostdError::UnsupportedRuntime`].
    pub fn runtime_of(&self, record: &SandboxRecord) -> Result<Arc<dyn RuntimeDriver>, HostdError> {
        self.runtimes.get(&record.runtime)
    }

    /// Where to reach the agent of a running sandbox, with the permit that counts the call as
    /// in flight (hold it for the call's length).
    ///
    /// Errors: [`AgentFailure::NotFound`] without a live record; [`AgentFailure::NotRunning`]
    /// when it is not (meant to be) running, or is being stopped.
    pub fn exec_target(&self, sandbox: SandboxId) -> Result<(SocketAddr, Permit), AgentFailure> {
        let address = {
            let table = self.table();
            let record = table.get(&sandbox).ok_or(AgentFailure::NotFound)?;
            match (record.phase, record.link) {
                (Phase::Running, Some(link)) => SocketAddr::new(link.sandbox.into(), AGENT_PORT),
                _ => return Err(AgentFailure::NotRunning),
            }
        };
        let permit = self.gates.enter(sandbox).ok_or(AgentFailure::NotRunning)?;
        Ok((address, permit))
    }

    /// The OOM kills counted in the sandbox's memory cgroup, when it runs and the count can be
    /// read.
    pub async fn oom_kills(&self, sandbox: SandboxId) -> Option<u64> {
        crate::cgroup::read_oom_kills(&self.oom_counter(sandbox).await?)
    }

    /// The file counting OOM kills in the sandbox's memory cgroup, when it runs (when it does
    /// not, the file a known one names is gone, and reads as no count).
    ///
    /// Found once and kept until the sandbox's delete: the cgroup path is the bundle's
    /// `cgroupsPath`, the same for every run of the sandbox. It is found from the pid the
    /// runtime wrote at boot ([`crate::layout::SandboxPaths::init_pid`]) when that process's
    /// cgroup is the sandbox's own (a pid file of an earlier run may name a process that is
    /// gone, or someone else's), else from the pid the runtime's `state` gives. Every exec
    /// reads the counter before and after, and asking the runtime cost each exec a runtime
    /// process: about 7 ms of a runc exec's 12 ms round trip, 30 ms on gVisor (issue 16).
    pub async fn oom_counter(&self, sandbox: SandboxId) -> Option<std::path::PathBuf> {
        if let Some(known) = self.oom_counters().get(&sandbox) {
            return Some(known.clone());
        }
        let names = self.names(sandbox);
        let booted = std::fs::read_to_string(self.layout.sandbox(sandbox).init_pid())
            .ok()
            .and_then(|pid| pid.trim().parse::<i64>().ok())
            .and_then(crate::cgroup::oom_counter_of)
            .filter(|file| crate::cgroup::is_in(file, &names.cgroup));
        let found = match booted {
            Some(file) => file,
            None => {
                let record = self.live(sandbox)?;
                let runtime = self.runtime_of(&record).ok()?;
                let pid = runtime.pid(&names.container_id).await.ok()??;
                crate::cgroup::oom_counter_of(pid)?
            }
        };
        self.oom_counters().insert(sandbox, found.clone());
        Some(found)
    }

    /// Drops what [`Host::oom_counter`] kept of a deleted sandbox.
    pub fn forget_oom_counter(&self, sandbox: SandboxId) {
        self.oom_counters().remove(&sandbox);
    }

    /// Resolves once the sandbox's container no longer runs (polled every `interval`); never
    /// while it runs.
    pub async fn stopped_running(&self, sandbox: SandboxId, interval: std::time::Duration) {
        // Not knowing is not "stopped": without a record or runtime this never resolves, and
        // the exec ends by its own answer or timeout.
        let Some(record) = self.live(sandbox) else {
            return std::future::pending().await;
        };
        let Ok(runtime) = self.runtime_of(&record) else {
            return std::future::pending().await;
        };
        let container_id = self.names(sandbox).container_id;
        loop {
            tokio::time::sleep(interval).await;
            match runtime.status(&container_id).await {
                Ok(Some(ContainerStatus::Running)) | Err(_) => {}
                Ok(_) => return,
            }
        }
    }

    /// Reserves the sandbox's address (again, when the record has one), then writes the
    /// record with it and lifts any tombstone. `foreign` yields the slots in use by others on
    /// this machine; it is awaited only when a new address is needed.
    ///
    /// Errors: `foreign`'s; [`HostdError::AddressPoolExhausted`]; [`HostdError::Io`] from the
    /// store.
    pub async fn claim_address(
        &self,
        record: &mut SandboxRecord,
        foreign: impl Future<Output = Result<BTreeSet<Slot>, HostdError>>,
    ) -> Result<LinkAddresses, HostdError> {
        let id = record.sandbox_id;
        let link = match record.link {
            Some(link) => {
                self.allocator.restore(id, link);
                link
            }
            None => self.allocator.reserve(id, &foreign.await?)?,
        };
        record.link = Some(link);
        self.put(record)?;
        self.store.unbury(id)?;
        Ok(link)
    }

    /// Every container of every runtime this host offers, by id.
    ///
    /// Errors: [`HostdError`] from a runtime's `list`.
    pub async fn containers(&self) -> Result<HashMap<String, ContainerStatus>, HostdError> {
        let mut all = HashMap::new();
        for runtime in self.runtimes.all() {
            all.extend(runtime.list().await?);
        }
        Ok(all)
    }

    /// The heartbeat's `used` and `inventory`: each live sandbox's status as observed now
    /// (runtime state plus an agent ping), and the resources of those not `Stopped`; warm pool
    /// sandboxes are in neither.
    ///
    /// Errors: [`HostdError`] from the runtime's `list`.
    pub async fn observe(&self) -> Result<(Resources, Vec<InventoryItem>), HostdError> {
        // Warm pool sandboxes are no sandboxes of the control plane's: the heartbeat offers
        // them apart (`Heartbeat::warm`) and takes what they hold off its capacity.
        let mut records = self.snapshot();
        records.retain(|r| !r.warm);
        let containers = self.containers().await?;
        let checks = records.iter().map(|record| {
            let container = containers
                .get(&self.names(record.sandbox_id).container_id)
                .copied();
            async move {
                let running = container == Some(ContainerStatus::Running);
                let answers = match (running, record.link) {
                    (true, Some(link)) => self.backend.answers(self, record.sandbox_id, link).await,
                    _ => false,
                };
                InventoryItem {
                    sandbox_id: record.sandbox_id,
                    generation: record.applied_generation,
                    status: guest_status(record.phase, running, answers),
                }
            }
        });
        let inventory = futures::future::join_all(checks).await;
        // What runs or should run holds resources; only a stopped sandbox does not.
        let used = records
            .iter()
            .zip(&inventory)
            .filter(|(_, item)| item.status != GuestStatus::Stopped)
            .fold(Resources::default(), |acc, (r, _)| Resources {
                vcpus: acc.vcpus + r.spec.resources.vcpus,
                memory_mib: acc.memory_mib + r.spec.resources.memory_mib,
            });
        Ok((used, inventory))
    }

    fn table(&self) -> MutexGuard<'_, HashMap<SandboxId, SandboxRecord>> {
        // Writers replace whole entries, so a poisoned table is still consistent.
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn oom_counters(&self) -> MutexGuard<'_, HashMap<SandboxId, std::path::PathBuf>> {
        // Whole entries too.
        self.oom_counters.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A sandbox's status as observed: what runs is `Running` (agent answers) or `Unhealthy`;
/// what does not run is `Stopped` when it was stopped on purpose, else `Unhealthy` (it should
/// run — a dead container or an interrupted create — and the control plane should know).
pub fn guest_status(phase: Phase, container_running: bool, agent_answers: bool) -> GuestStatus {
    match (container_running, agent_answers, phase) {
        (true, true, _) => GuestStatus::Running,
        (true, false, _) => GuestStatus::Unhealthy,
        (false, _, Phase::Stopped) => GuestStatus::Stopped,
        (false, _, _) => GuestStatus::Unhealthy,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heartbeat_sequence_rises_by_one_or_jumps_to_the_clock() {
        let seq = HeartbeatSeq::default();
        assert_eq!(seq.current(), 0);
        assert_eq!(seq.next(1_000), 1_000);
        // The clock did not move (or went back): still one more than before.
        assert_eq!(seq.next(1_000), 1_001);
        assert_eq!(seq.next(500), 1_002);
        assert_eq!(seq.current(), 1_002);
        // A restarted hostd starts from its clock, above what its predecessor sent.
        let restarted = HeartbeatSeq::default();
        assert!(restarted.next(2_000) > seq.current());
    }

    #[test]
    fn a_running_container_whose_agent_answers_is_running() {
        assert_eq!(
            guest_status(Phase::Running, true, true),
            GuestStatus::Running
        );
        // Observed state wins over the record: a start interrupted after the container came up.
        assert_eq!(
            guest_status(Phase::Stopped, true, true),
            GuestStatus::Running
        );
    }

    #[test]
    fn a_running_container_whose_agent_is_silent_is_unhealthy() {
        assert_eq!(
            guest_status(Phase::Running, true, false),
            GuestStatus::Unhealthy
        );
    }

    #[test]
    fn a_dead_container_is_unhealthy_unless_the_sandbox_was_stopped() {
        assert_eq!(
            guest_status(Phase::Running, false, false),
            GuestStatus::Unhealthy
        );
        assert_eq!(
            guest_status(Phase::Creating, false, false),
            GuestStatus::Unhealthy
        );
        assert_eq!(
            guest_status(Phase::Stopped, false, false),
            GuestStatus::Stopped
        );
    }
}
