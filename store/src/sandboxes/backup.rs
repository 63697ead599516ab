//! The writes of a restore from backup (issue 14, `restoring`): `POST …/restore-from-backup`
//! and the reconciler's failover of a sandbox whose host was lost. [`vacate_for_backup`]
//! releases what the sandbox holds on its old host, so placement may pick that host again;
//! [`restore_from_backup`] moves the row to the host placement chose and queues the
//! `sandbox.migrate` of the backup there (and a delete of the old copy on the old host). Both
//! run in the caller's transaction, around the placement: a placement that fails rolls back the
//! release with it.

use berth_schemas::ids::SnapshotId;
use berth_schemas::state::{FAILS_OVER, RESTORES_FROM_BACKUP};
use berth_schemas::wire::{Command, SnapshotOrder};
use berth_schemas::{CommandId, CommandKind, HostId, Reason, SandboxState};
use sqlx::PgConnection;

use super::{SandboxRow, COLUMNS};
use crate::events::{self, NewEvent};
use crate::hosts;
use crate::op::{timed, Op};
use crate::{commands, StoreError};

/// Releases the capacity the locked `row` holds on its host, if it holds any, before placement
/// picks the host its backup boots on (the row itself is rewritten by [`restore_from_backup`]
/// in the same transaction). Guarantee 4 holds again once that write commits; call nothing
/// else in between.
pub async fn vacate_for_backup(
    conn: &mut PgConnection,
    row: &SandboxRow,
) -> Result<(), StoreError> {
    if let (Some(host), true) = (row.host_id, row.holds_capacity) {
        hosts::release(&mut *conn, host, row.resources).await?;
    }
    Ok(())
}

/// What [`restore_from_backup`] writes.
#[derive(Debug, Clone, Copy)]
pub struct BackupRestore<'a> {
    /// The host placement chose, where it already reserved the sandbox's capacity.
    pub to: HostId,
    /// The ready backup (a snapshot of `kind = 'backup'` of this sandbox) to boot.
    pub backup: SnapshotId,
    /// Why, as the event records it (`user_request`, or `host_lost` for a failover).
    pub reason: Reason,
    /// The `state_reason` and the event's message.
    pub message: &'a str,
}

/// Moves the locked sandbox `row` (vacated by [`vacate_for_backup`]) to `restore.to` as
/// `restoring` at the next generation, holding the capacity placement reserved there, with
/// `seed_snapshot` naming the backup (so a start after a failed restore boots it again) and
/// the backup as its newest (`last_backup_id`; `restored_backup`, `restored_at`: a backup
/// requested before this restore never replaces it, so a rollback stays rolled back); its
/// durable stop, if any, is superseded (the backup replaces its disk). Queues a
/// `sandbox.migrate` of the backup (disk only) on the new host and, when the old host is
/// another, a `sandbox.delete` of the old copy there at the same generation (its result comes
/// from off the placement and changes nothing); an event records the move. Returns the row and
/// the migrate's id.
///
/// Errors: [`StoreError::Fenced`] when the row is no longer at `row.generation` in a state a
/// restore from backup leaves from, or is being deleted.
pub async fn restore_from_backup(
    conn: &mut PgConnection,
    row: &SandboxRow,
    restore: BackupRestore<'_>,
) -> Result<(SandboxRow, CommandId), StoreError> {
    let fenced = StoreError::Fenced {
        sandbox: row.id,
        expected: row.generation,
    };
    // A user's restore leaves a settled state; a failover also a restore in flight.
    let leaves_from: Vec<&str> = RESTORES_FROM_BACKUP
        .iter()
        .chain(&FAILS_OVER)
        .map(|s| s.as_str())
        .collect();
    super::superseded::supersede(&mut *conn, row.id, Some(row.generation), None, false).await?;
    let generation = row.generation.next();
    let updated = timed(
        Op::SandboxRestoreBackup,
        sqlx::query(&format!(
            "UPDATE sandboxes
                SET host_id = $3, generation = $4, holds_capacity = true, state = $5,
                    seed_snapshot = $6, state_reason = $7, migrated_from = NULL, address = NULL,
                    restored_backup = $6, restored_at = now(),
                    last_backup_id = $6,
                    last_backup_at = (SELECT ready_at FROM snapshots WHERE id = $6),
                    last_activity_at = now(), updated_at = now()
              WHERE id = $1 AND generation = $2 AND state = ANY($8) AND deleted_at IS NULL
              RETURNING {COLUMNS}"
        ))
        .bind(row.id)
        .bind(row.generation)
        .bind(restore.to)
        .bind(generation)
        .bind(SandboxState::Restoring.as_str())
        .bind(restore.backup)
        .bind(restore.message)
        .bind(&leaves_from)
        .fetch_optional(&mut *conn),
    )
    .await?
    .ok_or(fenced)?;
    let moved = SandboxRow::from_row(&updated)?;
    let migrate = Command {
        snapshot: Some(SnapshotOrder {
            snapshot_id: restore.backup,
            parent: None,
            disk_only: true,
        }),
        id: CommandId::new(),
        sandbox_id: row.id,
        generation,
        kind: CommandKind::Migrate,
        spec: Some(moved.spec()),
    };
    commands::insert(&mut *conn, restore.to, &migrate).await?;
    if let Some(old) = row.host_id.filter(|old| *old != restore.to) {
        super::migrate::delete_copy_on(&mut *conn, old, &moved, generation).await?;
    }
    events::insert(
        conn,
        &NewEvent {
            sandbox_id: row.id,
            org_id: row.org_id,
            from: Some(row.state),
            to: SandboxState::Restoring,
            reason: restore.reason,
            generation,
            command_id: Some(migrate.id),
            message: Some(restore.message),
            stop: None,
        },
    )
    .await?;
    Ok((moved, migrate.id))
}
