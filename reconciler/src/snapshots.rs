//! A host's result for a `sandbox.snapshot` command, applied to its snapshot row (issue 13
//! item 3): `ready` only from a report that the manifest is stored, `failed` with the host's
//! reason otherwise, each with its event on the sandbox's stream. The sandbox row is never
//! changed by a snapshot. Decisions come from `berth_schemas::state::snapshot`.

use berth_schemas::state::snapshot::{
    on_snapshot_report, SnapshotDecision, SnapshotReport, SnapshotState,
};
use berth_schemas::wire::{CommandResult, ResultOutcome};
use berth_schemas::Reason;
use berth_store::chunks::{self, ReadyCheck};
use berth_store::events::{self, NewEvent};
use berth_store::sandboxes;
use berth_store::snapshots::{self, Settled, SnapshotRow};
use berth_store::StoreError;
use sqlx::PgConnection;
use tracing::{info, warn};

use crate::results::Applied;

/// Applies a snapshot command's result in the caller's transaction.
pub(crate) async fn apply(
    conn: &mut PgConnection,
    result: &CommandResult,
) -> Result<Applied, StoreError> {
    let Some(row) = snapshots::lock_by_command(conn, result.command_id).await? else {
        return Ok(Applied::Unknown);
    };
    let (report, reason) = match &result.outcome {
        ResultOutcome::Snapshotted(_) => (SnapshotReport::Durable, None),
        ResultOutcome::Failed { reason } | ResultOutcome::Rejected { reason } => {
            (SnapshotReport::Failed, Some(reason.clone()))
        }
        ResultOutcome::RefusedStale { applied } => (
            SnapshotReport::Failed,
            Some(format!(
                "the host refused the snapshot: it had applied generation {applied}"
            )),
        ),
        ResultOutcome::Succeeded { .. }
        | ResultOutcome::StoppedOnDisk { .. }
        | ResultOutcome::Durable(_) => (
            SnapshotReport::Failed,
            Some("the host answered the snapshot with another command's outcome".into()),
        ),
    };
    match on_snapshot_report(row.state, report) {
        SnapshotDecision::Apply(SnapshotState::Ready) => {
            let ResultOutcome::Snapshotted(stored) = &result.outcome else {
                unreachable!("only a durable report leads to ready")
            };
            let chunks: Vec<(String, i64)> = stored
                .chunks
                .iter()
                .map(|(h, n)| (h.clone(), i64::from(*n)))
                .collect();
            let hashes: Vec<String> = chunks.iter().map(|(h, _)| h.clone()).collect();
            match chunks::check_for_ready(conn, row.id, row.created_at, &hashes).await? {
                ReadyCheck::Clear => {}
                ReadyCheck::Lost(lost) => {
                    let reason = format!(
                        "{} of its chunks were removed by a snapshot delete while it was \
                         uploaded; take the snapshot again",
                        lost.len()
                    );
                    return fail(conn, &row, reason).await;
                }
                ReadyCheck::TooOld => {
                    return fail(conn, &row, crate::results::SNAPSHOT_TOO_OLD.to_owned()).await;
                }
            }
            let settled = Settled {
                holds: if stored.memory {
                    "disk_and_memory"
                } else {
                    "disk"
                },
                logical_bytes: i64::try_from(stored.logical_bytes).unwrap_or(i64::MAX),
                stored_bytes: i64::try_from(stored.stored_bytes).unwrap_or(i64::MAX),
                new_bytes: i64::try_from(stored.new_bytes).unwrap_or(i64::MAX),
                paused_ms: i32::try_from(stored.paused_ms).unwrap_or(i32::MAX),
                chunks: &chunks,
            };
            snapshots::write_ready(conn, row.id, &settled).await?;
            event(conn, &row, "snapshot.ready", Reason::HostReport, None).await?;
            metrics::counter!("berth_snapshots_total", "outcome" => "ready").increment(1);
            info!(snapshot_id = %row.id, paused_ms = stored.paused_ms, "snapshot ready");
            Ok(Applied::Snapshot(SnapshotState::Ready))
        }
        SnapshotDecision::Apply(_) => {
            fail(
                conn,
                &row,
                reason.unwrap_or_else(|| "snapshot failed".into()),
            )
            .await
        }
        SnapshotDecision::DeleteContent => {
            // The snapshot timed out before this upload landed; it stays failed. Its chunks are
            // content-addressed and referenced by no row: the store's sweep of unreferenced
            // content removes them (not automatic yet: see ARCHITECTURE.md).
            metrics::counter!("berth_snapshot_late_uploads_total").increment(1);
            warn!(snapshot_id = %row.id, "a failed snapshot's upload landed late; its content is unreferenced");
            Ok(Applied::Duplicate)
        }
        SnapshotDecision::Ignore => Ok(Applied::Duplicate),
    }
}

/// Writes `failed` with `reason` and its event.
async fn fail(
    conn: &mut PgConnection,
    row: &SnapshotRow,
    reason: String,
) -> Result<Applied, StoreError> {
    snapshots::write_failed(conn, row.id, &reason).await?;
    event(
        conn,
        row,
        "snapshot.failed",
        Reason::RuntimeError,
        Some(&reason),
    )
    .await?;
    metrics::counter!("berth_snapshots_total", "outcome" => "failed").increment(1);
    warn!(snapshot_id = %row.id, %reason, "snapshot failed");
    Ok(Applied::Snapshot(SnapshotState::Failed))
}

/// Writes a snapshot's event on its sandbox's stream, when the sandbox row still exists (a
/// snapshot outlives its sandbox's purged tombstone; its events went with it).
pub(crate) async fn event(
    conn: &mut PgConnection,
    snapshot: &SnapshotRow,
    kind_row: &'static str,
    reason: Reason,
    message: Option<&str>,
) -> Result<(), StoreError> {
    let Some(sandbox) = sandboxes::lock(conn, snapshot.sandbox_id, None).await? else {
        return Ok(());
    };
    events::insert_snapshot_event(
        conn,
        &NewEvent {
            sandbox_id: sandbox.id,
            org_id: snapshot.org_id,
            from: Some(sandbox.state),
            to: sandbox.state,
            reason,
            generation: sandbox.generation,
            command_id: Some(snapshot.command_id),
            message,
            stop: None,
        },
        kind_row,
        snapshot.id,
    )
    .await?;
    Ok(())
}
