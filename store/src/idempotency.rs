//! The `idempotency_keys` table: the response stored for each `(org, Idempotency-Key)` (the
//! org `None`: the operator's keys, which have no org; migration 0029)
//! ([`find`], [`insert`], written by the API in the transaction of the request it answers), and
//! its retention ([`purge`], by the reconciler's pass).

use std::time::Duration;

use berth_schemas::OrgId;
use sqlx::{PgExecutor, Row};

use crate::op::{timed, Op};
use crate::StoreError;

/// Deletes idempotency keys older than `retention`; returns how many.
pub async fn purge(db: impl PgExecutor<'_>, retention: Duration) -> Result<u64, StoreError> {
    let done = timed(
        Op::IdempotencyPurge,
        sqlx::query(
            "DELETE FROM idempotency_keys WHERE created_at < now() - make_interval(secs => $1)",
        )
        .bind(retention.as_secs_f64())
        .execute(db),
    )
    .await?;
    Ok(done.rows_affected())
}

/// A stored response.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredKey {
    /// The SHA-256 of the request the key was first used for.
    pub fingerprint: Vec<u8>,
    /// The HTTP status answered.
    pub status: i32,
    /// The JSON body answered.
    pub response: serde_json::Value,
}

/// Locks the org's `key` until the caller's transaction ends (a transaction-scoped advisory
/// lock on a hash of org and key): a concurrent request with the same key waits here until the
/// first commits or rolls back, then finds its stored response, instead of racing it (and
/// failing placement against the first one's reservation, say). Outside a transaction the
/// lock is released at once.
pub async fn lock(
    db: impl PgExecutor<'_>,
    org: impl Into<Option<OrgId>>,
    key: &str,
) -> Result<(), StoreError> {
    timed(
        Op::IdempotencyLock,
        // A NULL org (the operator) would make the hash NULL, and the lock a no-op.
        sqlx::query(
            "SELECT pg_advisory_xact_lock(
                 hashtextextended(COALESCE($1::text, 'operator') || ':' || $2, 0))",
        )
        .bind(org.into())
        .bind(key)
        .execute(db),
    )
    .await?;
    Ok(())
}

/// The scope of an org's keys in SQL: the operator's (`NULL`) as the nil uuid, as the unique
/// index of migration 0029 reads it.
const SCOPE: &str = "COALESCE(org_id, '00000000-0000-0000-0000-000000000000'::uuid)";

/// The response stored under the org's `key` (`None`: the operator's), if any.
pub async fn find(
    db: impl PgExecutor<'_>,
    org: impl Into<Option<OrgId>>,
    key: &str,
) -> Result<Option<StoredKey>, StoreError> {
    let row = timed(
        Op::IdempotencyFind,
        sqlx::query(&format!(
            "SELECT fingerprint, status, response FROM idempotency_keys
              WHERE {SCOPE} = COALESCE($1, '00000000-0000-0000-0000-000000000000'::uuid)
                AND key = $2"
        ))
        .bind(org.into())
        .bind(key)
        .fetch_optional(db),
    )
    .await?;
    let get = StoreError::database(Op::IdempotencyFind);
    row.map(|r| {
        Ok(StoredKey {
            fingerprint: r.try_get("fingerprint").map_err(get)?,
            status: r.try_get("status").map_err(get)?,
            response: r.try_get("response").map_err(get)?,
        })
    })
    .transpose()
}

/// Stores `stored` under the org's `key` (`None`: the operator's); `false` when another
/// request with the same key stored first (the caller rolls back and replays that one).
pub async fn insert(
    db: impl PgExecutor<'_>,
    org: impl Into<Option<OrgId>>,
    key: &str,
    stored: &StoredKey,
) -> Result<bool, StoreError> {
    let inserted = timed(
        Op::IdempotencyInsert,
        sqlx::query(&format!(
            "INSERT INTO idempotency_keys (org_id, key, fingerprint, status, response)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (({SCOPE}), key) DO NOTHING"
        ))
        .bind(org.into())
        .bind(key)
        .bind(&stored.fingerprint)
        .bind(stored.status)
        .bind(&stored.response)
        .execute(db),
    )
    .await?;
    Ok(inserted.rows_affected() == 1)
}
