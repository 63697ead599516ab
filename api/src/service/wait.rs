//! Waiting for a sandbox's state without polling: `GET /v1/sandboxes/{id}/wait` and `?wait=`
//! on a create or a lifecycle request. The row is read once, then again only when
//! [`SandboxWatch`] says it changed (an event of the sandbox, or its fallback tick).
//!
//! # Guarantees
//! - Answers as soon as the row is in the target state (`Ok`), or settled where it cannot get
//!   there without a new request ([`ServiceError::WaitConflict`], judged by
//!   [`wait_verdict`]); otherwise when `timeout` passes or `stop` fires
//!   ([`ServiceError::WaitTimeout`]).
//! - Org-scoped like every read: another org's sandbox is [`ServiceError::NotFound`].

use std::time::Duration;

use berth_schemas::state::{wait_verdict, Timers, WaitTarget, WaitVerdict};
use berth_schemas::{OrgId, SandboxId};
use berth_store::sandboxes;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::instrument;

use super::ServiceError;
use crate::model::Sandbox;
use crate::watch::SandboxWatch;

/// How long a wait lasts when the request names no `timeout`.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest `timeout` a wait may ask for; more is refused (400).
pub const MAX_WAIT_TIMEOUT: Duration = Duration::from_secs(300);

/// Waits until `org`'s sandbox `id` is in `target`'s state and returns it.
///
/// Errors: [`ServiceError::NotFound`] (also when the row is purged while waited on),
/// [`ServiceError::WaitConflict`], [`ServiceError::WaitTimeout`] (after `timeout`, or at once
/// when `stop` fires), [`ServiceError::Internal`] when the watch cannot subscribe.
#[instrument(skip_all, fields(org_id = %org, sandbox_id = %id, target = %target))]
pub async fn wait(
    db: &PgPool,
    watch: &SandboxWatch,
    org: OrgId,
    id: SandboxId,
    target: WaitTarget,
    timeout: Duration,
    stop: &CancellationToken,
) -> Result<Sandbox, ServiceError> {
    // Registered before the first read: a change committed after it wakes us.
    let mut changes = watch
        .subscribe(id)
        .await
        .map_err(|e| ServiceError::Internal(e.to_string()))?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let row = sandboxes::get(db, org, id)
            .await?
            .ok_or_else(|| ServiceError::NotFound(format!("sandbox {id}")))?;
        let timers = Timers {
            auto_stop: row.auto_stop_minutes.is_some(),
            auto_delete: row.auto_delete_minutes.is_some(),
            expiry: row.expires_at.map(|_| row.on_expiry),
        };
        match wait_verdict(target, row.state, row.deleting(), timers) {
            WaitVerdict::Reached => return Ok(Sandbox::from(row)),
            WaitVerdict::Impossible => {
                return Err(ServiceError::WaitConflict {
                    sandbox: id,
                    state: row.state,
                    target: target.state(),
                })
            }
            WaitVerdict::Pending => {}
        }
        let timed_out = ServiceError::WaitTimeout {
            sandbox: id,
            state: row.state,
            target: target.state(),
        };
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep_until(deadline) => return Err(timed_out),
            _ = stop.cancelled() => return Err(timed_out),
        }
    }
}
