//! The SQL half of the contract: migrations, and the two writes every component shares (a
//! command into the outbox, an event row). Both take the caller's transaction, so the state
//! change, its command and its event commit together or not at all (guarantee 1).

use sqlx::{PgConnection, Postgres, Transaction};

use crate::ids::{CommandId, EventId, Generation, HostId, OrgId, SandboxId};
use crate::state::{CommandKind, Reason, SandboxState};
use crate::wire::{self, Command, Resources, SandboxSpec};

/// Every migration in `schemas/migrations`, embedded at build time.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// The `LISTEN`/`NOTIFY` channel an insert into `commands` signals (see the migration's
/// trigger); the outbox relay listens on it.
pub const OUTBOX_CHANNEL: &str = "berth_outbox";

/// Inserts `command` into the outbox for `host`. Published later by the relay with
/// `Nats-Msg-Id` = `command.id`.
pub async fn insert_command(
    tx: &mut Transaction<'_, Postgres>,
    host: HostId,
    command: &Command,
) -> Result<(), sqlx::Error> {
    insert_command_on(tx, host, command).await
}

/// [`insert_command`] on a plain connection (the caller's transaction).
pub async fn insert_command_on(
    conn: &mut PgConnection,
    host: HostId,
    command: &Command,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO commands (id, sandbox_id, host_id, kind, generation, payload)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(command.id)
    .bind(command.sandbox_id)
    .bind(host)
    .bind(command.kind.as_str())
    .bind(command.generation)
    .bind(wire::encode(command))
    .execute(conn)
    .await?;
    Ok(())
}

/// One state change of one sandbox, as written to `events`.
#[derive(Debug, Clone)]
pub struct NewEvent<'a> {
    pub sandbox_id: SandboxId,
    pub org_id: OrgId,
    pub from: Option<SandboxState>,
    pub to: SandboxState,
    pub reason: Reason,
    pub generation: Generation,
    pub command_id: Option<CommandId>,
    pub message: Option<&'a str>,
}

impl NewEvent<'_> {
    /// The event type: `sandbox.<to-state>` (`sandbox.running`, `sandbox.failed-start`, …).
    pub fn event_type(&self) -> String {
        format!("sandbox.{}", self.to.as_str())
    }
}

/// Inserts an event row in the caller's transaction and returns its id.
pub async fn insert_event(
    conn: &mut PgConnection,
    event: &NewEvent<'_>,
) -> Result<EventId, sqlx::Error> {
    let id = EventId::new();
    sqlx::query(
        "INSERT INTO events (id, sandbox_id, org_id, type, from_state, to_state, reason,
                             generation, command_id, message)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(id)
    .bind(event.sandbox_id)
    .bind(event.org_id)
    .bind(event.event_type())
    .bind(event.from.map(SandboxState::as_str))
    .bind(event.to.as_str())
    .bind(event.reason.as_str())
    .bind(event.generation)
    .bind(event.command_id)
    .bind(event.message)
    .execute(conn)
    .await?;
    Ok(id)
}

/// A sandbox row as the lifecycle writers need it, read `FOR UPDATE` in their transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxSnapshot {
    pub id: SandboxId,
    pub org_id: OrgId,
    pub host_id: Option<HostId>,
    pub template: String,
    pub state: SandboxState,
    pub generation: Generation,
    /// Whether `deleted_at` is set.
    pub deleting: bool,
    /// Whether its resources are counted in its host's reservation.
    pub holds_capacity: bool,
    pub resources: Resources,
}

/// The columns [`SandboxSnapshot::from_row`] reads (unqualified; select from `sandboxes`).
pub const SNAPSHOT_COLUMNS: &str = "id, org_id, host_id, template, state, generation, \
     deleted_at IS NOT NULL AS deleting, holds_capacity, vcpus, memory_mib";

impl SandboxSnapshot {
    /// Reads a row selected with [`SNAPSHOT_COLUMNS`].
    pub fn from_row(row: &sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        use sqlx::Row;
        let state: String = row.try_get("state")?;
        Ok(Self {
            id: row.try_get("id")?,
            org_id: row.try_get("org_id")?,
            host_id: row.try_get("host_id")?,
            template: row.try_get("template")?,
            state: state
                .parse()
                .map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
            generation: row.try_get("generation")?,
            deleting: row.try_get("deleting")?,
            holds_capacity: row.try_get("holds_capacity")?,
            resources: Resources {
                vcpus: u32::try_from(row.try_get::<i32, _>("vcpus")?).unwrap_or(0),
                memory_mib: u32::try_from(row.try_get::<i32, _>("memory_mib")?).unwrap_or(0),
            },
        })
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

/// A lifecycle transition to write (decided by [`crate::state`] or by the reconciler).
#[derive(Debug, Clone)]
pub struct Transition<'a> {
    pub to: SandboxState,
    /// The command for the sandbox's host, if any.
    pub command: Option<CommandKind>,
    pub reason: Reason,
    /// Whether the sandbox holds capacity afterwards (the caller reserved or released it).
    pub holds_capacity: bool,
    /// Whether this transition sets `deleted_at`.
    pub delete: bool,
    /// `state_reason` to show (e.g. why a boot failed).
    pub message: Option<&'a str>,
}

/// Writes `transition` of the locked sandbox `snap` in the caller's transaction: the row (new
/// state, next generation — the fence), the host command at that generation, and the event.
/// Returns the new generation and the command id.
///
/// Fenced: the `UPDATE` requires the row to still be at `snap.generation`; the caller holds
/// the row lock, so it is.
pub async fn write_transition(
    conn: &mut PgConnection,
    snap: &SandboxSnapshot,
    transition: &Transition<'_>,
) -> Result<(Generation, Option<CommandId>), sqlx::Error> {
    let generation = snap.generation.next();
    let updated = sqlx::query(
        "UPDATE sandboxes
            SET state = $3, generation = $4, holds_capacity = $5, state_reason = $6,
                deleted_at = CASE WHEN $7 THEN COALESCE(deleted_at, now()) ELSE deleted_at END,
                address = CASE WHEN $3 IN ('running', 'stopping') THEN address ELSE NULL END,
                updated_at = now()
          WHERE id = $1 AND generation = $2",
    )
    .bind(snap.id)
    .bind(snap.generation)
    .bind(transition.to.as_str())
    .bind(generation)
    .bind(transition.holds_capacity)
    .bind(transition.message)
    .bind(transition.delete)
    .execute(&mut *conn)
    .await?;
    if updated.rows_affected() != 1 {
        return Err(sqlx::Error::RowNotFound);
    }
    let mut command_id = None;
    if let (Some(kind), Some(host)) = (transition.command, snap.host_id) {
        let command = Command {
            id: CommandId::new(),
            sandbox_id: snap.id,
            generation,
            kind,
            spec: snap.spec(),
        };
        insert_command_on(&mut *conn, host, &command).await?;
        command_id = Some(command.id);
    }
    insert_event(
        conn,
        &NewEvent {
            sandbox_id: snap.id,
            org_id: snap.org_id,
            from: Some(snap.state),
            to: transition.to,
            reason: transition.reason,
            generation,
            command_id,
            message: transition.message,
        },
    )
    .await?;
    Ok((generation, command_id))
}
