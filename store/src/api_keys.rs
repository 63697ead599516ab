//! The `api_keys` table: only SHA-256 hashes of keys are stored, with the org they act for
//! (none for an operator key).

use berth_schemas::{ApiKeyId, OrgId};
use sqlx::PgExecutor;

use crate::op::{timed, Op};
use crate::StoreError;

/// A key to store.
#[derive(Debug, Clone)]
pub struct NewKey<'a> {
    /// The org it acts for; `None` for an operator key.
    pub org_id: Option<OrgId>,
    /// SHA-256 of the whole key.
    pub hash: &'a [u8],
    /// Its first characters, to tell keys apart in listings.
    pub prefix: &'a str,
    /// Whether it may use the operator routes.
    pub is_admin: bool,
}

/// Stores a key; returns its id.
pub async fn insert(db: impl PgExecutor<'_>, key: &NewKey<'_>) -> Result<ApiKeyId, StoreError> {
    let id = ApiKeyId::new();
    timed(
        Op::ApiKeyInsert,
        sqlx::query(
            "INSERT INTO api_keys (id, org_id, key_hash, prefix, is_admin)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(id)
        .bind(key.org_id)
        .bind(key.hash)
        .bind(key.prefix)
        .bind(key.is_admin)
        .execute(db),
    )
    .await?;
    Ok(id)
}

/// The unrevoked key with this hash: (id, its org, whether it is an operator key).
pub async fn find_active(
    db: impl PgExecutor<'_>,
    hash: &[u8],
) -> Result<Option<(ApiKeyId, Option<OrgId>, bool)>, StoreError> {
    timed(
        Op::ApiKeyFind,
        sqlx::query_as(
            "SELECT id, org_id, is_admin FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL",
        )
        .bind(hash)
        .fetch_optional(db),
    )
    .await
}
