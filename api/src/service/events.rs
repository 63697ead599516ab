//! Reading the `events` table: a sandbox's events (`GET /v1/sandboxes/{id}/events`), and the
//! published event log — rows the relay has published, in publish order (`seq`), rendered as
//! CloudEvents. Read by the SSE stream ([`crate::http::events`]) and the webhook fan-out
//! ([`crate::webhooks::delivery`]); written by the relay ([`crate::outbox::event_relay`]).
//!
//! # Guarantees
//! - `seq` values become visible in increasing order (see `0005_events_outbox.sql`), so
//!   "every published event after seq N" read twice never skips one that committed between
//!   the reads: the resume point of SSE and of each webhook's cursor.
//! - An event's CloudEvent `id` is its row id, on every path.

use berth_schemas::cloudevents::{CloudEvent, SandboxEventData, TYPE_PREFIX};
use berth_schemas::{EventId, OrgId, SandboxId, SandboxState};
use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Row};

use super::ServiceError;
use crate::model::Event;

/// The columns [`EventRecord::from_row`] reads (select from `events`).
pub const EVENT_COLUMNS: &str = "id, sandbox_id, org_id, from_state, to_state, reason, \
     generation, command_id, message, at, seq";

/// One event row with its place in the publish order (`None` before it is published).
#[derive(Debug, Clone)]
pub struct EventRecord {
    pub seq: Option<i64>,
    pub event: CloudEvent<SandboxEventData>,
}

impl EventRecord {
    /// Reads a row selected with [`EVENT_COLUMNS`].
    ///
    /// Errors: a decode error when a column is missing or a state is not one Berth writes.
    pub fn from_row(row: &PgRow) -> Result<Self, sqlx::Error> {
        let state = |name: &str| -> Result<Option<SandboxState>, sqlx::Error> {
            row.try_get::<Option<String>, _>(name)?
                .map(|s| s.parse().map_err(|e| sqlx::Error::Decode(Box::new(e))))
                .transpose()
        };
        let to = state("to_state")?.ok_or_else(|| {
            sqlx::Error::Decode("events.to_state is NOT NULL but read as NULL".into())
        })?;
        let at: DateTime<Utc> = row.try_get("at")?;
        Ok(Self {
            seq: row.try_get("seq")?,
            event: CloudEvent::sandbox(
                row.try_get("id")?,
                at,
                SandboxEventData {
                    sandbox_id: row.try_get("sandbox_id")?,
                    org_id: row.try_get("org_id")?,
                    from: state("from_state")?,
                    to,
                    reason: row.try_get("reason")?,
                    generation: row.try_get("generation")?,
                    command_id: row.try_get("command_id")?,
                    message: row.try_get("message")?,
                },
            ),
        })
    }
}

/// Which events a reader wants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventFilter {
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
    conn: &mut PgConnection,
    org: OrgId,
    after_seq: i64,
    filter: &EventFilter,
    limit: i64,
) -> Result<Vec<EventRecord>, sqlx::Error> {
    let rows = sqlx::query(&format!(
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
    .fetch_all(conn)
    .await?;
    rows.iter().map(EventRecord::from_row).collect()
}

/// The publish position of one of `org`'s published events; `None` when there is no such
/// event (another org's, never published, or purged with its sandbox).
pub async fn seq_of(
    conn: &mut PgConnection,
    org: OrgId,
    event: EventId,
) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT seq FROM events WHERE id = $1 AND org_id = $2 AND seq IS NOT NULL")
        .bind(event)
        .bind(org)
        .fetch_optional(conn)
        .await
}

/// The highest published position so far (0 when nothing was published).
pub async fn latest_seq(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT COALESCE(max(seq), 0)::int8 FROM events")
        .fetch_one(conn)
        .await
}

/// The events of `org`'s sandbox `id`, oldest first.
///
/// Errors: [`ServiceError::NotFound`] when the sandbox is not `org`'s.
pub async fn of_sandbox(
    db: &PgPool,
    org: OrgId,
    id: SandboxId,
) -> Result<Vec<Event>, ServiceError> {
    let sandbox = super::sandboxes::get(db, org, id).await?;
    let rows = sqlx::query(
        "SELECT id, sandbox_id, type, from_state, to_state, reason, generation, message, at
           FROM events WHERE sandbox_id = $1 AND org_id = $2 ORDER BY id",
    )
    .bind(sandbox.id)
    .bind(org)
    .fetch_all(db)
    .await?;
    let events = rows
        .iter()
        .map(|r| {
            Ok(Event {
                id: r.try_get("id")?,
                sandbox_id: r.try_get("sandbox_id")?,
                kind: r.try_get("type")?,
                from: r.try_get("from_state")?,
                to: r.try_get("to_state")?,
                reason: r.try_get("reason")?,
                generation: r.try_get("generation")?,
                message: r.try_get("message")?,
                at: r.try_get("at")?,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    Ok(events)
}

/// Why a stream cannot start where it was asked to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamStart {
    /// Start after this publish position.
    After(i64),
    /// The resume point names no published event of the org.
    UnknownLastEvent,
}

/// Where an SSE stream of `org` starts: after the published event `last` (`None`: from the
/// oldest retained event; `Some(None)`: a resume point that is not an event id, which names
/// nothing).
///
/// Errors: [`ServiceError::NotFound`] when `filter` names a sandbox that is not `org`'s.
pub async fn stream_start(
    db: &PgPool,
    org: OrgId,
    filter: &EventFilter,
    last: Option<Option<EventId>>,
) -> Result<StreamStart, ServiceError> {
    let mut conn = db.acquire().await?;
    if let Some(sandbox) = filter.sandbox_id {
        // Another org's sandbox (or none) is "not found", as on every sandbox route.
        let owned: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM sandboxes WHERE id = $1 AND org_id = $2")
                .bind(sandbox)
                .bind(org)
                .fetch_optional(&mut *conn)
                .await?;
        if owned.is_none() {
            return Err(ServiceError::NotFound(format!("sandbox {sandbox}")));
        }
    }
    Ok(match last {
        None => StreamStart::After(0),
        Some(None) => StreamStart::UnknownLastEvent,
        Some(Some(id)) => match seq_of(&mut conn, org, id).await? {
            Some(seq) => StreamStart::After(seq),
            None => StreamStart::UnknownLastEvent,
        },
    })
}

/// [`published_after`] on a connection of the pool.
pub async fn published_after_on(
    db: &PgPool,
    org: OrgId,
    after_seq: i64,
    filter: &EventFilter,
    limit: i64,
) -> Result<Vec<EventRecord>, sqlx::Error> {
    let mut conn = db.acquire().await?;
    published_after(&mut conn, org, after_seq, filter, limit).await
}
