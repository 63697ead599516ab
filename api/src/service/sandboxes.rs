//! Sandbox use cases: create, get, list, the lifecycle requests (stop, start, delete), and
//! marking a sandbox active. Each state change commits its row, command and event in one
//! transaction (guarantee 1); the relay publishes the command afterwards.

use std::time::Duration;

use berth_scheduler::placement;
use berth_schemas::db::{
    insert_command, insert_event, write_transition, NewEvent, SandboxSnapshot, Transition,
    SNAPSHOT_COLUMNS,
};
use berth_schemas::state::{on_request, Decision, Reason, Refusal, Request};
use berth_schemas::wire::{Command, SandboxSpec};
use berth_schemas::{CommandId, CommandKind, Generation, OrgId, SandboxId, SandboxState};
use sqlx::{PgConnection, PgPool};
use tracing::{info, instrument};

use super::idempotency::{self, IdempotencyKey, Replayable, StoredResponse};
use super::ServiceError;
use crate::model::{Sandbox, ValidCreate, SANDBOX_COLUMNS};

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
/// under `key`).
///
/// Errors: [`ServiceError::UnknownTemplate`], [`ServiceError::QuotaExceeded`],
/// [`ServiceError::NoCapacity`] (nothing written), [`ServiceError::IdempotencyKeyReused`].
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
    let known = sqlx::query("SELECT 1 FROM templates WHERE name = $1")
        .bind(&req.template)
        .fetch_optional(&mut *tx)
        .await?;
    if known.is_none() {
        return Err(ServiceError::UnknownTemplate(req.template));
    }
    super::quota::check(&mut tx, org, req.resources).await?;
    let Some(host) = placement::place(
        &mut tx,
        req.resources,
        policy.heartbeat_freshness,
        policy.overcommit,
    )
    .await?
    else {
        // Dropping the transaction rolls back: nothing is written.
        return Err(ServiceError::NoCapacity {
            vcpus: req.resources.vcpus,
            memory_mib: req.resources.memory_mib,
        });
    };
    let id = SandboxId::new();
    let generation = Generation::INITIAL;
    let row = sqlx::query(&format!(
        "INSERT INTO sandboxes (id, org_id, template, host_id, state, generation, vcpus,
                                memory_mib, holds_capacity, metadata, auto_stop_minutes,
                                auto_delete_minutes)
         VALUES ($1, $2, $3, $4, 'provisioning', $5, $6, $7, true, $8, $9, $10)
         RETURNING {SANDBOX_COLUMNS}"
    ))
    .bind(id)
    .bind(org)
    .bind(&req.template)
    .bind(host)
    .bind(generation)
    .bind(i32::try_from(req.resources.vcpus).unwrap_or(i32::MAX))
    .bind(i32::try_from(req.resources.memory_mib).unwrap_or(i32::MAX))
    .bind(&req.metadata)
    .bind(req.auto_stop_minutes)
    .bind(req.auto_delete_minutes)
    .fetch_one(&mut *tx)
    .await?;
    let command = Command {
        id: CommandId::new(),
        sandbox_id: id,
        generation,
        kind: CommandKind::Create,
        spec: SandboxSpec {
            org_id: org,
            template: req.template,
            resources: req.resources,
        },
    };
    insert_command(&mut tx, host, &command).await?;
    insert_event(
        &mut tx,
        &NewEvent {
            sandbox_id: id,
            org_id: org,
            from: None,
            to: SandboxState::Provisioning,
            reason: Reason::UserRequest,
            generation,
            command_id: Some(command.id),
            message: None,
        },
    )
    .await?;
    let sandbox = Sandbox::from_row(&row)?;
    let response = idempotency::commit(tx, db, org, key, render(&sandbox)?).await?;
    metrics::counter!("berth_sandboxes_created_total").increment(1);
    info!(sandbox_id = %id, host_id = %host, "sandbox placed");
    Ok(Replayable::Fresh(sandbox, response))
}

/// One sandbox of `org`; another org's sandbox is "not found".
///
/// Errors: [`ServiceError::NotFound`].
pub async fn get(db: &PgPool, org: OrgId, id: SandboxId) -> Result<Sandbox, ServiceError> {
    let row = sqlx::query(&format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = $1 AND org_id = $2"
    ))
    .bind(id)
    .bind(org)
    .fetch_optional(db)
    .await?
    .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))?;
    Sandbox::from_row(&row)
}

/// Which sandboxes a list wants.
#[derive(Debug, Clone, Copy)]
pub struct ListFilter {
    /// Only this state; `None`: every state but `deleted`.
    pub state: Option<SandboxState>,
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
    let rows = sqlx::query(&format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes
          WHERE org_id = $1
            AND ($2::text IS NULL AND state <> 'deleted' OR state = $2)
            AND ($3::uuid IS NULL OR id < $3)
          ORDER BY id DESC
          LIMIT $4"
    ))
    .bind(org)
    .bind(filter.state.map(SandboxState::as_str))
    .bind(filter.before)
    .bind(i64::from(filter.limit) + 1)
    .fetch_all(db)
    .await?;
    let mut sandboxes = rows
        .iter()
        .map(Sandbox::from_row)
        .collect::<Result<Vec<_>, _>>()?;
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
/// Errors: [`ServiceError::NotFound`], [`ServiceError::Conflict`] (the request conflicts with
/// the state), [`ServiceError::QuotaExceeded`] and [`ServiceError::NoCapacity`] (a start).
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
    let row = sqlx::query(&format!(
        "SELECT {SNAPSHOT_COLUMNS} FROM sandboxes WHERE id = $1 AND org_id = $2 FOR UPDATE"
    ))
    .bind(id)
    .bind(org)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))?;
    let snap = SandboxSnapshot::from_row(&row)?;
    let decision =
        on_request(snap.state, snap.deleting, request).map_err(|refusal| match refusal {
            Refusal::Conflict { state, .. } => ServiceError::Conflict {
                state,
                message: refusal.to_string(),
            },
        })?;
    let (to, kind) = match decision {
        Decision::Unchanged => {
            let outcome = LifecycleOutcome::Unchanged(read_in(&mut tx, id).await?);
            let response = idempotency::commit(tx, db, org, key, render(&outcome)?).await?;
            return Ok(Replayable::Fresh(outcome, response));
        }
        Decision::Transition { to, command } => (to, command),
    };
    let host = snap
        .host_id
        .ok_or_else(|| ServiceError::Internal(format!("sandbox {id} has no host")))?;
    let mut holds_capacity = snap.holds_capacity;
    if kind == CommandKind::Start && !holds_capacity {
        super::quota::check(&mut tx, org, snap.resources).await?;
        let admitted = placement::reserve(
            &mut tx,
            host,
            snap.resources,
            overcommit,
            placement::Admit::ResidentSandbox,
        )
        .await?;
        if !admitted {
            return Err(ServiceError::NoCapacity {
                vcpus: snap.resources.vcpus,
                memory_mib: snap.resources.memory_mib,
            });
        }
        holds_capacity = true;
    }
    let (generation, command_id) = write_transition(
        &mut tx,
        &snap,
        &Transition {
            to,
            command: Some(kind),
            reason: Reason::UserRequest,
            holds_capacity,
            delete: kind == CommandKind::Delete,
            message: None,
        },
    )
    .await?;
    touch(&mut tx, id).await?;
    let outcome = LifecycleOutcome::Accepted(read_in(&mut tx, id).await?);
    let response = idempotency::commit(tx, db, org, key, render(&outcome)?).await?;
    info!(command_id = ?command_id, generation = %generation, to = %to, "lifecycle request accepted");
    Ok(Replayable::Fresh(outcome, response))
}

async fn read_in(conn: &mut PgConnection, id: SandboxId) -> Result<Sandbox, ServiceError> {
    let row = sqlx::query(&format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = $1"
    ))
    .bind(id)
    .fetch_one(conn)
    .await?;
    Sandbox::from_row(&row)
}

/// Sets `last_activity_at`, the clock of auto-stop.
async fn touch(conn: &mut PgConnection, id: SandboxId) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE sandboxes SET last_activity_at = now() WHERE id = $1")
        .bind(id)
        .execute(conn)
        .await?;
    Ok(())
}

/// Marks a sandbox active now (an exec counts as activity for auto-stop).
pub async fn mark_active(db: &PgPool, id: SandboxId) -> Result<(), ServiceError> {
    let mut conn = db.acquire().await?;
    Ok(touch(&mut conn, id).await?)
}
