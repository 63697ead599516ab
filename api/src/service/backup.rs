//! Restore from backup (issue 14, `restoring`): `POST /v1/sandboxes/{id}/restore-from-backup`
//! cold-boots one of the sandbox's ready backups (its newest, `last_backup_id`, unless the
//! request names one) on the host placement picks, in one transaction, like a create: what the
//! old host held is released, placement reserves on the new host (any in service, the old one
//! included), the row moves there `restoring` with a `sandbox.migrate` of the backup, and the
//! old host gets a delete of its copy. Memory is never restored. The decision is the state
//! machine's (`on_request`, [`Request::RestoreFromBackup`], the table's `(B)`).
//!
//! Source: the seed lifecycle doc, "Archive, back up and recover from host loss" ("cold-boots
//! the backed-up disk on a new placement. Memory is not restored").

use berth_schemas::ids::SnapshotId;
use berth_schemas::state::snapshot::SnapshotState;
use berth_schemas::state::{on_request, Decision, Reason, Refusal, Request};
use berth_schemas::{OrgId, SandboxId};
use berth_store::sandboxes::{self, BackupRestore};
use berth_store::snapshots::{self, KIND_BACKUP};
use sqlx::PgPool;
use tracing::{info, instrument};

use super::idempotency::{self, IdempotencyKey, Replayable, StoredResponse};
use super::sandboxes::{place_avoiding, PlacementPolicy};
use super::ServiceError;
use crate::model::Sandbox;

/// Restores sandbox `id` from its backup `backup` (its newest ready one when `None`).
/// A sandbox already `restoring` is returned as it is.
///
/// Errors: [`ServiceError::NotFound`] (the sandbox; a backup that is not one of its own),
/// [`ServiceError::Conflict`] (the request × state table: only `running`, `stopped`,
/// `failed-start` and `archived` restore), [`ServiceError::SnapshotUnavailable`] (it has no
/// ready backup), [`ServiceError::SnapshotConflict`] (the backup named is not `ready`, or is a
/// user snapshot: those restore through `POST …/restore`), [`ServiceError::QuotaExceeded`] (a
/// sandbox holding no capacity would pass the org's quota), placement's
/// [`ServiceError::NoCapacity`] and [`ServiceError::Unavailable`],
/// [`ServiceError::IdempotencyKeyReused`]. Nothing is written on an error.
#[instrument(skip_all, fields(org_id = %org, sandbox_id = %id))]
pub async fn restore_from_backup(
    db: &PgPool,
    policy: PlacementPolicy,
    org: OrgId,
    id: SandboxId,
    backup: Option<SnapshotId>,
    key: Option<&IdempotencyKey>,
    render: impl FnOnce(&Sandbox) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<Sandbox>, ServiceError> {
    let mut tx = db.begin().await?;
    if let Some(key) = key {
        if let Some(stored) = idempotency::replay(&mut tx, org, key).await? {
            return Ok(Replayable::Replayed(stored));
        }
    }
    // The backup is locked before the sandbox, in the order a snapshot delete and a backup
    // settling `ready` take them (each then rewrites the sandbox's `last_backup_id`), and
    // `FOR NO KEY UPDATE`: a delete waits for this restore (and then refuses, the backup being
    // booted), while a snapshot or backup taken meanwhile, which names it as its parent, does
    // not (an attack run deadlocked restores against snapshots on `FOR UPDATE`). The newest
    // backup is read again when a delete took it in between.
    let mut found = None;
    for _ in 0..3 {
        let named = match backup {
            Some(backup) => Some(backup),
            None => {
                sandboxes::get(&mut *tx, org, id)
                    .await?
                    .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))?
                    .last_backup_id
            }
        };
        let Some(named) = named else { break };
        found = snapshots::lock_for_boot(&mut tx, named, false)
            .await?
            .filter(|s| s.org_id == org && s.sandbox_id == id);
        if found.is_some() {
            break;
        }
        if backup.is_some() {
            return Err(ServiceError::NotFound(format!(
                "backup {named} of sandbox {id}"
            )));
        }
    }
    let row = sandboxes::lock(&mut tx, id, Some(org))
        .await?
        .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))?;
    let decision =
        on_request(row.state, row.deleting(), Request::RestoreFromBackup).map_err(|refusal| {
            let Refusal::Conflict { state, .. } = refusal;
            ServiceError::Conflict {
                state,
                message: refusal.to_string(),
            }
        })?;
    if decision == Decision::Unchanged {
        let sandbox = Sandbox::from(row);
        let response = idempotency::commit(tx, db, org, key, render(&sandbox)?).await?;
        return Ok(Replayable::Fresh(sandbox, response));
    }
    let Some(found) = found else {
        return Err(ServiceError::SnapshotUnavailable {
            state: row.state,
            message: format!(
                "sandbox {id} has no ready backup: take one with POST /v1/sandboxes/{id}/backup \
                 or set backup_interval_min"
            ),
        });
    };
    let backup = found.id;
    if found.kind != KIND_BACKUP || found.state != SnapshotState::Ready {
        return Err(ServiceError::SnapshotConflict {
            state: found.state.as_str().to_owned(),
            message: format!(
                "snapshot {backup} is a {} that is {}; only a ready backup restores here (a \
                 snapshot restores with POST /v1/sandboxes/{id}/restore)",
                found.kind, found.state
            ),
        });
    }
    if !row.holds_capacity {
        super::quota::check(&mut tx, org, row.resources).await?;
    }
    sandboxes::vacate_for_backup(&mut tx, &row).await?;
    let to = place_avoiding(&mut tx, policy, row.resources, None).await?;
    let message = format!("restore from backup {backup}");
    let (moved, command_id) = sandboxes::restore_from_backup(
        &mut tx,
        &row,
        BackupRestore {
            to,
            backup,
            reason: Reason::UserRequest,
            message: &message,
        },
    )
    .await?;
    let (generation, from) = (moved.generation, row.host_id);
    let sandbox = Sandbox::from(moved);
    let response = idempotency::commit(tx, db, org, key, render(&sandbox)?).await?;
    info!(%command_id, %generation, host_id = %to, from = ?from, backup_id = %backup,
        "restore from backup placed");
    Ok(Replayable::Fresh(sandbox, response))
}
