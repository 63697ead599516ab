//! A host's health (`hosts.health` and its companions, migration 0013): what
//! [`HostHealth::on`] decides after a boot's outcome or a probe, the operators' view of it, and
//! why placement found no host when none was placeable (issue 12 items 2 and 5).
//!
//! # Guarantees
//! - Every health write goes through [`HostHealth::on`], under the host row's lock (the same
//!   row placement reserves on), so concurrent outcomes of one host serialize.
//! - [`room_elsewhere`] never counts a host that is really full: "no capacity" is said only
//!   when no host in service would fit the sandbox even with fresh data and good health.

use std::time::Duration;

use berth_schemas::host_state::{HealthChange, HealthEvent, HealthPolicy, HostHealth};
use berth_schemas::wire::Resources;
use berth_schemas::{HostCondition, HostId};
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};

use crate::hosts::{Admit, Overcommit};
use crate::op::{timed, Op};
use crate::StoreError;

fn condition(s: &str) -> Result<HostCondition, StoreError> {
    s.parse().map_err(|e| StoreError::Corrupt {
        column: "hosts.health",
        message: format!("{e}"),
    })
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A health write: the host's health before, and what [`HostHealth::on`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// The health before the event.
    pub before: HostHealth,
    /// The decision written.
    pub change: HealthChange,
}

/// `host`'s health, locking its row when `lock`; `None` when no such host exists.
async fn read(
    conn: &mut PgConnection,
    host: HostId,
    lock: bool,
) -> Result<Option<HostHealth>, StoreError> {
    let current: Option<(String, i32, i64)> = timed(
        Op::HostHealthRecord,
        sqlx::query_as(if lock {
            "SELECT health, health_failures, health_backoff_ms FROM hosts
              WHERE id = $1 FOR NO KEY UPDATE"
        } else {
            "SELECT health, health_failures, health_backoff_ms FROM hosts WHERE id = $1"
        })
        .bind(host)
        .fetch_optional(&mut *conn),
    )
    .await?;
    current
        .map(|(health, failures, backoff_ms)| {
            Ok(HostHealth {
                condition: condition(&health)?,
                failures: u32::try_from(failures.max(0)).unwrap_or(0),
                backoff: Duration::from_millis(u64::try_from(backoff_ms.max(0)).unwrap_or(0)),
            })
        })
        .transpose()
}

/// Applies `event` to `host`'s health in the caller's transaction: locks the row, asks
/// [`HostHealth::on`], writes the result (`probe_at` = now + the decided delay, cleared when
/// `healthy`; `reason` is kept as the last bad boot's). `None` when no such host exists.
///
/// An event that changes nothing (a good boot on a healthy host, the common case) is decided
/// on an unlocked read and writes nothing: every boot result would otherwise lock and rewrite
/// its host's row, queueing behind the heartbeat upserts that hold it (issue 12, the sim's
/// result consumer). Deciding it before a concurrent bad event is a valid order of the two.
///
/// Errors: [`StoreError::Corrupt`] for a `hosts.health` the schema does not know.
pub async fn record(
    conn: &mut PgConnection,
    host: HostId,
    event: HealthEvent,
    policy: &HealthPolicy,
    reason: Option<&str>,
) -> Result<Option<Recorded>, StoreError> {
    let Some(seen) = read(conn, host, false).await? else {
        return Ok(None);
    };
    let unchanged = seen.on(event, policy);
    if unchanged.health == seen && unchanged.probe_in.is_none() && !event.is_bad() {
        return Ok(Some(Recorded {
            before: seen,
            change: unchanged,
        }));
    }
    let Some(before) = read(conn, host, true).await? else {
        return Ok(None);
    };
    let change = before.on(event, policy);
    let after = change.health;
    let reason = reason.filter(|_| event.is_bad());
    timed(
        Op::HostHealthRecord,
        sqlx::query(
            "UPDATE hosts
                SET health = $2, health_failures = $3, health_backoff_ms = $4,
                    probe_at = CASE WHEN $2 = $7 THEN NULL
                                    WHEN $5::float8 IS NULL THEN probe_at
                                    ELSE now() + make_interval(secs => $5) END,
                    health_changed_at = CASE WHEN health = $2 THEN health_changed_at
                                             ELSE now() END,
                    health_reason = COALESCE($6, health_reason)
              WHERE id = $1",
        )
        .bind(host)
        .bind(after.condition.as_str())
        .bind(i32::try_from(after.failures).unwrap_or(i32::MAX))
        .bind(millis(after.backoff))
        .bind(change.probe_in.map(|d| d.as_secs_f64()))
        .bind(reason)
        .bind(HostCondition::Healthy.as_str())
        .execute(&mut *conn),
    )
    .await?;
    Ok(Some(Recorded { before, change }))
}

/// Records that placement put a create on `host` as its probe ([`HealthEvent::ProbePlaced`]:
/// `degraded` → `probing`, the next probe one back-off later). The decision reads no policy.
pub async fn probe_placed(
    conn: &mut PgConnection,
    host: HostId,
) -> Result<Option<Recorded>, StoreError> {
    record(
        conn,
        host,
        HealthEvent::ProbePlaced,
        &HealthPolicy::default(),
        None,
    )
    .await
}

/// Why nothing was placeable although some host in service would fit the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RoomElsewhere {
    /// Hosts that admit new sandboxes and would fit it, but whose last heartbeat is older than
    /// the freshness window: their data is stale (they, or the control plane's heartbeat
    /// ingest, fell silent), not full.
    pub stale: i64,
    /// Fresh hosts that would fit it but are `degraded` or `probing` and not due a probe.
    pub unhealthy: i64,
    /// Seconds until the earliest of those unhealthy hosts is due its probe.
    pub next_probe_in: Option<f64>,
}

impl RoomElsewhere {
    /// Whether any host with room exists that placement could not use.
    pub fn any(&self) -> bool {
        self.stale > 0 || self.unhealthy > 0
    }
}

/// Counts the hosts that admit new sandboxes and would fit `need` (within `overcommit`) but
/// that placement could not choose: heard from longer ago than `freshness`, or unhealthy and
/// not due a probe. Called only once placement found nothing, to tell "unavailable" (stale or
/// unhealthy data: retry soon) from "no capacity" (every host really is full).
pub async fn room_elsewhere(
    conn: &mut PgConnection,
    need: Resources,
    freshness: Duration,
    overcommit: Overcommit,
) -> Result<RoomElsewhere, StoreError> {
    let (stale, unhealthy, next): (i64, i64, Option<f64>) = timed(
        Op::HostRoomElsewhere,
        sqlx::query_as(
            "WITH room AS (
                 SELECT last_seen > now() - make_interval(secs => $2) AS fresh,
                        health <> $7 AND (probe_at IS NULL OR probe_at > now()) AS unhealthy,
                        probe_at
                   FROM hosts
                  WHERE state = ANY($1)
                    AND reserved_vcpus + $3 <= floor(capacity_vcpus * $5)
                    AND reserved_memory_mib + $4 <= floor(capacity_memory_mib * $6))
             SELECT count(*) FILTER (WHERE NOT fresh),
                    count(*) FILTER (WHERE fresh AND unhealthy),
                    (min(EXTRACT(EPOCH FROM probe_at - now()))
                        FILTER (WHERE fresh AND unhealthy))::float8
               FROM room",
        )
        .bind(Admit::NewSandbox.states())
        .bind(freshness.as_secs_f64())
        .bind(i32::try_from(need.vcpus).unwrap_or(i32::MAX))
        .bind(i64::from(need.memory_mib))
        .bind(overcommit.cpu)
        .bind(overcommit.memory)
        .bind(HostCondition::Healthy.as_str())
        .fetch_one(conn),
    )
    .await?;
    Ok(RoomElsewhere {
        stale,
        unhealthy,
        next_probe_in: next.map(|secs| secs.max(0.0)),
    })
}

/// How many hosts take new sandboxes, and how many an operator holds out of placement, of the
/// hosts not `lost`: tells a fleet taken out of service (every host cordoned or draining) from
/// one that is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InService {
    /// Hosts whose state admits new sandboxes (`ready`), fresh or not, full or not.
    pub admitting: i64,
    /// `cordoned` hosts.
    pub cordoned: i64,
    /// `draining` hosts.
    pub draining: i64,
}

impl InService {
    /// Whether no host takes new sandboxes because an operator cordoned or drained every host
    /// there is (not `lost`).
    pub fn held_out(&self) -> bool {
        self.admitting == 0 && self.cordoned + self.draining > 0
    }
}

/// Counts the hosts by whether they take new sandboxes ([`InService`]). Called only once
/// placement found nothing and no host with room ([`room_elsewhere`]).
pub async fn in_service(conn: &mut PgConnection) -> Result<InService, StoreError> {
    let (admitting, cordoned, draining): (i64, i64, i64) = timed(
        Op::HostInService,
        sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state = ANY($1)),
                    count(*) FILTER (WHERE state = $2),
                    count(*) FILTER (WHERE state = $3)
               FROM hosts",
        )
        .bind(Admit::NewSandbox.states())
        .bind(berth_schemas::HostState::Cordoned.as_str())
        .bind(berth_schemas::HostState::Draining.as_str())
        .fetch_one(conn),
    )
    .await?;
    Ok(InService {
        admitting,
        cordoned,
        draining,
    })
}

/// A host's health as operators see it (`GET /v1/hosts`) and the gauges count it.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthView {
    /// The host.
    pub id: HostId,
    /// `healthy`, `degraded` or `probing`.
    pub condition: HostCondition,
    /// Bad boots in a row since the last good one.
    pub consecutive_failures: u32,
    /// When placement may send its next probe (`None` while healthy).
    pub probe_at: Option<DateTime<Utc>>,
    /// When the condition last changed.
    pub changed_at: DateTime<Utc>,
    /// The last bad boot's reason, if any.
    pub reason: Option<String>,
}

type HealthRow = (
    HostId,
    String,
    i32,
    Option<DateTime<Utc>>,
    DateTime<Utc>,
    Option<String>,
);

/// Every host's health (or only `host`'s).
pub async fn conditions(
    db: impl PgExecutor<'_>,
    host: Option<HostId>,
) -> Result<Vec<HealthView>, StoreError> {
    let rows: Vec<HealthRow> = timed(
        Op::HostHealthList,
        sqlx::query_as(
            "SELECT id, health, health_failures, probe_at, health_changed_at, health_reason
               FROM hosts WHERE $1::uuid IS NULL OR id = $1",
        )
        .bind(host)
        .fetch_all(db),
    )
    .await?;
    rows.into_iter()
        .map(|(id, health, failures, probe_at, changed_at, reason)| {
            Ok(HealthView {
                id,
                condition: condition(&health)?,
                consecutive_failures: u32::try_from(failures.max(0)).unwrap_or(0),
                probe_at,
                changed_at,
                reason,
            })
        })
        .collect()
}

/// Sets the `last_seen` of `hosts` to `age` ago (database clock): what a control-plane outage
/// that could not write their heartbeats leaves behind. For tests and drills; a heartbeat
/// that arrives afterwards makes the row fresh again. Returns how many rows changed.
pub async fn backdate_heartbeats(
    db: impl PgExecutor<'_>,
    hosts: &[HostId],
    age: Duration,
) -> Result<u64, StoreError> {
    let ids: Vec<uuid::Uuid> = hosts.iter().map(|h| h.as_uuid()).collect();
    let done = timed(
        Op::HostBackdate,
        sqlx::query(
            "UPDATE hosts SET last_seen = now() - make_interval(secs => $2) WHERE id = ANY($1)",
        )
        .bind(&ids)
        .bind(age.as_secs_f64())
        .execute(db),
    )
    .await?;
    Ok(done.rows_affected())
}

/// Makes `host`'s probe due now (`probe_at` = now) if it is not `healthy`: its back-off is
/// cut short, as if it had passed. For tests and drills (a real back-off is minutes long).
/// Returns whether the host was degraded or probing.
pub async fn make_probe_due(db: impl PgExecutor<'_>, host: HostId) -> Result<bool, StoreError> {
    let done = timed(
        Op::HostHealthRecord,
        sqlx::query("UPDATE hosts SET probe_at = now() WHERE id = $1 AND health <> $2")
            .bind(host)
            .bind(HostCondition::Healthy.as_str())
            .execute(db),
    )
    .await?;
    Ok(done.rows_affected() == 1)
}
