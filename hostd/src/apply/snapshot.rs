//! Snapshot (issue 13 item 4): capture a running sandbox into the object store without
//! stopping it.
//!
//! - runc: freeze the container (`runc pause`, the cgroup freezer), capture the overlay upper
//!   dir into a staging dir (only what changed since the parent snapshot is read and
//!   compressed), thaw. `paused_ms` is the time from freeze to thaw.
//! - gVisor: drain the agent's calls, `runsc checkpoint` saves its memory and ends it, the
//!   upper dir is captured while nothing runs (disk and memory of the same instant), then the
//!   sandbox is restored in place. `paused_ms` covers checkpoint, capture and restore. (This
//!   runsc's `pause` does not pause a restored sandbox, so the disk is never captured under
//!   it after a restore.)
//! - Then, with the sandbox running again, upload: chunks first, the manifest last. The
//!   result reports the snapshot only once its manifest is stored (DESIGN.md guarantee 9).
//!
//! A backup (issue 14, [`berth_schemas::wire::SnapshotOrder::disk_only`]) skips the gVisor
//! checkpoint: the disk is captured under the same brief freeze on every runtime.
//!
//! A failure at any step fails the snapshot ([`ResultOutcome::Failed`]), never the sandbox: a
//! frozen container is always thawed, and the sandbox's record and state are not touched.
//! The staging dir of a failed capture is removed.

use std::time::{Duration, Instant};

use berth_schemas::wire::{Command, ResultOutcome, SnapshotStored};
use berth_storage::{Holds, SnapshotInfo, TreeKind, TreeSource};

use crate::error::HostdError;
use crate::host::Host;
use crate::record::SandboxRecord;
use crate::runtime::ContainerStatus;

/// How long a gVisor snapshot waits for the sandbox's agent calls in flight to finish before it
/// checkpoints anyway (as a memory stop does, see [`super::stop::CHECKPOINT_DRAIN_TIMEOUT`]).
pub const SNAPSHOT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Takes the snapshot `cmd` orders of the sandbox of `live`. The record comes back unchanged
/// (the apply stores the result in it, for a redelivery's replay).
pub async fn snapshot(
    host: &Host,
    cmd: &Command,
    live: Option<SandboxRecord>,
) -> (Option<SandboxRecord>, ResultOutcome) {
    let Some(record) = live else {
        return (
            None,
            ResultOutcome::Failed {
                reason: "no such sandbox on this host".into(),
            },
        );
    };
    let Some(order) = cmd.snapshot else {
        return (
            Some(record),
            ResultOutcome::Rejected {
                reason: "a snapshot command without its snapshot order".into(),
            },
        );
    };
    let outcome = match take(host, &record, order).await {
        Ok(stored) => ResultOutcome::Snapshotted(stored),
        Err(error) => {
            // The reason reaches the user (the snapshot's `reason`): no host paths in it; the
            // whole chain goes to the log.
            let reason = format!("snapshot failed: {}", error.public_reason());
            tracing::warn!(error = %error.report(), snapshot_id = %order.snapshot_id, "snapshot failed; the sandbox is untouched");
            ResultOutcome::Failed { reason }
        }
    };
    (Some(record), outcome)
}

async fn take(
    host: &Host,
    record: &SandboxRecord,
    order: berth_schemas::wire::SnapshotOrder,
) -> Result<SnapshotStored, HostdError> {
    let id = record.sandbox_id;
    let names = host.names(id);
    let paths = host.layout.sandbox(id);
    let runtime = host.runtime_of(record)?;
    if runtime.status(&names.container_id).await? != Some(ContainerStatus::Running) {
        return Err(HostdError::UnknownSandbox { sandbox_id: id });
    }
    let storage = &host.snapshots;
    let parent = match order.parent {
        Some(p) => match berth_storage::fetch_manifest(&storage.objects, p).await {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::info!(error = %e, parent = %p, "parent snapshot unreadable; taking a full snapshot");
                None
            }
        },
        None => None,
    };
    let info = SnapshotInfo {
        snapshot_id: order.snapshot_id,
        sandbox_id: id,
        template: record.spec.template.clone(),
        runtime: record.spec.runtime,
        vcpus: record.spec.resources.vcpus,
        memory_mib: record.spec.resources.memory_mib,
        disk_mib: record.spec.disk_mib,
        parent: parent.as_ref().map(|m| m.info.snapshot_id),
    };
    std::fs::create_dir_all(&storage.staging)
        .map_err(HostdError::io("create the snapshot staging dir"))?;
    let memory_dir = storage
        .staging
        .join(format!("{}.memory", order.snapshot_id));
    let (upper, _work) = crate::volume::overlay_dirs(&paths, record.spec.disk_mib);
    let mut sources = vec![TreeSource {
        kind: TreeKind::Disk,
        root: upper,
    }];
    let started = Instant::now();
    let staging = storage.staging.clone();
    let stage = move |sources: Vec<TreeSource>| async move {
        tokio::task::spawn_blocking(move || {
            berth_storage::stage(info, &sources, parent.as_ref(), &staging)
        })
        .await
        .map_err(|e| HostdError::Io {
            context: "snapshot capture task".into(),
            source: std::io::Error::other(e),
        })
    };
    // A backup keeps the disk only: no checkpoint, only the freeze of the disk capture.
    let with_memory = runtime.memory_snapshot() && !order.disk_only;
    let (staged, paused) = if with_memory {
        if !host.gates.close_and_drain(id, SNAPSHOT_DRAIN_TIMEOUT).await {
            tracing::warn!(waited = ?SNAPSHOT_DRAIN_TIMEOUT, "agent calls still in flight; checkpointing anyway");
        }
        super::settle::before_checkpoint(record.link).await;
        // Checkpoint (this runsc's `checkpoint --leave-running` never returns, so the sandbox
        // ends), capture the disk while nothing runs, then restore in place. The disk is
        // captured before the restore, not under a `runsc pause` after it: this runsc's pause
        // does not pause a restored sandbox (runsc 0.0~20221219: a restored counter went on
        // writing while "paused"), so a disk captured then was a running sandbox's, later than
        // its memory, and a file it renamed meanwhile failed the capture.
        let checkpointed = runtime.checkpoint(&names.container_id, &memory_dir).await;
        let staged = match &checkpointed {
            Ok(()) => {
                sources.push(TreeSource {
                    kind: TreeKind::Memory,
                    root: memory_dir.clone(),
                });
                Some(stage(sources).await)
            }
            Err(_) => None,
        };
        // Restore whatever the capture did: a snapshot never leaves its sandbox stopped.
        let restored = match checkpointed {
            Ok(()) => {
                async {
                    let link = record
                        .link
                        .ok_or(HostdError::UnknownSandbox { sandbox_id: id })?;
                    crate::netns::ensure(
                        &names,
                        &link,
                        &crate::netns::owner_alias(host.host_id, id),
                    )
                    .await?;
                    // The sandbox's netstack took its address off `eth0` at boot; the
                    // restore reads it from there again, as a memory stop's next start does.
                    runtime
                        .restore(
                            crate::runtime::RunRequest {
                                container_id: &names.container_id,
                                bundle: paths.dir(),
                                console_log: &paths.console_log(),
                                pid_file: &paths.init_pid(),
                            },
                            &memory_dir,
                        )
                        .await
                }
                .await
            }
            Err(e) => Err(e),
        };
        host.gates.open(id);
        let _ = std::fs::remove_dir_all(&memory_dir);
        restored?;
        let staged = staged.ok_or(HostdError::UnknownSandbox { sandbox_id: id })?;
        (staged, started.elapsed())
    } else {
        runtime.freeze(&names.container_id).await?;
        let staged = stage(sources).await;
        // Thaw whatever the capture did: a snapshot never leaves its sandbox frozen.
        let thawed = runtime.thaw(&names.container_id).await;
        let paused = started.elapsed();
        thawed?;
        (staged, paused)
    };
    let staged = staged??;
    crate::fault::crash_point(crate::fault::Step::Captured);
    let paused_ms = u32::try_from(paused.as_millis()).unwrap_or(u32::MAX);
    tracing::info!(
        paused_ms,
        new_chunks = staged.new_chunks().len(),
        "snapshot captured; uploading"
    );
    let manifest = staged.manifest.clone();
    let report =
        berth_storage::upload(&storage.objects, staged, Some(&storage.cache), &|_| {}).await?;
    tracing::info!(
        snapshot_id = %order.snapshot_id,
        bytes_uploaded = report.bytes_uploaded,
        chunks_uploaded = report.chunks_uploaded,
        "snapshot durable"
    );
    let chunks = manifest.distinct_chunks();
    Ok(SnapshotStored {
        memory: manifest.holds == Holds::DiskAndMemory,
        logical_bytes: manifest.sizes.logical_bytes,
        stored_bytes: manifest.sizes.stored_bytes,
        new_bytes: manifest.sizes.new_bytes,
        paused_ms,
        chunks,
    })
}
