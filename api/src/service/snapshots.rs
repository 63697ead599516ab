//! Snapshot use cases (issue 13 item 3): take one (a `creating` row, its `sandbox.snapshot`
//! command and its `snapshot.created` event in one transaction, within the org's snapshot
//! quota), read them, delete one (its row and chunk references in one transaction, then the
//! stored content no other snapshot references). Decisions come from
//! `berth_schemas::state::snapshot`.

use berth_schemas::ids::SnapshotId;
use berth_schemas::state::snapshot::{on_snapshot_delete, on_snapshot_request, SnapshotRefusal};
use berth_schemas::{OrgId, Reason, SandboxId};
use berth_store::snapshots;
use berth_store::{chunks, sandboxes};
use sqlx::PgPool;
use tracing::{info, instrument, warn};

use super::idempotency::{self, IdempotencyKey, Replayable, StoredResponse};
use super::ServiceError;
use crate::model::snapshot::Snapshot;

/// Requests a snapshot of a running sandbox: the row (`creating`), the host command (with the
/// sandbox's newest ready snapshot on its host as the parent) and the `snapshot.created` event,
/// in one transaction with the idempotency record.
///
/// Errors: [`ServiceError::NotFound`], [`ServiceError::Conflict`] (the sandbox is not running,
/// or is being deleted), [`ServiceError::QuotaExceeded`] (`max_snapshots`,
/// `max_snapshot_bytes`), [`ServiceError::IdempotencyKeyReused`].
#[instrument(skip_all, fields(org_id = %org, sandbox_id = %id))]
pub async fn create(
    db: &PgPool,
    org: OrgId,
    id: SandboxId,
    kind: &'static str,
    key: Option<&IdempotencyKey>,
    render: impl FnOnce(&Snapshot) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<Snapshot>, ServiceError> {
    let mut tx = db.begin().await?;
    if let Some(key) = key {
        if let Some(stored) = idempotency::replay(&mut tx, org, key).await? {
            return Ok(Replayable::Replayed(stored));
        }
    }
    let row = sandboxes::lock(&mut tx, id, Some(org))
        .await?
        .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))?;
    let created = request_locked(&mut tx, org, &row, kind).await?;
    let snapshot_id = created.id;
    let snapshot = Snapshot::from(created);
    let response = idempotency::commit(tx, db, org, key, render(&snapshot)?).await?;
    info!(snapshot_id = %snapshot_id, parent = ?snapshot.parent_id, "snapshot requested");
    Ok(Replayable::Fresh(snapshot, response))
}

/// Requests a snapshot of the locked sandbox `row` in the caller's transaction: the state
/// check, the org's snapshot quota, the `creating` row, its `sandbox.snapshot` command and its
/// `snapshot.created` event (a snapshot request and a fork share it).
///
/// Errors: [`ServiceError::Conflict`], [`ServiceError::QuotaExceeded`].
pub(crate) async fn request_locked(
    tx: &mut sqlx::PgConnection,
    org: OrgId,
    row: &sandboxes::SandboxRow,
    kind: &'static str,
) -> Result<snapshots::SnapshotRow, ServiceError> {
    let id = row.id;
    on_snapshot_request(row.state, row.deleting()).map_err(|refusal| ServiceError::Conflict {
        state: row.state,
        message: refusal.to_string(),
    })?;
    let host = row
        .host_id
        .ok_or_else(|| ServiceError::Internal(format!("running sandbox {id} has no host")))?;
    if let Some((limit, value)) = snapshots::quota_refusal(&mut *tx, org).await? {
        return Err(ServiceError::QuotaExceeded { limit, value });
    }
    Ok(snapshots::request(&mut *tx, row, host, kind, Reason::UserRequest).await?)
}

/// One snapshot of `org`; another org's is "not found".
///
/// Errors: [`ServiceError::NotFound`].
pub async fn get(db: &PgPool, org: OrgId, id: SnapshotId) -> Result<Snapshot, ServiceError> {
    snapshots::get(db, org, id)
        .await?
        .map(Snapshot::from)
        .ok_or_else(|| ServiceError::NotFound(format!("snapshot {id}")))
}

/// The snapshots `org` has of a sandbox, oldest first (also of a deleted sandbox, even once
/// its tombstone is purged: they outlive it).
///
/// Errors: [`ServiceError::NotFound`] when `org` has no such sandbox and no snapshot of it
/// (an unknown id, or another org's sandbox: guarantee 7), as every sandbox route answers.
pub async fn list(
    db: &PgPool,
    org: OrgId,
    sandbox: SandboxId,
) -> Result<Vec<Snapshot>, ServiceError> {
    let rows = snapshots::list_for_sandbox(db, org, sandbox).await?;
    if rows.is_empty() && sandboxes::get(db, org, sandbox).await?.is_none() {
        return Err(ServiceError::NotFound(format!("sandbox {sandbox}")));
    }
    Ok(rows.into_iter().map(Snapshot::from).collect())
}

/// One look of the backup retention (issue 14, the collector's): deletes, with their content,
/// up to `batch` backups past their org's policy (`berth_store::snapshots::past_retention`:
/// of each sandbox, ready ones beyond the newest `backups_kept`, failed ones but the newest).
/// A backup a sandbox is booting from (or gone meanwhile) is skipped. How many it deleted.
pub async fn prune_backups(
    db: &PgPool,
    objects: &berth_storage::Objects,
    batch: i64,
) -> Result<usize, ServiceError> {
    let due = {
        let mut conn = db.acquire().await?;
        snapshots::past_retention(&mut conn, batch).await?
    };
    let mut pruned = 0;
    for (org, id) in due {
        match delete(db, Some(objects), org, id).await {
            Ok(()) => pruned += 1,
            Err(ServiceError::SnapshotConflict { .. } | ServiceError::NotFound(_)) => {}
            Err(error) => return Err(error),
        }
    }
    if pruned > 0 {
        metrics::counter!("berth_backups_pruned_total").increment(pruned as u64);
        tracing::info!(pruned, "backups past their org's retention deleted");
    }
    Ok(pruned)
}

/// Deletes a settled snapshot: its row and chunk references in one transaction, then (when an
/// object store is given) its manifest and the chunks no other snapshot references. Content
/// whose delete failed after the commit is only unreferenced, never lost from a live snapshot.
///
/// Errors: [`ServiceError::NotFound`], [`ServiceError::SnapshotConflict`] (still `creating`, or
/// a sandbox still resuming from it).
pub async fn delete(
    db: &PgPool,
    objects: Option<&berth_storage::Objects>,
    org: OrgId,
    id: SnapshotId,
) -> Result<(), ServiceError> {
    let mut tx = db.begin().await?;
    let row = snapshots::lock(&mut tx, id)
        .await?
        .filter(|r| r.org_id == org)
        .ok_or_else(|| ServiceError::NotFound(format!("snapshot {id}")))?;
    on_snapshot_delete(row.state).map_err(|refusal: SnapshotRefusal| {
        ServiceError::SnapshotConflict {
            state: row.state.as_str().to_owned(),
            message: refusal.to_string(),
        }
    })?;
    let booting = snapshots::boots_in_progress(&mut tx, id).await?;
    if booting > 0 {
        return Err(ServiceError::SnapshotConflict {
            state: row.state.as_str().to_owned(),
            message: format!(
                "{booting} sandbox(es) are still resuming from snapshot {id}; delete it once \
                 they are running"
            ),
        });
    }
    let orphans = snapshots::delete(&mut tx, id).await?;
    let hashes: Vec<String> = orphans.iter().map(|(h, _)| h.clone()).collect();
    chunks::queue(&mut tx, &hashes).await?;
    tx.commit().await?;
    crate::outbox::wake();
    if let Some(objects) = objects {
        let removed = async {
            objects
                .delete(&berth_storage::Objects::manifest_key(id))
                .await
                .map_err(|e| e.to_string())?;
            remove_chunks(db, objects, &hashes).await
        }
        .await;
        if let Err(error) = removed {
            warn!(%error, snapshot_id = %id, "snapshot deleted; some of its content could not be removed from the store");
        }
    }
    info!(snapshot_id = %id, chunks_freed = orphans.len(), "snapshot deleted");
    Ok(())
}

/// Removes the queued chunks `hashes` from the object store, each only once claimed (no
/// snapshot references it: `berth_store::chunks`), the claim committed before the object goes;
/// how many went.
///
/// Errors: the first database or store failure, as text; the chunks not reached stay queued, a
/// claimed one whose delete failed stays claimed (the sweep takes it over).
pub async fn remove_chunks(
    db: &PgPool,
    objects: &berth_storage::Objects,
    hashes: &[String],
) -> Result<usize, String> {
    let mut removed = 0;
    for hash in hashes {
        let mut conn = db.acquire().await.map_err(|e| e.to_string())?;
        let claimed = std::time::Instant::now();
        let Some(token) = chunks::claim_at(&mut conn, hash)
            .await
            .map_err(|e| e.to_string())?
        else {
            continue;
        };
        if remove_claimed(&mut conn, objects, hash, (claimed, token)).await? {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Deletes the object of chunk `hash`, whose removal this remover claimed (or took over):
/// `claimed` is the local time noted before its claim's statement went out and the claim's
/// token (`removing_at`, on the database's clock). Finishes the removal, fenced by that token;
/// whether it went. Only within the claim's `chunks::delete_budget` and while the database
/// still says the claim is this remover's and younger than half of `chunks::STALE_CLAIM`
/// (`chunks::still_claimed`: the local clock of a paused process may not have run): past
/// either, nothing is deleted and the row stays claimed for the sweep's takeover. The delete
/// is cut at the budget's timeout, so it never lands after a takeover finished and an upload
/// stored the chunk again.
///
/// Errors: the store's or the database's failure, or the delete's timeout, as text; the row
/// stays claimed.
pub(crate) async fn remove_claimed(
    conn: &mut sqlx::PgConnection,
    objects: &berth_storage::Objects,
    hash: &str,
    (claimed, token): (std::time::Instant, chrono::DateTime<chrono::Utc>),
) -> Result<bool, String> {
    let budget = match chunks::delete_budget(claimed) {
        Some(budget)
            if chunks::still_claimed(conn, hash, token)
                .await
                .map_err(|e| e.to_string())? =>
        {
            budget
        }
        _ => {
            warn!(sha256 = %hash, elapsed = ?claimed.elapsed(),
                "a chunk removal's claim is too old or no longer this remover's; left for the sweep's takeover");
            return Ok(false);
        }
    };
    tokio::time::timeout(
        budget,
        objects.delete(&berth_storage::Objects::chunk_key(hash)),
    )
    .await
    .map_err(|_| format!("deleting chunk {hash} took longer than {budget:?}"))?
    .map_err(|e| e.to_string())?;
    chunks::finish_claimed(conn, hash, token)
        .await
        .map_err(|e| e.to_string())
}
