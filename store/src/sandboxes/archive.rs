//! The writes of durable stops and archives (issue 14): [`write_durable`] records a stop
//! snapshot the host confirmed stored, fenced on the generation it was taken at;
//! [`free_archived_copy`] sends the archiving host the delete that frees its disk, once
//! `archived` is written;
//! [`unarchive`] moves an archived sandbox to the host placement chose and queues its
//! `sandbox.unarchive` there.

use berth_schemas::ids::SnapshotId;
use berth_schemas::wire::{Command, SnapshotOrder};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, Reason, SandboxId, SandboxState};
use sqlx::PgConnection;

use super::{SandboxRow, COLUMNS};
use crate::events::{self, NewEvent};
use crate::op::{timed, Op};
use crate::{commands, StoreError};

/// The states a confirmed stop snapshot may be recorded in: the sandbox is still stopped (or
/// being archived, or archived by that very upload).
const DURABLE_STATES: [SandboxState; 3] = [
    SandboxState::Stopped,
    SandboxState::Archiving,
    SandboxState::Archived,
];

/// Records that the stop snapshot `snapshot` (referencing `chunks`: SHA-256 and compressed
/// bytes) is stored, in the caller's transaction: `durable_at` and `durable_snapshot` of the
/// sandbox, and its chunk references (so a snapshot delete keeps them). Fenced: only at
/// `generation`, not being deleted, in a state that keeps the stopped disk; returns whether it
/// was written (`false`: the sandbox moved on, and nothing changed).
pub async fn write_durable(
    conn: &mut PgConnection,
    id: SandboxId,
    generation: Generation,
    snapshot: SnapshotId,
    chunks: &[(String, i64)],
) -> Result<bool, StoreError> {
    let states: Vec<&str> = DURABLE_STATES.iter().map(|s| s.as_str()).collect();
    let updated: Option<Option<SnapshotId>> = timed(
        Op::SandboxDurable,
        sqlx::query_scalar(
            "WITH old AS (SELECT id, durable_snapshot FROM sandboxes WHERE id = $1 FOR UPDATE)
             UPDATE sandboxes s SET durable_at = now(), durable_snapshot = $3
               FROM old
              WHERE s.id = old.id AND s.generation = $2 AND s.deleted_at IS NULL
                AND s.state = ANY($4)
              RETURNING old.durable_snapshot",
        )
        .bind(id)
        .bind(generation)
        .bind(snapshot)
        .bind(&states)
        .fetch_optional(&mut *conn),
    )
    .await?;
    let Some(replaced) = updated else {
        return Ok(false);
    };
    if let Some(old) = replaced.filter(|old| *old != snapshot) {
        // A newer durable stop replaces it: collected once nothing needs it.
        super::superseded::record(conn, id, old, false).await?;
    }
    let (hashes, sizes): (Vec<String>, Vec<i64>) = chunks.iter().cloned().unzip();
    timed(
        Op::SandboxDurable,
        sqlx::query("DELETE FROM durable_chunks WHERE sandbox_id = $1")
            .bind(id)
            .execute(&mut *conn),
    )
    .await?;
    timed(
        Op::SandboxDurable,
        sqlx::query(
            "INSERT INTO durable_chunks (sha256, sandbox_id, stored)
             SELECT h, $1, s FROM unnest($2::text[], $3::int8[]) AS t(h, s)
             ON CONFLICT DO NOTHING",
        )
        .bind(id)
        .bind(&hashes)
        .bind(&sizes)
        .execute(&mut *conn),
    )
    .await?;
    Ok(true)
}

/// For the locked sandbox `row` whose archive's success is being written `archived` (issue 14,
/// two-phase free): queues on `host`, the host that reported it, a `sandbox.delete` of its copy
/// at `row.generation` — the archive's own, which that host applied last, so its fence lets it
/// through, and older than any unarchive (the next generation), so an unarchive that lands on
/// the same host is never undone by it (it comes first; a late one is refused as stale). Its
/// result changes nothing (`archived` ignores a delete's). Returns its id.
pub async fn free_archived_copy(
    conn: &mut PgConnection,
    row: &SandboxRow,
    host: HostId,
) -> Result<CommandId, StoreError> {
    super::migrate::delete_copy_on(conn, host, row, row.generation).await
}

/// Moves the locked `archived` sandbox `row` to `to`, where placement already reserved its
/// capacity in the caller's transaction (like a create): the row becomes `unarchiving` at the
/// next generation on `to`, holding capacity, a `sandbox.unarchive` naming its durable stop
/// snapshot goes to `to`, and an event records it.
///
/// Errors: [`StoreError::Fenced`] when the row is no longer `archived` at `row.generation` or
/// has no durable snapshot.
pub async fn unarchive(
    conn: &mut PgConnection,
    row: &SandboxRow,
    to: HostId,
    reason: Reason,
) -> Result<(SandboxRow, CommandId), StoreError> {
    let fenced = StoreError::Fenced {
        sandbox: row.id,
        expected: row.generation,
    };
    let Some(snapshot) = row.durable_snapshot else {
        return Err(fenced);
    };
    let generation = row.generation.next();
    let updated = timed(
        Op::SandboxUnarchive,
        sqlx::query(&format!(
            "UPDATE sandboxes
                SET host_id = $3, generation = $4, holds_capacity = true, state = $5,
                    state_reason = NULL, address = NULL, last_activity_at = now(),
                    updated_at = now()
              WHERE id = $1 AND generation = $2 AND state = $6 AND deleted_at IS NULL
              RETURNING {COLUMNS}"
        ))
        .bind(row.id)
        .bind(row.generation)
        .bind(to)
        .bind(generation)
        .bind(SandboxState::Unarchiving.as_str())
        .bind(SandboxState::Archived.as_str())
        .fetch_optional(&mut *conn),
    )
    .await?
    .ok_or(fenced)?;
    let moved = SandboxRow::from_row(&updated)?;
    let command_id = boot_from_durable(
        conn,
        row,
        &moved,
        DurableBoot {
            to,
            kind: CommandKind::Unarchive,
            snapshot,
            reason,
            message: None,
        },
    )
    .await?;
    Ok((moved, command_id))
}

/// What [`boot_from_durable`] queues.
pub(super) struct DurableBoot<'a> {
    /// The host placement chose (the command's subject).
    pub to: HostId,
    /// `sandbox.unarchive` or `sandbox.migrate`.
    pub kind: CommandKind,
    /// The durable stop snapshot the new host fetches.
    pub snapshot: SnapshotId,
    /// The event's reason.
    pub reason: Reason,
    /// The event's message.
    pub message: Option<&'a str>,
}

/// Queues, for a sandbox `row` just moved (`moved`: its row on the host placement chose, at the
/// next generation), the command that boots it there from its durable stop, and the event of
/// the move; returns the command's id.
pub(super) async fn boot_from_durable(
    conn: &mut PgConnection,
    row: &SandboxRow,
    moved: &SandboxRow,
    boot: DurableBoot<'_>,
) -> Result<CommandId, StoreError> {
    let command = Command {
        snapshot: Some(SnapshotOrder {
            snapshot_id: boot.snapshot,
            parent: None,
            disk_only: false,
        }),
        id: CommandId::new(),
        sandbox_id: row.id,
        generation: moved.generation,
        kind: boot.kind,
        spec: Some(moved.spec()),
    };
    commands::insert(&mut *conn, boot.to, &command).await?;
    events::insert(
        conn,
        &NewEvent {
            sandbox_id: row.id,
            org_id: row.org_id,
            from: Some(row.state),
            to: moved.state,
            reason: boot.reason,
            generation: moved.generation,
            command_id: Some(command.id),
            message: boot.message,
            stop: None,
        },
    )
    .await?;
    Ok(command.id)
}

/// Up to `limit` sandboxes being deleted (or deleted) that still name a durable stop snapshot,
/// oldest delete first: the content every delete supersedes ([`take_durable`]), whoever deleted
/// them (a user, the reconciler's auto-delete or expiry, an org's delete).
pub async fn deleted_with_durable(
    conn: &mut PgConnection,
    limit: i64,
) -> Result<Vec<SandboxId>, StoreError> {
    timed(
        Op::SandboxDurable,
        sqlx::query_scalar(
            "SELECT id FROM sandboxes
              WHERE deleted_at IS NOT NULL AND durable_snapshot IS NOT NULL
              ORDER BY deleted_at LIMIT $1",
        )
        .bind(limit)
        .fetch_all(conn),
    )
    .await
}

/// For a sandbox being deleted: moves its durable stop snapshot (`durable_at`,
/// `durable_snapshot` and its chunk references) to the superseded ones awaiting collection
/// (`super::superseded`), in the caller's transaction; the snapshot moved. `None` when it has
/// none, or is not being deleted.
pub async fn take_durable(
    conn: &mut PgConnection,
    id: SandboxId,
) -> Result<Option<SnapshotId>, StoreError> {
    let state: Option<String> = timed(
        Op::SandboxDurable,
        sqlx::query_scalar(
            "SELECT state FROM sandboxes WHERE id = $1 AND deleted_at IS NOT NULL FOR UPDATE",
        )
        .bind(id)
        .fetch_optional(&mut *conn),
    )
    .await?;
    let Some(state) = state else {
        return Ok(None);
    };
    // Deleted elsewhere, from a state this cannot tell: a boot may still fetch it until the
    // delete is answered.
    let until_deleted = state != SandboxState::Deleted.as_str();
    super::superseded::supersede(conn, id, None, None, until_deleted).await
}
