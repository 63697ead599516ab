//! The SQL half of the contract: migrations, and the two writes every component shares (a
//! command into the outbox, an event row). Both take the caller's transaction, so the state
//! change, its command and its event commit together or not at all (guarantee 1).

use sqlx::{PgConnection, Postgres, Transaction};

use crate::ids::{CommandId, EventId, Generation, HostId, OrgId, SandboxId};
use crate::state::{Reason, SandboxState};
use crate::wire::{self, Command};

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
    .execute(&mut **tx)
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
