//! Restore, clone and fork (issue 13 items 5–7): each one transaction, like a create.
//!
//! - [`restore`]: a running or stopped sandbox (or one whose boot failed) moves to `resuming`
//!   at the next generation with a `sandbox.restore` naming one of its own `ready` snapshots
//!   (`berth_schemas::state::on_request`, [`Request::Restore`]).
//! - [`clone`]: a new sandbox (own id, the org's quota, placement on any host) written
//!   `resuming` with a `sandbox.clone` naming a `ready` snapshot; template, runtime and size
//!   are the snapshot's.
//! - [`fork`]: a snapshot of a running sandbox plus `count` clones of it, in one transaction.
//!   The clones' hosts wait for the snapshot's manifest (it is durable only then) before they
//!   build; a snapshot that fails leaves them to fail (`failed-start` with the reason).

use berth_schemas::ids::SnapshotId;
use berth_schemas::state::snapshot::{on_clone_request, CloneRefusal, SnapshotState};
use berth_schemas::state::{on_request, Decision, Reason, Refusal, Request};
use berth_schemas::wire::Resources;
use berth_schemas::{Capacity, OrgId, SandboxId};
use berth_store::sandboxes::{self, NewSandbox, SandboxRow, Transition};
use berth_store::snapshots::{self, SnapshotRow};
use berth_store::templates;
use sqlx::{PgConnection, PgPool};
use tracing::{info, instrument};

use super::idempotency::{self, IdempotencyKey, Replayable, StoredResponse};
use super::sandboxes::{place_new, PlacementPolicy};
use super::ServiceError;
use crate::model::snapshot::{Fork, Snapshot};
use crate::model::{Sandbox, ValidCreate};

/// The most clones one fork makes.
pub const MAX_FORK_COUNT: u32 = 16;

/// `Retry-After` of a fork whose clones do not all fit: room comes back as sandboxes stop or
/// are deleted, and a fork asks for several at once.
pub const FORK_NO_CAPACITY_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

/// Rebuilds sandbox `id` from its own ready snapshot `snapshot_id`: `resuming` at the next
/// generation, a `sandbox.restore` to its host and the event, in one transaction. A stopped (or
/// failed) sandbox reserves its capacity again, within the org's quota.
///
/// Errors: [`ServiceError::NotFound`] (the sandbox or the snapshot, also a snapshot of
/// another sandbox), [`ServiceError::Conflict`] (the request × state table),
/// [`ServiceError::SnapshotConflict`] (the snapshot is not `ready`),
/// [`ServiceError::QuotaExceeded`], [`ServiceError::IdempotencyKeyReused`].
#[instrument(skip_all, fields(org_id = %org, sandbox_id = %id, snapshot_id = %snapshot_id))]
pub async fn restore(
    db: &PgPool,
    policy: PlacementPolicy,
    org: OrgId,
    id: SandboxId,
    snapshot_id: SnapshotId,
    key: Option<&IdempotencyKey>,
    render: impl FnOnce(&Sandbox) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<Sandbox>, ServiceError> {
    let mut tx = db.begin().await?;
    if let Some(key) = key {
        if let Some(stored) = idempotency::replay(&mut tx, org, key).await? {
            return Ok(Replayable::Replayed(stored));
        }
    }
    let row = sandboxes::lock(&mut tx, id, Some(org))
        .await?
        .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))?;
    let snapshot = ready_snapshot(&mut tx, org, snapshot_id, Some(id)).await?;
    let decision = on_request(row.state, row.deleting(), Request::Restore).map_err(|refusal| {
        let Refusal::Conflict { state, .. } = refusal;
        ServiceError::Conflict {
            state,
            message: refusal.to_string(),
        }
    })?;
    let Decision::Transition {
        to,
        command,
        capacity,
    } = decision
    else {
        return Err(ServiceError::Internal(
            "a restore decided no transition".into(),
        ));
    };
    if capacity == Capacity::Reserve && !row.holds_capacity {
        super::quota::check(&mut tx, org, row.resources).await?;
    }
    let written = sandboxes::write_transition(
        &mut tx,
        &row,
        &Transition {
            to,
            command: Some(command),
            capacity,
            reason: Reason::UserRequest,
            delete: false,
            message: None,
            activity: true,
            overcommit: policy.overcommit,
            snapshot: Some(snapshot.id),
        },
    )
    .await?;
    let generation = written.row.generation;
    let sandbox = Sandbox::from(written.row);
    let response = idempotency::commit(tx, db, org, key, render(&sandbox)?).await?;
    info!(generation = %generation, "restore accepted");
    Ok(Replayable::Fresh(sandbox, response))
}

/// A new sandbox booted from the ready snapshot `snapshot_id`, with `settings` (its metadata,
/// timers, network, env, …; its template, runtime and size are the snapshot's): placement and
/// the `resuming` row with its `sandbox.clone`, in one transaction. With `source`, the
/// snapshot must be one of that sandbox's (`POST /v1/sandboxes/{id}/clone`).
///
/// Errors: [`ServiceError::NotFound`] (also a deleted `source`), [`ServiceError::Conflict`]
/// (`source` in a transition or being deleted: `on_clone_request`),
/// [`ServiceError::SnapshotConflict`] (not `ready`), [`ServiceError::UnknownTemplate`] (its
/// template was removed), the quota and placement errors of a create,
/// [`ServiceError::IdempotencyKeyReused`].
#[instrument(skip_all, fields(org_id = %org, snapshot_id = %snapshot_id))]
// A create's arguments (pool, policy, org, settings, key, render) plus the snapshot and its
// source: bundling two of them into a one-use struct would read worse than the list.
#[allow(clippy::too_many_arguments)]
pub async fn clone(
    db: &PgPool,
    policy: PlacementPolicy,
    org: OrgId,
    source: Option<SandboxId>,
    snapshot_id: SnapshotId,
    settings: CloneSettings,
    key: Option<&IdempotencyKey>,
    render: impl FnOnce(&Sandbox) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<Sandbox>, ServiceError> {
    let mut tx = db.begin().await?;
    if let Some(key) = key {
        if let Some(stored) = idempotency::replay(&mut tx, org, key).await? {
            return Ok(Replayable::Replayed(stored));
        }
    }
    let settings = match (source, settings) {
        (Some(id), CloneSettings::FromSource) => {
            let row = sandboxes::lock(&mut tx, id, Some(org))
                .await?
                .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))?;
            on_clone_request(row.state, row.deleting()).map_err(|refusal| match refusal {
                CloneRefusal::Deleted => ServiceError::NotFound(format!("sandbox {id}")),
                CloneRefusal::Deleting { state } | CloneRefusal::SandboxState { state } => {
                    ServiceError::Conflict {
                        state,
                        message: refusal.to_string(),
                    }
                }
            })?;
            settings_of(&row)
        }
        (None, CloneSettings::FromSource) => {
            return Err(ServiceError::Internal(
                "a clone without a source names its settings".into(),
            ))
        }
        (_, CloneSettings::Given(given)) => *given,
    };
    let snapshot = ready_snapshot(&mut tx, org, snapshot_id, source).await?;
    let row = clone_locked(&mut tx, policy, org, &snapshot, settings).await?;
    let (id, host) = (row.id, row.host_id);
    let sandbox = Sandbox::from(row);
    let response = idempotency::commit(tx, db, org, key, render(&sandbox)?).await?;
    metrics::counter!("berth_sandboxes_created_total").increment(1);
    info!(sandbox_id = %id, host_id = ?host, "clone placed");
    Ok(Replayable::Fresh(sandbox, response))
}

/// Where a clone's settings come from.
#[derive(Debug, Clone)]
pub enum CloneSettings {
    /// The source sandbox's own (`POST …/clone`, `…/fork`).
    FromSource,
    /// A create body's (`POST /v1/sandboxes {snapshot_id, …}`); its template and size are
    /// ignored (the API refuses them in the body).
    Given(Box<ValidCreate>),
}

/// A snapshot of running sandbox `id` and `count` (1 to [`MAX_FORK_COUNT`]) clones of it, in
/// one transaction: the snapshot's row, command and event, then each clone's placement, row
/// and `sandbox.clone`. All or nothing: a clone that does not fit rolls the whole fork back.
///
/// Errors: [`ServiceError::InvalidRequest`] (`count`), [`ServiceError::NotFound`],
/// [`ServiceError::Conflict`] (the sandbox is not `running`), the snapshot's and the clones'
/// quota errors, [`ServiceError::ForkNoCapacity`] (with [`FORK_NO_CAPACITY_RETRY_AFTER`]),
/// [`ServiceError::Unavailable`], [`ServiceError::IdempotencyKeyReused`]. The clones take the
/// sandbox's settings and its `expires_at` (they never outlive its deadline).
#[instrument(skip_all, fields(org_id = %org, sandbox_id = %id, count))]
pub async fn fork(
    db: &PgPool,
    policy: PlacementPolicy,
    org: OrgId,
    id: SandboxId,
    count: u32,
    key: Option<&IdempotencyKey>,
    render: impl FnOnce(&Fork) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<Fork>, ServiceError> {
    if !(1..=MAX_FORK_COUNT).contains(&count) {
        return Err(ServiceError::InvalidRequest {
            field: "count",
            message: format!("count must be between 1 and {MAX_FORK_COUNT}, got {count}"),
        });
    }
    let mut tx = db.begin().await?;
    if let Some(key) = key {
        if let Some(stored) = idempotency::replay(&mut tx, org, key).await? {
            return Ok(Replayable::Replayed(stored));
        }
    }
    let row = sandboxes::lock(&mut tx, id, Some(org))
        .await?
        .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))?;
    let snapshot =
        super::snapshots::request_locked(&mut tx, org, &row, snapshots::KIND_SNAPSHOT).await?;
    // A fork's children live within the parent's deadline: they take its expiry.
    let settings = ValidCreate {
        expires_at: row.expires_at,
        ..settings_of(&row)
    };
    let mut clones = Vec::new();
    for placed in 0..count {
        let clone = clone_locked(&mut tx, policy, org, &snapshot, settings.clone())
            .await
            .map_err(|e| match e {
                ServiceError::NoCapacity { vcpus, memory_mib } => ServiceError::ForkNoCapacity {
                    count,
                    placed,
                    vcpus,
                    memory_mib,
                    retry_after: FORK_NO_CAPACITY_RETRY_AFTER,
                },
                other => other,
            })?;
        clones.push(Sandbox::from(clone));
    }
    let fork = Fork {
        snapshot: Snapshot::from(snapshot),
        sandboxes: clones,
    };
    let response = idempotency::commit(tx, db, org, key, render(&fork)?).await?;
    metrics::counter!("berth_sandboxes_created_total").increment(u64::from(count));
    info!(snapshot_id = %fork.snapshot.id, "fork placed");
    Ok(Replayable::Fresh(fork, response))
}

/// The snapshot a clone that never ran boots from again at its start (the locked `row`'s
/// `seed_snapshot`), locked `FOR SHARE` like a clone's.
///
/// Errors: [`ServiceError::SnapshotUnavailable`] when it is no longer `ready` (deleted,
/// say): the sandbox has no disk of its own to start, only a delete is left.
pub(crate) async fn seed_for_start(
    tx: &mut PgConnection,
    org: OrgId,
    row: &SandboxRow,
) -> Result<SnapshotId, ServiceError> {
    let Some(seed) = row.seed_snapshot else {
        return Err(ServiceError::Internal(format!(
            "sandbox {} boots from no snapshot",
            row.id
        )));
    };
    match ready_snapshot(tx, org, seed, None).await {
        Ok(snapshot) => Ok(snapshot.id),
        Err(ServiceError::NotFound(_) | ServiceError::SnapshotConflict { .. }) => {
            Err(ServiceError::SnapshotUnavailable {
                state: row.state,
                message: format!(
                    "sandbox {} never ran: a start boots it from snapshot {seed}, which is \
                     no longer ready; delete it",
                    row.id
                ),
            })
        }
        Err(other) => Err(other),
    }
}

/// The org's snapshot `id`, `ready`, locked `FOR SHARE` (a delete waits for this transaction,
/// then sees its command); with `of`, it must be that sandbox's.
///
/// Errors: [`ServiceError::NotFound`], [`ServiceError::SnapshotConflict`].
async fn ready_snapshot(
    tx: &mut PgConnection,
    org: OrgId,
    id: SnapshotId,
    of: Option<SandboxId>,
) -> Result<SnapshotRow, ServiceError> {
    let snapshot = snapshots::get_shared(&mut *tx, org, id)
        .await?
        .filter(|s| of.is_none_or(|sandbox| s.sandbox_id == sandbox))
        .ok_or_else(|| match of {
            Some(sandbox) => ServiceError::NotFound(format!("snapshot {id} of sandbox {sandbox}")),
            None => ServiceError::NotFound(format!("snapshot {id}")),
        })?;
    if snapshot.state != SnapshotState::Ready {
        return Err(ServiceError::SnapshotConflict {
            state: snapshot.state.as_str().to_owned(),
            message: format!(
                "snapshot {id} is {}; only a ready snapshot can be restored or cloned",
                snapshot.state
            ),
        });
    }
    Ok(snapshot)
}

/// The settings a clone takes from its source sandbox (not its expiry: a clone's clock
/// starts at its own birth, so it has none; a fork's children take it, see [`fork`]).
fn settings_of(row: &SandboxRow) -> ValidCreate {
    ValidCreate {
        template: row.template.clone(),
        resources: row.resources,
        metadata: row.metadata.clone(),
        auto_stop_minutes: row.auto_stop_minutes,
        auto_delete_minutes: row.auto_delete_minutes,
        auto_archive_days: row.auto_archive_days,
        backup_interval_min: row.backup_interval_min,
        disk_mib: row.disk_mib,
        network: row.network.clone(),
        auto_resume: row.auto_resume,
        public_ports: row.public_ports.clone(),
        expires_at: None,
        on_expiry: row.on_expiry,
        env: row.env.clone(),
        entrypoint: row.entrypoint.clone(),
        image_uri: None,
    }
}

/// Places and writes one clone of `snapshot` in the caller's transaction: the template must
/// still exist, the org's quota must hold its size, placement reserves it.
async fn clone_locked(
    tx: &mut PgConnection,
    policy: PlacementPolicy,
    org: OrgId,
    snapshot: &SnapshotRow,
    settings: ValidCreate,
) -> Result<SandboxRow, ServiceError> {
    let template = templates::get(&mut *tx, &snapshot.template)
        .await?
        .ok_or_else(|| ServiceError::UnknownTemplate(snapshot.template.clone()))?;
    let resources = Resources {
        vcpus: u32::try_from(snapshot.vcpus).unwrap_or(0),
        memory_mib: u32::try_from(snapshot.memory_mib).unwrap_or(0),
    };
    super::quota::check(&mut *tx, org, resources).await?;
    let host = place_new(&mut *tx, policy, resources).await?;
    let runtime = snapshot
        .runtime
        .parse()
        .map_err(|e| ServiceError::Internal(format!("snapshot {}: {e}", snapshot.id)))?;
    let (row, _command) = sandboxes::create(
        &mut *tx,
        NewSandbox {
            id: None,
            org_id: org,
            template: snapshot.template.clone(),
            runtime,
            image: template.image_pinned.clone(),
            host_id: host,
            resources,
            metadata: settings.metadata,
            auto_stop_minutes: settings.auto_stop_minutes,
            auto_delete_minutes: settings.auto_delete_minutes,
            auto_archive_days: settings.auto_archive_days,
            backup_interval_min: settings.backup_interval_min,
            disk_mib: u32::try_from(snapshot.disk_mib).unwrap_or(0),
            network: settings.network,
            auto_resume: settings.auto_resume,
            public_ports: settings.public_ports,
            expires_at: settings.expires_at,
            on_expiry: settings.on_expiry,
            env: settings.env,
            entrypoint: settings.entrypoint,
            image_uri: settings.image_uri,
            from_snapshot: Some(snapshot.id),
        },
    )
    .await?;
    Ok(row)
}
