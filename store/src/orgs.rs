//! The `orgs` table: tenants and their quotas. Quotas are checked inside the transaction that
//! would reserve capacity, against what [`crate::sandboxes::org_usage`] sums.

use berth_schemas::OrgId;
use sqlx::{PgConnection, PgExecutor};

use crate::op::{timed, Op};
use crate::StoreError;

/// An org's quota; `None` means unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Quota {
    /// Sandboxes holding capacity at once.
    pub max_running: Option<i32>,
    /// Whole vCPUs held at once.
    pub max_vcpus: Option<i32>,
    /// Memory held at once, MiB.
    pub max_memory_mib: Option<i64>,
}

impl Quota {
    /// Whether no limit is set.
    pub fn is_unlimited(&self) -> bool {
        self.max_running.is_none() && self.max_vcpus.is_none() && self.max_memory_mib.is_none()
    }
}

/// Reads the org's quota. When it has limits, the org's row is locked (`FOR NO KEY UPDATE`)
/// until the caller's transaction ends, so two creates of one org cannot both pass the same
/// headroom; an org without limits takes no lock, so its creates never wait on each other.
///
/// Errors: [`StoreError::NotFound`] when no such org exists.
pub async fn lock_quota(conn: &mut PgConnection, org: OrgId) -> Result<Quota, StoreError> {
    let read = |lock: &'static str| {
        format!("SELECT max_running, max_vcpus, max_memory_mib FROM orgs WHERE id = $1 {lock}")
    };
    let (max_running, max_vcpus, max_memory_mib): (Option<i32>, Option<i32>, Option<i64>) = timed(
        Op::OrgQuota,
        sqlx::query_as(&read(""))
            .bind(org)
            .fetch_optional(&mut *conn),
    )
    .await?
    .ok_or_else(|| StoreError::NotFound {
        what: "org",
        id: org.to_string(),
    })?;
    let quota = Quota {
        max_running,
        max_vcpus,
        max_memory_mib,
    };
    if quota.is_unlimited() {
        return Ok(quota);
    }
    let (max_running, max_vcpus, max_memory_mib) = timed(
        Op::OrgQuota,
        sqlx::query_as(&read("FOR NO KEY UPDATE"))
            .bind(org)
            .fetch_one(conn),
    )
    .await?;
    Ok(Quota {
        max_running,
        max_vcpus,
        max_memory_mib,
    })
}

/// Sets the quota of the org named `name`; whether it exists.
pub async fn set_quota(
    db: impl PgExecutor<'_>,
    name: &str,
    quota: Quota,
) -> Result<bool, StoreError> {
    let updated = timed(
        Op::OrgQuota,
        sqlx::query(
            "UPDATE orgs SET max_running = $2, max_vcpus = $3, max_memory_mib = $4
              WHERE name = $1",
        )
        .bind(name)
        .bind(quota.max_running)
        .bind(quota.max_vcpus)
        .bind(quota.max_memory_mib)
        .execute(db),
    )
    .await?;
    Ok(updated.rows_affected() == 1)
}

/// How many orgs exist (the `berth_orgs` gauge).
pub async fn count(db: impl PgExecutor<'_>) -> Result<i64, StoreError> {
    timed(
        Op::OrgCount,
        sqlx::query_scalar("SELECT count(*) FROM orgs").fetch_one(db),
    )
    .await
}

/// Creates the org `name`; its id, or `None` when an org of that name exists.
pub async fn create(db: impl PgExecutor<'_>, name: &str) -> Result<Option<OrgId>, StoreError> {
    let org = OrgId::new();
    let inserted = timed(
        Op::OrgCreate,
        sqlx::query("INSERT INTO orgs (id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING")
            .bind(org)
            .bind(name)
            .execute(db),
    )
    .await?;
    Ok((inserted.rows_affected() == 1).then_some(org))
}

/// An org's snapshot quota (issue 13 item 3); `None` means unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SnapshotQuota {
    /// Snapshots that may exist at once (any state).
    pub max_snapshots: Option<i32>,
    /// Compressed bytes the org's ready snapshots may reference (distinct chunks).
    pub max_snapshot_bytes: Option<i64>,
}

/// Reads the org's snapshot quota with its row locked (`FOR NO KEY UPDATE`) until the caller's
/// transaction ends, so two snapshot requests of one org cannot both pass the same headroom.
///
/// Errors: [`StoreError::NotFound`] when no such org exists.
pub async fn lock_snapshot_quota(
    conn: &mut PgConnection,
    org: OrgId,
) -> Result<SnapshotQuota, StoreError> {
    let (max_snapshots, max_snapshot_bytes): (Option<i32>, Option<i64>) = timed(
        Op::OrgQuota,
        sqlx::query_as(
            "SELECT max_snapshots, max_snapshot_bytes FROM orgs WHERE id = $1 FOR NO KEY UPDATE",
        )
        .bind(org)
        .fetch_optional(conn),
    )
    .await?
    .ok_or_else(|| StoreError::NotFound {
        what: "org",
        id: org.to_string(),
    })?;
    Ok(SnapshotQuota {
        max_snapshots,
        max_snapshot_bytes,
    })
}

/// Sets the snapshot quota of the org named `name`; whether it exists.
pub async fn set_snapshot_quota(
    db: impl PgExecutor<'_>,
    name: &str,
    quota: SnapshotQuota,
) -> Result<bool, StoreError> {
    let updated = timed(
        Op::OrgQuota,
        sqlx::query("UPDATE orgs SET max_snapshots = $2, max_snapshot_bytes = $3 WHERE name = $1")
            .bind(name)
            .bind(quota.max_snapshots)
            .bind(quota.max_snapshot_bytes)
            .execute(db),
    )
    .await?;
    Ok(updated.rows_affected() == 1)
}

/// An org's backup policy (issue 14).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackupPolicy {
    /// The `backup_interval_min` a new sandbox takes when its create names none (minutes,
    /// 1 to 525600); `None`: no periodic backups unless asked for.
    pub interval_min: Option<i32>,
    /// How many ready backups of each sandbox are kept (1 to 1000; older ones are deleted, and
    /// every failed backup but the newest).
    pub kept: i32,
}

impl Default for BackupPolicy {
    fn default() -> Self {
        Self {
            interval_min: None,
            kept: DEFAULT_BACKUPS_KEPT,
        }
    }
}

/// [`BackupPolicy::kept`] of a new org (migration 0036).
pub const DEFAULT_BACKUPS_KEPT: i32 = 7;

/// Changes the backup policy of the org named `name`: `interval_min` when `Some` (its inner
/// `None` turns the default off), `kept` when `Some`; the rest stays. Whether the org exists.
///
/// Errors: the database's, also for a value outside the ranges of [`BackupPolicy`] (a CHECK).
pub async fn set_backup_policy(
    db: impl PgExecutor<'_>,
    name: &str,
    interval_min: Option<Option<i32>>,
    kept: Option<i32>,
) -> Result<bool, StoreError> {
    let updated = timed(
        Op::OrgQuota,
        sqlx::query(
            "UPDATE orgs SET backup_interval_min = CASE WHEN $2 THEN $3 ELSE backup_interval_min END,
                             backups_kept = COALESCE($4, backups_kept)
              WHERE name = $1",
        )
        .bind(name)
        .bind(interval_min.is_some())
        .bind(interval_min.flatten())
        .bind(kept)
        .execute(db),
    )
    .await?;
    Ok(updated.rows_affected() == 1)
}

/// The org's backup policy; `None` when no such org exists.
pub async fn backup_policy(
    db: impl PgExecutor<'_>,
    org: OrgId,
) -> Result<Option<BackupPolicy>, StoreError> {
    let found: Option<(Option<i32>, i32)> = timed(
        Op::OrgQuota,
        sqlx::query_as("SELECT backup_interval_min, backups_kept FROM orgs WHERE id = $1")
            .bind(org)
            .fetch_optional(db),
    )
    .await?;
    Ok(found.map(|(interval_min, kept)| BackupPolicy { interval_min, kept }))
}

/// The org named `name`: its id and when it was deleted (`None`: live); `None` when no org has
/// that name.
pub async fn find_by_name(
    db: impl PgExecutor<'_>,
    name: &str,
) -> Result<Option<(OrgId, Option<chrono::DateTime<chrono::Utc>>)>, StoreError> {
    timed(
        Op::OrgDelete,
        sqlx::query_as("SELECT id, deleted_at FROM orgs WHERE name = $1")
            .bind(name)
            .fetch_optional(db),
    )
    .await
}

/// Marks `org` deleted (a tombstone: the row, its name and its events stay); `false` when it
/// already was or does not exist. Its keys stop working with it ([`crate::api_keys::find_active`]).
pub async fn tombstone(db: impl PgExecutor<'_>, org: OrgId) -> Result<bool, StoreError> {
    let done = timed(
        Op::OrgDelete,
        sqlx::query("UPDATE orgs SET deleted_at = now() WHERE id = $1 AND deleted_at IS NULL")
            .bind(org)
            .execute(db),
    )
    .await?;
    Ok(done.rows_affected() == 1)
}
