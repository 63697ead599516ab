//! The two fenced writes of a sandbox's state: [`write_transition`] (a transition the control
//! plane starts, at the next generation) and [`write_result`] (a host's result, at the current
//! one). Both apply the decision's [`Capacity`] change in the same transaction — the only place
//! a sandbox's hold on its host's capacity changes (guarantee 4). A `migrating` sandbox that
//! either writes `stopped` goes back to the host it came from (`migrated_from`), after its
//! capacity was released on the new one.

use berth_schemas::ids::SnapshotId;
use berth_schemas::wire::{Command, SnapshotOrder, StopFallback, StopMode};
use berth_schemas::{Capacity, CommandId, CommandKind, Reason, SandboxState};
use sqlx::PgConnection;

use super::{SandboxRow, COLUMNS};
use crate::events::{self, NewEvent};
use crate::hosts::{self, Admit, Overcommit};
use crate::op::{timed, Op};
use crate::{commands, StoreError};

/// A transition the control plane starts (a request's or the reconciler's decision): the row
/// moves to `to` at the next generation, its capacity changes as `capacity` says, `command`
/// goes to its host at the new generation, and an event records it.
#[derive(Debug, Clone)]
pub struct Transition<'a> {
    /// The state to write.
    pub to: SandboxState,
    /// The command to queue on its host at the new generation; `None` queues none.
    pub command: Option<CommandKind>,
    /// The capacity change, applied in the same transaction (guarantee 4).
    pub capacity: Capacity,
    /// Why, as the event records it (`user_request`, `timeout`, …).
    pub reason: Reason,
    /// Whether this transition accepts a delete (sets `deleted_at`).
    pub delete: bool,
    /// The `state_reason` to show (why a boot failed, …).
    pub message: Option<&'a str>,
    /// Whether it counts as the user's activity (stamps `last_activity_at`).
    pub activity: bool,
    /// The limits a [`Capacity::Reserve`] reserves within.
    pub overcommit: Overcommit,
    /// For a `sandbox.restore`: the snapshot it boots from, carried in the command's order;
    /// `None` for every other command (a `sandbox.archive` names the row's durable stop
    /// snapshot by itself).
    pub snapshot: Option<SnapshotId>,
}

/// What [`write_transition`] wrote.
#[derive(Debug, Clone)]
pub struct Written {
    /// The row as it is now.
    pub row: SandboxRow,
    /// The command queued, if any.
    pub command_id: Option<CommandId>,
}

/// Writes `transition` of the locked sandbox `row` in the caller's transaction: capacity, the
/// row (new state, next generation), the command at that generation and the event.
///
/// Errors: [`StoreError::Fenced`] when the row is no longer at `row.generation`;
/// [`StoreError::NoCapacity`] when a [`Capacity::Reserve`] does not fit on the host (nothing
/// is written; the caller rolls back).
pub async fn write_transition(
    conn: &mut PgConnection,
    row: &SandboxRow,
    transition: &Transition<'_>,
) -> Result<Written, StoreError> {
    let holds_capacity =
        apply_capacity(&mut *conn, row, transition.capacity, transition.overcommit).await?;
    if transition.delete
        || matches!(
            transition.to,
            SandboxState::Starting | SandboxState::Resuming
        )
    {
        // A start changes the disk, a delete ends it: the durable stop is superseded (issue 14),
        // collected by the API's collector once nothing may still need it.
        // A boot may still fetch it, and an archive still reads it: its manifest tells the
        // archive whether to upload again, and one collected under it would be stored again
        // as a copy no row names (`ops::race14`).
        let booting = matches!(
            row.state,
            SandboxState::Migrating | SandboxState::Unarchiving | SandboxState::Archiving
        );
        let until_deleted = transition.delete && booting;
        super::superseded::supersede(
            &mut *conn,
            row.id,
            Some(row.generation),
            None,
            until_deleted,
        )
        .await?;
    }
    let generation = row.generation.next();
    let updated = timed(
        Op::SandboxTransition,
        sqlx::query(&format!(
            "UPDATE sandboxes
                SET state = $3, generation = $4, holds_capacity = $5, state_reason = $6,
                    deleted_at = CASE WHEN $7 THEN COALESCE(deleted_at, now()) ELSE deleted_at END,
                    address = CASE WHEN $3 IN ('running', 'stopping') THEN address ELSE NULL END,
                    last_activity_at = CASE WHEN $8 THEN now() ELSE last_activity_at END,
                    durable_at = CASE WHEN $3 IN ('starting', 'resuming') THEN NULL
                                      ELSE durable_at END,
                    durable_snapshot = CASE WHEN $3 IN ('starting', 'resuming') THEN NULL
                                            ELSE durable_snapshot END,
                    host_id = CASE WHEN state = 'migrating' AND $3 = 'stopped'
                                   THEN COALESCE(migrated_from, host_id) ELSE host_id END,
                    migrated_from = NULL,
                    updated_at = now()
              WHERE id = $1 AND generation = $2
              RETURNING {COLUMNS}"
        ))
        .bind(row.id)
        .bind(row.generation)
        .bind(transition.to.as_str())
        .bind(generation)
        .bind(holds_capacity)
        .bind(transition.message)
        .bind(transition.delete)
        .bind(transition.activity)
        .fetch_optional(&mut *conn),
    )
    .await?
    .ok_or(StoreError::Fenced {
        sandbox: row.id,
        expected: row.generation,
    })?;
    let mut command_id = None;
    if let (Some(kind), Some(host)) = (transition.command, row.host_id) {
        // An archive names the durable stop snapshot the row recorded, the only earlier stop
        // its host may reuse (issue 14): one the control plane refused, or never heard of,
        // is uploaded again.
        let snapshot = match kind {
            CommandKind::Archive => row.durable_at.and(row.durable_snapshot),
            _ => transition.snapshot,
        };
        let command = Command {
            snapshot: snapshot.map(|snapshot_id| SnapshotOrder {
                snapshot_id,
                parent: None,
                disk_only: false,
            }),
            id: CommandId::new(),
            sandbox_id: row.id,
            generation,
            kind,
            spec: Some(row.spec()),
        };
        commands::insert(&mut *conn, host, &command).await?;
        command_id = Some(command.id);
    }
    if transition.delete {
        // A delete while `migrating`: the host it came from still holds its last stop's disk.
        super::migrate::delete_stale_copy(&mut *conn, row, generation).await?;
    }
    events::insert(
        conn,
        &NewEvent {
            sandbox_id: row.id,
            org_id: row.org_id,
            from: Some(row.state),
            to: transition.to,
            reason: transition.reason,
            generation,
            command_id,
            message: transition.message,
            stop: None,
        },
    )
    .await?;
    Ok(Written {
        row: SandboxRow::from_row(&updated)?,
        command_id,
    })
}

/// A host's result applied to the locked `row` at its current generation (no new generation:
/// the result completes the transition that generation started).
#[derive(Debug, Clone)]
pub struct ResultWrite<'a> {
    /// The state to write (from [`berth_schemas::state::on_result`]).
    pub to: SandboxState,
    /// The capacity change, applied in the same transaction (guarantee 4).
    pub capacity: Capacity,
    /// Why, as the event records it (`host_report`, or `runtime_error` for a failure).
    pub reason: Reason,
    /// The command the result answers.
    pub command_id: CommandId,
    /// The sandbox's address when it runs.
    pub address: Option<&'a str>,
    /// How a stop kept it; `None` leaves the last value.
    pub last_stop: Option<StopMode>,
    /// Why a stop that wanted memory kept the disk only; written (or cleared, when `None`)
    /// with every `last_stop`, left alone when `last_stop` is `None`.
    pub stop_fallback: Option<&'a StopFallback>,
    /// The host's failure reason, shown as `state_reason`.
    pub message: Option<&'a str>,
}

/// Writes a host result onto the locked sandbox `row`: state, capacity, address, stop mode
/// (with why a memory stop kept the disk only, or cleared) and the event, in the caller's
/// transaction. A sandbox that runs has a disk of its own: its `seed_snapshot` is cleared.
///
/// Errors: [`StoreError::Fenced`] when the row is no longer at `row.generation`.
pub async fn write_result(
    conn: &mut PgConnection,
    row: &SandboxRow,
    result: &ResultWrite<'_>,
) -> Result<(), StoreError> {
    let holds_capacity =
        apply_capacity(&mut *conn, row, result.capacity, Overcommit::default()).await?;
    if result.to == SandboxState::Running {
        // It runs on a disk of its own now (a migrate or unarchive booted): the durable stop it
        // came from is superseded (issue 14).
        super::superseded::supersede(&mut *conn, row.id, Some(row.generation), None, false).await?;
    }
    let updated = timed(
        Op::SandboxApplyResult,
        sqlx::query(
            "UPDATE sandboxes
                SET state = $3,
                    state_reason = $4,
                    address = CASE WHEN $3 = 'running' THEN $5 ELSE NULL END,
                    last_stop = COALESCE($6, last_stop),
                    last_stop_code = CASE WHEN $6 IS NULL THEN last_stop_code ELSE $8 END,
                    last_stop_reason = CASE WHEN $6 IS NULL THEN last_stop_reason ELSE $9 END,
                    holds_capacity = $7,
                    durable_at = CASE WHEN $3 = 'running' THEN NULL ELSE durable_at END,
                    durable_snapshot = CASE WHEN $3 = 'running' THEN NULL
                                            ELSE durable_snapshot END,
                    host_id = CASE WHEN state = 'migrating' AND $3 = 'stopped'
                                   THEN COALESCE(migrated_from, host_id) ELSE host_id END,
                    migrated_from = NULL,
                    seed_snapshot = CASE WHEN $3 = 'running' THEN NULL ELSE seed_snapshot END,
                    updated_at = now()
              WHERE id = $1 AND generation = $2",
        )
        .bind(row.id)
        .bind(row.generation)
        .bind(result.to.as_str())
        .bind(result.message)
        .bind(result.address)
        .bind(result.last_stop.map(StopMode::as_str))
        .bind(holds_capacity)
        .bind(result.stop_fallback.map(|f| f.code.as_str()))
        .bind(result.stop_fallback.map(|f| f.detail.as_str()))
        .execute(&mut *conn),
    )
    .await?;
    if updated.rows_affected() != 1 {
        return Err(StoreError::Fenced {
            sandbox: row.id,
            expected: row.generation,
        });
    }
    events::insert(
        conn,
        &NewEvent {
            sandbox_id: row.id,
            org_id: row.org_id,
            from: Some(row.state),
            to: result.to,
            reason: result.reason,
            generation: row.generation,
            command_id: Some(result.command_id),
            message: result.message,
            stop: result.last_stop.map(|mode| (mode, result.stop_fallback)),
        },
    )
    .await?;
    Ok(())
}

/// Applies `capacity` to the host reservation of the locked `row`; returns whether the row
/// holds capacity afterwards. Reserving what is held, or releasing what is not, changes
/// nothing. A start reserves on its own host, which admits it unless lost.
async fn apply_capacity(
    conn: &mut PgConnection,
    row: &SandboxRow,
    capacity: Capacity,
    overcommit: Overcommit,
) -> Result<bool, StoreError> {
    let Some(host) = row.host_id else {
        return Ok(false);
    };
    match (capacity, row.holds_capacity) {
        (Capacity::Reserve, false) => {
            let admitted = hosts::reserve(
                conn,
                host,
                row.resources,
                overcommit,
                Admit::ResidentSandbox,
            )
            .await?;
            if !admitted {
                return Err(StoreError::NoCapacity {
                    host,
                    need: row.resources,
                });
            }
            Ok(true)
        }
        (Capacity::Release, true) => {
            hosts::release(conn, host, row.resources).await?;
            Ok(false)
        }
        (Capacity::Keep | Capacity::Reserve, held) => Ok(held),
        (Capacity::Release, false) => Ok(false),
    }
}

/// Sends the failed create of the locked `provisioning` sandbox `row` to `to` (issue 12 item
/// 2, [`berth_schemas::state::retries_elsewhere`]), in the caller's transaction: the old
/// host's hold is released (placement reserved on `to` in this transaction already), the row
/// moves to `to` at the next generation and stays `provisioning`, a `sandbox.create` goes to
/// `to` and a `sandbox.delete` to the old host (it buries the failed create's record there;
/// its result is the old host's, off the placement, and changes nothing), and an event with
/// [`Reason::RetriedElsewhere`] and `message` records it.
///
/// Errors: [`StoreError::Fenced`] when the row is no longer `provisioning` at `row.generation`.
pub async fn move_create(
    conn: &mut PgConnection,
    row: &SandboxRow,
    to: berth_schemas::HostId,
    message: &str,
) -> Result<Written, StoreError> {
    if let (Some(old), true) = (row.host_id, row.holds_capacity) {
        hosts::release(&mut *conn, old, row.resources).await?;
    }
    let generation = row.generation.next();
    let updated = timed(
        Op::SandboxMoveCreate,
        sqlx::query(&format!(
            "UPDATE sandboxes
                SET host_id = $3, generation = $4, holds_capacity = true, state_reason = $5,
                    address = NULL, updated_at = now()
              WHERE id = $1 AND generation = $2 AND state = $6 AND deleted_at IS NULL
              RETURNING {COLUMNS}"
        ))
        .bind(row.id)
        .bind(row.generation)
        .bind(to)
        .bind(generation)
        .bind(message)
        .bind(SandboxState::Provisioning.as_str())
        .fetch_optional(&mut *conn),
    )
    .await?
    .ok_or(StoreError::Fenced {
        sandbox: row.id,
        expected: row.generation,
    })?;
    let moved = SandboxRow::from_row(&updated)?;
    let create = Command {
        snapshot: None,
        id: CommandId::new(),
        sandbox_id: row.id,
        generation,
        kind: CommandKind::Create,
        spec: Some(moved.spec()),
    };
    commands::insert(&mut *conn, to, &create).await?;
    if let Some(old) = row.host_id {
        super::migrate::delete_copy_on(&mut *conn, old, &moved, generation).await?;
    }
    events::insert(
        conn,
        &NewEvent {
            sandbox_id: row.id,
            org_id: row.org_id,
            from: Some(row.state),
            to: SandboxState::Provisioning,
            reason: Reason::RetriedElsewhere,
            generation,
            command_id: Some(create.id),
            message: Some(message),
            stop: None,
        },
    )
    .await?;
    Ok(Written {
        row: moved,
        command_id: Some(create.id),
    })
}
