//! Durable stops and archives (issue 14).
//!
//! - After a stop succeeds, [`durable_after_stop`] uploads the stop snapshot in the background
//!   — the overlay upper dir, and the memory image a gVisor memory stop kept — with
//!   `berth_storage`'s capture and upload (the manifest last), remembers it in the sandbox's
//!   record and reports it as a second result of the stop ([`ResultOutcome::Durable`]). It runs
//!   in the sandbox's command chain, so no later command of the sandbox touches its disk while
//!   it is read; the next command waits for a capture in flight (the disk read, which then
//!   releases the disk) but never for the upload ([`UploadCancels`]),
//!   and an upload already staged finishes off the chain ([`StopReport::Later`]). A hostd
//!   that died during that upload starts it again when it starts ([`StopRef::pending_in`],
//!   `nats::commands`), so a stop a crash interrupted still becomes durable.
//! - An archive ([`archive`]) makes sure the stop snapshot is durable and whole (its manifest
//!   reads back and every chunk it names is in the store; else it uploads the disk now),
//!   records it, and reports it, keeping the disk: the control plane checks the chunks once
//!   more against concurrent chunk removals and only then, with `archived`, queues the
//!   `sandbox.delete` that frees the disk (two-phase free, DESIGN.md guarantee 9). A failed
//!   upload leaves the sandbox as it was, with its disk, and fails the archive with the reason.
//!
//! An unarchive is a clone of the stop snapshot onto this host under the sandbox's own id
//! (`resume.rs`): a new disk seeded from the store, its memory image put where a memory stop
//! leaves one, then the bring-up (on gVisor, `runsc restore`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use berth_schemas::ids::SnapshotId;
use berth_schemas::wire::{Command, CommandResult, ResultOutcome, StopDurable};
use berth_schemas::{CommandId, CommandKind, Generation, SandboxId};
use berth_storage::{Holds, SnapshotInfo, TreeKind, TreeSource};
use tokio_util::sync::CancellationToken;

use crate::error::HostdError;
use crate::host::Host;
use crate::record::{Phase, SandboxRecord};
use crate::runtime::sim::SIM;
use crate::volume;

/// The cancellation of each sandbox's background stop upload, so the sandbox's next command
/// need not wait for it: a command arriving for a sandbox cancels its capture (nothing is
/// stored yet), or lets its staged upload finish off the command chain.
#[derive(Debug, Default)]
pub struct UploadCancels(Mutex<HashMap<SandboxId, CancellationToken>>);

impl UploadCancels {
    /// A new token for `sandbox`'s upload (replacing any older one).
    pub fn arm(&self, sandbox: SandboxId) -> CancellationToken {
        let token = CancellationToken::new();
        self.table().insert(sandbox, token.clone());
        token
    }

    /// Cancels `sandbox`'s upload, if one runs.
    pub fn cancel(&self, sandbox: SandboxId) {
        if let Some(token) = self.table().remove(&sandbox) {
            token.cancel();
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, CancellationToken>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A stop whose snapshot is to be made durable: the stop's command (its durability report is
/// a second result of that command, so the reconciler believes it only as the command that
/// was issued, guarantee 8) and the generation it left the sandbox stopped at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopRef {
    /// The stop command.
    pub command_id: CommandId,
    /// Its sandbox.
    pub sandbox_id: SandboxId,
    /// Its generation.
    pub generation: Generation,
}

impl StopRef {
    /// The stop `cmd`.
    pub fn of(cmd: &Command) -> Self {
        Self {
            command_id: cmd.id,
            sandbox_id: cmd.sandbox_id,
            generation: cmd.generation,
        }
    }

    /// The stop that left `record` stopped, when its snapshot is not durable yet: the record
    /// is `Stopped`, names no durable snapshot, and its result at its applied generation is
    /// that stop's success. A hostd that died during a stop's background upload finds these
    /// at its next start (the stop was acked before its upload began, so nothing redelivers
    /// it) and uploads them again. A record a later command left stopped (a failed archive:
    /// its own generation) is not one: its next archive uploads.
    pub fn pending_in(record: &SandboxRecord) -> Option<Self> {
        if record.phase != Phase::Stopped || record.durable.is_some() {
            return None;
        }
        let stop = record.results.iter().rev().find(|r| {
            r.generation == record.applied_generation
                && r.kind == CommandKind::Stop
                && matches!(
                    r.outcome,
                    ResultOutcome::Succeeded { .. } | ResultOutcome::StoppedOnDisk { .. }
                )
        })?;
        Some(Self {
            command_id: stop.command_id,
            sandbox_id: record.sandbox_id,
            generation: stop.generation,
        })
    }
}

/// A stop's durability report: to publish now, or once an upload its sandbox's next command
/// handed off finishes.
#[derive(Debug)]
pub enum StopReport {
    /// Publish this now.
    Now(CommandResult),
    /// The upload goes on off the command chain; publish what it returns, if anything.
    Later(tokio::task::JoinHandle<Option<CommandResult>>),
}

/// After `stop` succeeded: uploads its stop snapshot, records it, and returns the durability
/// report to publish; `None` when there is nothing to report (the sandbox moved on, a sim host,
/// a capture cancelled or failed, a failed upload: logged). Run it inside
/// [`crate::fault::scope`] of a stop, so the upload passes the stop's `Uploading` crash point.
///
/// `cancel` (the sandbox's next command) stops the capture, the part that reads the disk. An
/// upload already staged is never cut short, which would leave in the store chunks no
/// manifest names: it goes on off the chain ([`StopReport::Later`]) and reports without
/// touching the record, which belongs to the next command now; the reconciler names that
/// snapshot or hands it to the collector.
pub async fn durable_after_stop(
    host: &Arc<Host>,
    stop: StopRef,
    cancel: CancellationToken,
) -> Option<StopReport> {
    let record = host.live(stop.sandbox_id)?;
    if record.phase != Phase::Stopped || record.applied_generation != stop.generation {
        return None;
    }
    let durable = match record.durable.clone() {
        // A redelivered stop: report what was stored again.
        Some(durable) => durable,
        None => {
            let mut capture = std::pin::pin!(stage_stop(host, &record));
            let staged = tokio::select! {
                staged = &mut capture => staged,
                () = cancel.cancelled() => {
                    // The capture reads the mounted disk in a blocking task that cannot be cut
                    // short: dropping it here left the disk mounted, and the next command's
                    // mount or release then failed (`disk.img still attached to loop`: an
                    // archive right after a stop, found by `berth bench --storage`). It is let
                    // finish, which releases the disk, and what it staged is dropped.
                    drop(capture.await);
                    tracing::info!("stop capture cancelled by the sandbox's next command");
                    return None;
                }
            };
            let staged = match staged {
                Ok(Some(staged)) => staged,
                Ok(None) => return None,
                Err(error) => {
                    tracing::warn!(error = %error.report(), "stop capture failed; the stop is not durable");
                    return None;
                }
            };
            let uploading = {
                let host = host.clone();
                crate::fault::scope(CommandKind::Stop, async move {
                    upload_staged(&host, staged).await
                })
            };
            let mut upload = tokio::spawn(uploading);
            let uploaded = tokio::select! {
                uploaded = &mut upload => uploaded,
                () = cancel.cancelled() => {
                    tracing::info!("the sandbox's next command came; its stop upload finishes off the chain");
                    let host = host.clone();
                    let later = async move {
                        match upload.await {
                            Ok(Ok(durable)) => Some(report(&host, stop, durable)),
                            Ok(Err(error)) => {
                                tracing::warn!(error = %error.report(), "stop upload failed");
                                None
                            }
                            Err(error) => {
                                tracing::warn!(%error, "stop upload task failed");
                                None
                            }
                        }
                    };
                    return Some(StopReport::Later(tokio::spawn(later)));
                }
            };
            match uploaded {
                Ok(Ok(durable)) => durable,
                Ok(Err(error)) => {
                    tracing::warn!(error = %error.report(), "stop upload failed; the stop is not durable");
                    return None;
                }
                Err(error) => {
                    tracing::warn!(%error, "stop upload task failed; the stop is not durable");
                    return None;
                }
            }
        }
    };
    let mut current = host.live(stop.sandbox_id)?;
    if current.applied_generation != stop.generation || current.phase != Phase::Stopped {
        return None;
    }
    if current.durable.as_ref() != Some(&durable) {
        current.durable = Some(durable.clone());
        current.durable_by = None;
        if let Err(error) = host.put(&current) {
            tracing::warn!(error = %error.report(), "durable stop not recorded");
        }
    }
    Some(StopReport::Now(report(host, stop, durable)))
}

/// `stop`'s durability report: a second result of the stop command.
fn report(host: &Host, stop: StopRef, durable: StopDurable) -> CommandResult {
    CommandResult {
        command_id: stop.command_id,
        sandbox_id: stop.sandbox_id,
        host_id: host.host_id,
        generation: stop.generation,
        kind: CommandKind::Stop,
        outcome: ResultOutcome::Durable(durable),
        heartbeat_seq: host.heartbeat_seq.current(),
        apply_ms: 0,
    }
}

/// Captures the stopped sandbox's upper dir (and memory image) and uploads it: chunks, then
/// the manifest. `None` on a sim host (it keeps no files).
///
/// Errors: [`HostdError::Storage`] (capture or upload), [`HostdError::Io`], the disk's mount.
pub async fn upload_stop(
    host: &Host,
    record: &SandboxRecord,
) -> Result<Option<StopDurable>, HostdError> {
    match stage_stop(host, record).await? {
        Some(staged) => upload_staged(host, staged).await.map(Some),
        None => Ok(None),
    }
}

/// Captures the stopped sandbox's upper dir (and memory image) into the staging dir, the disk
/// mounted only meanwhile; `None` on a sim host (it keeps no files). The only part of a stop's
/// upload that reads the disk.
///
/// Errors: [`HostdError::Storage`] (capture), [`HostdError::Io`], the disk's mount.
pub async fn stage_stop(
    host: &Host,
    record: &SandboxRecord,
) -> Result<Option<berth_storage::Staged>, HostdError> {
    let runtime = host.runtime_of(record)?;
    if runtime.name() == SIM {
        return Ok(None);
    }
    let id = record.sandbox_id;
    let paths = host.layout.sandbox(id);
    let storage = &host.snapshots;
    let snapshot_id = SnapshotId::new();
    // A full capture: the upload still skips every chunk the store holds already (an
    // earlier stop's), so only what changed travels.
    let parent: Option<berth_storage::Manifest> = None;
    let info = SnapshotInfo {
        snapshot_id,
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
    // A stopped sandbox's disk is unmounted: mount it to read its upper dir.
    volume::ensure(&paths, record.spec.disk_mib).await?;
    let (upper, _work) = volume::overlay_dirs(&paths, record.spec.disk_mib);
    let mut sources = vec![TreeSource {
        kind: TreeKind::Disk,
        root: upper,
    }];
    let memory = paths.snapshot();
    if runtime.memory_snapshot() && memory.is_dir() {
        sources.push(TreeSource {
            kind: TreeKind::Memory,
            root: memory,
        });
    }
    let staging = storage.staging.clone();
    let staged = tokio::task::spawn_blocking(move || {
        berth_storage::stage(info, &sources, parent.as_ref(), &staging)
    })
    .await
    .map_err(|e| HostdError::Io {
        context: "stop capture task".into(),
        source: std::io::Error::other(e),
    });
    let released = volume::release(&paths).await;
    let staged = staged??;
    released?;
    Ok(Some(staged))
}

/// Uploads a staged stop snapshot: its chunks, then its manifest (the host cache keeps the
/// chunks). Passes the `Uploading` crash point after the first chunk.
///
/// Errors: [`HostdError::Storage`].
pub async fn upload_staged(
    host: &Host,
    staged: berth_storage::Staged,
) -> Result<StopDurable, HostdError> {
    let storage = &host.snapshots;
    let manifest = staged.manifest.clone();
    let snapshot_id = manifest.info.snapshot_id;
    // A crash test's point: some chunks are stored, the manifest is not.
    let mid_upload = |p: berth_storage::UploadProgress| {
        if p.chunks_done == 1 {
            crate::fault::crash_point(crate::fault::Step::Uploading);
        }
    };
    let report =
        berth_storage::upload(&storage.objects, staged, Some(&storage.cache), &mid_upload).await?;
    tracing::info!(
        %snapshot_id,
        bytes_uploaded = report.bytes_uploaded,
        chunks_uploaded = report.chunks_uploaded,
        "stop snapshot durable"
    );
    let chunks = manifest.distinct_chunks();
    Ok(StopDurable {
        snapshot_id,
        memory: manifest.holds == Holds::DiskAndMemory,
        stored_bytes: manifest.sizes.stored_bytes,
        chunks,
    })
}

/// Applies a `sandbox.archive` (issue 14, two-phase free): makes the stop snapshot durable and
/// whole in the store, records it, and reports it; the disk stays. Returns the record naming
/// the stored copy and [`ResultOutcome::Durable`], or the record untouched and `Failed` with
/// why. The disk is freed only by the `sandbox.delete` the control plane queues in the
/// transaction that writes `archived` — after its own check of the chunks
/// (`chunks::check_for_ready`), whose verdict may still refuse the copy and leave the sandbox
/// `stopped` here with its disk.
///
/// A stop snapshot this host recorded earlier is reused only when the control plane recorded
/// it (the command's [`Command::snapshot`] names it) or this very archive stored it (a
/// redelivery after a crash, [`SandboxRecord::durable_by`]), and only when every chunk it names
/// is still in the store ([`whole`]); otherwise the disk is captured and uploaded anew, as a
/// new snapshot.
pub async fn archive(
    host: &Arc<Host>,
    cmd: &Command,
    live: Option<SandboxRecord>,
) -> (Option<SandboxRecord>, ResultOutcome) {
    let Some(mut record) = live else {
        let reason = "no such sandbox on this host".to_owned();
        return (None, ResultOutcome::Failed { reason });
    };
    if record.phase != Phase::Stopped {
        let reason = format!("cannot archive a sandbox that is {:?} here", record.phase);
        return (Some(record), ResultOutcome::Failed { reason });
    }
    let named = cmd.snapshot.map(|order| order.snapshot_id);
    let recorded = record
        .durable
        .clone()
        .filter(|d| Some(d.snapshot_id) == named || (record.durable_by == Some(cmd.id)));
    let reused = match recorded {
        Some(durable) => match whole(host, durable.snapshot_id).await {
            Ok(()) => Some(durable),
            Err(why) => {
                tracing::info!(snapshot_id = %durable.snapshot_id, %why,
                    "the recorded stop snapshot is not whole; uploading the disk again");
                None
            }
        },
        None => None,
    };
    let durable = match reused {
        Some(durable) => durable,
        None => {
            let durable = match upload_stop(host, &record).await {
                Ok(Some(durable)) => durable,
                Ok(None) => {
                    let reason = "a sim host keeps no files to archive".to_owned();
                    return (Some(record), ResultOutcome::Rejected { reason });
                }
                Err(error) => {
                    // The user reads the reason: what failed, never the host's paths or the
                    // store's raw error (those go to this log).
                    let reason = format!(
                        "archive upload failed; the sandbox keeps its disk on its host: {}",
                        error.public_reason()
                    );
                    tracing::warn!(error = %error.report(), "archive failed");
                    return (Some(record), ResultOutcome::Failed { reason });
                }
            };
            // Confirmed only when the manifest (written last) reads back and every chunk it
            // names, including those the upload skipped as stored, is there.
            if let Err(why) = whole(host, durable.snapshot_id).await {
                tracing::warn!(snapshot_id = %durable.snapshot_id, %why, "archive not confirmed");
                let reason = format!("archive not confirmed: {why}; the sandbox keeps its disk");
                return (Some(record), ResultOutcome::Failed { reason });
            }
            durable
        }
    };
    // Recorded before it is reported: a redelivered archive reuses it (`durable_by`).
    record.durable = Some(durable.clone());
    record.durable_by = Some(cmd.id);
    if let Err(error) = host.put(&record) {
        tracing::warn!(error = %error.report(), "archive not recorded; the sandbox keeps its disk");
        let reason = "archive not recorded on its host; the sandbox keeps its disk".to_owned();
        return (Some(record), ResultOutcome::Failed { reason });
    }
    crate::fault::crash_point(crate::fault::Step::Captured);
    tracing::info!(snapshot_id = %durable.snapshot_id,
        "stop snapshot stored whole; the disk stays until the control plane frees it");
    (Some(record), ResultOutcome::Durable(durable))
}

/// Whether the stop snapshot `id` is whole in the object store: its manifest reads back and
/// every chunk it names exists ([`berth_storage::missing_chunks`]). `Err` says, for the user,
/// what is not (never a path or the store's raw error; those are logged).
async fn whole(host: &Host, id: SnapshotId) -> Result<(), String> {
    let objects = &host.snapshots.objects;
    let manifest = berth_storage::fetch_manifest(objects, id)
        .await
        .map_err(|error| {
            tracing::warn!(%error, snapshot_id = %id, "stop snapshot manifest not read back");
            "its manifest did not read back from the object store".to_owned()
        })?;
    let missing = berth_storage::missing_chunks(objects, &manifest)
        .await
        .map_err(|error| {
            tracing::warn!(%error, snapshot_id = %id, "stop snapshot chunks not looked up");
            "its chunks could not be looked up in the object store".to_owned()
        })?;
    if missing.is_empty() {
        Ok(())
    } else {
        tracing::warn!(snapshot_id = %id, missing = missing.len(), "stop snapshot lacks chunks");
        Err(format!(
            "{} of its chunks are missing from the object store",
            missing.len()
        ))
    }
}

#[cfg(test)]
mod tests {
    use berth_schemas::wire::{Resources, SandboxSpec};
    use berth_schemas::OrgId;

    use super::*;
    use crate::record::StoredResult;

    fn record(phase: Phase, results: &[(i64, CommandKind, ResultOutcome)]) -> SandboxRecord {
        let spec = SandboxSpec {
            org_id: OrgId::new(),
            template: "base".into(),
            resources: Resources {
                vcpus: 1,
                memory_mib: 128,
            },
            runtime: Default::default(),
            disk_mib: 64,
            network: Default::default(),
            env: Vec::new(),
            entrypoint: Vec::new(),
            image: None,
        };
        let mut r = SandboxRecord::new(SandboxId::new(), spec, "runc", Generation(1));
        for (generation, kind, outcome) in results {
            r.remember(StoredResult {
                command_id: CommandId::new(),
                generation: Generation(*generation),
                kind: *kind,
                outcome: outcome.clone(),
            });
        }
        r.phase = phase;
        r
    }

    fn ok() -> ResultOutcome {
        ResultOutcome::Succeeded {
            address: None,
            last_stop: None,
        }
    }

    #[test]
    fn a_stopped_record_whose_last_result_is_its_stop_is_pending_until_durable() {
        let mut r = record(
            Phase::Stopped,
            &[(1, CommandKind::Create, ok()), (2, CommandKind::Stop, ok())],
        );
        let stop = StopRef::pending_in(&r).expect("its stop's upload is pending");
        assert_eq!(stop.generation, Generation(2));
        assert_eq!(stop.command_id, r.results[1].command_id);
        assert_eq!(stop.sandbox_id, r.sandbox_id);
        r.durable = Some(StopDurable {
            snapshot_id: SnapshotId::new(),
            memory: false,
            stored_bytes: 1,
            chunks: Vec::new(),
        });
        assert_eq!(StopRef::pending_in(&r), None, "durable already");
    }

    #[test]
    fn a_record_not_left_stopped_by_a_successful_stop_is_not_pending() {
        let failed = ResultOutcome::Failed {
            reason: "store down".into(),
        };
        let cases = [
            // Running again.
            record(
                Phase::Running,
                &[(2, CommandKind::Stop, ok()), (3, CommandKind::Start, ok())],
            ),
            // A failed archive at its own generation: the next archive uploads.
            record(
                Phase::Stopped,
                &[
                    (2, CommandKind::Stop, ok()),
                    (3, CommandKind::Archive, failed.clone()),
                ],
            ),
            // A stop that failed.
            record(Phase::Stopped, &[(2, CommandKind::Stop, failed)]),
            // A tombstone.
            record(Phase::Deleted, &[(2, CommandKind::Stop, ok())]),
        ];
        for r in cases {
            assert_eq!(StopRef::pending_in(&r), None, "{:?}", r.results);
        }
    }
}
