//! The `events` table: one row per state change of a sandbox, written in the same transaction
//! as the change (guarantee 1), published later by the API's event relay, and read back in
//! publish order (`seq`) as CloudEvents by the SSE stream and the webhook fan-out.
//!
//! # Guarantees
//! - `seq` values become visible in increasing order: [`mark_published`] stamps them under
//!   the advisory transaction lock [`EVENTS_SEQ_LOCK`], held only for that `UPDATE` and the
//!   commit (never across a publish). So "every published event after seq N" read twice never
//!   skips one that committed between the reads: the resume point of SSE and of each webhook's
//!   cursor.
//! - An event's CloudEvent `id` is its row id, on every path.

use berth_schemas::cloudevents::{
    CloudEvent, SandboxEventData, SANDBOX_UPDATED_ROW, SNAPSHOT_EVENT_ROWS, TYPE_PREFIX,
};
use berth_schemas::wire::{StopFallback, StopMode};
use berth_schemas::{CommandId, EventId, Generation, OrgId, Reason, SandboxId, SandboxState};
use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgExecutor, Row};

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
    /// For a stop's result: how the stop kept the sandbox, and why it kept the disk only
    /// when it wanted memory; `None` for every other change.
    pub stop: Option<(StopMode, Option<&'a StopFallback>)>,
}

impl NewEvent<'_> {
    /// The event type: `sandbox.<to-state>` (`sandbox.running`, `sandbox.failed-start`, …).
    pub fn event_type(&self) -> String {
        format!("sandbox.{}", self.to.as_str())
    }
}

/// Inserts an event row in the caller's transaction and returns its id.
pub async fn insert(conn: &mut PgConnection, event: &NewEvent<'_>) -> Result<EventId, StoreError> {
    insert_of_type(conn, event, &event.event_type(), None).await
}

/// Inserts a `sandbox.updated` event (a change of settings, no state change: `from` = `to` =
/// the sandbox's state) in the caller's transaction and returns its id.
pub async fn insert_updated(
    conn: &mut PgConnection,
    event: &NewEvent<'_>,
) -> Result<EventId, StoreError> {
    insert_of_type(conn, event, SANDBOX_UPDATED_ROW, None).await
}

async fn insert_of_type(
    conn: &mut PgConnection,
    event: &NewEvent<'_>,
    kind: &str,
    snapshot: Option<berth_schemas::ids::SnapshotId>,
) -> Result<EventId, StoreError> {
    let id = EventId::new();
    let fallback = event.stop.and_then(|(_, fallback)| fallback);
    timed(
        Op::EventInsert,
        sqlx::query(
            "INSERT INTO events (id, sandbox_id, org_id, type, from_state, to_state, reason,
                                 generation, command_id, message, last_stop, last_stop_code,
                                 last_stop_reason, snapshot_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
        )
        .bind(id)
        .bind(event.sandbox_id)
        .bind(event.org_id)
        .bind(kind)
        .bind(event.from.map(SandboxState::as_str))
        .bind(event.to.as_str())
        .bind(event.reason.as_str())
        .bind(event.generation)
        .bind(event.command_id)
        .bind(event.message)
        .bind(event.stop.map(|(mode, _)| mode.as_str()))
        .bind(fallback.map(|f| f.code.as_str()))
        .bind(fallback.map(|f| f.detail.as_str()))
        .bind(snapshot)
        .execute(conn),
    )
    .await?;
    Ok(id)
}

/// A snapshot's event (`snapshot.created`, `.ready`, `.failed`: one of
/// [`SNAPSHOT_EVENT_ROWS`]) on its sandbox's stream, in the caller's transaction: `from` and
/// `to` are both the sandbox's current state, `snapshot_id` names the snapshot.
pub async fn insert_snapshot_event(
    conn: &mut PgConnection,
    event: &NewEvent<'_>,
    kind_row: &'static str,
    snapshot: berth_schemas::ids::SnapshotId,
) -> Result<EventId, StoreError> {
    debug_assert!(SNAPSHOT_EVENT_ROWS.contains(&kind_row));
    insert_of_type(conn, event, kind_row, Some(snapshot)).await
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
    /// How the stop the event records kept the sandbox; `None` on other events.
    pub last_stop: Option<String>,
    /// Why that stop kept the disk only (`checkpoint_failed`); `None` when it did not.
    pub last_stop_code: Option<String>,
    /// With `last_stop_code`: the runtime's error.
    pub last_stop_reason: Option<String>,
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
            "SELECT id, sandbox_id, type, from_state, to_state, reason, generation, message, at,
                    last_stop, last_stop_code, last_stop_reason
               FROM events WHERE sandbox_id = $1 AND org_id = $2 ORDER BY id",
        )
        .bind(sandbox)
        .bind(org)
        .fetch_all(db),
    )
    .await
}

/// The columns [`EventRecord::from_row`] reads (select from `events`).
pub const EVENT_COLUMNS: &str = "id, sandbox_id, org_id, type, from_state, to_state, reason, \
     generation, command_id, message, at, seq, last_stop, last_stop_code, last_stop_reason, snapshot_id";

/// The advisory lock under which [`mark_published`] stamps `seq` (ASCII "BERTHSEQ").
pub const EVENTS_SEQ_LOCK: i64 = 0x4245_5254_4853_4551;

/// One event row as a CloudEvent, with its place in the publish order.
#[derive(Debug, Clone)]
pub struct EventRecord {
    /// Its publish position; `None` before it is published.
    pub seq: Option<i64>,
    /// The CloudEvent (`id` = the row id).
    pub event: CloudEvent<SandboxEventData>,
}

impl EventRecord {
    /// Reads a row selected with [`EVENT_COLUMNS`].
    ///
    /// Errors: [`StoreError::Corrupt`] for a state this build does not know.
    pub fn from_row(row: &PgRow) -> Result<Self, StoreError> {
        let get = StoreError::database(Op::EventList);
        let state = |name: &'static str| -> Result<Option<SandboxState>, StoreError> {
            row.try_get::<Option<String>, _>(name)
                .map_err(get)?
                .map(|s| {
                    s.parse().map_err(|e| StoreError::Corrupt {
                        column: name,
                        message: format!("{e}"),
                    })
                })
                .transpose()
        };
        let to = state("to_state")?.ok_or(StoreError::Corrupt {
            column: "to_state",
            message: "NULL in a NOT NULL column".into(),
        })?;
        let at: DateTime<Utc> = row.try_get("at").map_err(get)?;
        let kind: String = row.try_get("type").map_err(get)?;
        let snapshot_kind = SNAPSHOT_EVENT_ROWS
            .contains(&kind.as_str())
            .then_some(kind.clone());
        let render = move |id, at, data| match (&snapshot_kind, kind == SANDBOX_UPDATED_ROW) {
            (Some(k), _) => CloudEvent::snapshot(id, at, k, data),
            (None, true) => CloudEvent::sandbox_updated(id, at, data),
            (None, false) => CloudEvent::sandbox(id, at, data),
        };
        Ok(Self {
            seq: row.try_get("seq").map_err(get)?,
            event: render(
                row.try_get("id").map_err(get)?,
                at,
                SandboxEventData {
                    sandbox_id: row.try_get("sandbox_id").map_err(get)?,
                    org_id: row.try_get("org_id").map_err(get)?,
                    from: state("from_state")?,
                    to,
                    reason: row.try_get("reason").map_err(get)?,
                    generation: row.try_get("generation").map_err(get)?,
                    command_id: row.try_get("command_id").map_err(get)?,
                    message: row.try_get("message").map_err(get)?,
                    last_stop: row.try_get("last_stop").map_err(get)?,
                    last_stop_code: row.try_get("last_stop_code").map_err(get)?,
                    last_stop_reason: row.try_get("last_stop_reason").map_err(get)?,
                    snapshot_id: row.try_get("snapshot_id").map_err(get)?,
                },
            ),
        })
    }
}

/// Which published events a reader wants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventFilter {
    /// Only this sandbox's; `None`: every sandbox of the org.
    pub sandbox_id: Option<SandboxId>,
    /// CloudEvent types (`dev.berth.sandbox.running`); empty: every type.
    pub types: Vec<String>,
}

impl EventFilter {
    /// The `events.type` values (`sandbox.running`) the CloudEvent types name; `None` for all.
    fn row_types(&self) -> Option<Vec<String>> {
        (!self.types.is_empty()).then(|| {
            self.types
                .iter()
                .map(|t| t.strip_prefix(TYPE_PREFIX).unwrap_or(t).to_owned())
                .collect()
        })
    }
}

/// Published events of `org` after `after_seq` that pass `filter`, in publish order, at most
/// `limit`.
pub async fn published_after(
    db: impl PgExecutor<'_>,
    org: OrgId,
    after_seq: i64,
    filter: &EventFilter,
    limit: i64,
) -> Result<Vec<EventRecord>, StoreError> {
    let rows = timed(
        Op::EventList,
        sqlx::query(&format!(
            "SELECT {EVENT_COLUMNS} FROM events
              WHERE org_id = $1 AND seq > $2
                AND ($3::uuid IS NULL OR sandbox_id = $3)
                AND ($4::text[] IS NULL OR type = ANY($4))
              ORDER BY seq
              LIMIT $5"
        ))
        .bind(org)
        .bind(after_seq)
        .bind(filter.sandbox_id)
        .bind(filter.row_types())
        .bind(limit)
        .fetch_all(db),
    )
    .await?;
    rows.iter().map(EventRecord::from_row).collect()
}

/// The publish position of one of `org`'s published events; `None` when there is no such
/// event (another org's, never published, or purged with its sandbox).
pub async fn seq_of(
    db: impl PgExecutor<'_>,
    org: OrgId,
    event: EventId,
) -> Result<Option<i64>, StoreError> {
    timed(
        Op::EventList,
        sqlx::query_scalar(
            "SELECT seq FROM events WHERE id = $1 AND org_id = $2 AND seq IS NOT NULL",
        )
        .bind(event)
        .bind(org)
        .fetch_optional(db),
    )
    .await
}

/// The highest published position so far (0 when nothing was published).
pub async fn latest_seq(db: impl PgExecutor<'_>) -> Result<i64, StoreError> {
    timed(
        Op::EventList,
        sqlx::query_scalar("SELECT COALESCE(max(seq), 0)::int8 FROM events").fetch_one(db),
    )
    .await
}

/// Locks (skipping rows another relay holds) up to `batch` unpublished events, oldest first.
pub async fn claim_unpublished(
    conn: &mut PgConnection,
    batch: i64,
) -> Result<Vec<EventRecord>, StoreError> {
    let rows = timed(
        Op::EventClaim,
        sqlx::query(&format!(
            "SELECT {EVENT_COLUMNS} FROM events
              WHERE published_at IS NULL
              ORDER BY at, id
              LIMIT $1
              FOR UPDATE SKIP LOCKED"
        ))
        .bind(batch)
        .fetch_all(conn),
    )
    .await?;
    rows.iter().map(EventRecord::from_row).collect()
}

/// Marks `published` (acked by JetStream, in publish order) published and stamps consecutive
/// `seq` values on them, under [`EVENTS_SEQ_LOCK`] until the caller's transaction ends.
pub async fn mark_published(
    conn: &mut PgConnection,
    published: &[EventId],
) -> Result<(), StoreError> {
    if published.is_empty() {
        return Ok(());
    }
    timed(
        Op::EventMarkPublished,
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(EVENTS_SEQ_LOCK)
            .execute(&mut *conn),
    )
    .await?;
    let count = i64::try_from(published.len()).expect("a batch fits in i64");
    let first: i64 = timed(
        Op::EventMarkPublished,
        sqlx::query_scalar("SELECT nextval('events_seq')").fetch_one(&mut *conn),
    )
    .await?;
    if count > 1 {
        timed(
            Op::EventMarkPublished,
            sqlx::query("SELECT setval('events_seq', $1)")
                .bind(first + count - 1)
                .execute(&mut *conn),
        )
        .await?;
    }
    let seqs: Vec<i64> = (first..first + count).collect();
    timed(
        Op::EventMarkPublished,
        sqlx::query(
            "UPDATE events e SET published_at = now(), seq = u.seq
               FROM unnest($1::uuid[], $2::int8[]) AS u(id, seq)
              WHERE e.id = u.id",
        )
        .bind(published)
        .bind(&seqs)
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// The event outbox's backlog: (unpublished rows, age of the oldest in seconds).
pub async fn backlog(db: impl PgExecutor<'_>) -> Result<(i64, f64), StoreError> {
    timed(
        Op::EventBacklog,
        sqlx::query_as(
            "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(at)), 0)::float8
               FROM events WHERE published_at IS NULL",
        )
        .fetch_one(db),
    )
    .await
}

/// Every event that failed a sandbox with one of `messages` (the reconciler's guest-failure
/// messages): the sandbox and when the event was written. `berth bench --runtime sim` asks the
/// sim runtime which of those guests were alive then (a false failure).
pub async fn guest_failures(
    db: impl PgExecutor<'_>,
    messages: &[&str],
) -> Result<Vec<(SandboxId, DateTime<Utc>)>, StoreError> {
    timed(
        Op::EventGuestFailures,
        sqlx::query_as(
            "SELECT sandbox_id, at FROM events
              WHERE to_state = 'failed-start' AND message = ANY($1)",
        )
        .bind(messages)
        .fetch_all(db),
    )
    .await
}
