//! The writes of start elsewhere (issue 14, `migrating`): [`migrate`] moves a stopped sandbox
//! whose own host cannot take it back to the host placement chose and queues its
//! `sandbox.migrate` there; [`leave_old_host`] sends the host it came from a delete of its
//! stale copy once that copy is no longer the sandbox's. Going back `stopped` to the old host
//! (a failed or timed-out migration) is part of `write_result` and `write_transition`.

use berth_schemas::wire::Command;
use berth_schemas::{CommandId, CommandKind, HostId, Reason, SandboxState};
use sqlx::PgConnection;

use super::archive::{boot_from_durable, DurableBoot};
use super::{SandboxRow, COLUMNS};
use crate::op::{timed, Op};
use crate::{commands, StoreError};

/// Moves the locked `stopped` sandbox `row` to `to`, where placement already reserved its
/// capacity in the caller's transaction (like a create): the row becomes `migrating` at the
/// next generation on `to`, holding capacity and remembering its old host in
/// `migrated_from`; a `sandbox.migrate` naming its durable stop snapshot goes to `to`, and an
/// event records it with `message` (why its own host could not take it).
///
/// Errors: [`StoreError::Fenced`] when the row is no longer `stopped` at `row.generation`, is
/// being deleted, or its stop is not durable.
pub async fn migrate(
    conn: &mut PgConnection,
    row: &SandboxRow,
    to: HostId,
    reason: Reason,
    message: &str,
) -> Result<(SandboxRow, CommandId), StoreError> {
    let fenced = StoreError::Fenced {
        sandbox: row.id,
        expected: row.generation,
    };
    let (Some(snapshot), Some(from)) = (row.durable_snapshot, row.host_id) else {
        return Err(fenced);
    };
    let generation = row.generation.next();
    let updated = timed(
        Op::SandboxMigrate,
        sqlx::query(&format!(
            "UPDATE sandboxes
                SET host_id = $3, generation = $4, holds_capacity = true, state = $5,
                    migrated_from = $6, state_reason = $7, address = NULL,
                    last_activity_at = now(), updated_at = now()
              WHERE id = $1 AND generation = $2 AND state = $8 AND deleted_at IS NULL
                AND durable_snapshot IS NOT NULL
              RETURNING {COLUMNS}"
        ))
        .bind(row.id)
        .bind(row.generation)
        .bind(to)
        .bind(generation)
        .bind(SandboxState::Migrating.as_str())
        .bind(from)
        .bind(message)
        .bind(SandboxState::Stopped.as_str())
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
            kind: CommandKind::Migrate,
            snapshot,
            reason,
            message: Some(message),
        },
    )
    .await?;
    Ok((moved, command_id))
}

/// For the locked sandbox `row` whose migration is over for its old host (it runs on the new
/// one, or it is being deleted): clears `migrated_from` and queues a `sandbox.delete` of the
/// stale copy on that host at `row.generation` (newer than anything the old host applied, so
/// its fence lets it through; a host that is down gets it when it comes back). Its result comes
/// from off the placement and changes nothing. Returns the delete's id; `None` when the row
/// came from no other host.
pub async fn leave_old_host(
    conn: &mut PgConnection,
    row: &SandboxRow,
) -> Result<Option<CommandId>, StoreError> {
    if row.migrated_from.is_none() {
        return Ok(None);
    }
    timed(
        Op::SandboxMigrate,
        sqlx::query("UPDATE sandboxes SET migrated_from = NULL WHERE id = $1")
            .bind(row.id)
            .execute(&mut *conn),
    )
    .await?;
    delete_stale_copy(conn, row, row.generation).await
}

/// Queues a `sandbox.delete` at `generation` on the host `row` came from, if it is `migrating`
/// from another host; its id.
pub(super) async fn delete_stale_copy(
    conn: &mut PgConnection,
    row: &SandboxRow,
    generation: berth_schemas::Generation,
) -> Result<Option<CommandId>, StoreError> {
    let Some(old) = row.migrated_from.filter(|old| Some(*old) != row.host_id) else {
        return Ok(None);
    };
    Ok(Some(delete_copy_on(conn, old, row, generation).await?))
}

/// Queues on `host` a `sandbox.delete` of its copy of `row`'s sandbox at `generation` (newer
/// than anything that host applied, so its fence lets it through; its result comes from off
/// the placement and changes nothing); its id.
pub(super) async fn delete_copy_on(
    conn: &mut PgConnection,
    host: HostId,
    row: &SandboxRow,
    generation: berth_schemas::Generation,
) -> Result<CommandId, StoreError> {
    let cleanup = Command {
        snapshot: None,
        id: CommandId::new(),
        sandbox_id: row.id,
        generation,
        kind: CommandKind::Delete,
        spec: Some(row.spec()),
    };
    commands::insert(&mut *conn, host, &cleanup).await?;
    Ok(cleanup.id)
}
