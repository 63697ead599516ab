//! The `sandboxes` table: one row type ([`SandboxRow`]) read through one column list
//! ([`COLUMNS`]) and one `from_row`, and every write of a sandbox's state.
//!
//! # Guarantees
//! - Fenced: [`write_transition`] and [`write_result`] update a row only at the generation the
//!   caller read (`WHERE id = $1 AND generation = $2`); a miss is [`StoreError::Fenced`].
//! - Capacity (guarantee 4): the hold on the host's capacity changes only here, as the
//!   decision's [`Capacity`] says, in the same transaction as the state write, the command and
//!   the event (guarantee 1).
//! - Org scoping (guarantee 7): [`get`], [`lock`] and [`list`] take the caller's org.

use std::time::Duration;

use berth_schemas::state::{GuestFailure, STRANDED_ON_LOST_HOST, TIMED_COMMANDS};
use berth_schemas::wire::{Command, Resources, SandboxSpec, StopMode};
use berth_schemas::{
    Capacity, CommandId, CommandKind, Generation, HostId, OrgId, Reason, SandboxId, SandboxState,
};
use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgExecutor, Row};

use crate::events::{self, NewEvent};
use crate::hosts::{self, Admit, Overcommit};
use crate::op::{timed, Op};
use crate::{commands, StoreError};

/// The columns [`SandboxRow::from_row`] reads, unqualified (select from `sandboxes`).
pub const COLUMNS: &str = "id, org_id, template, host_id, state, state_reason, generation, \
     holds_capacity, vcpus, memory_mib, metadata, address, last_stop, created_at, updated_at, \
     deleted_at, auto_stop_minutes, auto_delete_minutes";

/// [`COLUMNS`] qualified with a table alias (`s.id, s.org_id, …`), for joins.
pub fn columns_of(alias: &str) -> String {
    COLUMNS
        .split(", ")
        .map(|c| format!("{alias}.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One sandbox row.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    /// The sandbox (`sandboxes.id`, UUIDv7).
    pub id: SandboxId,
    /// The org that owns it; every API read is scoped by it.
    pub org_id: OrgId,
    /// The template it was created from (`base`, …; a `templates.name`).
    pub template: String,
    /// The host it is placed on (always set today: placement happens at create).
    pub host_id: Option<HostId>,
    /// Its lifecycle state (`sandboxes.state`, kebab-case).
    pub state: SandboxState,
    /// Why it is in its state (a boot failure's message, …).
    pub state_reason: Option<String>,
    /// The fence: bumped by every transition the control plane starts.
    pub generation: Generation,
    /// Whether its resources are counted in its host's reservation (guarantee 4).
    pub holds_capacity: bool,
    /// Its size: whole vCPUs and MiB (the `vcpus` and `memory_mib` columns).
    pub resources: Resources,
    /// The user's metadata object.
    pub metadata: serde_json::Value,
    /// Its IPv4 address while running.
    pub address: Option<String>,
    /// How the last stop kept it.
    pub last_stop: Option<StopMode>,
    /// When the create was accepted (database clock).
    pub created_at: DateTime<Utc>,
    /// When the row last changed (database clock); auto-delete measures from it.
    pub updated_at: DateTime<Utc>,
    /// Set when a delete was accepted.
    pub deleted_at: Option<DateTime<Utc>>,
    /// Minutes without activity after which a `running` sandbox is stopped; `None`: never.
    pub auto_stop_minutes: Option<i32>,
    /// Minutes after which a `stopped` or `failed-start` sandbox is deleted; `None`: never.
    pub auto_delete_minutes: Option<i32>,
}

impl SandboxRow {
    /// Reads a row selected with [`COLUMNS`] (or [`columns_of`]).
    ///
    /// Errors: [`StoreError::Corrupt`] for a state or stop mode this build does not know.
    pub fn from_row(row: &PgRow) -> Result<Self, StoreError> {
        let get = StoreError::database(Op::SandboxGet);
        let state: String = row.try_get("state").map_err(get)?;
        let last_stop: Option<String> = row.try_get("last_stop").map_err(get)?;
        Ok(Self {
            id: row.try_get("id").map_err(get)?,
            org_id: row.try_get("org_id").map_err(get)?,
            template: row.try_get("template").map_err(get)?,
            host_id: row.try_get("host_id").map_err(get)?,
            state: state.parse().map_err(|e| corrupt("sandboxes.state", e))?,
            state_reason: row.try_get("state_reason").map_err(get)?,
            generation: row.try_get("generation").map_err(get)?,
            holds_capacity: row.try_get("holds_capacity").map_err(get)?,
            resources: resources(
                row.try_get("vcpus").map_err(get)?,
                row.try_get("memory_mib").map_err(get)?,
            ),
            metadata: row.try_get("metadata").map_err(get)?,
            address: row.try_get("address").map_err(get)?,
            last_stop: last_stop.as_deref().map(stop_mode).transpose()?,
            created_at: row.try_get("created_at").map_err(get)?,
            updated_at: row.try_get("updated_at").map_err(get)?,
            deleted_at: row.try_get("deleted_at").map_err(get)?,
            auto_stop_minutes: row.try_get("auto_stop_minutes").map_err(get)?,
            auto_delete_minutes: row.try_get("auto_delete_minutes").map_err(get)?,
        })
    }

    /// Whether a delete was accepted (`deleted_at` is set).
    pub fn deleting(&self) -> bool {
        self.deleted_at.is_some()
    }

    /// The spec a host needs for a command about this sandbox.
    pub fn spec(&self) -> SandboxSpec {
        SandboxSpec {
            org_id: self.org_id,
            template: self.template.clone(),
            resources: self.resources,
        }
    }
}

/// `vcpus` and `memory_mib` columns (both `integer`) as [`Resources`]; the only place they are
/// read. A negative value (which the table's CHECKs forbid) reads as 0.
pub(crate) fn resources(vcpus: i32, memory_mib: i32) -> Resources {
    Resources {
        vcpus: u32::try_from(vcpus).unwrap_or(0),
        memory_mib: u32::try_from(memory_mib).unwrap_or(0),
    }
}

/// [`Resources`] as the `integer` columns they are written to; the only place they are written.
pub(crate) fn resource_columns(r: Resources) -> (i32, i32) {
    (
        i32::try_from(r.vcpus).unwrap_or(i32::MAX),
        i32::try_from(r.memory_mib).unwrap_or(i32::MAX),
    )
}

fn stop_mode(s: &str) -> Result<StopMode, StoreError> {
    [StopMode::Memory, StopMode::Disk]
        .into_iter()
        .find(|m| m.as_str() == s)
        .ok_or_else(|| corrupt("sandboxes.last_stop", s))
}

fn corrupt(column: &'static str, message: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        column,
        message: message.to_string(),
    }
}

fn rows(rows: &[PgRow]) -> Result<Vec<SandboxRow>, StoreError> {
    rows.iter().map(SandboxRow::from_row).collect()
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// A sandbox to create, already placed on `host_id` (whose capacity the caller reserved).
#[derive(Debug, Clone)]
pub struct NewSandbox {
    /// The org that owns it.
    pub org_id: OrgId,
    /// The template to provision from (a `templates.name`, already checked to exist).
    pub template: String,
    /// The host placement chose; its capacity is already reserved in this transaction.
    pub host_id: HostId,
    /// Its size: whole vCPUs and MiB.
    pub resources: Resources,
    /// The user's metadata object, stored as given.
    pub metadata: serde_json::Value,
    /// Minutes without activity before auto-stop; `None`: never.
    pub auto_stop_minutes: Option<i32>,
    /// Minutes stopped (or failed) before auto-delete; `None`: never.
    pub auto_delete_minutes: Option<i32>,
}

/// Writes a new `provisioning` sandbox holding the capacity its placement reserved, its
/// `sandbox.create` command and its event, in the caller's transaction (guarantee 1). Returns
/// the row and the command id.
pub async fn create(
    conn: &mut PgConnection,
    new: NewSandbox,
) -> Result<(SandboxRow, CommandId), StoreError> {
    let id = SandboxId::new();
    let generation = Generation::INITIAL;
    let (vcpus, memory_mib) = resource_columns(new.resources);
    let row = timed(
        Op::SandboxInsert,
        sqlx::query(&format!(
            "INSERT INTO sandboxes (id, org_id, template, host_id, state, generation, vcpus,
                                    memory_mib, holds_capacity, metadata, auto_stop_minutes,
                                    auto_delete_minutes)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, true, $9, $10, $11)
             RETURNING {COLUMNS}"
        ))
        .bind(id)
        .bind(new.org_id)
        .bind(&new.template)
        .bind(new.host_id)
        .bind(SandboxState::Provisioning.as_str())
        .bind(generation)
        .bind(vcpus)
        .bind(memory_mib)
        .bind(&new.metadata)
        .bind(new.auto_stop_minutes)
        .bind(new.auto_delete_minutes)
        .fetch_one(&mut *conn),
    )
    .await?;
    let row = SandboxRow::from_row(&row)?;
    let command = Command {
        id: CommandId::new(),
        sandbox_id: id,
        generation,
        kind: CommandKind::Create,
        spec: row.spec(),
    };
    commands::insert(&mut *conn, new.host_id, &command).await?;
    events::insert(
        conn,
        &NewEvent {
            sandbox_id: id,
            org_id: new.org_id,
            from: None,
            to: SandboxState::Provisioning,
            reason: Reason::UserRequest,
            generation,
            command_id: Some(command.id),
            message: None,
        },
    )
    .await?;
    Ok((row, command.id))
}

/// The org's sandbox `id`, or `None` (also for another org's sandbox: guarantee 7).
pub async fn get(
    db: impl PgExecutor<'_>,
    org: OrgId,
    id: SandboxId,
) -> Result<Option<SandboxRow>, StoreError> {
    let row = timed(
        Op::SandboxGet,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes WHERE id = $1 AND org_id = $2"
        ))
        .bind(id)
        .bind(org)
        .fetch_optional(db),
    )
    .await?;
    row.as_ref().map(SandboxRow::from_row).transpose()
}

/// Locks the sandbox's row (`FOR UPDATE`) in the caller's transaction and reads it; scoped to
/// `org` when given (a user's request), any org otherwise (the control plane).
pub async fn lock(
    conn: &mut PgConnection,
    id: SandboxId,
    org: Option<OrgId>,
) -> Result<Option<SandboxRow>, StoreError> {
    let row = timed(
        Op::SandboxLock,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes
              WHERE id = $1 AND ($2::uuid IS NULL OR org_id = $2)
              FOR UPDATE"
        ))
        .bind(id)
        .bind(org)
        .fetch_optional(conn),
    )
    .await?;
    row.as_ref().map(SandboxRow::from_row).transpose()
}

/// One page of the org's sandboxes, newest first: those in `state` (without it, all but
/// tombstones), older than `before` when given, at most `limit`.
pub async fn list(
    db: impl PgExecutor<'_>,
    org: OrgId,
    state: Option<SandboxState>,
    before: Option<SandboxId>,
    limit: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    let found = timed(
        Op::SandboxList,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes
              WHERE org_id = $1
                AND ($2::text IS NULL AND state <> 'deleted' OR state = $2)
                AND ($3::uuid IS NULL OR id < $3)
              ORDER BY id DESC
              LIMIT $4"
        ))
        .bind(org)
        .bind(state.map(SandboxState::as_str))
        .bind(before)
        .bind(limit)
        .fetch_all(db),
    )
    .await?;
    rows(&found)
}

/// Marks the sandbox active now (`last_activity_at`, which auto-stop measures from).
pub async fn touch(db: impl PgExecutor<'_>, id: SandboxId) -> Result<(), StoreError> {
    timed(
        Op::SandboxTouch,
        sqlx::query("UPDATE sandboxes SET last_activity_at = now() WHERE id = $1")
            .bind(id)
            .execute(db),
    )
    .await?;
    Ok(())
}

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
    let generation = row.generation.next();
    let updated = timed(
        Op::SandboxTransition,
        sqlx::query(&format!(
            "UPDATE sandboxes
                SET state = $3, generation = $4, holds_capacity = $5, state_reason = $6,
                    deleted_at = CASE WHEN $7 THEN COALESCE(deleted_at, now()) ELSE deleted_at END,
                    address = CASE WHEN $3 IN ('running', 'stopping') THEN address ELSE NULL END,
                    last_activity_at = CASE WHEN $8 THEN now() ELSE last_activity_at END,
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
        let command = Command {
            id: CommandId::new(),
            sandbox_id: row.id,
            generation,
            kind,
            spec: row.spec(),
        };
        commands::insert(&mut *conn, host, &command).await?;
        command_id = Some(command.id);
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
    /// The host's failure reason, shown as `state_reason`.
    pub message: Option<&'a str>,
}

/// Writes a host result onto the locked sandbox `row`: state, capacity, address, stop mode and
/// the event, in the caller's transaction.
///
/// Errors: [`StoreError::Fenced`] when the row is no longer at `row.generation`.
pub async fn write_result(
    conn: &mut PgConnection,
    row: &SandboxRow,
    result: &ResultWrite<'_>,
) -> Result<(), StoreError> {
    let holds_capacity =
        apply_capacity(&mut *conn, row, result.capacity, Overcommit::default()).await?;
    let updated = timed(
        Op::SandboxApplyResult,
        sqlx::query(
            "UPDATE sandboxes
                SET state = $3,
                    state_reason = $4,
                    address = CASE WHEN $3 = 'running' THEN $5 ELSE NULL END,
                    last_stop = COALESCE($6, last_stop),
                    holds_capacity = $7,
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

/// What the org's capacity-holding sandboxes use (its quota's measure).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// How many sandboxes hold capacity (the `max_running` measure).
    pub sandboxes: i64,
    /// Their summed vCPUs (whole vCPUs).
    pub vcpus: i64,
    /// Their summed memory, MiB.
    pub memory_mib: i64,
}

/// Sums the org's sandboxes that hold capacity and are not being deleted.
pub async fn org_usage(conn: &mut PgConnection, org: OrgId) -> Result<Usage, StoreError> {
    let (sandboxes, vcpus, memory_mib): (i64, i64, i64) = timed(
        Op::SandboxOrgUsage,
        sqlx::query_as(
            "SELECT count(*), COALESCE(sum(vcpus), 0)::int8, COALESCE(sum(memory_mib), 0)::int8
               FROM sandboxes WHERE org_id = $1 AND holds_capacity AND deleted_at IS NULL",
        )
        .bind(org)
        .fetch_one(conn),
    )
    .await?;
    Ok(Usage {
        sandboxes,
        vcpus,
        memory_mib,
    })
}

/// How long each timed command may stay unanswered.
#[derive(Debug, Clone, Copy)]
pub struct CommandTimeouts {
    /// How long a `sandbox.create` may stay unanswered.
    pub create: Duration,
    /// How long a `sandbox.start` may stay unanswered.
    pub start: Duration,
    /// How long a `sandbox.stop` may stay unanswered (a delete is not timed).
    pub stop: Duration,
}

impl CommandTimeouts {
    fn of(&self, kind: CommandKind) -> Duration {
        match kind {
            CommandKind::Create => self.create,
            CommandKind::Start => self.start,
            CommandKind::Stop | CommandKind::Delete => self.stop,
        }
    }
}

/// Locks (skipping rows others hold) up to `batch` sandboxes whose current command, one they
/// still wait on ([`TIMED_COMMANDS`]), is older than its timeout; with the command's kind.
pub async fn lock_timed_out(
    conn: &mut PgConnection,
    timeouts: CommandTimeouts,
    batch: i64,
) -> Result<Vec<(SandboxRow, CommandKind)>, StoreError> {
    let kinds: Vec<&str> = TIMED_COMMANDS.iter().map(|(k, _)| k.as_str()).collect();
    let states: Vec<&str> = TIMED_COMMANDS.iter().map(|(_, s)| s.as_str()).collect();
    let limits: Vec<f64> = TIMED_COMMANDS
        .iter()
        .map(|(k, _)| secs(timeouts.of(*k)))
        .collect();
    let found = timed(
        Op::SandboxTimedOut,
        sqlx::query(&format!(
            "SELECT c.kind AS command_kind, {cols}
               FROM commands c JOIN sandboxes s ON s.id = c.sandbox_id
               JOIN unnest($1::text[], $2::text[], $3::float8[]) AS t(kind, state, secs)
                 ON t.kind = c.kind AND t.state = s.state
              WHERE c.completed_at IS NULL
                AND c.generation = s.generation AND s.deleted_at IS NULL
                AND c.created_at < now() - make_interval(secs => t.secs)
              ORDER BY c.created_at
              LIMIT $4
              FOR UPDATE OF s SKIP LOCKED",
            cols = columns_of("s")
        ))
        .bind(&kinds)
        .bind(&states)
        .bind(&limits)
        .bind(batch)
        .fetch_all(conn),
    )
    .await?;
    found
        .iter()
        .map(|r| {
            let kind: String = r
                .try_get("command_kind")
                .map_err(StoreError::database(Op::SandboxTimedOut))?;
            let kind = kind.parse().map_err(|e| corrupt("commands.kind", e))?;
            Ok((SandboxRow::from_row(r)?, kind))
        })
        .collect()
}

/// Locks up to `batch` `running` sandboxes whose host (not lost) sent a heartbeat more than
/// `grace` after the row's last change that does not list the guest as running; with how the
/// guest failed.
pub async fn lock_failed_guests(
    conn: &mut PgConnection,
    grace: Duration,
    batch: i64,
) -> Result<Vec<(SandboxRow, GuestFailure)>, StoreError> {
    let found = timed(
        Op::SandboxUnhealthy,
        sqlx::query(&format!(
            "SELECT {cols},
                    EXISTS (SELECT 1 FROM jsonb_array_elements(h.inventory) i
                             WHERE i->>'sandbox_id' = s.id::text) AS listed
               FROM sandboxes s JOIN hosts h ON h.id = s.host_id
              WHERE s.state = 'running' AND s.deleted_at IS NULL AND h.state <> 'lost'
                AND h.last_seen > s.updated_at + make_interval(secs => $1)
                AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(h.inventory) i
                                 WHERE i->>'sandbox_id' = s.id::text
                                   AND i->>'status' = 'running')
              LIMIT $2
              FOR UPDATE OF s SKIP LOCKED",
            cols = columns_of("s")
        ))
        .bind(secs(grace))
        .bind(batch)
        .fetch_all(conn),
    )
    .await?;
    found
        .iter()
        .map(|r| {
            let listed: bool = r
                .try_get("listed")
                .map_err(StoreError::database(Op::SandboxUnhealthy))?;
            let failure = if listed {
                GuestFailure::Unhealthy
            } else {
                GuestFailure::Missing
            };
            Ok((SandboxRow::from_row(r)?, failure))
        })
        .collect()
}

/// Locks up to `batch` sandboxes living on a host that has been silent for `silent_for` and is
/// `lost` ([`STRANDED_ON_LOST_HOST`] states).
pub async fn lock_stranded(
    conn: &mut PgConnection,
    silent_for: Duration,
    batch: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    let states: Vec<&str> = STRANDED_ON_LOST_HOST.iter().map(|s| s.as_str()).collect();
    let found = timed(
        Op::SandboxStranded,
        sqlx::query(&format!(
            "SELECT {cols}
               FROM sandboxes s JOIN hosts h ON h.id = s.host_id
              WHERE h.state = 'lost' AND s.deleted_at IS NULL
                AND h.last_seen < now() - make_interval(secs => $1)
                AND s.state = ANY($2)
              LIMIT $3
              FOR UPDATE OF s SKIP LOCKED",
            cols = columns_of("s")
        ))
        .bind(secs(silent_for))
        .bind(&states)
        .bind(batch)
        .fetch_all(conn),
    )
    .await?;
    rows(&found)
}

/// Locks up to `batch` `running` sandboxes idle for their `auto_stop_minutes`.
pub async fn lock_idle(conn: &mut PgConnection, batch: i64) -> Result<Vec<SandboxRow>, StoreError> {
    let found = timed(
        Op::SandboxAutoStop,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes
              WHERE deleted_at IS NULL AND state = 'running' AND auto_stop_minutes IS NOT NULL
                AND last_activity_at < now() - make_interval(mins => auto_stop_minutes)
              LIMIT $1 FOR UPDATE SKIP LOCKED"
        ))
        .bind(batch)
        .fetch_all(conn),
    )
    .await?;
    rows(&found)
}

/// Locks up to `batch` `stopped` or `failed-start` sandboxes left so for their
/// `auto_delete_minutes`.
pub async fn lock_expired(
    conn: &mut PgConnection,
    batch: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    let found = timed(
        Op::SandboxAutoDelete,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes
              WHERE deleted_at IS NULL AND state IN ('stopped', 'failed-start')
                AND auto_delete_minutes IS NOT NULL
                AND updated_at < now() - make_interval(mins => auto_delete_minutes)
              LIMIT $1 FOR UPDATE SKIP LOCKED"
        ))
        .bind(batch)
        .fetch_all(conn),
    )
    .await?;
    rows(&found)
}

/// Deletes up to `batch` tombstones (`deleted` for longer than `retention`) whose events are
/// all published (purging cascades to them); returns their ids.
pub async fn purge_tombstones(
    conn: &mut PgConnection,
    retention: Duration,
    batch: i64,
) -> Result<Vec<SandboxId>, StoreError> {
    timed(
        Op::SandboxPurge,
        sqlx::query_scalar(
            "DELETE FROM sandboxes WHERE id IN (
                 SELECT id FROM sandboxes
                  WHERE state = 'deleted' AND updated_at < now() - make_interval(secs => $1)
                    AND NOT EXISTS (SELECT 1 FROM events e
                                     WHERE e.sandbox_id = sandboxes.id
                                       AND e.published_at IS NULL)
                  LIMIT $2 FOR UPDATE SKIP LOCKED)
             RETURNING id",
        )
        .bind(secs(retention))
        .bind(batch)
        .fetch_all(conn),
    )
    .await
}

/// Guarantee 4 measured: the summed absolute differences, over hosts, between what a host has
/// reserved and what its capacity-holding sandboxes need, as (vCPUs, MiB). Both must be 0.
pub async fn capacity_drift(db: impl PgExecutor<'_>) -> Result<(i64, i64), StoreError> {
    timed(
        Op::CapacityDrift,
        sqlx::query_as(
            "SELECT COALESCE(sum(abs(h.reserved_vcpus - COALESCE(s.vcpus, 0))), 0)::int8,
                    COALESCE(sum(abs(h.reserved_memory_mib - COALESCE(s.mem, 0))), 0)::int8
               FROM hosts h
               LEFT JOIN (SELECT host_id, sum(vcpus) AS vcpus, sum(memory_mib) AS mem
                            FROM sandboxes WHERE holds_capacity GROUP BY host_id) s
                 ON s.host_id = h.id",
        )
        .fetch_one(db),
    )
    .await
}

/// How many rows are in each state (for the `berth_sandboxes{state}` gauge).
pub async fn count_by_state(
    db: impl PgExecutor<'_>,
) -> Result<Vec<(SandboxState, i64)>, StoreError> {
    let counts: Vec<(String, i64)> = timed(
        Op::SandboxList,
        sqlx::query_as("SELECT state, count(*) FROM sandboxes GROUP BY state").fetch_all(db),
    )
    .await?;
    counts
        .into_iter()
        .map(|(s, n)| Ok((s.parse().map_err(|e| corrupt("sandboxes.state", e))?, n)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_column_list_is_qualified_with_the_alias() {
        let qualified = columns_of("s");
        assert!(qualified.starts_with("s.id, s.org_id, "));
        assert_eq!(qualified.matches("s.").count(), COLUMNS.split(", ").count());
    }

    #[test]
    fn resources_round_trip_through_their_columns() {
        let r = Resources {
            vcpus: 3,
            memory_mib: 1536,
        };
        let (v, m) = resource_columns(r);
        assert_eq!(resources(v, m), r);
        assert_eq!(resources(-1, -1), Resources::default());
    }
}
