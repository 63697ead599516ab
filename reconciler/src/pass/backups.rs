//! Periodic backups (issue 14): each pass requests a backup of every running sandbox whose
//! `backup_interval_min` passed since its newest backup was requested, exactly as
//! `POST /v1/sandboxes/{id}/backup` would (the snapshot state check, the org's snapshot quota,
//! the `creating` row, its disk-only `sandbox.snapshot` command and its event, reason
//! `auto_backup`). A sandbox over its org's quota is skipped (and logged) until there is room.

use berth_schemas::state::snapshot::on_snapshot_request;
use berth_schemas::Reason;
use berth_store::leases::Lease;
use berth_store::snapshots::{self, KIND_BACKUP};
use sqlx::PgPool;
use tracing::{info, warn};

use super::{commit, fenced, PassConfig, PassError};

/// Requests the backups due; how many.
pub(super) async fn auto_backup(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let unit = config.backup_unit.as_secs_f64();
    let mut n = 0;
    for row in snapshots::lock_backups_due(&mut tx, unit, config.batch).await? {
        let Some(host) = row.host_id else { continue };
        if on_snapshot_request(row.state, row.deleting()).is_err() {
            continue;
        }
        if let Some((limit, value)) = snapshots::quota_refusal(&mut tx, row.org_id).await? {
            warn!(sandbox_id = %row.id, limit, value, "periodic backup skipped: the org's snapshot quota is full");
            continue;
        }
        let backup =
            snapshots::request(&mut tx, &row, host, KIND_BACKUP, Reason::AutoBackup).await?;
        info!(sandbox_id = %row.id, snapshot_id = %backup.id, "periodic backup requested");
        n += 1;
    }
    commit(tx).await?;
    Ok(n)
}
