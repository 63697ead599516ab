//! Org quotas, checked inside the placement transaction: running (capacity-holding)
//! sandboxes, their vCPUs and their memory. Sandboxes being deleted do not count.
//!
//! # Guarantees
//! Concurrent creates of an org with a quota cannot overshoot: the check locks the org's row
//! (`FOR NO KEY UPDATE`) until the caller's transaction ends, so they serialize per org.
//! That lock mode does not block the foreign-key checks of inserts that reference the org
//! (events, sandboxes), which take `FOR KEY SHARE`; `FOR UPDATE` did, and serialized every
//! result apply of the org behind its creates (`berth bench --runtime sim`).
//! An org without any limit takes no lock at all, so its creates run in parallel; a quota
//! set while such a create is in flight applies from the next request on.

use berth_schemas::wire::Resources;
use berth_schemas::OrgId;
use berth_store::orgs::{self, Quota};
use berth_store::{sandboxes, StoreError};
use sqlx::PgConnection;

use super::ServiceError;

/// Checks that the org can hold `adding` more, locking its row for the rest of the caller's
/// transaction.
///
/// Errors: [`ServiceError::QuotaExceeded`] naming the limit (`max_running`, `max_vcpus`,
/// `max_memory_mib`).
pub async fn check(
    conn: &mut PgConnection,
    org: OrgId,
    adding: Resources,
) -> Result<(), ServiceError> {
    let quota = orgs::lock_quota(&mut *conn, org).await?;
    if quota.is_unlimited() {
        return Ok(());
    }
    let used = sandboxes::org_usage(conn, org).await?;
    let checks = [
        (
            "max_running",
            quota.max_running.map(i64::from),
            used.sandboxes + 1,
        ),
        (
            "max_vcpus",
            quota.max_vcpus.map(i64::from),
            used.vcpus + i64::from(adding.vcpus),
        ),
        (
            "max_memory_mib",
            quota.max_memory_mib,
            used.memory_mib + i64::from(adding.memory_mib),
        ),
    ];
    for (limit, max, wanted) in checks {
        if let Some(max) = max {
            if wanted > max {
                return Err(ServiceError::QuotaExceeded { limit, value: max });
            }
        }
    }
    Ok(())
}

/// Sets the quota of the org named `org_name` (`None`: unlimited); whether the org exists.
pub async fn set(
    db: &sqlx::PgPool,
    org_name: &str,
    max_running: Option<i32>,
    max_vcpus: Option<i32>,
    max_memory_mib: Option<i64>,
) -> Result<bool, StoreError> {
    orgs::set_quota(
        db,
        org_name,
        Quota {
            max_running,
            max_vcpus,
            max_memory_mib,
        },
    )
    .await
}
