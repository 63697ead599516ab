//! A host's report that a stop snapshot is stored in the object store (issue 14,
//! [`ResultOutcome::Durable`]): the second result of a `sandbox.stop`, sent once its background
//! upload is confirmed, and the success of a `sandbox.archive` (whose host keeps the disk until
//! the control plane, having recorded it here, sends the delete that frees it). `durable_at` is written only
//! from such a report (DESIGN.md guarantee 9), and only while the sandbox is still at the
//! generation the snapshot was taken at: a late report for a sandbox that moved on (started,
//! deleted) changes nothing (the fence, guarantee 4 of the issue) but handing the snapshot it
//! stored, which no row will name, to the collector.

use berth_schemas::wire::{CommandResult, StopDurable};
use berth_schemas::SandboxState;
use berth_store::{chunks, sandboxes, SandboxRow, StoreError};
use sqlx::PgConnection;
use tracing::{debug, info, warn};

use crate::results::{Applied, Rejection};

/// Records `durable` for the locked `row` at `generation` in the caller's transaction;
/// whether it was written. A stop snapshot with a chunk a snapshot delete's claimed removal
/// may have taken from under its upload is not recorded (the next archive uploads again):
/// `requested_at` is a time no later than the upload's first look at the store (a removal
/// finished before it could not be skipped), on the database's clock.
pub(crate) async fn record(
    conn: &mut PgConnection,
    row: &SandboxRow,
    generation: berth_schemas::Generation,
    durable: &StopDurable,
    requested_at: chrono::DateTime<chrono::Utc>,
) -> Result<bool, StoreError> {
    let chunks: Vec<(String, i64)> = durable
        .chunks
        .iter()
        .map(|(h, n)| (h.clone(), i64::from(*n)))
        .collect();
    let hashes: Vec<String> = chunks.iter().map(|(h, _)| h.clone()).collect();
    let lost = chunks::check_for_ready(conn, durable.snapshot_id, requested_at, &hashes).await?;
    if !lost.is_empty() {
        warn!(lost = lost.len(), snapshot_id = %durable.snapshot_id,
            "a stop snapshot lost chunks to a snapshot delete; not recorded as durable");
        return Ok(false);
    }
    sandboxes::write_durable(conn, row.id, generation, durable.snapshot_id, &chunks).await
}

/// Applies a stop's durability report (the command already matched what was issued).
pub(crate) async fn apply_stop(
    conn: &mut PgConnection,
    result: &CommandResult,
    durable: &StopDurable,
) -> Result<Applied, StoreError> {
    let Some(row) = sandboxes::lock(&mut *conn, result.sandbox_id, None).await? else {
        return Ok(Applied::Unknown);
    };
    if row.host_id != Some(result.host_id) {
        forget(conn, &row, durable).await?;
        return Ok(Applied::Rejected(Rejection::NotPlacement));
    }
    if result.generation != row.generation || row.deleting() || row.state != SandboxState::Stopped {
        debug!(row_generation = %row.generation, state = %row.state,
            "a late stop durability report; the sandbox moved on");
        forget(conn, &row, durable).await?;
        return Ok(Applied::Stale);
    }
    // The row's last change (issue 14: a `stopped` applied late or a settings change can put
    // it after the upload's look; the precise bound needs the chunks the upload skipped).
    if record(conn, &row, result.generation, durable, row.updated_at).await? {
        info!(snapshot_id = %durable.snapshot_id, stored_bytes = durable.stored_bytes,
            "stop snapshot durable");
        Ok(Applied::Durable)
    } else {
        forget(conn, &row, durable).await?;
        Ok(Applied::Stale)
    }
}

/// A stored stop snapshot the sandbox will never name (its report came late, or lost chunks;
/// an archive's that came late or was refused) goes to the collector (never one a row names) like a superseded one, so what its upload stored does not stay in the
/// object store for good (a start cancels a stop's upload only before it stores anything; once
/// staged, the upload finishes and reports).
pub(crate) async fn forget(
    conn: &mut PgConnection,
    row: &SandboxRow,
    durable: &StopDurable,
) -> Result<(), StoreError> {
    let hashes: Vec<String> = durable.chunks.iter().map(|(h, _)| h.clone()).collect();
    if sandboxes::supersede_unnamed(conn, row.id, durable.snapshot_id, &hashes).await? {
        info!(snapshot_id = %durable.snapshot_id, "a late stop snapshot goes to the collector");
    }
    Ok(())
}
