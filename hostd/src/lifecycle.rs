//! Applying commands: the fence, then create/start (bring up), stop, delete, then the record.
//!
//! # Guarantees
//! - At most once (DESIGN.md guarantee 2): see `fence`. The result is written to the record
//!   before it is published, so a redelivery republishes it instead of redoing the work.
//! - Bring-up converges: every step checks what exists (record, address, netns, veth, mount,
//!   container), so a create redelivered after a crash finishes the sandbox without
//!   duplicating anything. On failure a cleanup stack undoes this attempt's work, newest first;
//!   a failed *create* removes everything and leaves a tombstone.
//! - Delete is idempotent and converges: it removes whatever exists by derived names; a failure
//!   is not reported but retried ([`Applied::Retry`]).
//!
//! # Assumptions
//! Commands of one sandbox are applied one at a time (`commands` chains them).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_schemas::wire::{Command, CommandResult, ResultOutcome, StopMode};
use berth_schemas::CommandKind;
use tracing::Instrument;

use crate::agent::client;
use crate::agent::protocol::AGENT_PORT;
use crate::cleanup::CleanupStack;
use crate::error::HostdError;
use crate::fence::{self, Fence};
use crate::host::Host;
use crate::layout::SandboxPaths;
use crate::metrics::{self, CommandOutcome};
use crate::oci::{self, ContainerConfig};
use crate::record::{write_json_atomic, Phase, SandboxRecord, StoredResult};
use crate::runtime::cli::console_tail;
use crate::runtime::{ContainerStatus, RunRequest, RuntimeDriver};
use crate::{netns, overlay, template, DEFAULT_RUNTIME};

/// How long a started container's agent has to answer its first ping.
pub const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Pause between pings while waiting for the agent. A ping to an agent not yet listening is
/// refused at once, so polling often is cheap; at 100 ms the wait alone was up to a third of
/// create→running (`berth bench`).
const AGENT_POLL_INTERVAL: Duration = Duration::from_millis(10);

/// While waiting for the agent, ask the runtime whether the container still runs every this
/// many pings, about every 500 ms (so a crashed boot fails fast with its console output).
const STATUS_CHECK_EVERY: u32 = 50;

/// How long a memory stop waits for the sandbox's agent calls in flight to finish before it
/// checkpoints anyway (a connection still open then makes the checkpoint fail, and the stop
/// falls back to disk only).
pub const CHECKPOINT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a memory stop waits after the agent calls drained, so the agent's side of the
/// last connections finishes closing (gVisor refuses to save an endpoint in CLOSE_WAIT or
/// LAST_ACK just as it does one in TIME_WAIT).
pub const CHECKPOINT_SETTLE: Duration = Duration::from_millis(200);

/// The runtime a command's template runs in; [`DEFAULT_RUNTIME`] for an unknown template
/// (whose create fails at the template step anyway).
fn runtime_name(templates: &template::Templates, cmd: &Command) -> &'static str {
    templates
        .runtime_of(&cmd.spec.template)
        .unwrap_or(DEFAULT_RUNTIME)
}

/// What to do with a command message after [`Host::apply`].
#[derive(Debug)]
pub enum Applied {
    /// Publish this result, then ack the message.
    Respond {
        result: CommandResult,
        outcome: CommandOutcome,
    },
    /// Publish nothing; nak the message so it is redelivered later (delete must converge, and a
    /// record that could not be written must not be acked).
    Retry { error: HostdError },
}

impl Host {
    /// Applies one command (fence, work, record) and says what to publish.
    pub async fn apply(self: &Arc<Self>, cmd: &Command) -> Applied {
        let span = tracing::info_span!(
            "apply",
            host_id = %self.host_id,
            sandbox_id = %cmd.sandbox_id,
            command_id = %cmd.id,
            kind = %cmd.kind,
            generation = %cmd.generation,
        );
        let started = Instant::now();
        let applied = self.apply_inner(cmd).instrument(span).await;
        metrics::runtime_operation(
            runtime_name(&self.templates, cmd),
            operation(cmd.kind),
            started.elapsed(),
        );
        match &applied {
            Applied::Respond { outcome, .. } => metrics::command(cmd.kind, *outcome),
            Applied::Retry { .. } => metrics::command(cmd.kind, CommandOutcome::Retried),
        }
        applied
    }

    async fn apply_inner(self: &Arc<Self>, cmd: &Command) -> Applied {
        let record = match self.live(cmd.sandbox_id) {
            Some(r) => Some(r),
            None => match self.store.load(cmd.sandbox_id) {
                Ok(r) => r,
                Err(error) => return Applied::Retry { error },
            },
        };
        match fence::check(record.as_ref(), cmd) {
            Fence::Replay(stored) => {
                tracing::info!("command already applied; replaying its result");
                return Applied::Respond {
                    result: stored.to_wire(self.host_id, cmd.sandbox_id),
                    outcome: CommandOutcome::Replayed,
                };
            }
            Fence::RefuseStale { applied } => {
                tracing::info!(%applied, "refusing a stale command");
                return Applied::Respond {
                    result: self.result(cmd, ResultOutcome::RefusedStale { applied }),
                    outcome: CommandOutcome::RefusedStale,
                };
            }
            Fence::Apply => {}
        }
        let live = record.clone().filter(|r| !r.is_tombstone());
        let (after, outcome) = match cmd.kind {
            CommandKind::Create | CommandKind::Start => self.up(cmd, live).await,
            CommandKind::Stop => self.stop(live).await,
            CommandKind::Delete => match self.delete(cmd, record).await {
                Ok(done) => done,
                Err(error) => {
                    tracing::warn!(error = %error.report(), "delete failed; will retry");
                    return Applied::Retry { error };
                }
            },
        };
        let stored = StoredResult {
            command_id: cmd.id,
            generation: cmd.generation,
            kind: cmd.kind,
            outcome,
        };
        if let Some(mut record) = after {
            record.remember(stored.clone());
            let persisted = if record.is_tombstone() {
                self.store
                    .bury(&record)
                    .map(|()| self.forget(cmd.sandbox_id))
            } else {
                self.put(&record)
            };
            if let Err(error) = persisted {
                tracing::error!(error = %error.report(), "record not written; will retry");
                return Applied::Retry { error };
            }
        }
        let outcome = match stored.outcome {
            ResultOutcome::Succeeded { .. } => CommandOutcome::Succeeded,
            ResultOutcome::Failed { .. } => CommandOutcome::Failed,
            ResultOutcome::RefusedStale { .. } => CommandOutcome::RefusedStale,
        };
        Applied::Respond {
            result: stored.to_wire(self.host_id, cmd.sandbox_id),
            outcome,
        }
    }

    fn result(&self, cmd: &Command, outcome: ResultOutcome) -> CommandResult {
        CommandResult {
            command_id: cmd.id,
            sandbox_id: cmd.sandbox_id,
            host_id: self.host_id,
            generation: cmd.generation,
            kind: cmd.kind,
            outcome,
        }
    }

    /// Create, or start: make the sandbox run. Without a live record (a start after a failed
    /// create) this is a full create from `cmd.spec`.
    async fn up(
        self: &Arc<Self>,
        cmd: &Command,
        live: Option<SandboxRecord>,
    ) -> (Option<SandboxRecord>, ResultOutcome) {
        let (mut record, fresh) = match live {
            Some(r) => {
                let fresh = r.phase == Phase::Creating;
                (r, fresh)
            }
            None => (
                SandboxRecord::new(
                    cmd.sandbox_id,
                    cmd.spec.clone(),
                    runtime_name(&self.templates, cmd),
                    cmd.generation,
                ),
                true,
            ),
        };
        let mut cleanup = CleanupStack::new();
        let started = Instant::now();
        match self.bring_up(&mut record, fresh, &mut cleanup).await {
            Ok(address) => {
                cleanup.disarm();
                record.phase = Phase::Running;
                tracing::info!(%address, elapsed = ?started.elapsed(), fresh, "sandbox running");
                let outcome = ResultOutcome::Succeeded {
                    address: Some(address.to_string()),
                    last_stop: None,
                };
                (Some(record), outcome)
            }
            Err(error) => {
                let mut reason = error.report();
                if let Err(cleanup_error) = cleanup.run().await {
                    reason = format!("{reason}; {}", cleanup_error.report());
                }
                tracing::warn!(%reason, fresh, "bring-up failed");
                if fresh {
                    record.phase = Phase::FailedCreate;
                    record.link = None;
                }
                (Some(record), ResultOutcome::Failed { reason })
            }
        }
    }

    /// The steps of [`Self::up`]; each pushes its undo onto `cleanup` *before* acting (undo
    /// steps are idempotent), when this attempt owns what it builds: everything for a fresh
    /// create, only what was missing for a start.
    async fn bring_up(
        self: &Arc<Self>,
        record: &mut SandboxRecord,
        fresh: bool,
        cleanup: &mut CleanupStack,
    ) -> Result<Ipv4Addr, HostdError> {
        let id = record.sandbox_id;
        let names = self.names(id);
        let paths = self.layout.sandbox(id);
        let runtime = self.runtime_of(record)?;
        self.gates.open(id);
        if runtime.simulated() {
            return crate::runtime::sim::bring_up(self, record, &*runtime).await;
        }
        let lower = self.templates.ensure(&record.spec.template).await?;
        let bundle = self.bundles.ensure().await?;

        if fresh {
            let (host, paths) = (self.clone(), paths.clone());
            cleanup.push("sandbox dir and address", move || async move {
                host.forget(id);
                host.allocator.release(id);
                remove_sandbox_dir(&paths).await
            });
        }
        let link = match record.link {
            Some(link) => {
                self.allocator.restore(id, link);
                link
            }
            None => {
                let foreign = netns::foreign_slots(self.allocator.pool()).await?;
                self.allocator.reserve(id, &foreign)?
            }
        };
        record.link = Some(link);
        self.put(record)?;
        self.store.unbury(id)?;

        if fresh || !names.netns_path().exists() {
            let (names, firewall) = (names.clone(), self.firewall.clone());
            cleanup.push("network", move || async move {
                firewall.remove(&link).await?;
                netns::teardown(&names).await
            });
        }
        netns::ensure(&names, &link, &netns::owner_alias(self.host_id, id)).await?;
        self.admit_to_firewall(&link).await?;

        let rootfs = paths.rootfs();
        if fresh || !overlay::is_mounted(&rootfs)? {
            let rootfs = rootfs.clone();
            cleanup.push(
                "overlay mount",
                move || async move { unmount(rootfs).await },
            );
        }
        let (upper, work, merged) = (paths.upper(), paths.work(), rootfs.clone());
        blocking(move || overlay::mount_overlay(&lower, &upper, &work, &merged)).await?;

        let write_spec = || -> Result<(), HostdError> {
            let spec = oci::build_spec(&ContainerConfig {
                rootfs: &rootfs,
                hostname: &names.container_id,
                netns_path: names.netns_path(),
                agent: &bundle,
                resources: record.spec.resources,
                cgroups_path: &names.cgroup,
            })?;
            write_json_atomic(&paths.oci_config(), &spec)
        };
        // A memory snapshot restores against the spec it was taken with.
        let snapshot = paths.snapshot();
        let restorable = runtime.memory_snapshot() && snapshot.is_dir();
        if !(restorable && paths.oci_config().is_file()) {
            write_spec()?;
        }

        let container_id = names.container_id.clone();
        let status = runtime.status(&container_id).await?;
        if fresh || status != Some(ContainerStatus::Running) {
            let (runtime, container_id) = (runtime.clone(), container_id.clone());
            cleanup.push("container", move || async move {
                runtime.destroy(&container_id).await
            });
        }
        if status != Some(ContainerStatus::Running) {
            let console_log = paths.console_log();
            std::fs::File::create(&console_log)
                .map_err(HostdError::io(format!("create {}", console_log.display())))?;
            let request = RunRequest {
                container_id: &container_id,
                bundle: paths.dir(),
                console_log: &console_log,
            };
            let mut restored = false;
            if restorable {
                let started = Instant::now();
                match runtime.restore(request, &snapshot).await {
                    Ok(()) => {
                        restored = true;
                        tracing::info!(elapsed = ?started.elapsed(), "memory snapshot restored");
                    }
                    Err(error) => {
                        tracing::warn!(error = %error.report(), "restore failed; booting from disk");
                        runtime.destroy(&container_id).await?;
                        write_spec()?;
                    }
                }
            }
            if !restored {
                if status.is_some() {
                    runtime.destroy(&container_id).await?;
                }
                runtime.run(request).await?;
            }
            // The image is spent: a later start must not resume stale memory over a newer disk.
            remove_dir_if_present(&snapshot).await?;
        }
        let address = SocketAddr::new(link.sandbox.into(), AGENT_PORT);
        self.wait_for_agent(&*runtime, address, &container_id, paths.console_log())
            .await?;
        Ok(link.sandbox)
    }

    /// Pings until the agent answers, the container dies, or [`AGENT_READY_TIMEOUT`] passes.
    async fn wait_for_agent(
        &self,
        runtime: &dyn RuntimeDriver,
        address: SocketAddr,
        container_id: &str,
        console_log: PathBuf,
    ) -> Result<(), HostdError> {
        let deadline = Instant::now() + AGENT_READY_TIMEOUT;
        let mut polls = 0u32;
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
            tokio::time::sleep(AGENT_POLL_INTERVAL).await;
        }
    }

    /// Stop: on a runtime with memory snapshots, drain the agent's connections and checkpoint
    /// (falling back to disk only when the checkpoint fails); then destroy the container and
    /// unmount the overlay; keep the upper dir, the network and the address. Stopping a
    /// stopped sandbox succeeds and reports how it was kept.
    async fn stop(&self, live: Option<SandboxRecord>) -> (Option<SandboxRecord>, ResultOutcome) {
        let Some(mut record) = live else {
            return (
                None,
                ResultOutcome::Failed {
                    reason: "no such sandbox on this host".into(),
                },
            );
        };
        let id = record.sandbox_id;
        let names = self.names(id);
        let paths = self.layout.sandbox(id);
        let done = async {
            let runtime = self.runtime_of(&record)?;
            let status = runtime.status(&names.container_id).await?;
            let snapshot = paths.snapshot();
            let mut mode = if snapshot.is_dir() {
                StopMode::Memory
            } else {
                StopMode::Disk
            };
            if runtime.memory_snapshot() && status == Some(ContainerStatus::Running) {
                if !self
                    .gates
                    .close_and_drain(id, CHECKPOINT_DRAIN_TIMEOUT)
                    .await
                {
                    tracing::warn!(waited = ?CHECKPOINT_DRAIN_TIMEOUT, "agent calls still in flight; checkpointing anyway");
                }
                tokio::time::sleep(CHECKPOINT_SETTLE).await;
                let started = Instant::now();
                mode = match runtime.checkpoint(&names.container_id, &snapshot).await {
                    Ok(()) => {
                        tracing::info!(elapsed = ?started.elapsed(), "memory snapshot taken");
                        StopMode::Memory
                    }
                    Err(error) => {
                        tracing::warn!(error = %error.report(), "checkpoint failed; stopping with disk only");
                        remove_dir_if_present(&snapshot).await?;
                        StopMode::Disk
                    }
                };
            }
            runtime.destroy(&names.container_id).await?;
            unmount(paths.rootfs()).await?;
            Ok::<_, HostdError>(mode)
        }
        .await;
        self.gates.open(id);
        match done {
            Ok(mode) => {
                record.phase = Phase::Stopped;
                tracing::info!(last_stop = mode.as_str(), "sandbox stopped");
                let outcome = ResultOutcome::Succeeded {
                    address: None,
                    last_stop: Some(mode),
                };
                (Some(record), outcome)
            }
            Err(error) => {
                let reason = error.report();
                tracing::warn!(%reason, "stop failed");
                (Some(record), ResultOutcome::Failed { reason })
            }
        }
    }

    /// Delete: remove whatever exists (container, mount, network, address, files), by derived
    /// names, so it also finishes a delete or create that crashed half-way.
    ///
    /// Errors: any step's error; the caller retries later.
    async fn delete(
        &self,
        cmd: &Command,
        record: Option<SandboxRecord>,
    ) -> Result<(Option<SandboxRecord>, ResultOutcome), HostdError> {
        if self.runtimes.simulated() {
            let tombstone = crate::runtime::sim::delete(self, cmd, record).await?;
            let outcome = ResultOutcome::Succeeded {
                address: None,
                last_stop: None,
            };
            return Ok((Some(tombstone), outcome));
        }
        let id = cmd.sandbox_id;
        let names = self.names(id);
        let paths = self.layout.sandbox(id);
        // Whatever runtime holds it (a record-less delete does not know which).
        for runtime in self.runtimes.all() {
            runtime.destroy(&names.container_id).await?;
        }
        unmount(paths.rootfs()).await?;
        if let Some(link) = record.as_ref().and_then(|r| r.link) {
            self.firewall.remove(&link).await?;
        }
        netns::teardown(&names).await?;
        self.allocator.release(id);
        remove_sandbox_dir(&paths).await?;
        let mut tombstone = record.unwrap_or_else(|| {
            SandboxRecord::new(
                id,
                cmd.spec.clone(),
                runtime_name(&self.templates, cmd),
                cmd.generation,
            )
        });
        tombstone.phase = Phase::Deleted;
        tombstone.link = None;
        tracing::info!("sandbox deleted");
        let outcome = ResultOutcome::Succeeded {
            address: None,
            last_stop: None,
        };
        Ok((Some(tombstone), outcome))
    }
}

/// The metrics `operation` label of a whole command.
fn operation(kind: CommandKind) -> &'static str {
    match kind {
        CommandKind::Create => "create",
        CommandKind::Start => "start",
        CommandKind::Stop => "stop",
        CommandKind::Delete => "delete",
    }
}

/// Runs a blocking filesystem/mount step off the async threads.
async fn blocking<T, F>(f: F) -> Result<T, HostdError>
where
    F: FnOnce() -> Result<T, HostdError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| HostdError::Io {
            context: "blocking task".into(),
            source: std::io::Error::other(e),
        })?
}

/// Removes a directory tree; succeeds when it is already gone.
async fn remove_dir_if_present(dir: &std::path::Path) -> Result<(), HostdError> {
    match tokio::fs::remove_dir_all(dir).await {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(HostdError::io(format!("remove {}", dir.display()))(e))
        }
        _ => Ok(()),
    }
}

async fn unmount(path: PathBuf) -> Result<(), HostdError> {
    blocking(move || overlay::unmount(&path)).await
}

/// Removes the sandbox dir; succeeds when it is already gone. Refuses while the overlay is
/// still mounted (removing through it would only litter the upper dir with whiteouts).
async fn remove_sandbox_dir(paths: &SandboxPaths) -> Result<(), HostdError> {
    let rootfs = paths.rootfs();
    if overlay::is_mounted(&rootfs)? {
        return Err(HostdError::Io {
            context: format!("remove {}: overlay still mounted", paths.dir().display()),
            source: std::io::ErrorKind::ResourceBusy.into(),
        });
    }
    let dir = paths.dir();
    match tokio::fs::remove_dir_all(dir).await {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(HostdError::io(format!("remove {}", dir.display()))(e))
        }
        _ => Ok(()),
    }
}
