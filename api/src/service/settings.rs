//! Changing a sandbox's settings: `PATCH /v1/sandboxes/{id}` ([`patch`]) and
//! `POST /v1/sandboxes/{id}/renew` ([`renew`]). Each runs one transaction: idempotency replay,
//! the row locked, the request × state check, the fenced write with its `sandbox.updated`
//! event, the stored response.
//!
//! # Guarantees
//! - A sandbox being deleted (or deleted) refuses both with 409 and its state, as it refuses
//!   start and stop (the request × state table); another org's is 404.
//! - Neither bumps the generation nor queues a command: a transition in flight completes as
//!   it would have.
//! - Changing `auto_stop_minutes` re-arms the idle clock from now, whatever it was before
//!   (so turning auto-stop on for a sandbox idle for hours does not stop it at the next pass,
//!   and changing it always arms the new deadline).

use berth_schemas::{OrgId, Reason, SandboxId, SandboxState};
use berth_store::sandboxes::{self, SettingsChange};
use berth_store::SandboxRow;
use chrono::Utc;
use sqlx::{PgPool, Postgres, Transaction};
use tracing::{info, instrument};

use super::idempotency::{self, IdempotencyKey, Replayable, StoredResponse};
use super::ServiceError;
use crate::model::settings::{Renewal, ValidPatch};
use crate::model::Sandbox;

/// Opens the transaction of a settings change: the replay of `key`, else the locked row of
/// `org`'s sandbox `id`, refused while it is being deleted.
async fn begin(
    db: &PgPool,
    org: OrgId,
    id: SandboxId,
    key: Option<&IdempotencyKey>,
) -> Result<Result<(Transaction<'static, Postgres>, SandboxRow), StoredResponse>, ServiceError> {
    let mut tx = db.begin().await?;
    if let Some(key) = key {
        if let Some(stored) = idempotency::replay(&mut tx, org, key).await? {
            return Ok(Err(stored));
        }
    }
    let row = sandboxes::lock(&mut tx, id, Some(org))
        .await?
        .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))?;
    if row.deleting() || row.state == SandboxState::Deleted {
        return Err(ServiceError::Conflict {
            state: row.state,
            message: format!(
                "cannot change the settings of a sandbox that is {}being deleted",
                if row.state == SandboxState::Deleted {
                    "deleted, not "
                } else {
                    ""
                }
            ),
        });
    }
    Ok(Ok((tx, row)))
}

/// Applies `patch` to `org`'s sandbox `id`: metadata merged (a `null` deletes its key), the
/// timers and the expiry set or cleared, a `sandbox.updated` event naming what changed. A
/// patch that changes nothing writes nothing.
///
/// Errors: [`ServiceError::NotFound`], [`ServiceError::Conflict`] (being deleted),
/// [`ServiceError::InvalidRequest`] (merged metadata over its bound),
/// [`ServiceError::IdempotencyKeyReused`].
#[instrument(skip_all, fields(org_id = %org, sandbox_id = %id))]
pub async fn patch(
    db: &PgPool,
    org: OrgId,
    id: SandboxId,
    patch: ValidPatch,
    key: Option<&IdempotencyKey>,
    render: impl FnOnce(&Sandbox) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<Sandbox>, ServiceError> {
    let (tx, row) = match begin(db, org, id, key).await? {
        Ok(open) => open,
        Err(stored) => return Ok(Replayable::Replayed(stored)),
    };
    let changed = patch.changed();
    let change = SettingsChange {
        metadata: patch.merge_metadata(&row.metadata)?,
        auto_stop_minutes: patch.auto_stop_minutes,
        auto_delete_minutes: patch.auto_delete_minutes,
        auto_archive_days: patch.auto_archive_days,
        backup_interval_min: patch.backup_interval_min,
        expires_at: patch.expires_at,
        on_expiry: patch.on_expiry,
        auto_resume: patch.auto_resume,
        public_ports: patch.public_ports,
        message: &changed,
    };
    write(
        tx,
        db,
        org,
        key,
        row,
        (!changed.is_empty()).then_some(change),
        render,
    )
    .await
}

/// Sets `org`'s sandbox `id`'s expiry as `renewal` says (an extension counts from its current
/// expiry, or from now when it has none or it passed), with a `sandbox.updated` event.
///
/// Errors: as [`patch`]; [`ServiceError::InvalidRequest`] for an extension past the bound.
#[instrument(skip_all, fields(org_id = %org, sandbox_id = %id))]
pub async fn renew(
    db: &PgPool,
    org: OrgId,
    id: SandboxId,
    renewal: Renewal,
    key: Option<&IdempotencyKey>,
    render: impl FnOnce(&Sandbox) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<Sandbox>, ServiceError> {
    let (tx, row) = match begin(db, org, id, key).await? {
        Ok(open) => open,
        Err(stored) => return Ok(Replayable::Replayed(stored)),
    };
    let until = renewal.resolve(row.expires_at, Utc::now())?;
    let message = format!("renewed: expires_at {}", until.to_rfc3339());
    let change = SettingsChange {
        expires_at: Some(Some(until)),
        message: &message,
        ..Default::default()
    };
    write(tx, db, org, key, row, Some(change), render).await
}

/// Writes `change` (none: nothing) onto the locked `row`, stores the rendered response and
/// commits.
async fn write(
    mut tx: Transaction<'static, Postgres>,
    db: &PgPool,
    org: OrgId,
    key: Option<&IdempotencyKey>,
    row: SandboxRow,
    change: Option<SettingsChange<'_>>,
    render: impl FnOnce(&Sandbox) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<Sandbox>, ServiceError> {
    let row = match &change {
        Some(change) => {
            let written =
                sandboxes::update_settings(&mut tx, &row, change, Reason::UserRequest).await?;
            info!(changed = change.message, "sandbox settings changed");
            written
        }
        None => row,
    };
    let sandbox = Sandbox::from(row);
    let response = idempotency::commit(tx, db, org, key, render(&sandbox)?).await?;
    Ok(Replayable::Fresh(sandbox, response))
}
