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
use sqlx::{PgConnection, Row};

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
    let unlimited: bool = sqlx::query_scalar(
        "SELECT max_running IS NULL AND max_vcpus IS NULL AND max_memory_mib IS NULL
           FROM orgs WHERE id = $1",
    )
    .bind(org)
    .fetch_one(&mut *conn)
    .await?;
    if unlimited {
        return Ok(());
    }
    let limits = sqlx::query(
        "SELECT max_running, max_vcpus, max_memory_mib FROM orgs WHERE id = $1
            FOR NO KEY UPDATE",
    )
    .bind(org)
    .fetch_one(&mut *conn)
    .await?;
    let max_running: Option<i32> = limits.try_get("max_running")?;
    let max_vcpus: Option<i32> = limits.try_get("max_vcpus")?;
    let max_memory: Option<i64> = limits.try_get("max_memory_mib")?;
    let used = sqlx::query(
        "SELECT count(*) AS running, COALESCE(sum(vcpus), 0)::int8 AS vcpus,
                COALESCE(sum(memory_mib), 0)::int8 AS memory
           FROM sandboxes WHERE org_id = $1 AND holds_capacity AND deleted_at IS NULL",
    )
    .bind(org)
    .fetch_one(&mut *conn)
    .await?;
    let checks = [
        (
            "max_running",
            max_running.map(i64::from),
            used.try_get::<i64, _>("running")? + 1,
        ),
        (
            "max_vcpus",
            max_vcpus.map(i64::from),
            used.try_get::<i64, _>("vcpus")? + i64::from(adding.vcpus),
        ),
        (
            "max_memory_mib",
            max_memory,
            used.try_get::<i64, _>("memory")? + i64::from(adding.memory_mib),
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

/// Sets an org's quotas (`None` = unlimited). Returns whether the org exists.
pub async fn set(
    db: &sqlx::PgPool,
    org_name: &str,
    max_running: Option<i32>,
    max_vcpus: Option<i32>,
    max_memory_mib: Option<i64>,
) -> Result<bool, sqlx::Error> {
    let updated = sqlx::query(
        "UPDATE orgs SET max_running = $2, max_vcpus = $3, max_memory_mib = $4 WHERE name = $1",
    )
    .bind(org_name)
    .bind(max_running)
    .bind(max_vcpus)
    .bind(max_memory_mib)
    .execute(db)
    .await?;
    Ok(updated.rows_affected() == 1)
}
