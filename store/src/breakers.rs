//! The reconciler's circuit breaker trips (`breaker_trips`) and the host events they raise
//! (`host_events`). The decision is `berth_schemas::state::breaker::judge`; this module only
//! stores what it decided, and an operator's release.
//!
//! # Guarantees
//! - One row per scope: a host (its id) or the fleet ([`Scope::Fleet`]). A row exists while the
//!   scope's share of failing guests stays exceeded; the pass deletes it once it is not.
//! - An operator's release ([`release`]) only marks an existing trip; it never creates one,
//!   so a release given before a trip cannot wave through a later one.

use berth_schemas::HostId;
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};

use crate::op::{timed, Op};
use crate::StoreError;

/// What a breaker guards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// One host's running sandboxes.
    Host(HostId),
    /// Every running sandbox.
    Fleet,
}

/// The `scope` column's spelling of the fleet.
const FLEET: &str = "fleet";

impl Scope {
    /// The `scope` column: the host's id, or `fleet`.
    pub fn key(self) -> String {
        match self {
            Scope::Host(id) => id.to_string(),
            Scope::Fleet => FLEET.to_owned(),
        }
    }

    fn parse(key: &str) -> Result<Self, StoreError> {
        if key == FLEET {
            return Ok(Scope::Fleet);
        }
        key.parse()
            .map(Scope::Host)
            .map_err(|_| StoreError::Corrupt {
                column: "breaker_trips.scope",
                message: key.to_owned(),
            })
    }

    /// The host, if the scope is one.
    pub fn host(self) -> Option<HostId> {
        match self {
            Scope::Host(id) => Some(id),
            Scope::Fleet => None,
        }
    }
}

/// Who released a trip (the `released_by` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleasedBy {
    /// `berth admin breaker-release`.
    Operator,
    /// The evidence persisted for the configured passes.
    Persisted,
}

impl ReleasedBy {
    /// The column's spelling (`operator`, `persisted`).
    pub fn as_str(self) -> &'static str {
        match self {
            ReleasedBy::Operator => "operator",
            ReleasedBy::Persisted => "persisted",
        }
    }
}

/// A stored trip.
#[derive(Debug, Clone, PartialEq)]
pub struct TripRow {
    /// What tripped.
    pub scope: Scope,
    /// When it tripped (database clock).
    pub tripped_at: DateTime<Utc>,
    /// Consecutive passes that found the share exceeded on new evidence.
    pub passes: u32,
    /// The heartbeat `seq` the last counted pass looked at (for the fleet: the newest of its
    /// failing hosts').
    pub last_seq: Option<i64>,
    /// Sandboxes the last pass would have failed there.
    pub would_fail: i64,
    /// Running sandboxes there at the last pass.
    pub running: i64,
    /// When and by whom it was released, if it was.
    pub released: Option<(DateTime<Utc>, String)>,
}

type TripTuple = (
    String,
    DateTime<Utc>,
    i32,
    Option<i64>,
    i64,
    i64,
    Option<DateTime<Utc>>,
    Option<String>,
);

/// Every stored trip, the fleet's first, then by host.
///
/// Errors: [`StoreError`] (also `Corrupt` for a scope that is neither a host id nor `fleet`).
pub async fn trips(db: impl PgExecutor<'_>) -> Result<Vec<TripRow>, StoreError> {
    let rows: Vec<TripTuple> = timed(
        Op::Breaker,
        sqlx::query_as(
            "SELECT scope, tripped_at, passes, last_seq, would_fail, running, released_at,
                    released_by
               FROM breaker_trips ORDER BY scope <> $1, scope",
        )
        .bind(FLEET)
        .fetch_all(db),
    )
    .await?;
    rows.into_iter()
        .map(
            |(scope, tripped_at, passes, last_seq, would_fail, running, at, by)| {
                Ok(TripRow {
                    scope: Scope::parse(&scope)?,
                    tripped_at,
                    passes: u32::try_from(passes.max(0)).unwrap_or(0),
                    last_seq,
                    would_fail,
                    running,
                    released: at.map(|at| (at, by.unwrap_or_default())),
                })
            },
        )
        .collect()
}

/// What a pass stores for a scope over its share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TripWrite {
    /// The scope.
    pub scope: Scope,
    /// Its pass count now.
    pub passes: u32,
    /// The heartbeat `seq` this pass looked at (for the fleet: the newest of its failing
    /// hosts').
    pub seq: Option<i64>,
    /// Sandboxes this pass would fail there.
    pub would_fail: i64,
    /// Running sandboxes there.
    pub running: i64,
    /// Set when this pass released it (an earlier release stays as it was).
    pub released_by: Option<ReleasedBy>,
}

/// Creates or updates the scope's trip.
///
/// Errors: [`StoreError`].
pub async fn record(conn: &mut PgConnection, trip: &TripWrite) -> Result<(), StoreError> {
    timed(
        Op::Breaker,
        sqlx::query(
            "INSERT INTO breaker_trips (scope, passes, last_seq, would_fail, running, released_at,
                                        released_by)
             VALUES ($1, $2, $3, $4, $5, CASE WHEN $6::text IS NULL THEN NULL ELSE now() END, $6)
             ON CONFLICT (scope) DO UPDATE SET
                 passes = EXCLUDED.passes, last_seq = EXCLUDED.last_seq,
                 would_fail = EXCLUDED.would_fail, running = EXCLUDED.running,
                 released_at = COALESCE(breaker_trips.released_at, EXCLUDED.released_at),
                 released_by = COALESCE(breaker_trips.released_by, EXCLUDED.released_by)",
        )
        .bind(trip.scope.key())
        .bind(i32::try_from(trip.passes).unwrap_or(i32::MAX))
        .bind(trip.seq)
        .bind(trip.would_fail)
        .bind(trip.running)
        .bind(trip.released_by.map(ReleasedBy::as_str))
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// Deletes the scope's trip (its share is no longer exceeded).
///
/// Errors: [`StoreError`].
pub async fn clear(conn: &mut PgConnection, scope: Scope) -> Result<(), StoreError> {
    timed(
        Op::Breaker,
        sqlx::query("DELETE FROM breaker_trips WHERE scope = $1")
            .bind(scope.key())
            .execute(conn),
    )
    .await?;
    Ok(())
}

/// An operator's word: the scope's trip acts from the next pass on (while its share stays
/// exceeded). Returns whether a trip existed; none is created.
///
/// Errors: [`StoreError`].
pub async fn release(db: &sqlx::PgPool, scope: Scope) -> Result<bool, StoreError> {
    let done = timed(
        Op::Breaker,
        sqlx::query(
            "UPDATE breaker_trips SET released_at = now(), released_by = $2
              WHERE scope = $1 AND released_at IS NULL",
        )
        .bind(scope.key())
        .bind(ReleasedBy::Operator.as_str())
        .execute(db),
    )
    .await?;
    if done.rows_affected() > 0 {
        return Ok(true);
    }
    // Already released counts as released; a missing trip does not.
    let exists: bool = timed(
        Op::Breaker,
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM breaker_trips WHERE scope = $1)")
            .bind(scope.key())
            .fetch_one(db),
    )
    .await?;
    Ok(exists)
}

/// A host event's type (the `type` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostEventType {
    /// A breaker tripped: the pass holds failures there.
    BreakerTripped,
    /// A trip was released: the pass acts on it.
    BreakerReleased,
    /// A trip cleared: the share is no longer exceeded.
    BreakerCleared,
}

impl HostEventType {
    /// `host.breaker_tripped`, `host.breaker_released`, `host.breaker_cleared`.
    pub fn as_str(self) -> &'static str {
        match self {
            HostEventType::BreakerTripped => "host.breaker_tripped",
            HostEventType::BreakerReleased => "host.breaker_released",
            HostEventType::BreakerCleared => "host.breaker_cleared",
        }
    }
}

/// Records a host event (`host` `None`: the fleet).
///
/// Errors: [`StoreError`].
pub async fn insert_event(
    db: impl PgExecutor<'_>,
    scope: Scope,
    kind: HostEventType,
    message: &str,
) -> Result<(), StoreError> {
    timed(
        Op::Breaker,
        sqlx::query("INSERT INTO host_events (host_id, type, message) VALUES ($1, $2, $3)")
            .bind(scope.host())
            .bind(kind.as_str())
            .bind(message)
            .execute(db),
    )
    .await?;
    Ok(())
}

/// A stored host event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEventRow {
    /// The host, or `None` for the fleet.
    pub host: Option<HostId>,
    /// Its type ([`HostEventType::as_str`]).
    pub kind: String,
    /// What happened, for a human.
    pub message: String,
    /// When (database clock).
    pub at: DateTime<Utc>,
}

/// The `limit` newest host events, newest first.
///
/// Errors: [`StoreError`].
pub async fn recent_events(
    db: impl PgExecutor<'_>,
    limit: i64,
) -> Result<Vec<HostEventRow>, StoreError> {
    let rows: Vec<(Option<uuid::Uuid>, String, String, DateTime<Utc>)> = timed(
        Op::Breaker,
        sqlx::query_as(
            "SELECT host_id, type, message, at FROM host_events ORDER BY id DESC LIMIT $1",
        )
        .bind(limit)
        .fetch_all(db),
    )
    .await?;
    Ok(rows
        .into_iter()
        .map(|(host, kind, message, at)| HostEventRow {
            host: host.map(HostId),
            kind,
            message,
            at,
        })
        .collect())
}
