//! Sandbox use cases: create, get, list, the lifecycle requests (stop, start, delete), and
//! marking a sandbox active. Each state change commits its row, command and event in one
//! transaction (guarantee 1); the relay publishes the command afterwards.

use std::time::Duration;

use berth_scheduler::placement;
use berth_schemas::state::{on_request, on_request_unseeded, Decision, Reason, Refusal, Request};
use berth_schemas::{Capacity, CommandKind, OrgId, SandboxId, SandboxState};
use berth_store::sandboxes::{self, NewSandbox, Transition};
use berth_store::{templates, warm};
use sqlx::PgPool;
use tracing::{info, instrument};

use super::idempotency::{self, IdempotencyKey, Replayable, StoredResponse};
use super::ServiceError;
use crate::model::{Sandbox, ValidCreate};

/// Where placement may put a new sandbox, and how far it may overcommit.
#[derive(Debug, Clone, Copy)]
pub struct PlacementPolicy {
    /// Placement only chooses hosts heard from within this window.
    pub heartbeat_freshness: Duration,
    /// How far placement reserves beyond hosts' physical capacity.
    pub overcommit: placement::Overcommit,
}

/// Creates a sandbox: placement, the row (`provisioning`), its `sandbox.create` command and its
/// event, in one transaction with the idempotency record (`render` gives the response stored
/// under `key`). Placement prefers a host holding a warm slot of the create's shape (template,
/// its runtime and pinned image, resources, disk size), and a slot claimed there gives the
/// sandbox its id (`berth_warm_claims_total{result="hit"|"miss"}`); otherwise the id is new.
///
/// Errors: [`ServiceError::UnknownTemplate`], [`ServiceError::QuotaExceeded`],
/// [`ServiceError::NoCapacity`] (every host is full; nothing written),
/// [`ServiceError::Unavailable`] (hosts with room have stale heartbeats or are degraded;
/// nothing written), [`ServiceError::IdempotencyKeyReused`].
#[instrument(skip_all, fields(org_id = %org))]
pub async fn create(
    db: &PgPool,
    policy: PlacementPolicy,
    org: OrgId,
    req: ValidCreate,
    key: Option<&IdempotencyKey>,
    render: impl FnOnce(&Sandbox) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<Sandbox>, ServiceError> {
    let mut tx = db.begin().await?;
    if let Some(key) = key {
        if let Some(stored) = idempotency::replay(&mut tx, org, key).await? {
            return Ok(Replayable::Replayed(stored));
        }
    }
    // Locked against a concurrent delete of the template until this create commits.
    let template = templates::get_shared(&mut *tx, &req.template)
        .await?
        .ok_or_else(|| ServiceError::UnknownTemplate(req.template.clone()))?;
    super::templates::check_ready(&template)?;
    super::quota::check(&mut tx, org, req.resources).await?;
    let runtime = template.runtime()?;
    let shape = warm::Shape {
        template: &template.name,
        runtime,
        resources: req.resources,
        disk_mib: req.disk_mib,
        image: template.image_pinned.as_deref(),
    };
    let placed = placement::place_warm(
        &mut tx,
        &shape,
        policy.heartbeat_freshness,
        policy.overcommit,
    )
    .await?;
    let host = placed_host(placed, req.resources)?;
    // A warm slot of this shape on the chosen host gives the sandbox its id: the host then
    // hands that booted sandbox over instead of booting one.
    let slot = warm::claim(&mut tx, host, &shape, policy.heartbeat_freshness).await?;
    let (row, _command) = sandboxes::create(
        &mut tx,
        NewSandbox {
            id: slot,
            org_id: org,
            runtime,
            image: template.image_pinned.clone(),
            template: template.name,
            host_id: host,
            resources: req.resources,
            metadata: req.metadata,
            auto_stop_minutes: req.auto_stop_minutes,
            auto_delete_minutes: req.auto_delete_minutes,
            auto_archive_days: req.auto_archive_days,
            backup_interval_min: req.backup_interval_min,
            disk_mib: req.disk_mib,
            network: req.network,
            auto_resume: req.auto_resume,
            public_ports: req.public_ports,
            expires_at: req.expires_at,
            on_expiry: req.on_expiry,
            env: req.env,
            entrypoint: req.entrypoint,
            image_uri: req.image_uri,
            from_snapshot: None,
        },
    )
    .await?;
    let id = row.id;
    let sandbox = Sandbox::from(row);
    let response = idempotency::commit(tx, db, org, key, render(&sandbox)?).await?;
    metrics::counter!("berth_sandboxes_created_total").increment(1);
    let warm = if slot.is_some() { "hit" } else { "miss" };
    metrics::counter!("berth_warm_claims_total", "result" => warm).increment(1);
    info!(sandbox_id = %id, host_id = %host, warm, "sandbox placed");
    Ok(Replayable::Fresh(sandbox, response))
}

/// Places a new sandbox of `resources` in the caller's transaction (reserving capacity on the
/// chosen host), as a create does but without its warm slots (those boot from a snapshot):
/// used by clone, fork, restore and unarchive.
///
/// Errors: [`ServiceError::NoCapacity`] (every host that takes new sandboxes is full),
/// [`ServiceError::Unavailable`] (hosts with room are stale or degraded, or every host is
/// cordoned or draining); nothing is reserved then, and the caller's transaction is to be
/// dropped.
pub(crate) async fn place_new(
    tx: &mut sqlx::PgConnection,
    policy: PlacementPolicy,
    resources: berth_schemas::wire::Resources,
) -> Result<berth_schemas::HostId, ServiceError> {
    place_avoiding(tx, policy, resources, None).await
}

/// [`place_new`], never on `avoid` (the host a migrating sandbox leaves).
pub(crate) async fn place_avoiding(
    tx: &mut sqlx::PgConnection,
    policy: PlacementPolicy,
    resources: berth_schemas::wire::Resources,
    avoid: Option<berth_schemas::HostId>,
) -> Result<berth_schemas::HostId, ServiceError> {
    let placed = placement::place(
        tx,
        resources,
        policy.heartbeat_freshness,
        policy.overcommit,
        avoid,
    )
    .await?;
    placed_host(placed, resources)
}

/// The host a placement of `resources` chose, or the error that says why it chose none.
fn placed_host(
    placed: placement::Placement,
    resources: berth_schemas::wire::Resources,
) -> Result<berth_schemas::HostId, ServiceError> {
    let host = match placed {
        placement::Placement::Placed { host, probe } => {
            if probe {
                info!(host_id = %host, "create placed as the degraded host's probe");
            }
            host
        }
        // Dropping the transaction rolls back: nothing is written.
        placement::Placement::NoCapacity => {
            return Err(ServiceError::NoCapacity {
                vcpus: resources.vcpus,
                memory_mib: resources.memory_mib,
            })
        }
        placement::Placement::Unavailable { why, retry_after } => {
            metrics::counter!("berth_creates_unavailable_total",
                "why" => if why.stale > 0 { "stale_hosts" } else { "degraded_hosts" })
            .increment(1);
            return Err(ServiceError::Unavailable {
                message: format!(
                    "no host can take the sandbox now: of the hosts with room, {} have stale \
                     heartbeats and {} are degraded; retry after {} s",
                    why.stale,
                    why.unhealthy,
                    retry_after.as_secs_f64().ceil()
                ),
                retry_after,
            });
        }
        placement::Placement::HeldOut { hosts, retry_after } => {
            metrics::counter!("berth_creates_unavailable_total", "why" => "held_out_hosts")
                .increment(1);
            return Err(ServiceError::Unavailable {
                message: format!(
                    "no host accepts new sandboxes: {} cordoned, {} draining; retry after {} s",
                    hosts.cordoned,
                    hosts.draining,
                    retry_after.as_secs_f64().ceil()
                ),
                retry_after,
            });
        }
    };
    Ok(host)
}

/// One sandbox of `org`; another org's sandbox is "not found".
///
/// Errors: [`ServiceError::NotFound`].
pub async fn get(db: &PgPool, org: OrgId, id: SandboxId) -> Result<Sandbox, ServiceError> {
    sandboxes::get(db, org, id)
        .await?
        .map(Sandbox::from)
        .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))
}

/// Which sandboxes a list wants.
#[derive(Debug, Clone)]
pub struct ListFilter {
    /// Only this state; `None`: every state but `deleted`.
    pub state: Option<SandboxState>,
    /// Only sandboxes whose metadata holds every pair of this JSON object of strings.
    pub metadata: Option<serde_json::Value>,
    /// Only ids before this one (the previous page's cursor).
    pub before: Option<SandboxId>,
    /// Page size.
    pub limit: u32,
}

/// A page of sandboxes, newest first, and the cursor of the next page.
#[derive(Debug, Clone)]
pub struct Page {
    /// At most the page size, newest first.
    pub sandboxes: Vec<Sandbox>,
    /// The id to pass as [`ListFilter::before`] for the next page; `None` on the last page.
    pub next: Option<SandboxId>,
}

/// `org`'s sandboxes that pass `filter`, newest first.
pub async fn list(db: &PgPool, org: OrgId, filter: ListFilter) -> Result<Page, ServiceError> {
    let rows = sandboxes::list(
        db,
        org,
        filter.state,
        filter.metadata.as_ref(),
        filter.before,
        i64::from(filter.limit) + 1,
    )
    .await?;
    let mut sandboxes: Vec<Sandbox> = rows.into_iter().map(Sandbox::from).collect();
    let next = if sandboxes.len() > filter.limit as usize {
        sandboxes.truncate(filter.limit as usize);
        sandboxes.last().map(|s| s.id)
    } else {
        None
    };
    Ok(Page { sandboxes, next })
}

/// What a lifecycle request did.
#[derive(Debug, Clone)]
pub enum LifecycleOutcome {
    /// Something changed; the transition is in flight.
    Accepted(Sandbox),
    /// The sandbox is already at or heading to the target; nothing changed.
    Unchanged(Sandbox),
}

/// Decides and, when it changes something, commits a lifecycle request: the row (new state,
/// next generation), a reservation when a start needs capacity again, the command and the
/// event, in one transaction with the idempotency record (`render` gives the stored response).
///
/// A start of a `stopped` sandbox whose own host cannot take it back moves it to another host
/// from its durable stop (`migrating`, see `service::migrate`). A start of a clone that never
/// ran (`seed_snapshot` set) in `failed-start` boots from its snapshot again (`resuming` +
/// `sandbox.clone`, [`on_request_unseeded`]).
///
/// Errors: [`ServiceError::NotFound`], [`ServiceError::Conflict`] (the request conflicts with
/// the state), [`ServiceError::QuotaExceeded`], [`ServiceError::NoCapacity`] and
/// [`ServiceError::Unavailable`] (a start), [`ServiceError::SnapshotUnavailable`] (a failed
/// clone whose snapshot is no longer ready).
#[instrument(skip_all, fields(org_id = %org, sandbox_id = %id, request = %request))]
pub async fn lifecycle(
    db: &PgPool,
    overcommit: placement::Overcommit,
    org: OrgId,
    id: SandboxId,
    request: Request,
    key: Option<&IdempotencyKey>,
    render: impl FnOnce(&LifecycleOutcome) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<LifecycleOutcome>, ServiceError> {
    let mut tx = db.begin().await?;
    if let Some(key) = key {
        if let Some(stored) = idempotency::replay(&mut tx, org, key).await? {
            return Ok(Replayable::Replayed(stored));
        }
    }
    let row = sandboxes::lock(&mut tx, id, Some(org))
        .await?
        .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))?;
    // A clone that never ran has no disk of its own: its start boots from its snapshot again.
    let decide = match row.seed_snapshot {
        Some(_) => on_request_unseeded,
        None => on_request,
    };
    let decision = decide(row.state, row.deleting(), request).map_err(|refusal| match refusal {
        Refusal::Conflict { state, .. } => ServiceError::Conflict {
            state,
            message: refusal.to_string(),
        },
    })?;
    let Decision::Transition {
        to,
        command,
        capacity,
    } = decision
    else {
        let outcome = LifecycleOutcome::Unchanged(Sandbox::from(row));
        let response = idempotency::commit(tx, db, org, key, render(&outcome)?).await?;
        return Ok(Replayable::Fresh(outcome, response));
    };
    let snapshot = match command {
        CommandKind::Clone => Some(super::resume::seed_for_start(&mut tx, org, &row).await?),
        _ => None,
    };
    if capacity == Capacity::Reserve && !row.holds_capacity {
        super::quota::check(&mut tx, org, row.resources).await?;
    }
    if to == SandboxState::Unarchiving {
        // An archived sandbox lives on no host: placement picks one and reserves its capacity
        // there in this transaction, as a create does (guarantee 4).
        let policy = PlacementPolicy {
            heartbeat_freshness: berth_scheduler::DEFAULT_HEARTBEAT_FRESHNESS,
            overcommit,
        };
        let host = place_new(&mut tx, policy, row.resources).await?;
        let (moved, command_id) =
            sandboxes::unarchive(&mut tx, &row, host, Reason::UserRequest).await?;
        let generation = moved.generation;
        let outcome = LifecycleOutcome::Accepted(Sandbox::from(moved));
        let response = idempotency::commit(tx, db, org, key, render(&outcome)?).await?;
        info!(command_id = %command_id, generation = %generation, host_id = %host, "unarchive placed");
        return Ok(Replayable::Fresh(outcome, response));
    }
    let transition = Transition {
        to,
        command: Some(command),
        capacity,
        reason: Reason::UserRequest,
        delete: request == Request::Delete,
        message: None,
        activity: true,
        overcommit,
        snapshot,
    };
    let written = if to == SandboxState::Starting && row.state == SandboxState::Stopped {
        // At home when its host can take it back, else elsewhere from its durable stop.
        super::migrate::start_stopped(&mut tx, overcommit, &row, &transition).await?
    } else {
        sandboxes::write_transition(&mut tx, &row, &transition).await?
    };
    let command_id = written.command_id;
    let (generation, to) = (written.row.generation, written.row.state);
    let outcome = LifecycleOutcome::Accepted(Sandbox::from(written.row));
    let response = idempotency::commit(tx, db, org, key, render(&outcome)?).await?;
    info!(command_id = ?command_id, generation = %generation, to = %to, "lifecycle request accepted");
    Ok(Replayable::Fresh(outcome, response))
}

/// After a delete was accepted: removes the sandbox's durable stop snapshots from the object
/// store (issue 14) — the newest and any superseded one still stored: each manifest, and each
/// chunk no snapshot, durable stop or other superseded stop references (claimed first, as a
/// snapshot delete's are). What a boot or upload in flight may still need waits for the
/// collector (`super::super::collector`). A store that fails leaves the content (logged, and
/// retried by the collector), never the delete.
pub async fn collect_durable(
    db: &PgPool,
    objects: &berth_storage::Objects,
    id: SandboxId,
) -> Result<(), ServiceError> {
    let mut tx = db.begin().await?;
    sandboxes::take_durable(&mut tx, id).await?;
    tx.commit().await?;
    while collect_one(db, objects, Some(id)).await? {}
    Ok(())
}

/// Collects one superseded durable stop snapshot (of `sandbox` when given) that nothing may
/// need any more: its manifest removed before its row is forgotten (a failure leaves the row
/// for the next look), then its orphaned chunks. Whether one was collected.
async fn collect_one(
    db: &PgPool,
    objects: &berth_storage::Objects,
    sandbox: Option<SandboxId>,
) -> Result<bool, ServiceError> {
    let mut tx = db.begin().await?;
    let Some(taken) = sandboxes::take_superseded(&mut tx, sandbox).await? else {
        return Ok(false);
    };
    if let Err(error) = objects
        .delete(&berth_storage::Objects::manifest_key(taken.snapshot))
        .await
    {
        tracing::warn!(%error, sandbox_id = %taken.sandbox, snapshot_id = %taken.snapshot,
            "superseded stop snapshot not removed from the store; retrying later");
        return Ok(false);
    }
    berth_store::chunks::queue(&mut tx, &taken.orphans).await?;
    tx.commit().await?;
    match super::snapshots::remove_chunks(db, objects, &taken.orphans).await {
        Ok(n) => {
            info!(sandbox_id = %taken.sandbox, snapshot_id = %taken.snapshot, chunks_freed = n, "durable stop snapshot removed")
        }
        Err(error) => {
            tracing::warn!(%error, sandbox_id = %taken.sandbox, "durable stop snapshot's chunks not removed from the store")
        }
    }
    Ok(true)
}

/// One look of the collector: supersedes the durable stop of up to `batch` deleted sandboxes
/// that still name one (deleted by the reconciler's auto-delete or expiry, an org's delete),
/// then collects up to `batch` superseded stop snapshots nothing may need any more (a start's,
/// a newer stop's, a delete's). How many it handled.
pub async fn collect_deleted(
    db: &PgPool,
    objects: &berth_storage::Objects,
    batch: i64,
) -> Result<usize, ServiceError> {
    let ids = {
        let mut conn = db.acquire().await?;
        sandboxes::deleted_with_durable(&mut conn, batch).await?
    };
    for &id in &ids {
        let mut tx = db.begin().await?;
        sandboxes::take_durable(&mut tx, id).await?;
        tx.commit().await?;
    }
    let mut collected = 0;
    while (collected as i64) < batch && collect_one(db, objects, None).await? {
        collected += 1;
    }
    Ok(ids.len().max(collected))
}

/// Marks a sandbox active now (an exec counts as activity for auto-stop).
pub async fn mark_active(db: &PgPool, id: SandboxId) -> Result<(), ServiceError> {
    Ok(sandboxes::touch(db, id).await?)
}
