//! Stop: keep the sandbox's disk (and, where the runtime can, its memory), end its container.
//!
//! On a runtime with memory snapshots the agent's connections are drained and the container
//! checkpointed, falling back to disk only when the checkpoint fails; then the container is
//! destroyed and the overlay and the disk unmounted (on a sim host only the mount table is
//! read). The disk image, the network and the address are kept for the next start.

use std::time::{Duration, Instant};

use berth_schemas::wire::{ResultOutcome, StopFallback, StopFallbackCode, StopMode};

use crate::disk::{remove_dir_if_present, unmount};
use crate::error::HostdError;
use crate::fault::{crash_point, Step};
use crate::host::Host;
use crate::record::{Phase, SandboxRecord};
use crate::runtime::ContainerStatus;
use tracing::Instrument as _;

/// How long a memory stop waits for the sandbox's agent calls in flight to finish before it
/// checkpoints anyway (a connection still open then makes the checkpoint fail, and the stop
/// falls back to disk only).
pub const CHECKPOINT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Stops the sandbox of `live`. Stopping a stopped sandbox succeeds and reports how it was
/// kept; without a live record the stop fails. A memory stop whose checkpoint failed succeeds
/// as [`ResultOutcome::StoppedOnDisk`] with the runtime's error (issue 12 item 4).
pub async fn stop(
    host: &Host,
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
    let id = record.sandbox_id;
    let names = host.names(id);
    let paths = host.layout.sandbox(id);
    let done = async {
        let runtime = host.runtime_of(&record)?;
        let status = runtime.status(&names.container_id).await?;
        let snapshot = paths.snapshot();
        let mut mode = if snapshot.is_dir() {
            StopMode::Memory
        } else {
            StopMode::Disk
        };
        let mut fallback = None;
        if runtime.memory_snapshot() && status == Some(ContainerStatus::Running) {
            async {
                if !host
                    .gates
                    .close_and_drain(id, CHECKPOINT_DRAIN_TIMEOUT)
                    .await
                {
                    tracing::warn!(waited = ?CHECKPOINT_DRAIN_TIMEOUT, "agent calls still in flight; checkpointing anyway");
                }
                super::settle::before_checkpoint(record.link).await;
            }
            .instrument(super::step("drain"))
            .await;
            crash_point(Step::Stopping);
            let started = Instant::now();
            let partial = paths.snapshot_partial();
            let checkpointed = async {
                runtime.checkpoint(&names.container_id, &partial).await?;
                crash_point(Step::ImageWritten);
                remove_dir_if_present(&snapshot).await?;
                tokio::fs::rename(&partial, &snapshot)
                    .await
                    .map_err(HostdError::io("rename the whole checkpoint image into place"))
            }
            .instrument(super::step("checkpoint"))
            .await;
            mode = match checkpointed {
                Ok(()) => {
                    tracing::info!(elapsed = ?started.elapsed(), "memory snapshot taken");
                    StopMode::Memory
                }
                Err(error) => {
                    let report = error.report();
                    tracing::warn!(error = %report, "checkpoint failed; stopping with disk only");
                    remove_dir_if_present(&partial).await?;
                    remove_dir_if_present(&snapshot).await?;
                    fallback = Some(StopFallback::new(
                        StopFallbackCode::CheckpointFailed,
                        &fallback_detail(&error),
                    ));
                    StopMode::Disk
                }
            };
            crash_point(Step::Checkpointed);
        } else {
            crash_point(Step::Stopping);
        }
        runtime
            .destroy(&names.container_id)
            .instrument(super::step("destroy"))
            .await?;
        crash_point(Step::Destroyed);
        unmount(paths.rootfs())
            .instrument(super::step("unmount"))
            .await?;
        crate::volume::release(&paths)
            .instrument(super::step("release"))
            .await?;
        crash_point(Step::Unmounted);
        Ok::<_, HostdError>((mode, fallback))
    }
    .await;
    // The gate opens again when the apply's guard drops, once the record says stopped.
    match done {
        Ok((mode, fallback)) => {
            record.phase = Phase::Stopped;
            tracing::info!(last_stop = mode.as_str(), "sandbox stopped");
            let outcome = match fallback {
                Some(fallback) => ResultOutcome::StoppedOnDisk { fallback },
                None => ResultOutcome::Succeeded {
                    address: None,
                    last_stop: Some(mode),
                },
            };
            (Some(record), outcome)
        }
        Err(error) => {
            tracing::warn!(error = %error.report(), "stop failed");
            let reason = error.result_reason();
            (Some(record), ResultOutcome::Failed { reason })
        }
    }
}

/// The part of a failed checkpoint's error that says why, for the result (whose detail is
/// bounded): a runtime's exit status and stderr without its command line, whose paths alone
/// can fill the bound; any other error without host paths
/// ([`HostdError::result_reason`]). hostd's log keeps the whole error.
fn fallback_detail(error: &HostdError) -> String {
    match error {
        HostdError::Tool {
            program,
            status,
            stderr,
            ..
        } => format!("{program} checkpoint failed ({status}): {}", stderr.trim()),
        other => other.result_reason(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_checkpoint_keeps_the_runtimes_status_and_error_without_its_paths() {
        let error = HostdError::Tool {
            program: "runsc".into(),
            args: format!(
                "--root /{} checkpoint --image-path /x c",
                "long/".repeat(200)
            ),
            status: "exit status: 128".into(),
            stderr: "checkpoint failed: urpc method \"containerManager.Checkpoint\" failed: EOF\n"
                .into(),
        };
        assert_eq!(
            fallback_detail(&error),
            "runsc checkpoint failed (exit status: 128): checkpoint failed: urpc method \
             \"containerManager.Checkpoint\" failed: EOF"
        );
    }

    #[test]
    fn another_error_of_a_checkpoint_is_kept_whole() {
        let error = HostdError::AgentTimeout {
            address: "10.0.0.2:7000".parse().unwrap(),
            waited: Duration::from_secs(1),
        };
        assert_eq!(fallback_detail(&error), error.report());
    }
}
