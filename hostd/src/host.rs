//! The host: what this hostd holds (records, addresses, templates, the agent bundle, the
//! runtime) and what others may read of it (exec targets, heartbeat snapshots).
//!
//! # Guarantees
//! - On open, every live record is adopted: its address is reserved again and its container,
//!   if still running, is left running (never started twice). Containers in this hostd's
//!   runtime root that no record accounts for are destroyed (DESIGN.md guarantee 5).
//! - The in-memory record table mirrors the files: a record is written to disk first, then
//!   to memory. The table's lock is never held across I/O.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use berth_schemas::wire::{ExecError, GuestStatus, InventoryItem, Resources};
use berth_schemas::{HostId, SandboxId};

use crate::address::{AddressPool, Allocator};
use crate::agent::protocol::AGENT_PORT;
use crate::bundle::Bundles;
use crate::error::HostdError;
use crate::firewall::Firewall;
use crate::gate::{AgentGates, Permit};
use crate::layout::{firewall_table, SandboxNames, StateLayout};
use crate::record::{Phase, RecordStore, SandboxRecord, TOMBSTONE_RETENTION};
use crate::runtime::{ContainerStatus, RuntimeDriver, Runtimes};
use crate::template::Templates;
use crate::HostdConfig;

/// Everything one hostd owns.
pub struct Host {
    pub host_id: HostId,
    pub layout: StateLayout,
    pub store: RecordStore,
    pub allocator: Allocator,
    pub templates: Templates,
    pub bundles: Bundles,
    /// The runtimes this host offers; each record names the one its sandbox uses.
    pub runtimes: Runtimes,
    /// Agent calls in flight per sandbox (drained before a memory snapshot).
    pub gates: Arc<AgentGates>,
    /// This hostd's nftables table.
    pub firewall: Firewall,
    records: Mutex<HashMap<SandboxId, SandboxRecord>>,
}

impl Host {
    /// Loads the live records of `config.state_dir` and reserves their addresses.
    ///
    /// Errors: [`HostdError::Io`] when the state dir cannot be read.
    pub fn open(
        host_id: HostId,
        config: &HostdConfig,
        runtimes: Runtimes,
    ) -> Result<Self, HostdError> {
        let layout = StateLayout::new(&config.state_dir);
        let store = RecordStore::new(layout.clone());
        let allocator = Allocator::new(AddressPool::new(config.address_pool));
        let mut records = HashMap::new();
        for record in store.load_live()? {
            if let Some(link) = record.link {
                allocator.restore(record.sandbox_id, link);
            }
            records.insert(record.sandbox_id, record);
        }
        Ok(Self {
            host_id,
            templates: Templates::new(layout.templates_dir(), config.template_cache.clone()),
            bundles: Bundles::new(layout.agent_dir(), config.agent_binary.clone()),
            layout,
            store,
            allocator,
            runtimes,
            gates: AgentGates::new(),
            firewall: Firewall::new(firewall_table(host_id)),
            records: Mutex::new(records),
        })
    }

    /// Adopts what a previous run left: destroys containers no record accounts for, reports
    /// the state of the others, purges old tombstones, sweeps stray mounts, namespaces and
    /// veths, and rebuilds the firewall table (see `sweep`).
    ///
    /// Errors: [`HostdError`] from the runtime's `list`.
    pub async fn adopt(&self) -> Result<(), HostdError> {
        let purged = self.store.purge_tombstones(TOMBSTONE_RETENTION);
        let records = self.snapshot();
        let known: HashMap<String, &SandboxRecord> = records
            .iter()
            .map(|r| (self.names(r.sandbox_id).container_id, r))
            .collect();
        let mut containers = HashMap::new();
        for runtime in self.runtimes.all() {
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
        let swept = crate::sweep::sweep(self).await?;
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
    /// Errors: [`ExecError::NotFound`] without a live record; [`ExecError::NotRunning`] when it
    /// is not (meant to be) running, or is being stopped.
    pub fn exec_target(&self, sandbox: SandboxId) -> Result<(SocketAddr, Permit), ExecError> {
        let address = {
            let table = self.table();
            let record = table.get(&sandbox).ok_or(ExecError::NotFound)?;
            match (record.phase, record.link) {
                (Phase::Running, Some(link)) => SocketAddr::new(link.sandbox.into(), AGENT_PORT),
                _ => return Err(ExecError::NotRunning),
            }
        };
        let permit = self.gates.enter(sandbox).ok_or(ExecError::NotRunning)?;
        Ok((address, permit))
    }

    /// The OOM kills counted in the sandbox's memory cgroup, when it runs and the count can be
    /// read.
    pub async fn oom_kills(&self, sandbox: SandboxId) -> Option<u64> {
        crate::cgroup::read_oom_kills(&self.oom_counter(sandbox).await?)
    }

    /// The file counting OOM kills in the sandbox's memory cgroup, when it runs.
    pub async fn oom_counter(&self, sandbox: SandboxId) -> Option<std::path::PathBuf> {
        let record = self.live(sandbox)?;
        let runtime = self.runtime_of(&record).ok()?;
        let pid = runtime
            .pid(&self.names(sandbox).container_id)
            .await
            .ok()??;
        crate::cgroup::oom_counter_of(pid)
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

    /// Admits a sandbox's link into the firewall table; when that fails (the table went
    /// missing, say), reinstalls the table from the live records plus `link`.
    ///
    /// Errors: [`HostdError::Nft`] from the reinstall.
    pub async fn admit_to_firewall(
        &self,
        link: &crate::address::LinkAddresses,
    ) -> Result<(), HostdError> {
        let Err(first) = self.firewall.admit(link).await else {
            return Ok(());
        };
        tracing::warn!(error = %first.report(), "firewall admit failed; reinstalling the table");
        let mut links: Vec<_> = self.snapshot().iter().filter_map(|r| r.link).collect();
        if !links.contains(link) {
            links.push(*link);
        }
        self.firewall.install(&links).await
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
    /// (runtime state plus an agent ping), and the resources of those not `Stopped`.
    ///
    /// Errors: [`HostdError`] from the runtime's `list`.
    pub async fn observe(&self) -> Result<(Resources, Vec<InventoryItem>), HostdError> {
        let records = self.snapshot();
        let containers = self.containers().await?;
        let checks = records.iter().map(|record| {
            let container = containers
                .get(&self.names(record.sandbox_id).container_id)
                .copied();
            async move {
                let running = container == Some(ContainerStatus::Running);
                let answers = match (running, record.link) {
                    // A sim sandbox has no agent; running is answering.
                    (true, Some(_)) if self.runtimes.simulated() => true,
                    (true, Some(link)) => match self.gates.enter(record.sandbox_id) {
                        Some(_permit) => crate::agent::client::ping(SocketAddr::new(
                            link.sandbox.into(),
                            AGENT_PORT,
                        ))
                        .await
                        .is_ok(),
                        // Being stopped: its agent is left alone; it answered until now.
                        None => true,
                    },
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
