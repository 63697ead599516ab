//! A host's report that a stop snapshot is stored in the object store (issue 14,
//! [`ResultOutcome::Durable`]): the second result of a `sandbox.stop`, sent once its background
//! upload is confirmed, and the success of a `sandbox.archive` (whose host keeps the disk until
//! the control plane, having recorded it here, sends the delete that frees it). `durable_at` is written only
//! from such a report (DESIGN.md guarantee 9), and only while the sandbox is still at the
//! generation the snapshot was taken at: a late report for a sandbox that moved on (started,
//! deleted) changes nothing (the fence, guarantee 4 of the issue) but handing the snapshot it
//! stored, which no row will name, to the collector.

use berth_schemas::wire::{CommandResult, StopDurable};
use berth_schemas::CommandId;
use berth_schemas::SandboxState;
use berth_store::chunks::{self, ReadyCheck};
use berth_store::{commands, sandboxes, sweep, SandboxRow, StoreError};
use sqlx::PgConnection;
use tracing::{debug, info, warn};

use crate::results::{Applied, Rejection};

/// Why a stored copy was not recorded durable ([`record`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The object store sweep claimed its manifest first (it may be gone).
    ManifestSwept,
    /// No command row to judge its chunks against.
    NoCommand,
    /// A chunk removal may have taken one of its chunks from under its upload.
    LostChunks,
    /// The row's generation moved on (`sandboxes::write_durable` wrote nothing).
    NotWritten,
    /// Its command was inserted more than `chunks::REMOVAL_RETENTION` ago: the removals that
    /// finished since may be forgotten, so its chunks cannot be checked.
    TooOld,
}

/// Records `durable`, reported for the `command` (a stop or an archive) of the locked `row` at
/// `generation`, in the caller's transaction; `Ok(())` when written, else why not
/// ([`Refused`]). Not recorded (the next archive uploads again):
/// - a snapshot whose manifest the object store sweep claimed (it may be gone: a report that
///   came after the sweep's grace period, `berth_store::sweep::manifest_removed`);
/// - a snapshot with a chunk a removal may have taken from under its upload
///   (`chunks::check_for_ready`), judged against the insert of `command`: the host looked at the
///   store only after it was requested, so a removal that finished before it could not have
///   been skipped, and no later write (a `stopped` applied late, a settings change) moves it.
///   A chunk removed after that insert and stored again by the upload itself counts as lost too:
///   the check errs only on the safe side;
/// - a snapshot whose command was inserted more than `chunks::REMOVAL_RETENTION` ago (the
///   database's clock, read by `chunks::check_for_ready` after the manifest's and the chunks'
///   removal records: the sweep forgets finished ones past that age, so none can be trusted to
///   be there).
///
/// Without the command row there is no time known to be before the upload's look, so nothing is
/// recorded. That happens only for a sandbox purged as a tombstone (commands are deleted only
/// with it, `commands::purge_completed`), whose report the result consumer already refuses as
/// an unknown command before it comes here; the row's `updated_at` would be the wrong fallback,
/// as it can come after the look.
pub(crate) async fn record(
    conn: &mut PgConnection,
    row: &SandboxRow,
    generation: berth_schemas::Generation,
    durable: &StopDurable,
    command: CommandId,
) -> Result<Result<(), Refused>, StoreError> {
    if sweep::manifest_removed(conn, durable.snapshot_id).await? {
        warn!(snapshot_id = %durable.snapshot_id,
            "a stored stop's manifest was swept as an orphan before its report; not recorded as durable");
        return Ok(Err(Refused::ManifestSwept));
    }
    let Some(requested_at) = commands::inserted_at(conn, command).await? else {
        warn!(snapshot_id = %durable.snapshot_id, command_id = %command,
            "no command to judge a stored stop's chunks against; not recorded as durable");
        return Ok(Err(Refused::NoCommand));
    };
    let chunks: Vec<(String, i64)> = durable
        .chunks
        .iter()
        .map(|(h, n)| (h.clone(), i64::from(*n)))
        .collect();
    let hashes: Vec<String> = chunks.iter().map(|(h, _)| h.clone()).collect();
    // After `manifest_removed`: the age check's clock must be read after every removal record
    // this report was judged by (`sweep::prune_removed`).
    match chunks::check_for_ready(conn, durable.snapshot_id, requested_at, &hashes).await? {
        ReadyCheck::Clear => {}
        ReadyCheck::Lost(lost) => {
            warn!(lost = lost.len(), snapshot_id = %durable.snapshot_id,
                "a stop snapshot lost chunks to a chunk removal; not recorded as durable");
            return Ok(Err(Refused::LostChunks));
        }
        ReadyCheck::TooOld => {
            warn!(snapshot_id = %durable.snapshot_id, command_id = %command, %requested_at,
                "a stored stop was reported longer after its command than removals are remembered; not recorded as durable");
            return Ok(Err(Refused::TooOld));
        }
    }
    let written =
        sandboxes::write_durable(conn, row.id, generation, durable.snapshot_id, &chunks).await?;
    Ok(if written {
        Ok(())
    } else {
        Err(Refused::NotWritten)
    })
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
    // Judged against the stop command's insert, never the row's `updated_at` (a `stopped`
    // applied late or a settings change moves it past the upload's look at the store).
    if record(conn, &row, result.generation, durable, result.command_id)
        .await?
        .is_ok()
    {
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
