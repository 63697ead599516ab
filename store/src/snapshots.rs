//! The `snapshots` table (issue 13 item 3) and `snapshot_chunks`: a snapshot row is written
//! `creating` with its `sandbox.snapshot` command, settles once to `ready` (with its sizes and
//! the chunks it references) or `failed` (with a reason), and is deleted with its chunk
//! references, returning the chunks no other snapshot references so the caller deletes exactly
//! those from the object store. What a row may move to is decided in
//! `berth_schemas::state::snapshot`; these functions only write it, and every settling write is
//! guarded by `WHERE state = 'creating'` (a miss is `Ok(false)`, never a second settle).

use berth_schemas::ids::SnapshotId;
use berth_schemas::state::snapshot::SnapshotState;
use berth_schemas::wire::{Command, SnapshotOrder};
use berth_schemas::{CommandId, CommandKind, HostId, OrgId, Reason, SandboxId};
use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgExecutor, Row};

use crate::events::{self, NewEvent};
use crate::op::{timed, Op};
use crate::sandboxes::SandboxRow;
use crate::{commands, orgs, StoreError};

const COLUMNS: &str =
    "id, org_id, sandbox_id, host_id, parent_id, state, reason, holds, template, runtime, \
     vcpus, memory_mib, disk_mib, logical_bytes, stored_bytes, new_bytes, paused_ms, command_id, \
     created_at, ready_at, expires_at, kind";

/// One snapshot row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRow {
    /// The snapshot.
    pub id: SnapshotId,
    /// Its org.
    pub org_id: OrgId,
    /// The sandbox it was taken of (which may be gone).
    pub sandbox_id: SandboxId,
    /// The host that took it.
    pub host_id: HostId,
    /// The snapshot it is incremental against, while that one exists.
    pub parent_id: Option<SnapshotId>,
    /// Its state.
    pub state: SnapshotState,
    /// Why it failed.
    pub reason: Option<String>,
    /// `disk` or `disk_and_memory`, once ready.
    pub holds: Option<String>,
    /// The sandbox's template.
    pub template: String,
    /// The sandbox's runtime (`runc`, `runsc`).
    pub runtime: String,
    /// Whole vCPUs of the sandbox.
    pub vcpus: i32,
    /// Memory of the sandbox, MiB.
    pub memory_mib: i32,
    /// Disk limit of the sandbox, MiB.
    pub disk_mib: i32,
    /// Bytes of its files, once ready.
    pub logical_bytes: Option<i64>,
    /// Compressed bytes of the chunks it references, once ready.
    pub stored_bytes: Option<i64>,
    /// Compressed bytes of the chunks it added over its parent, once ready.
    pub new_bytes: Option<i64>,
    /// How long the sandbox was frozen for it, ms.
    pub paused_ms: Option<i32>,
    /// The command that takes it.
    pub command_id: CommandId,
    /// When it was requested.
    pub created_at: DateTime<Utc>,
    /// When it became ready.
    pub ready_at: Option<DateTime<Utc>>,
    /// When it is deleted unless deleted earlier.
    pub expires_at: Option<DateTime<Utc>>,
    /// `snapshot` (taken by `POST …/snapshot`, a fork) or `backup` (disk only, taken by
    /// `POST …/backup` or the reconciler's backup pass; issue 14).
    pub kind: String,
}

impl SnapshotRow {
    fn from_row(row: &PgRow) -> Result<Self, StoreError> {
        let state: String = row
            .try_get("state")
            .map_err(StoreError::database(Op::SnapshotGet))?;
        let state =
            state.parse().map_err(
                |e: berth_schemas::state::UnknownState| StoreError::Corrupt {
                    column: "snapshots.state",
                    message: e.to_string(),
                },
            )?;
        let g = |e| StoreError::database(Op::SnapshotGet)(e);
        Ok(SnapshotRow {
            id: row.try_get("id").map_err(g)?,
            org_id: row.try_get("org_id").map_err(g)?,
            sandbox_id: row.try_get("sandbox_id").map_err(g)?,
            host_id: row.try_get("host_id").map_err(g)?,
            parent_id: row.try_get("parent_id").map_err(g)?,
            state,
            reason: row.try_get("reason").map_err(g)?,
            holds: row.try_get("holds").map_err(g)?,
            template: row.try_get("template").map_err(g)?,
            runtime: row.try_get("runtime").map_err(g)?,
            vcpus: row.try_get("vcpus").map_err(g)?,
            memory_mib: row.try_get("memory_mib").map_err(g)?,
            disk_mib: row.try_get("disk_mib").map_err(g)?,
            logical_bytes: row.try_get("logical_bytes").map_err(g)?,
            stored_bytes: row.try_get("stored_bytes").map_err(g)?,
            new_bytes: row.try_get("new_bytes").map_err(g)?,
            paused_ms: row.try_get("paused_ms").map_err(g)?,
            command_id: row.try_get("command_id").map_err(g)?,
            created_at: row.try_get("created_at").map_err(g)?,
            ready_at: row.try_get("ready_at").map_err(g)?,
            expires_at: row.try_get("expires_at").map_err(g)?,
            kind: row.try_get("kind").map_err(g)?,
        })
    }
}

/// A snapshot to insert as `creating`.
#[derive(Debug, Clone)]
pub struct NewSnapshot<'a> {
    /// The snapshot.
    pub id: SnapshotId,
    /// Its org.
    pub org_id: OrgId,
    /// The sandbox.
    pub sandbox_id: SandboxId,
    /// The sandbox's host, which takes it.
    pub host_id: HostId,
    /// The sandbox's newest ready snapshot on that host, to be incremental against.
    pub parent_id: Option<SnapshotId>,
    /// The sandbox's template.
    pub template: &'a str,
    /// The sandbox's runtime.
    pub runtime: &'a str,
    /// Whole vCPUs.
    pub vcpus: i32,
    /// Memory, MiB.
    pub memory_mib: i32,
    /// Disk, MiB.
    pub disk_mib: i32,
    /// The command that takes it (queued by the caller in the same transaction).
    pub command_id: CommandId,
    /// When it expires; `None` for never.
    pub expires_at: Option<DateTime<Utc>>,
    /// [`KIND_SNAPSHOT`] or [`KIND_BACKUP`].
    pub kind: &'a str,
}

/// The kind of a snapshot taken by `POST /v1/sandboxes/{id}/snapshot` or a fork.
pub const KIND_SNAPSHOT: &str = "snapshot";
/// The kind of a backup: the disk only, named by its sandbox's `last_backup_id` once ready.
pub const KIND_BACKUP: &str = "backup";

/// Inserts a `creating` snapshot in the caller's transaction.
pub async fn create(conn: &mut PgConnection, s: &NewSnapshot<'_>) -> Result<(), StoreError> {
    timed(
        Op::SnapshotInsert,
        sqlx::query(
            "INSERT INTO snapshots (id, org_id, sandbox_id, host_id, parent_id, state, template, runtime,
                                    vcpus, memory_mib, disk_mib, command_id, expires_at, kind)
             VALUES ($1, $2, $3, $4, $5, 'creating', $6, $7, $8, $9, $10, $11, $12, $13)",
        )
        .bind(s.id)
        .bind(s.org_id)
        .bind(s.sandbox_id)
        .bind(s.host_id)
        .bind(s.parent_id)
        .bind(s.template)
        .bind(s.runtime)
        .bind(s.vcpus)
        .bind(s.memory_mib)
        .bind(s.disk_mib)
        .bind(s.command_id)
        .bind(s.expires_at)
        .bind(s.kind)
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// One snapshot of `org` (another org's is `None`, like a missing one: guarantee 7).
pub async fn get(
    db: impl PgExecutor<'_>,
    org: OrgId,
    id: SnapshotId,
) -> Result<Option<SnapshotRow>, StoreError> {
    select_of_org(db, org, id, "").await
}

/// [`get`], locked `FOR SHARE` until the caller's transaction ends: a restore or clone holds
/// it so a delete (which locks it `FOR UPDATE`) cannot cross it; the delete then sees the
/// boot's command ([`boots_in_progress`]).
pub async fn get_shared(
    conn: &mut PgConnection,
    org: OrgId,
    id: SnapshotId,
) -> Result<Option<SnapshotRow>, StoreError> {
    select_of_org(conn, org, id, "FOR SHARE").await
}

async fn select_of_org(
    db: impl PgExecutor<'_>,
    org: OrgId,
    id: SnapshotId,
    lock: &str,
) -> Result<Option<SnapshotRow>, StoreError> {
    let row = timed(
        Op::SnapshotGet,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE id = $1 AND org_id = $2 {lock}"
        ))
        .bind(id)
        .bind(org)
        .fetch_optional(db),
    )
    .await?;
    row.as_ref().map(SnapshotRow::from_row).transpose()
}

/// Up to `limit` settled backups past their org's policy, oldest first, as `(org, backup)`:
/// of each sandbox, the ready ones beyond the newest `backups_kept`, and the failed ones but the
/// newest (its reason stays readable); never the backup a sandbox names (`last_backup_id`,
/// which after a rollback may be older than the rest). Deleting them is the caller's (with
/// their content).
pub async fn past_retention(
    conn: &mut PgConnection,
    limit: i64,
) -> Result<Vec<(OrgId, SnapshotId)>, StoreError> {
    timed(
        Op::SnapshotGet,
        sqlx::query_as(
            "SELECT org_id, id FROM (
                 SELECT b.org_id, b.id, b.sandbox_id, b.state, b.created_at, o.backups_kept,
                        row_number() OVER (PARTITION BY b.sandbox_id, b.state
                                           ORDER BY b.created_at DESC) AS newer
                   FROM snapshots b JOIN orgs o ON o.id = b.org_id
                  WHERE b.kind = 'backup' AND b.state IN ('ready', 'failed')) r
              WHERE ((state = 'ready' AND newer > backups_kept) OR (state = 'failed' AND newer > 1))
                AND NOT EXISTS (SELECT 1 FROM sandboxes s
                                 WHERE s.id = r.sandbox_id AND s.last_backup_id = r.id)
              ORDER BY created_at LIMIT $1",
        )
        .bind(limit)
        .fetch_all(conn),
    )
    .await
}

/// How many sandboxes are still `resuming` or `restoring` from snapshot `id`: restores, clones
/// and restores from backup whose command (`commands.snapshot_id`) is open at the sandbox's
/// current generation. Their hosts still read its content.
pub async fn boots_in_progress(conn: &mut PgConnection, id: SnapshotId) -> Result<i64, StoreError> {
    timed(
        Op::SnapshotGet,
        sqlx::query_scalar(
            "SELECT count(*) FROM commands c JOIN sandboxes s ON s.id = c.sandbox_id
              WHERE c.snapshot_id = $1 AND c.completed_at IS NULL
                AND s.state IN ('resuming', 'restoring') AND s.generation = c.generation",
        )
        .bind(id)
        .fetch_one(conn),
    )
    .await
}

/// One snapshot, locked `FOR UPDATE` until the caller's transaction ends (the reconciler, a
/// delete).
pub async fn lock(
    conn: &mut PgConnection,
    id: SnapshotId,
) -> Result<Option<SnapshotRow>, StoreError> {
    let row = timed(
        Op::SnapshotGet,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE id = $1 FOR UPDATE"
        ))
        .bind(id)
        .fetch_optional(conn),
    )
    .await?;
    row.as_ref().map(SnapshotRow::from_row).transpose()
}

/// One snapshot, locked `FOR NO KEY UPDATE` until the caller's transaction ends: what a boot
/// from it (a restore from backup, a failover) takes, so a snapshot delete (`FOR UPDATE`, in
/// [`lock`]) waits for it, while a new snapshot naming it as its parent (a foreign key's
/// `KEY SHARE`) does not. `skip_locked`: `None` instead of waiting when another holds it.
pub async fn lock_for_boot(
    conn: &mut PgConnection,
    id: SnapshotId,
    skip_locked: bool,
) -> Result<Option<SnapshotRow>, StoreError> {
    let wait = if skip_locked { " SKIP LOCKED" } else { "" };
    let row = timed(
        Op::SnapshotGet,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE id = $1 FOR NO KEY UPDATE{wait}"
        ))
        .bind(id)
        .fetch_optional(conn),
    )
    .await?;
    row.as_ref().map(SnapshotRow::from_row).transpose()
}

/// The snapshots of one sandbox of `org`, oldest first.
pub async fn list_for_sandbox(
    db: impl PgExecutor<'_>,
    org: OrgId,
    sandbox: SandboxId,
) -> Result<Vec<SnapshotRow>, StoreError> {
    let rows = timed(
        Op::SnapshotGet,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE sandbox_id = $1 AND org_id = $2 ORDER BY id"
        ))
        .bind(sandbox)
        .bind(org)
        .fetch_all(db),
    )
    .await?;
    rows.iter().map(SnapshotRow::from_row).collect()
}

/// The sandbox's newest `ready` snapshot taken on `host`: the parent a new snapshot there is
/// incremental against.
pub async fn latest_ready_on(
    db: impl PgExecutor<'_>,
    sandbox: SandboxId,
    host: HostId,
) -> Result<Option<SnapshotId>, StoreError> {
    timed(
        Op::SnapshotGet,
        sqlx::query_scalar(
            "SELECT id FROM snapshots WHERE sandbox_id = $1 AND host_id = $2 AND state = 'ready'
              ORDER BY id DESC LIMIT 1",
        )
        .bind(sandbox)
        .bind(host)
        .fetch_optional(db),
    )
    .await
}

/// What a ready snapshot holds and weighs, as its host reported it.
#[derive(Debug, Clone)]
pub struct Settled<'a> {
    /// `disk` or `disk_and_memory`.
    pub holds: &'a str,
    /// Bytes of its files.
    pub logical_bytes: i64,
    /// Compressed bytes of the chunks it references.
    pub stored_bytes: i64,
    /// Compressed bytes it added over its parent.
    pub new_bytes: i64,
    /// How long the sandbox was frozen, ms.
    pub paused_ms: i32,
    /// Every chunk it references: SHA-256 (hex) and compressed bytes.
    pub chunks: &'a [(String, i64)],
}

/// Writes `ready` with its sizes and chunk references, only if the row is still `creating`;
/// whether it was.
pub async fn write_ready(
    conn: &mut PgConnection,
    id: SnapshotId,
    s: &Settled<'_>,
) -> Result<bool, StoreError> {
    let done = timed(
        Op::SnapshotSettle,
        sqlx::query(
            "UPDATE snapshots SET state = 'ready', holds = $2, logical_bytes = $3, stored_bytes = $4,
                    new_bytes = $5, paused_ms = $6, ready_at = clock_timestamp()
              WHERE id = $1 AND state = 'creating'",
        )
        .bind(id)
        .bind(s.holds)
        .bind(s.logical_bytes)
        .bind(s.stored_bytes)
        .bind(s.new_bytes)
        .bind(s.paused_ms)
        .execute(&mut *conn),
    )
    .await?;
    if done.rows_affected() != 1 {
        return Ok(false);
    }
    let (hashes, sizes): (Vec<&str>, Vec<i64>) =
        s.chunks.iter().map(|(h, n)| (h.as_str(), *n)).unzip();
    timed(
        Op::SnapshotSettle,
        sqlx::query(
            "INSERT INTO snapshot_chunks (sha256, snapshot_id, stored)
             SELECT h, $1, n FROM unnest($2::text[], $3::bigint[]) AS t(h, n)
             ON CONFLICT DO NOTHING",
        )
        .bind(id)
        .bind(&hashes)
        .bind(&sizes)
        .execute(&mut *conn),
    )
    .await?;
    refresh_last_backup(conn, id, None).await?;
    Ok(true)
}

/// Points the sandbox of backup `id` at its newest `ready` backup other than `excluding`
/// (`last_backup_id`, `last_backup_at`; both `NULL` when it has none); nothing when `id` is not
/// a backup. In the caller's transaction: when a backup settles ready, and before one is deleted
/// (then only when the sandbox names it).
async fn refresh_last_backup(
    conn: &mut PgConnection,
    id: SnapshotId,
    excluding: Option<SnapshotId>,
) -> Result<(), StoreError> {
    timed(
        Op::SnapshotSettle,
        sqlx::query(
            "UPDATE sandboxes s SET (last_backup_id, last_backup_at) =
                    (SELECT b.id, b.ready_at FROM snapshots b
                      WHERE b.sandbox_id = s.id AND b.kind = 'backup' AND b.state = 'ready'
                        AND b.id IS DISTINCT FROM $2
                        AND (s.restored_at IS NULL OR b.created_at > s.restored_at
                             OR b.id = s.restored_backup)
                      ORDER BY b.ready_at DESC, b.id DESC LIMIT 1)
              FROM snapshots me
             WHERE me.id = $1 AND me.kind = 'backup' AND s.id = me.sandbox_id
               AND ($2::uuid IS NULL OR s.last_backup_id = $2)",
        )
        .bind(id)
        .bind(excluding)
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// The newest `ready` backup of `sandbox` (what a restore-from-backup, or a host-loss failover,
/// boots): its id and when it became ready.
pub async fn newest_ready_backup(
    db: impl PgExecutor<'_>,
    sandbox: SandboxId,
) -> Result<Option<(SnapshotId, DateTime<Utc>)>, StoreError> {
    timed(
        Op::SnapshotGet,
        sqlx::query_as(
            "SELECT id, ready_at FROM snapshots
              WHERE sandbox_id = $1 AND kind = 'backup' AND state = 'ready'
              ORDER BY ready_at DESC, id DESC LIMIT 1",
        )
        .bind(sandbox)
        .fetch_optional(db),
    )
    .await
}

/// Writes `failed` with `reason`, only if the row is still `creating`; whether it was.
pub async fn write_failed(
    conn: &mut PgConnection,
    id: SnapshotId,
    reason: &str,
) -> Result<bool, StoreError> {
    let done = timed(
        Op::SnapshotSettle,
        sqlx::query("UPDATE snapshots SET state = 'failed', reason = $2 WHERE id = $1 AND state = 'creating'")
            .bind(id)
            .bind(reason)
            .execute(conn),
    )
    .await?;
    Ok(done.rows_affected() == 1)
}

/// An org's snapshots: how many exist (any state), and the compressed bytes of the distinct
/// chunks its ready snapshots reference. Call after [`crate::orgs::lock_snapshot_quota`] so two
/// requests cannot pass the same headroom.
pub async fn org_usage(conn: &mut PgConnection, org: OrgId) -> Result<(i64, i64), StoreError> {
    timed(
        Op::SnapshotOrgUsage,
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM snapshots WHERE org_id = $1),
                    (SELECT coalesce(sum(stored), 0)::bigint FROM (
                        SELECT DISTINCT c.sha256, c.stored FROM snapshot_chunks c
                          JOIN snapshots s ON s.id = c.snapshot_id WHERE s.org_id = $1) AS d)",
        )
        .bind(org)
        .fetch_one(conn),
    )
    .await
}

/// Deletes a snapshot row and its chunk references in the caller's transaction, and returns
/// the chunks (SHA-256, compressed bytes) no other snapshot references: exactly what the
/// caller then deletes from the object store. The row must have been locked ([`lock`]).
pub async fn delete(
    conn: &mut PgConnection,
    id: SnapshotId,
) -> Result<Vec<(String, i64)>, StoreError> {
    refresh_last_backup(&mut *conn, id, Some(id)).await?;
    let orphans: Vec<(String, i64)> = timed(
        Op::SnapshotDelete,
        sqlx::query_as(
            "WITH mine AS (DELETE FROM snapshot_chunks WHERE snapshot_id = $1 RETURNING sha256, stored)
             SELECT m.sha256, m.stored FROM mine m
              WHERE NOT EXISTS (SELECT 1 FROM snapshot_chunks o WHERE o.sha256 = m.sha256 AND o.snapshot_id <> $1)",
        )
        .bind(id)
        .fetch_all(&mut *conn),
    )
    .await?;
    timed(
        Op::SnapshotDelete,
        sqlx::query("DELETE FROM snapshots WHERE id = $1")
            .bind(id)
            .execute(conn),
    )
    .await?;
    Ok(orphans)
}

/// `creating` snapshots requested more than `older_than_secs` seconds ago (database clock),
/// at most `batch`, locked (skipping rows another pass holds): the reconciler fails them
/// ([`berth_schemas::state::snapshot::on_snapshot_timeout`]).
pub async fn lock_timed_out(
    conn: &mut PgConnection,
    older_than_secs: f64,
    batch: i64,
) -> Result<Vec<SnapshotRow>, StoreError> {
    let rows = timed(
        Op::SnapshotDue,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots
              WHERE state = 'creating' AND created_at < clock_timestamp() - make_interval(secs => $1)
              ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED"
        ))
        .bind(older_than_secs)
        .bind(batch)
        .fetch_all(conn),
    )
    .await?;
    rows.iter().map(SnapshotRow::from_row).collect()
}

/// Settled snapshots whose `expires_at` has passed, locked (skipping rows another pass holds).
pub async fn lock_expired(
    conn: &mut PgConnection,
    now: DateTime<Utc>,
) -> Result<Vec<SnapshotRow>, StoreError> {
    let rows = timed(
        Op::SnapshotDue,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE expires_at < $1 AND state <> 'creating'
              ORDER BY expires_at LIMIT 100 FOR UPDATE SKIP LOCKED"
        ))
        .bind(now)
        .fetch_all(conn),
    )
    .await?;
    rows.iter().map(SnapshotRow::from_row).collect()
}

/// The snapshot its `sandbox.snapshot` command `command` takes, locked `FOR UPDATE` (the
/// reconciler applying the command's result).
pub async fn lock_by_command(
    conn: &mut PgConnection,
    command: CommandId,
) -> Result<Option<SnapshotRow>, StoreError> {
    let row = timed(
        Op::SnapshotGet,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE command_id = $1 FOR UPDATE"
        ))
        .bind(command)
        .fetch_optional(conn),
    )
    .await?;
    row.as_ref().map(SnapshotRow::from_row).transpose()
}

/// The org's snapshot quota a new snapshot (or backup) would exceed: `(limit, value)`, the
/// quota's name and its value; `None` when it fits. Locks the org's quota row until the
/// caller's transaction ends, so two requests cannot both take the last place.
pub async fn quota_refusal(
    conn: &mut PgConnection,
    org: OrgId,
) -> Result<Option<(&'static str, i64)>, StoreError> {
    let quota = orgs::lock_snapshot_quota(&mut *conn, org).await?;
    let (count, bytes) = org_usage(&mut *conn, org).await?;
    if let Some(max) = quota.max_snapshots {
        if count + 1 > i64::from(max) {
            return Ok(Some(("max_snapshots", i64::from(max))));
        }
    }
    if let Some(max) = quota.max_snapshot_bytes {
        if bytes >= max {
            return Ok(Some(("max_snapshot_bytes", max)));
        }
    }
    Ok(None)
}

/// Requests a snapshot of `kind` of the locked, running sandbox `row` on `host`, in the
/// caller's transaction: the `creating` row, its `sandbox.snapshot` command (incremental
/// against the sandbox's newest ready snapshot on that host; a backup's order is disk only)
/// and its `snapshot.created` event (with `reason`). The caller checked the state and the quota
/// ([`quota_refusal`]): the API for a user's snapshot or backup, the reconciler for a periodic
/// backup.
pub async fn request(
    conn: &mut PgConnection,
    row: &SandboxRow,
    host: HostId,
    kind: &'static str,
    reason: Reason,
) -> Result<SnapshotRow, StoreError> {
    let id = row.id;
    let snapshot_id = SnapshotId::new();
    let parent = latest_ready_on(&mut *conn, id, host).await?;
    let command = Command {
        id: CommandId::new(),
        sandbox_id: id,
        generation: row.generation,
        kind: CommandKind::Snapshot,
        spec: Some(row.spec()),
        snapshot: Some(SnapshotOrder {
            snapshot_id,
            parent,
            disk_only: kind == KIND_BACKUP,
        }),
    };
    commands::insert(&mut *conn, host, &command).await?;
    create(
        &mut *conn,
        &NewSnapshot {
            id: snapshot_id,
            org_id: row.org_id,
            sandbox_id: id,
            host_id: host,
            parent_id: parent,
            template: &row.template,
            runtime: row.runtime.as_str(),
            vcpus: i32::try_from(row.resources.vcpus).unwrap_or(i32::MAX),
            memory_mib: i32::try_from(row.resources.memory_mib).unwrap_or(i32::MAX),
            disk_mib: i32::try_from(row.disk_mib).unwrap_or(i32::MAX),
            command_id: command.id,
            expires_at: None,
            kind,
        },
    )
    .await?;
    events::insert_snapshot_event(
        &mut *conn,
        &NewEvent {
            sandbox_id: id,
            org_id: row.org_id,
            from: Some(row.state),
            to: row.state,
            reason,
            generation: row.generation,
            command_id: Some(command.id),
            message: None,
            stop: None,
        },
        "snapshot.created",
        snapshot_id,
    )
    .await?;
    lock(&mut *conn, snapshot_id)
        .await?
        .ok_or(StoreError::Corrupt {
            column: "snapshots.id",
            message: format!("the snapshot {snapshot_id} just written is gone"),
        })
}

/// Running sandboxes whose periodic backup is due, at most `batch`, locked (skipping rows
/// another pass holds): `backup_interval_min` set, not being deleted, and no backup of it
/// `creating` or requested within its interval (a failed one counts, so a failing store is
/// retried once per interval, not every pass). `unit_secs` is the length of one of its minutes
/// (60; tests shorten it).
pub async fn lock_backups_due(
    conn: &mut PgConnection,
    unit_secs: f64,
    batch: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    let rows = timed(
        Op::SandboxAutoBackup,
        sqlx::query(&format!(
            "SELECT {} FROM sandboxes s
              WHERE s.state = 'running' AND s.deleted_at IS NULL AND s.backup_interval_min IS NOT NULL
                AND s.host_id IS NOT NULL
                AND NOT EXISTS (SELECT 1 FROM snapshots b
                                 WHERE b.sandbox_id = s.id AND b.kind = 'backup'
                                   AND (b.state = 'creating'
                                        OR b.created_at > now() - make_interval(secs => s.backup_interval_min * $1)))
              ORDER BY s.last_backup_at NULLS FIRST
              LIMIT $2 FOR UPDATE OF s SKIP LOCKED",
            crate::sandboxes::columns_of("s")
        ))
        .bind(unit_secs)
        .bind(batch)
        .fetch_all(conn),
    )
    .await?;
    rows.iter().map(SandboxRow::from_row).collect()
}
