//! Drain moves (issue 14): `hosts.drain_live` and the `drain_moves` table (migration 0037),
//! one row per sandbox the reconciler's drive is moving off a draining host or failed to.
//! What to do with each is [`berth_schemas::host_state::drain`]'s to decide; the state writes
//! themselves are [`crate::sandboxes`]' (`write_transition`, `migrate`), in the same
//! transaction as the row here.
//!
//! # Guarantees
//! - A sandbox has at most one move (`drain_moves.sandbox_id` is the key); a failed one stays
//!   until the host is drained again, cordoned or uncordoned ([`begin`], [`end`]), so it is
//!   never retried on every pass.
//! - The drive's reads lock the sandbox rows they return (`FOR UPDATE … SKIP LOCKED`): a
//!   user's request on the same sandbox waits for the pass's transaction or is skipped by it.

use berth_schemas::host_state::drain::{DrainFailure, DrainKind, DrainPhase};
use berth_schemas::{HostId, SandboxId};
use sqlx::{PgConnection, PgExecutor, Row};

use crate::op::{timed, Op};
use crate::sandboxes::{columns_of, SandboxRow};
use crate::StoreError;

/// A draining host as the drive sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draining {
    /// The host.
    pub id: HostId,
    /// Its running sandboxes move too (`{"live": true}`).
    pub live: bool,
    /// Its moves in flight (`stopping` or `moving`).
    pub in_flight: i64,
}

/// A move in flight, with its sandbox (locked).
#[derive(Debug, Clone)]
pub struct Move {
    /// The drained host.
    pub host: HostId,
    /// How it moves.
    pub kind: DrainKind,
    /// `stopping` or `moving`.
    pub phase: DrainPhase,
    /// Seconds since it entered its phase (database clock).
    pub waited_seconds: f64,
    /// The sandbox, as it is now.
    pub row: SandboxRow,
}

/// A host's drain progress (`GET /v1/hosts/{id}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// The host.
    pub host: HostId,
    /// Whether the drain moves running sandboxes too.
    pub live: bool,
    /// Sandboxes still on the host that the drain is to move and has not begun to.
    pub left: i64,
    /// Sandboxes on the host the drain does not move: `failed-start` ones (whose disk, when
    /// they have one, stays on the host), and without `live` the running ones and those in a
    /// transition. Not being deleted, not `archived`, no move recorded.
    pub staying: i64,
    /// Moves in flight.
    pub moving: i64,
    /// Moves that failed (the sandbox stays), not retried until the host is drained again.
    pub failed: i64,
    /// Up to [`FAILURES_SHOWN`] failed moves: the sandbox and why.
    pub failures: Vec<(SandboxId, String)>,
}

/// How many failed moves [`progress`] names per host.
pub const FAILURES_SHOWN: i64 = 20;

/// A drain (again) of `host`: records whether it is `live`, and forgets its failed moves so
/// the drive tries them again.
pub async fn begin(conn: &mut PgConnection, host: HostId, live: bool) -> Result<(), StoreError> {
    set(conn, host, live).await
}

/// The end of a drain (`uncordon`, `cordon`): the drive moves nothing more from `host`, and its
/// failed moves are forgotten; moves in flight finish.
pub async fn end(conn: &mut PgConnection, host: HostId) -> Result<(), StoreError> {
    set(conn, host, false).await
}

async fn set(conn: &mut PgConnection, host: HostId, live: bool) -> Result<(), StoreError> {
    timed(
        Op::DrainSet,
        sqlx::query("UPDATE hosts SET drain_live = $2 WHERE id = $1")
            .bind(host)
            .bind(live)
            .execute(&mut *conn),
    )
    .await?;
    timed(
        Op::DrainSet,
        sqlx::query("DELETE FROM drain_moves WHERE host_id = $1 AND phase = $2")
            .bind(host)
            .bind(DrainPhase::Failed.as_str())
            .execute(&mut *conn),
    )
    .await?;
    Ok(())
}

/// Every `draining` host, with its moves in flight.
pub async fn draining(db: impl PgExecutor<'_>) -> Result<Vec<Draining>, StoreError> {
    let rows = timed(
        Op::DrainLock,
        sqlx::query(
            "SELECT h.id, h.drain_live,
                    (SELECT count(*) FROM drain_moves m
                      WHERE m.host_id = h.id AND m.phase <> 'failed') AS in_flight
               FROM hosts h WHERE h.state = 'draining' ORDER BY h.id",
        )
        .fetch_all(db),
    )
    .await?;
    let get = StoreError::database(Op::DrainLock);
    rows.iter()
        .map(|r| {
            Ok(Draining {
                id: r.try_get("id").map_err(get)?,
                live: r.try_get("drain_live").map_err(get)?,
                in_flight: r.try_get("in_flight").map_err(get)?,
            })
        })
        .collect()
}

/// Locks up to `limit` sandboxes of `host` the drive has not begun to move (no move row,
/// failed ones included), not being deleted: `stopped` ones first, then `running` ones when
/// `live`, oldest first.
pub async fn lock_untracked(
    conn: &mut PgConnection,
    host: HostId,
    live: bool,
    limit: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    let found = timed(
        Op::DrainLock,
        sqlx::query(&format!(
            "SELECT {} FROM sandboxes s
              WHERE s.host_id = $1 AND s.deleted_at IS NULL
                AND (s.state = 'stopped' OR ($2 AND s.state = 'running'))
                AND NOT EXISTS (SELECT 1 FROM drain_moves m WHERE m.sandbox_id = s.id)
              ORDER BY s.state = 'running', s.created_at, s.id
              LIMIT $3 FOR UPDATE OF s SKIP LOCKED",
            columns_of("s")
        ))
        .bind(host)
        .bind(live)
        .bind(limit)
        .fetch_all(conn),
    )
    .await?;
    found.iter().map(SandboxRow::from_row).collect()
}

/// Locks up to `batch` moves in flight (of every host: a drain that ended still finishes its
/// moves) with their sandboxes.
pub async fn lock_in_flight(conn: &mut PgConnection, batch: i64) -> Result<Vec<Move>, StoreError> {
    let found = timed(
        Op::DrainLock,
        sqlx::query(&format!(
            "SELECT m.host_id AS drain_host, m.kind, m.phase,
                    GREATEST(EXTRACT(EPOCH FROM now() - m.phase_at), 0)::float8 AS waited, {}
               FROM drain_moves m JOIN sandboxes s ON s.id = m.sandbox_id
              WHERE m.phase <> 'failed'
              ORDER BY m.phase_at
              LIMIT $1 FOR UPDATE OF s SKIP LOCKED",
            columns_of("s")
        ))
        .bind(batch)
        .fetch_all(conn),
    )
    .await?;
    let get = StoreError::database(Op::DrainLock);
    let corrupt = |column| {
        move |e: berth_schemas::state::UnknownState| StoreError::Corrupt {
            column,
            message: e.to_string(),
        }
    };
    found
        .iter()
        .map(|r| {
            let kind: String = r.try_get("kind").map_err(get)?;
            let phase: String = r.try_get("phase").map_err(get)?;
            Ok(Move {
                host: r.try_get("drain_host").map_err(get)?,
                kind: kind.parse().map_err(corrupt("drain_moves.kind"))?,
                phase: phase.parse().map_err(corrupt("drain_moves.phase"))?,
                waited_seconds: r.try_get("waited").map_err(get)?,
                row: SandboxRow::from_row(r)?,
            })
        })
        .collect()
}

/// Records that `sandbox` is moving off `host` as `kind`, now in `phase` (a failed one with
/// `why`), replacing what was recorded.
pub async fn track(
    conn: &mut PgConnection,
    sandbox: SandboxId,
    host: HostId,
    kind: DrainKind,
    phase: DrainPhase,
    why: Option<DrainFailure>,
) -> Result<(), StoreError> {
    timed(
        Op::DrainTrack,
        sqlx::query(
            "INSERT INTO drain_moves (sandbox_id, host_id, kind, phase, reason)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (sandbox_id) DO UPDATE
                SET host_id = $2, kind = $3, phase = $4, reason = $5, phase_at = now()",
        )
        .bind(sandbox)
        .bind(host)
        .bind(kind.as_str())
        .bind(phase.as_str())
        .bind(why.map(DrainFailure::as_str))
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// Forgets the move of `sandbox` (it left the host, or it is being deleted).
pub async fn forget(conn: &mut PgConnection, sandbox: SandboxId) -> Result<(), StoreError> {
    timed(
        Op::DrainTrack,
        sqlx::query("DELETE FROM drain_moves WHERE sandbox_id = $1")
            .bind(sandbox)
            .execute(conn),
    )
    .await?;
    Ok(())
}

/// The drain progress of `host` (every host when `None`) that is `draining` or still has moves
/// recorded; a host with neither is absent.
///
/// `left` counts the sandboxes still on the host, not being deleted and without a move, that
/// the drive is to move: `stopped` ones (and `stopping`, `archiving`), and with `live` every
/// one but `archived` and `failed-start`; `staying` the rest of those (see [`Progress::staying`]).
/// `failed` counts only moves whose sandbox is not being deleted.
pub async fn progress(
    conn: &mut PgConnection,
    host: Option<HostId>,
) -> Result<Vec<Progress>, StoreError> {
    let rows = timed(
        Op::DrainProgress,
        sqlx::query(
            "SELECT h.id, h.drain_live,
                    (SELECT count(*) FROM sandboxes s
                      WHERE s.host_id = h.id AND s.deleted_at IS NULL
                        AND NOT EXISTS (SELECT 1 FROM drain_moves m WHERE m.sandbox_id = s.id)
                        AND (s.state IN ('stopped', 'stopping', 'archiving')
                             OR (h.drain_live AND s.state NOT IN
                                 ('archived', 'failed-start', 'deleted')))) AS left_,
                    (SELECT count(*) FROM sandboxes s
                      WHERE s.host_id = h.id AND s.deleted_at IS NULL
                        AND s.state NOT IN ('archived', 'deleted')
                        AND NOT EXISTS (SELECT 1 FROM drain_moves m WHERE m.sandbox_id = s.id)
                        AND NOT (s.state IN ('stopped', 'stopping', 'archiving')
                                 OR (h.drain_live AND s.state <> 'failed-start'))) AS staying,
                    (SELECT count(*) FROM drain_moves m
                      WHERE m.host_id = h.id AND m.phase <> 'failed') AS moving,
                    (SELECT count(*) FROM drain_moves m JOIN sandboxes s ON s.id = m.sandbox_id
                      WHERE m.host_id = h.id AND m.phase = 'failed'
                        AND s.deleted_at IS NULL) AS failed
               FROM hosts h
              WHERE ($1::uuid IS NULL OR h.id = $1)
                AND (h.state = 'draining'
                     OR EXISTS (SELECT 1 FROM drain_moves m WHERE m.host_id = h.id))
              ORDER BY h.id",
        )
        .bind(host)
        .fetch_all(&mut *conn),
    )
    .await?;
    let get = StoreError::database(Op::DrainProgress);
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let id: HostId = r.try_get("id").map_err(get)?;
        let failed: i64 = r.try_get("failed").map_err(get)?;
        let failures = if failed > 0 {
            failures(&mut *conn, id).await?
        } else {
            Vec::new()
        };
        out.push(Progress {
            host: id,
            live: r.try_get("drain_live").map_err(get)?,
            left: r.try_get("left_").map_err(get)?,
            staying: r.try_get("staying").map_err(get)?,
            moving: r.try_get("moving").map_err(get)?,
            failed,
            failures,
        });
    }
    Ok(out)
}

async fn failures(
    conn: &mut PgConnection,
    host: HostId,
) -> Result<Vec<(SandboxId, String)>, StoreError> {
    let rows = timed(
        Op::DrainProgress,
        sqlx::query(
            "SELECT m.sandbox_id, m.reason FROM drain_moves m
               JOIN sandboxes s ON s.id = m.sandbox_id
              WHERE m.host_id = $1 AND m.phase = 'failed' AND s.deleted_at IS NULL
              ORDER BY m.phase_at, m.sandbox_id LIMIT $2",
        )
        .bind(host)
        .bind(FAILURES_SHOWN)
        .fetch_all(conn),
    )
    .await?;
    let get = StoreError::database(Op::DrainProgress);
    rows.iter()
        .map(|r| {
            Ok((
                r.try_get("sandbox_id").map_err(get)?,
                r.try_get::<Option<String>, _>("reason")
                    .map_err(get)?
                    .unwrap_or_default(),
            ))
        })
        .collect()
}
