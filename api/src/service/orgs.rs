//! Deleting an org (`berth admin delete-org`): an operator's use case, run outside any request.
//!
//! # Guarantees
//! - The org's keys are revoked first, in their own transaction, so nothing new starts while
//!   the rest runs (every process forgets its cached keys at that commit,
//!   [`crate::revocations`]).
//! - Each of its sandboxes not yet deleted is deleted through the same use case as
//!   `DELETE /v1/sandboxes/{id}` ([`super::sandboxes::lifecycle`]): its row, command and event
//!   commit together, capacity is released and hostd destroys the container, as for a user's
//!   delete. A sandbox already being deleted is left to finish.
//! - Only then is the org marked deleted (a tombstone: its name stays taken, its events keep
//!   their org). Running it again after a failure finishes the job.
//!
//! # Errors
//! [`ServiceError::NotFound`] for an unknown org name; Postgres errors as [`ServiceError`].

use berth_schemas::state::Request;
use berth_schemas::OrgId;
use berth_store::{api_keys, orgs, sandboxes};
use sqlx::PgPool;
use tracing::info;

use super::idempotency::StoredResponse;
use super::sandboxes::lifecycle;
use super::ServiceError;

/// The status a delete's (unused) stored response carries: `202 Accepted`.
const ACCEPTED: u16 = 202;
/// Sandboxes read per page while deleting an org's.
const PAGE: i64 = 500;

/// What deleting an org did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrgDeleted {
    /// The org.
    pub org: OrgId,
    /// Keys that still worked and were revoked.
    pub keys_revoked: u64,
    /// Sandboxes whose delete this run requested (those already being deleted not counted).
    pub sandboxes_deleted: usize,
    /// Whether this run wrote the tombstone (`false`: the org was already deleted).
    pub tombstoned: bool,
}

/// Deletes the org named `name` (see the module's guarantees).
///
/// Errors: [`ServiceError::NotFound`] when no org has that name.
pub async fn delete(db: &PgPool, name: &str) -> Result<OrgDeleted, ServiceError> {
    let (org, _) = orgs::find_by_name(db, name)
        .await?
        .ok_or_else(|| ServiceError::NotFound(format!("org {name:?}")))?;
    let keys_revoked = api_keys::revoke_all_of_org(db, org).await?;
    let mut sandboxes_deleted = 0;
    let mut before = None;
    loop {
        let page = sandboxes::list(db, org, None, None, before, PAGE).await?;
        let Some(last) = page.last() else { break };
        before = Some(last.id);
        for row in page.iter().filter(|row| !row.deleting()) {
            let accepted = lifecycle(
                db,
                Default::default(),
                org,
                row.id,
                Request::Delete,
                None,
                |_| {
                    Ok(StoredResponse {
                        status: ACCEPTED,
                        body: serde_json::Value::Null,
                    })
                },
            )
            .await;
            match accepted {
                Ok(_) => sandboxes_deleted += 1,
                // Deleted meanwhile (its owner's last request, or another run).
                Err(ServiceError::NotFound(_) | ServiceError::Conflict { .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }
    let tombstoned = orgs::tombstone(db, org).await?;
    info!(org_id = %org, keys_revoked, sandboxes_deleted, tombstoned, "org deleted");
    Ok(OrgDeleted {
        org,
        keys_revoked,
        sandboxes_deleted,
        tombstoned,
    })
}
