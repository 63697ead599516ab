//! The reconciler pass's selections of sandboxes: commands that timed out, guests that failed,
//! sandboxes stranded on lost hosts, idle and expired ones, tombstones to purge; and the
//! capacity-drift measure of guarantee 4. Each `lock_*` locks what it returns (`FOR UPDATE
//! SKIP LOCKED`) in the caller's transaction, so two passes never act on one row.

use std::time::Duration;

use berth_schemas::state::{GuestFailure, STRANDED_ON_LOST_HOST, TIMED_COMMANDS};
use berth_schemas::{CommandKind, HostId, HostState, SandboxId, SandboxState};
use sqlx::{PgConnection, PgExecutor, Row};

use super::{columns_of, corrupt, rows, SandboxRow, COLUMNS};
use crate::op::{timed, Op};
use crate::StoreError;

/// The host state whose sandboxes are stranded (never spelled by hand in SQL).
const LOST: &str = HostState::Lost.as_str();

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// How long each timed command may stay unanswered.
#[derive(Debug, Clone, Copy)]
pub struct CommandTimeouts {
    /// How long a `sandbox.create` may stay unanswered; also a `sandbox.restore` and a
    /// `sandbox.clone` (`resuming`), which fetch a snapshot and boot like a create.
    pub create: Duration,
    /// How long a `sandbox.start` may stay unanswered.
    pub start: Duration,
    /// How long a `sandbox.stop` may stay unanswered (a delete is not timed).
    pub stop: Duration,
    /// How long a `sandbox.archive` (upload, then free the disk), a `sandbox.unarchive` or a
    /// `sandbox.migrate` (fetch, then boot) may stay unanswered.
    pub archive: Duration,
}

impl CommandTimeouts {
    fn of(&self, kind: CommandKind) -> Duration {
        match kind {
            CommandKind::Create | CommandKind::Restore | CommandKind::Clone => self.create,
            CommandKind::Start => self.start,
            CommandKind::Archive | CommandKind::Unarchive | CommandKind::Migrate => self.archive,
            // A snapshot is timed on its own row (`snapshots.created_at`), never here.
            CommandKind::Stop | CommandKind::Delete | CommandKind::Snapshot => self.stop,
        }
    }
}

/// A sandbox whose open command outlived its timeout ([`lock_timed_out`]).
#[derive(Debug)]
pub struct TimedOut {
    /// The locked row.
    pub row: SandboxRow,
    /// The command's kind.
    pub kind: CommandKind,
    /// Whether the relay had published it: an unpublished one (a boot held back behind an
    /// unhealthy host's cap) never reached its host, so its timeout charges the host nothing.
    pub published: bool,
}

/// Locks (skipping rows others hold) up to `batch` sandboxes whose current command, one they
/// still wait on ([`TIMED_COMMANDS`]), is older than its timeout; with the command's kind.
///
/// A command its host has applied is never timed out: when the host's newest inventory shows
/// the sandbox at the command's generation (or later), the host answered and its result is in
/// the control plane's queues (results are durable in JetStream, so it arrives); failing the
/// sandbox then would be a false failure caused by the control plane's own lag (issue 12).
///
/// For the same reason a published command's time runs from its publish (the relay's backlog
/// is not its host's) to the results watermark (`results_watermark`, advanced by
/// `berth_reconciler::watermark`), not to now: it is timed out only when every result published
/// until its deadline has been applied and none was its own. While the result consumer has a
/// backlog the watermark stays behind, and so do the timeouts.
///
/// A command the relay has not published never times out while its host is healthy: it waits
/// in the control plane's own outbox (a backlog the relay's alert `BerthOutboxStuck` covers),
/// and failing it would fail healthy work (the 1,000-host sim had creates 136 s in the outbox).
/// Only a boot held back behind the boot cap of a host that is not healthy (its earlier boots
/// hang, so the cap never frees) runs from its insert to now (`published` is false: the host
/// never had it, so its health is not charged again).
pub async fn lock_timed_out(
    conn: &mut PgConnection,
    timeouts: CommandTimeouts,
    batch: i64,
) -> Result<Vec<TimedOut>, StoreError> {
    let kinds: Vec<&str> = TIMED_COMMANDS.iter().map(|(k, _)| k.as_str()).collect();
    let states: Vec<&str> = TIMED_COMMANDS.iter().map(|(_, s)| s.as_str()).collect();
    let limits: Vec<f64> = TIMED_COMMANDS
        .iter()
        .map(|(k, _)| secs(timeouts.of(*k)))
        .collect();
    let found = timed(
        Op::SandboxTimedOut,
        sqlx::query(&format!(
            "SELECT c.kind AS command_kind, c.published_at IS NOT NULL AS delivered, {cols}
               FROM commands c JOIN sandboxes s ON s.id = c.sandbox_id
               JOIN unnest($1::text[], $2::text[], $3::float8[]) AS t(kind, state, secs)
                 ON t.kind = c.kind AND t.state = s.state
              WHERE c.completed_at IS NULL
                AND c.generation = s.generation AND s.deleted_at IS NULL
                AND CASE WHEN c.published_at IS NULL
                         THEN c.kind IN {boots}
                              AND (SELECT health FROM hosts WHERE id = c.host_id) <> 'healthy'
                              AND c.created_at < now() - make_interval(secs => t.secs)
                         ELSE c.published_at < COALESCE((SELECT applied_through
                                                           FROM results_watermark), now())
                                               - make_interval(secs => t.secs) END
                AND NOT EXISTS (SELECT 1 FROM hosts h
                                 CROSS JOIN LATERAL jsonb_array_elements(h.inventory) i
                                 WHERE h.id = c.host_id
                                   AND i->>'sandbox_id' = s.id::text
                                   AND (i->>'generation')::int8 >= c.generation)
              ORDER BY c.created_at
              LIMIT $4
              FOR UPDATE OF s SKIP LOCKED",
            cols = columns_of("s"),
            boots = crate::commands::BOOTS_SQL,
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
            let published: bool = r
                .try_get("delivered")
                .map_err(StoreError::database(Op::SandboxTimedOut))?;
            Ok(TimedOut {
                row: SandboxRow::from_row(r)?,
                kind,
                published,
            })
        })
        .collect()
}

/// The SQL condition (aliases `s`, `h`) of a sandbox the pass may fail as a guest: `running`,
/// not being deleted, on a host in service.
fn running_on_a_host_in_service() -> String {
    format!("s.state = 'running' AND s.deleted_at IS NULL AND h.state <> '{LOST}'")
}

/// When the pass may judge a `running` sandbox by its host's inventory.
#[derive(Debug, Clone, Copy)]
pub struct Judging {
    /// The inventory must have been taken this much after the row's last change.
    pub grace: Duration,
    /// The host's evidence must be younger than this
    /// ([`crate::heartbeats::EVIDENCE_AGE_SQL`]); older evidence judges nothing.
    pub max_age: Duration,
}

/// The SQL condition (aliases `s`, `h`; `$1` grace and `$2` max age in seconds) under which a
/// `running` sandbox's host inventory is evidence about it: the inventory was taken (host send
/// time, never later than its arrival) `grace` after the row's last change; the host's evidence
/// is younger than the max age; the host applied every command of the sandbox before it took
/// that inventory (a greater heartbeat `seq` than any result of the sandbox's commands there
/// carried) and none is still open.
fn judged_sql() -> String {
    use crate::heartbeats::{EVIDENCE_AGE_SQL, INVENTORY_TAKEN_SQL};
    format!(
        "{INVENTORY_TAKEN_SQL} > s.updated_at + make_interval(secs => $1)
         AND {EVIDENCE_AGE_SQL} < make_interval(secs => $2)
         AND NOT EXISTS (SELECT 1 FROM commands c
                          WHERE c.sandbox_id = s.id AND c.host_id = h.id
                            AND (c.completed_at IS NULL OR c.host_seq >= h.heartbeat_seq))"
    )
}

/// One host's `running` sandboxes and how many of them the pass would fail on the evidence it
/// has ([`lock_failed_guests`]'s conditions): what the circuit breaker weighs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestTally {
    /// The host (in service).
    pub host: HostId,
    /// Its newest applied heartbeat's `seq` (the evidence the tally was made on).
    pub heartbeat_seq: i64,
    /// Its `running` sandboxes.
    pub running: i64,
    /// Of those, the ones its inventory shows failed, judged as the pass would.
    pub would_fail: i64,
}

/// [`GuestTally`] of every host in service that has `running` sandboxes.
///
/// The running sandboxes are counted per host on the index `sandboxes_running_on_host`; the
/// ones that would fail are read from the findings of each host's current inventory
/// ([`crate::findings`]: running rows it does not list running) and judged on the current rows
/// ([`judged_sql`]), never by expanding the inventories. Each finding's row is read by primary
/// key in a `LATERAL … OFFSET 0` subquery, so the plan does not hang on an estimate of the
/// findings' number, which swings between passes (thousands while a fleet is being created,
/// none at rest): the plain join once took 25 s in a 20,000-sandbox sim run while creating.
///
/// Errors: [`StoreError`].
pub async fn guest_tallies(
    conn: &mut PgConnection,
    judging: Judging,
) -> Result<Vec<GuestTally>, StoreError> {
    let rows: Vec<(HostId, i64, i64, i64)> = timed(
        Op::SandboxGuestTally,
        sqlx::query_as(&format!(
            "WITH failing AS (
               SELECT f.host_id, count(*) AS n
                 FROM inventory_findings f
                 JOIN hosts h ON h.id = f.host_id AND {current}
                CROSS JOIN LATERAL (
                      SELECT 1 FROM sandboxes s
                       WHERE s.id = f.sandbox_id AND s.host_id = h.id AND {running_here}
                         AND {judged}
                      OFFSET 0) s
                WHERE f.unlisted
                GROUP BY f.host_id),
             running AS (
               SELECT s.host_id, count(*) AS n FROM sandboxes s
                WHERE s.state = 'running' AND s.deleted_at IS NULL
                GROUP BY s.host_id)
             SELECT r.host_id, h.heartbeat_seq, r.n::int8, COALESCE(fl.n, 0)::int8
               FROM running r JOIN hosts h ON h.id = r.host_id
               LEFT JOIN failing fl ON fl.host_id = r.host_id
              WHERE h.state <> '{LOST}'",
            current = crate::findings::CURRENT_SQL,
            running_here = running_on_a_host_in_service(),
            judged = judged_sql()
        ))
        .bind(secs(judging.grace))
        .bind(secs(judging.max_age))
        .fetch_all(conn),
    )
    .await?;
    Ok(rows
        .into_iter()
        .map(|(host, heartbeat_seq, running, would_fail)| GuestTally {
            host,
            heartbeat_seq,
            running,
            would_fail,
        })
        .collect())
}

/// Locks up to `batch` `running` sandboxes on `hosts` (none of them lost) whose host inventory
/// is evidence about them (see [`Judging`]) and does not list the guest as running (the
/// findings of the host's current inventory, [`crate::findings`], each row read and locked by
/// primary key with every condition inside the `LATERAL` subquery, so only rows acted on are
/// locked); with how the guest failed:
/// [`GuestFailure::Unhealthy`] when the inventory lists it otherwise, else
/// [`GuestFailure::Missing`].
pub async fn lock_failed_guests(
    conn: &mut PgConnection,
    judging: Judging,
    hosts: &[HostId],
    batch: i64,
) -> Result<Vec<(SandboxRow, GuestFailure)>, StoreError> {
    let hosts: Vec<uuid::Uuid> = hosts.iter().map(|h| h.as_uuid()).collect();
    let found = timed(
        Op::SandboxUnhealthy,
        sqlx::query(&format!(
            "SELECT {cols}, f.status IS NOT NULL AS listed
               FROM inventory_findings f
               JOIN hosts h ON h.id = f.host_id AND {current}
              CROSS JOIN LATERAL (
                    SELECT {cols} FROM sandboxes s
                     WHERE s.id = f.sandbox_id AND s.host_id = h.id AND {running_here}
                       AND {judged}
                    OFFSET 0) s
              WHERE f.unlisted AND f.host_id = ANY($4)
              LIMIT $3
              FOR UPDATE OF s SKIP LOCKED",
            cols = columns_of("s"),
            current = crate::findings::CURRENT_SQL,
            running_here = running_on_a_host_in_service(),
            judged = judged_sql()
        ))
        .bind(secs(judging.grace))
        .bind(secs(judging.max_age))
        .bind(batch)
        .bind(&hosts)
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

/// A sandbox [`lock_stranded`] found on a lost host.
#[derive(Debug, Clone)]
pub struct Stranded {
    /// The sandbox (locked).
    pub row: SandboxRow,
    /// A pass first deferred its failover, during this silence of its host, longer ago than
    /// the bound on deferred failovers (`retry_for` of [`lock_stranded`]): a failover still
    /// deferred now is given up.
    pub overdue: bool,
}

/// The SQL condition (sandbox alias `s`, its host `h`) that the sandbox's recorded first
/// deferral ([`note_failover_deferred`]) belongs to its host's current silence: recorded on
/// the host it is on, after that host's last heartbeat. An older one (the host came back since)
/// or one recorded on another host counts for nothing.
const DEFERRED_IN_THIS_SILENCE: &str =
    "(s.failover_deferred_on = s.host_id AND s.failover_deferred_at > h.last_seen)";

/// Locks up to `batch` sandboxes living on a host that has been silent for `silent_for` and is
/// `lost` ([`STRANDED_ON_LOST_HOST`] states), leaving out the sandboxes in `skip` (those the
/// caller already deferred in this transaction, so the next call reaches the rows behind them).
/// Oldest silence first, then by id: a stable order, so a pass reaches the same rows first
/// again. [`Stranded::overdue`]: the failover was first deferred during this silence more than
/// `retry_for` ago (database clock).
pub async fn lock_stranded(
    conn: &mut PgConnection,
    silent_for: Duration,
    retry_for: Duration,
    skip: &[SandboxId],
    batch: i64,
) -> Result<Vec<Stranded>, StoreError> {
    let states: Vec<&str> = STRANDED_ON_LOST_HOST.iter().map(|s| s.as_str()).collect();
    let skip: Vec<uuid::Uuid> = skip.iter().map(|id| id.as_uuid()).collect();
    let found = timed(
        Op::SandboxStranded,
        sqlx::query(&format!(
            "SELECT {cols},
                    COALESCE({DEFERRED_IN_THIS_SILENCE}
                             AND s.failover_deferred_at < now() - make_interval(secs => $5),
                             false) AS overdue
               FROM sandboxes s JOIN hosts h ON h.id = s.host_id
              WHERE h.state = '{LOST}' AND s.deleted_at IS NULL
                AND h.last_seen < now() - make_interval(secs => $1)
                AND s.state = ANY($2)
                AND s.id <> ALL($4)
              ORDER BY h.last_seen, s.id
              LIMIT $3
              FOR UPDATE OF s SKIP LOCKED",
            cols = columns_of("s")
        ))
        .bind(secs(silent_for))
        .bind(&states)
        .bind(batch)
        .bind(&skip)
        .bind(secs(retry_for))
        .fetch_all(conn),
    )
    .await?;
    found
        .iter()
        .map(|r| {
            Ok(Stranded {
                row: SandboxRow::from_row(r)?,
                overdue: r
                    .try_get("overdue")
                    .map_err(StoreError::database(Op::SandboxStranded))?,
            })
        })
        .collect()
}

/// Records that a pass deferred the failover of `id` (locked by [`lock_stranded`]) now
/// (database clock), unless a deferral during its host's current silence is recorded already:
/// the first one stays, and [`Stranded::overdue`] counts from it. Not fenced by generation:
/// the caller holds the row's lock, and the pair is judged only against the row's host.
pub async fn note_failover_deferred(
    conn: &mut PgConnection,
    id: SandboxId,
) -> Result<(), StoreError> {
    timed(
        Op::SandboxFailoverDeferred,
        sqlx::query(&format!(
            "UPDATE sandboxes s
                SET failover_deferred_at = now(), failover_deferred_on = s.host_id
               FROM hosts h
              WHERE s.id = $1 AND h.id = s.host_id
                AND NOT COALESCE({DEFERRED_IN_THIS_SILENCE}, false)"
        ))
        .bind(id)
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// An automatic request a sandbox can be due for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// `running` and idle (no activity) for its `auto_stop_minutes`.
    AutoStop,
    /// `stopped` or `failed-start` for its `auto_delete_minutes`.
    AutoDelete,
    /// `stopped` for its `auto_archive_days` (`auto_archive_seconds` overrides, for tests).
    AutoArchive,
}

/// Locks up to `batch` sandboxes, not being deleted, that are `due` for an automatic request.
///
/// Each filter is read through a partial index whose predicate is its condition spelled the
/// same way (`sandboxes_auto_stop`, `_auto_delete`, `_auto_archive`, migration 0042): change
/// one and the other together, or the pass scans every sandbox again.
pub async fn lock_due(
    conn: &mut PgConnection,
    due: Due,
    batch: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    let (op, filter) = match due {
        Due::AutoStop => (
            Op::SandboxAutoStop,
            "state = 'running' AND auto_stop_minutes IS NOT NULL
             AND last_activity_at < now() - make_interval(mins => auto_stop_minutes)",
        ),
        Due::AutoDelete => (
            Op::SandboxAutoDelete,
            "state IN ('stopped', 'failed-start') AND auto_delete_minutes IS NOT NULL
             AND updated_at < now() - make_interval(mins => auto_delete_minutes)",
        ),
        Due::AutoArchive => (
            Op::SandboxAutoArchive,
            "state = 'stopped'
             AND COALESCE(auto_archive_seconds, auto_archive_days * 86400) IS NOT NULL
             AND updated_at < now() - make_interval(
                 secs => COALESCE(auto_archive_seconds, auto_archive_days * 86400))",
        ),
    };
    let found = timed(
        op,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes
              WHERE deleted_at IS NULL AND {filter}
              LIMIT $1 FOR UPDATE SKIP LOCKED"
        ))
        .bind(batch)
        .fetch_all(conn),
    )
    .await?;
    rows(&found)
}

/// Deletes up to `batch` tombstones (`deleted` for longer than `retention`, found through the
/// partial index `sandboxes_tombstones`) whose events are all published and fanned out to every
/// live webhook of the org (purging cascades to them); returns their ids.
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
                    -- ... and every live webhook of its org has fanned them out (the
                    -- webhook worker reads them from this table, after the relay).
                    AND NOT EXISTS (SELECT 1 FROM events e
                                      JOIN webhooks w ON w.org_id = e.org_id
                                                     AND w.disabled_at IS NULL
                                                     AND w.deleted_at IS NULL
                                     WHERE e.sandbox_id = sandboxes.id
                                       AND e.seq > w.cursor_seq)
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
