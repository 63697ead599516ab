//! The `events` table: one row per state change of a sandbox, written in the same transaction
//! as the change (guarantee 1), published later by the API's event relay.

use berth_schemas::{CommandId, EventId, Generation, OrgId, Reason, SandboxId, SandboxState};
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};

use crate::op::{timed, Op};
use crate::StoreError;

/// One state change of one sandbox, as written to `events`.
#[derive(Debug, Clone)]
pub struct NewEvent<'a> {
    /// The sandbox that changed.
    pub sandbox_id: SandboxId,
    /// The org that owns it (events are listed and published per org).
    pub org_id: OrgId,
    /// The state before; `None` for a sandbox's first event (its create).
    pub from: Option<SandboxState>,
    /// The state entered.
    pub to: SandboxState,
    /// Why it changed.
    pub reason: Reason,
    /// The generation the change was written at.
    pub generation: Generation,
    /// The command the change queued or completed; `None` when it has none.
    pub command_id: Option<CommandId>,
    /// Detail shown to users (why a boot failed, …).
    pub message: Option<&'a str>,
}

impl NewEvent<'_> {
    /// The event type: `sandbox.<to-state>` (`sandbox.running`, `sandbox.failed-start`, …).
    pub fn event_type(&self) -> String {
        format!("sandbox.{}", self.to.as_str())
    }
}

/// Inserts an event row in the caller's transaction and returns its id.
pub async fn insert(conn: &mut PgConnection, event: &NewEvent<'_>) -> Result<EventId, StoreError> {
    let id = EventId::new();
    timed(
        Op::EventInsert,
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
        .execute(conn),
    )
    .await?;
    Ok(id)
}

/// An event row as the API lists it.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct EventRow {
    /// The event's id (UUIDv7); also the CloudEvent `id`.
    pub id: EventId,
    /// The sandbox that changed.
    pub sandbox_id: SandboxId,
    /// `sandbox.<state>`.
    #[sqlx(rename = "type")]
    pub kind: String,
    #[sqlx(rename = "from_state")]
    /// The state before (`from_state`); `None` for the first event.
    pub from: Option<String>,
    #[sqlx(rename = "to_state")]
    /// The state entered (`to_state`).
    pub to: String,
    /// Why (`user_request`, `host_report`, …).
    pub reason: String,
    /// The generation the change was written at.
    pub generation: Generation,
    /// Detail (why a boot failed, …); `None` when there is none.
    pub message: Option<String>,
    /// When it was written (database clock).
    pub at: DateTime<Utc>,
}

/// The org's sandbox's events, oldest first.
pub async fn list_for_sandbox(
    db: impl PgExecutor<'_>,
    org: OrgId,
    sandbox: SandboxId,
) -> Result<Vec<EventRow>, StoreError> {
    timed(
        Op::EventList,
        sqlx::query_as(
            "SELECT id, sandbox_id, type, from_state, to_state, reason, generation, message, at
               FROM events WHERE sandbox_id = $1 AND org_id = $2 ORDER BY id",
        )
        .bind(sandbox)
        .bind(org)
        .fetch_all(db),
    )
    .await
}
