//! Restore and clone (issue 13 items 5–6): a sandbox's disk (and on gVisor its memory) rebuilt
//! from a stored snapshot, then booted by the same bring-up as a create or start.
//!
//! - restore (`sandbox.restore`, a sandbox this host holds): its container is destroyed (the
//!   network and address stay), the overlay's upper dir is replaced by the snapshot's disk
//!   tree and its memory image (if any) put where a memory stop leaves one, then it is brought
//!   up again: on gVisor `runsc restore` continues the snapshot's processes, against the
//!   sandbox's own spec; on runc it boots from the restored disk. Files written after the
//!   snapshot are gone.
//! - clone (`sandbox.clone`, a new sandbox): its disk is made and seeded the same way, then a
//!   fresh create runs, with its own id, address and container. A memory image restores
//!   against the clone's own spec; where runsc refuses it, the clone boots from the disk (the
//!   bring-up's fallback, logged).
//!
//! Chunks come from the host's cache first, else the object store (and are cached). A clone
//! of a fork waits for its snapshot's manifest ([`SNAPSHOT_WAIT`]): a snapshot is durable, and
//! usable, only once its manifest is stored.
//!
//! # Crash safety
//! Seeding is written beside its target and renamed into place, the disk last: an upper dir
//! that exists is a finished seed. A clone redelivered after a crash keeps a finished seed
//! (and adopts a container that runs); a restore redelivered starts again from the snapshot.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_schemas::wire::{Command, ResultOutcome, SnapshotOrder};
use berth_schemas::CommandKind;
use berth_storage::{Manifest, StorageError, TreeKind};

use crate::disk::{blocking, remove_dir_if_present, remove_sandbox_dir, unmount};
use crate::error::HostdError;
use crate::fault::{crash_point, Step};
use crate::host::Host;
use crate::record::{Phase, SandboxRecord};
use crate::runtime::sim::SIM;
use crate::volume;

/// How long a clone waits for its snapshot's manifest to be stored (a fork's clones are sent
/// with the snapshot they boot from, which is still being taken).
pub const SNAPSHOT_WAIT: Duration = Duration::from_secs(120);

/// Pause between looks for a manifest not stored yet.
const SNAPSHOT_POLL: Duration = Duration::from_millis(25);

/// Applies a `sandbox.restore` or `sandbox.clone`.
pub async fn resume(
    host: &Arc<Host>,
    cmd: &Command,
    live: Option<SandboxRecord>,
) -> (Option<SandboxRecord>, ResultOutcome) {
    let Some(order) = cmd.snapshot else {
        let reason = format!("a {} command without its snapshot", cmd.kind);
        return (live, ResultOutcome::Rejected { reason });
    };
    match cmd.kind {
        CommandKind::Restore => restore(host, cmd, order, live).await,
        _ => clone(host, cmd, order, live).await,
    }
}

async fn restore(
    host: &Arc<Host>,
    cmd: &Command,
    order: SnapshotOrder,
    live: Option<SandboxRecord>,
) -> (Option<SandboxRecord>, ResultOutcome) {
    let Some(mut record) = live else {
        return (
            None,
            ResultOutcome::Failed {
                reason: "no such sandbox on this host".into(),
            },
        );
    };
    let closed = host.gates.close_while(record.sandbox_id);
    if let Err(error) = rebuild(host, &record, order).await {
        let reason = format!(
            "restore from snapshot {}: {}",
            order.snapshot_id,
            error.public_reason()
        );
        tracing::warn!(error = %error.report(), snapshot_id = %order.snapshot_id, "restore failed");
        record.phase = Phase::Stopped;
        return (Some(record), ResultOutcome::Failed { reason });
    }
    drop(closed);
    record.phase = Phase::Stopped;
    super::up::up(host, cmd, Some(record)).await
}

/// Tears the sandbox's container and root down and seeds its disk (and memory image) from
/// the snapshot; the network, address and disk stay.
async fn rebuild(
    host: &Arc<Host>,
    record: &SandboxRecord,
    order: SnapshotOrder,
) -> Result<(), HostdError> {
    let id = record.sandbox_id;
    let runtime = host.runtime_of(record)?;
    if runtime.name() == SIM {
        return Ok(());
    }
    let manifest = wait_for_manifest(host, order, Duration::ZERO).await?;
    let names = host.names(id);
    let paths = host.layout.sandbox(id);
    runtime.destroy(&names.container_id).await?;
    unmount(paths.rootfs()).await?;
    volume::ensure(&paths, record.spec.disk_mib).await?;
    let (upper, work) = volume::overlay_dirs(&paths, record.spec.disk_mib);
    remove_dir_if_present(&upper).await?;
    remove_dir_if_present(&work).await?;
    seed(host, record, &manifest, &paths.snapshot(), &upper).await?;
    crash_point(Step::Seeded);
    Ok(())
}

async fn clone(
    host: &Arc<Host>,
    cmd: &Command,
    order: SnapshotOrder,
    live: Option<SandboxRecord>,
) -> (Option<SandboxRecord>, ResultOutcome) {
    let record = match live {
        Some(r) => r,
        None => match super::new_record(host, cmd) {
            Some(r) => r,
            None => {
                let reason = "a clone command without its spec".to_owned();
                return (None, ResultOutcome::Rejected { reason });
            }
        },
    };
    // A fork's clone waits for its snapshot's manifest; an unarchive's (or a migration's) stop
    // snapshot was confirmed stored before it was sent, so a missing one fails at once.
    let wait = if matches!(cmd.kind, CommandKind::Unarchive | CommandKind::Migrate) {
        Duration::ZERO
    } else {
        SNAPSHOT_WAIT
    };
    if record.phase == Phase::Creating {
        if let Err(error) = prepare_clone(host, &record, order, wait).await {
            let what = match cmd.kind {
                CommandKind::Unarchive => "unarchive of stop snapshot",
                // A start elsewhere (a durable stop) or a restore from backup.
                CommandKind::Migrate => "boot from snapshot",
                _ => "clone of snapshot",
            };
            let reason = format!("{what} {}: {}", order.snapshot_id, error.public_reason());
            tracing::warn!(error = %error.report(), snapshot_id = %order.snapshot_id, "clone failed");
            let paths = host.layout.sandbox(record.sandbox_id);
            let cleaned = async {
                volume::release(&paths).await?;
                remove_sandbox_dir(&paths).await
            }
            .await;
            if let Err(e) = cleaned {
                tracing::warn!(error = %e.report(), "clone's partial disk not removed");
            }
            let mut record = record;
            record.phase = Phase::FailedCreate;
            record.link = None;
            return (Some(record), ResultOutcome::Failed { reason });
        }
    }
    super::up::up(host, cmd, Some(record)).await
}

/// Makes a new sandbox's disk and seeds it from the snapshot, unless a seed finished already
/// (a redelivery after a crash).
async fn prepare_clone(
    host: &Arc<Host>,
    record: &SandboxRecord,
    order: SnapshotOrder,
    wait: Duration,
) -> Result<(), HostdError> {
    if host.runtime_of(record)?.name() == SIM {
        return Ok(());
    }
    let paths = host.layout.sandbox(record.sandbox_id);
    let (upper, _) = volume::overlay_dirs(&paths, record.spec.disk_mib);
    std::fs::create_dir_all(paths.dir())
        .map_err(HostdError::io(format!("create {}", paths.dir().display())))?;
    volume::ensure(&paths, record.spec.disk_mib).await?;
    if upper.is_dir() {
        tracing::info!("the clone's disk was seeded before; keeping it");
        return Ok(());
    }
    let manifest = wait_for_manifest(host, order, wait).await?;
    seed(host, record, &manifest, &paths.snapshot(), &upper).await?;
    crash_point(Step::Seeded);
    Ok(())
}

/// Writes the snapshot's memory image (if it holds one) to `memory` and its disk tree to
/// `upper` (which must not exist), each beside its target first, the disk last. On runc the
/// upper dir's root is given to the sandbox's ids (its contents carry them already, as
/// captured).
async fn seed(
    host: &Arc<Host>,
    record: &SandboxRecord,
    manifest: &Manifest,
    memory: &Path,
    upper: &Path,
) -> Result<(), HostdError> {
    let storage = &host.snapshots;
    let started = Instant::now();
    remove_dir_if_present(memory).await?;
    if manifest.memory.is_some() && host.runtime_of(record)?.memory_snapshot() {
        let partial = beside(memory);
        remove_dir_if_present(&partial).await?;
        berth_storage::materialize(
            &storage.objects,
            &storage.cache,
            manifest,
            TreeKind::Memory,
            &partial,
        )
        .await?;
        rename(&partial, memory)?;
    }
    let partial = beside(upper);
    remove_dir_if_present(&partial).await?;
    let fetched = berth_storage::materialize(
        &storage.objects,
        &storage.cache,
        manifest,
        TreeKind::Disk,
        &partial,
    )
    .await?;
    if let Some(ids) = host.runtime_of(record)?.user_namespace() {
        let root = partial.clone();
        blocking(move || {
            let id = ids.to_host(0);
            std::os::unix::fs::chown(&root, Some(id), Some(id))
                .map_err(HostdError::io(format!("chown {}", root.display())))
        })
        .await?;
    }
    rename(&partial, upper)?;
    tracing::info!(
        snapshot_id = %manifest.info.snapshot_id,
        memory = manifest.memory.is_some(),
        chunks_fetched = fetched.chunks_fetched,
        bytes_fetched = fetched.bytes_fetched,
        chunks_from_cache = fetched.chunks_from_cache,
        elapsed = ?started.elapsed(),
        "disk seeded from the snapshot"
    );
    Ok(())
}

/// The snapshot's manifest, looked for until `wait` passes while it is not stored yet.
///
/// Errors: [`HostdError::Storage`] — not stored by then, or the store failed.
async fn wait_for_manifest(
    host: &Host,
    order: SnapshotOrder,
    wait: Duration,
) -> Result<Manifest, HostdError> {
    let deadline = Instant::now() + wait;
    loop {
        match berth_storage::fetch_manifest(&host.snapshots.objects, order.snapshot_id).await {
            Err(StorageError::NotFound(_)) if Instant::now() < deadline => {
                tokio::time::sleep(SNAPSHOT_POLL).await;
            }
            other => return Ok(other?),
        }
    }
}

fn beside(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".partial");
    path.with_file_name(name)
}

fn rename(from: &Path, to: &Path) -> Result<(), HostdError> {
    std::fs::rename(from, to).map_err(HostdError::io(format!(
        "rename {} to {}",
        from.display(),
        to.display()
    )))
}
