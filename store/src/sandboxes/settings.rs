//! Writes of a sandbox's settings — what `PATCH /v1/sandboxes/{id}` and renew change without a
//! state change — and the reconciler's selection of expired sandboxes.
//!
//! # Guarantees
//! - Fenced like every write: [`update_settings`] and [`clear_expiry`] update a row only at the
//!   generation the caller read and never a row being deleted; a miss is
//!   [`StoreError::Fenced`]. Neither bumps the generation: a settings change queues no command,
//!   so the host's result for the command in flight still applies.
//! - A settings change and its `sandbox.updated` event commit together (guarantee 1).

use berth_schemas::state::ExpiryAction;
use berth_schemas::Reason;
use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use super::{rows, SandboxRow, COLUMNS};
use crate::events::{self, NewEvent};
use crate::op::{timed, Op};
use crate::StoreError;

/// What a settings change writes; `None` leaves a setting as it is, `Some(None)` clears it.
#[derive(Debug, Clone, Default)]
pub struct SettingsChange<'a> {
    /// The whole new metadata object (the caller merged it).
    pub metadata: Option<serde_json::Value>,
    /// New `auto_stop_minutes`; any change re-arms the idle clock from now
    /// (`last_activity_at = now()`), so the new deadline is now + the minutes.
    pub auto_stop_minutes: Option<Option<i32>>,
    /// New `auto_delete_minutes`; any change re-arms the auto-delete clock from now
    /// (`updated_at = now()`, which auto-delete measures from).
    pub auto_delete_minutes: Option<Option<i32>>,
    /// New `auto_archive_days`; any change re-arms the auto-archive clock from now, as
    /// `auto_delete_minutes` does.
    pub auto_archive_days: Option<Option<i32>>,
    /// New `backup_interval_min` (the next backup is due once the newest is that old).
    pub backup_interval_min: Option<Option<i32>>,
    /// New `expires_at`.
    pub expires_at: Option<Option<DateTime<Utc>>>,
    /// New `on_expiry`.
    pub on_expiry: Option<ExpiryAction>,
    /// New `auto_resume`.
    pub auto_resume: Option<bool>,
    /// New `public_ports` (validated: 1 to 65535).
    pub public_ports: Option<Vec<u16>>,
    /// What changed, for the event's `message` (`metadata, auto_stop_minutes`, …).
    pub message: &'a str,
}

/// Writes `change` onto the locked sandbox `row` with its `sandbox.updated` event, whose reason
/// is `reason` (`user_request` for a PATCH or renew, `expired` when an expiry turned
/// `auto_resume` off), in the caller's transaction; returns the row as it is now.
///
/// Errors: [`StoreError::Fenced`] when the row left `row.generation` or is being deleted.
pub async fn update_settings(
    conn: &mut PgConnection,
    row: &SandboxRow,
    change: &SettingsChange<'_>,
    reason: Reason,
) -> Result<SandboxRow, StoreError> {
    let updated = timed(
        Op::SandboxUpdateSettings,
        sqlx::query(&format!(
            "UPDATE sandboxes
                SET metadata = COALESCE($3, metadata),
                    auto_stop_minutes = CASE WHEN $4 THEN $5 ELSE auto_stop_minutes END,
                    last_activity_at = CASE WHEN $4 THEN now() ELSE last_activity_at END,
                    auto_delete_minutes = CASE WHEN $6 THEN $7 ELSE auto_delete_minutes END,
                    auto_archive_days = CASE WHEN $13 THEN $14 ELSE auto_archive_days END,
                    updated_at = CASE WHEN $6 OR $13 THEN now() ELSE updated_at END,
                    expires_at = CASE WHEN $8 THEN $9 ELSE expires_at END,
                    on_expiry = COALESCE($10, on_expiry),
                    auto_resume = COALESCE($11, auto_resume),
                    public_ports = COALESCE($12, public_ports),
                    backup_interval_min = CASE WHEN $15 THEN $16 ELSE backup_interval_min END
              WHERE id = $1 AND generation = $2 AND deleted_at IS NULL
              RETURNING {COLUMNS}"
        ))
        .bind(row.id)
        .bind(row.generation)
        .bind(&change.metadata)
        .bind(change.auto_stop_minutes.is_some())
        .bind(change.auto_stop_minutes.flatten())
        .bind(change.auto_delete_minutes.is_some())
        .bind(change.auto_delete_minutes.flatten())
        .bind(change.expires_at.is_some())
        .bind(change.expires_at.flatten())
        .bind(change.on_expiry.map(ExpiryAction::as_str))
        .bind(change.auto_resume)
        .bind(
            change
                .public_ports
                .as_ref()
                .map(|ports| ports.iter().map(|p| i32::from(*p)).collect::<Vec<i32>>()),
        )
        .bind(change.auto_archive_days.is_some())
        .bind(change.auto_archive_days.flatten())
        .bind(change.backup_interval_min.is_some())
        .bind(change.backup_interval_min.flatten())
        .fetch_optional(&mut *conn),
    )
    .await?
    .ok_or(StoreError::Fenced {
        sandbox: row.id,
        expected: row.generation,
    })?;
    events::insert_updated(
        conn,
        &NewEvent {
            sandbox_id: row.id,
            org_id: row.org_id,
            from: Some(row.state),
            to: row.state,
            reason,
            generation: row.generation,
            command_id: None,
            message: Some(change.message),
            stop: None,
        },
    )
    .await?;
    SandboxRow::from_row(&updated)
}

/// Locks (skipping rows others hold) up to `batch` sandboxes, not being deleted, whose
/// `expires_at` has passed, the longest expired first.
pub async fn lock_expired(
    conn: &mut PgConnection,
    batch: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    let found = timed(
        Op::SandboxExpired,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes
              WHERE deleted_at IS NULL AND expires_at IS NOT NULL AND expires_at <= now()
              ORDER BY expires_at
              LIMIT $1 FOR UPDATE SKIP LOCKED"
        ))
        .bind(batch)
        .fetch_all(conn),
    )
    .await?;
    rows(&found)
}

/// Clears the expiry of the locked sandbox `row` at `generation` (its own, or the one a
/// transition just wrote): an expiry fires once.
///
/// Errors: [`StoreError::Fenced`] when the row is no longer at `generation`.
pub async fn clear_expiry(
    conn: &mut PgConnection,
    row: &SandboxRow,
    generation: berth_schemas::Generation,
) -> Result<(), StoreError> {
    let cleared = timed(
        Op::SandboxClearExpiry,
        sqlx::query("UPDATE sandboxes SET expires_at = NULL WHERE id = $1 AND generation = $2")
            .bind(row.id)
            .bind(generation)
            .execute(conn),
    )
    .await?;
    if cleared.rows_affected() != 1 {
        return Err(StoreError::Fenced {
            sandbox: row.id,
            expected: generation,
        });
    }
    Ok(())
}
