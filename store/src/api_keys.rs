//! The `api_keys` table: only SHA-256 hashes of keys are stored, with the org they act for
//! (none for an operator key).

use berth_schemas::{ApiKeyId, OrgId};
use sqlx::{PgConnection, PgExecutor};

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

/// Stores a key; returns its row.
pub async fn insert(db: impl PgExecutor<'_>, key: &NewKey<'_>) -> Result<KeyRow, StoreError> {
    let id = ApiKeyId::new();
    timed(
        Op::ApiKeyInsert,
        sqlx::query_as(
            "INSERT INTO api_keys (id, org_id, key_hash, prefix, is_admin)
             VALUES ($1, $2, $3, $4, $5)
             RETURNING id, prefix, created_at, revoked_at",
        )
        .bind(id)
        .bind(key.org_id)
        .bind(key.hash)
        .bind(key.prefix)
        .bind(key.is_admin)
        .fetch_one(db),
    )
    .await
}

/// The unrevoked key with this hash, unless its org is deleted: (id, its org, whether it is an
/// operator key).
pub async fn find_active(
    db: impl PgExecutor<'_>,
    hash: &[u8],
) -> Result<Option<(ApiKeyId, Option<OrgId>, bool)>, StoreError> {
    timed(
        Op::ApiKeyFind,
        sqlx::query_as(
            "SELECT k.id, k.org_id, k.is_admin FROM api_keys k LEFT JOIN orgs o ON o.id = k.org_id
              WHERE k.key_hash = $1 AND k.revoked_at IS NULL AND o.deleted_at IS NULL",
        )
        .bind(hash)
        .fetch_optional(db),
    )
    .await
}

/// One key as its org sees it: never its hash.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct KeyRow {
    /// The key's id.
    pub id: ApiKeyId,
    /// Its first characters (`berth_` and four more), to tell keys apart.
    pub prefix: String,
    /// When it was made.
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// When it was revoked; `None` while it works.
    pub revoked_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// A revoked key: its row, and the SHA-256 it is stored under (what a key cache is keyed by,
/// never shown to anyone).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct RevokedKey {
    /// The key as its org sees it.
    #[sqlx(flatten)]
    pub row: KeyRow,
    /// `api_keys.key_hash`.
    pub key_hash: Vec<u8>,
}

/// The org's keys, revoked ones included, oldest first.
pub async fn list(db: impl PgExecutor<'_>, org: OrgId) -> Result<Vec<KeyRow>, StoreError> {
    timed(
        Op::ApiKeyList,
        sqlx::query_as(
            "SELECT id, prefix, created_at, revoked_at FROM api_keys
              WHERE org_id = $1 ORDER BY created_at, id",
        )
        .bind(org)
        .fetch_all(db),
    )
    .await
}

/// One page of the org's keys, revoked ones included, oldest first (by `created_at`, then
/// id): at most `limit` of those after the org's key `after` (all from the first without it).
/// A key `after` that is not the org's gives an empty page; the caller checks it first
/// ([`get`]).
pub async fn list_page(
    db: impl PgExecutor<'_>,
    org: OrgId,
    after: Option<ApiKeyId>,
    limit: i64,
) -> Result<Vec<KeyRow>, StoreError> {
    timed(
        Op::ApiKeyList,
        sqlx::query_as(
            "SELECT k.id, k.prefix, k.created_at, k.revoked_at FROM api_keys k
              WHERE k.org_id = $1
                AND ($2::uuid IS NULL OR (k.created_at, k.id) >
                     (SELECT c.created_at, c.id FROM api_keys c
                       WHERE c.org_id = $1 AND c.id = $2))
              ORDER BY k.created_at, k.id
              LIMIT $3",
        )
        .bind(org)
        .bind(after)
        .bind(limit)
        .fetch_all(db),
    )
    .await
}

/// The org's key `id`, revoked or not; `None` when `org` has no such key.
pub async fn get(
    db: impl PgExecutor<'_>,
    org: OrgId,
    id: ApiKeyId,
) -> Result<Option<KeyRow>, StoreError> {
    timed(
        Op::ApiKeyList,
        sqlx::query_as(
            "SELECT id, prefix, created_at, revoked_at FROM api_keys
              WHERE org_id = $1 AND id = $2",
        )
        .bind(org)
        .bind(id)
        .fetch_optional(db),
    )
    .await
}

/// Revokes key `id` when it belongs to `org` (`None`: any key, the operator's own command);
/// the key as it is now, revoked (at its first revocation's time when it already was), or
/// `None` when no such key (of that org) exists. Every process forgets its cached keys at
/// commit (migration 0022's trigger).
pub async fn revoke(
    db: impl PgExecutor<'_>,
    org: Option<OrgId>,
    id: ApiKeyId,
) -> Result<Option<RevokedKey>, StoreError> {
    timed(
        Op::ApiKeyRevoke,
        sqlx::query_as(
            "UPDATE api_keys SET revoked_at = COALESCE(revoked_at, now())
              WHERE id = $1 AND ($2::uuid IS NULL OR org_id = $2)
              RETURNING id, prefix, created_at, revoked_at, key_hash",
        )
        .bind(id)
        .bind(org)
        .fetch_optional(db),
    )
    .await
}

/// Revokes every key of `org`; how many were still working.
pub async fn revoke_all_of_org(db: impl PgExecutor<'_>, org: OrgId) -> Result<u64, StoreError> {
    let revoked = timed(
        Op::ApiKeyRevoke,
        sqlx::query(
            "UPDATE api_keys SET revoked_at = now() WHERE org_id = $1 AND revoked_at IS NULL",
        )
        .bind(org)
        .execute(db),
    )
    .await?;
    Ok(revoked.rows_affected())
}

/// How many of `org`'s keys still work, with the org's row locked (`FOR NO KEY UPDATE`) until
/// the caller's transaction ends, so two creates cannot both pass the same headroom.
///
/// Errors: [`StoreError::NotFound`] when no such org exists.
pub async fn lock_active_count(conn: &mut PgConnection, org: OrgId) -> Result<i64, StoreError> {
    timed(
        Op::ApiKeyCount,
        sqlx::query_scalar::<_, i32>("SELECT 1 FROM orgs WHERE id = $1 FOR NO KEY UPDATE")
            .bind(org)
            .fetch_optional(&mut *conn),
    )
    .await?
    .ok_or_else(|| StoreError::NotFound {
        what: "org",
        id: org.to_string(),
    })?;
    timed(
        Op::ApiKeyCount,
        sqlx::query_scalar(
            "SELECT count(*) FROM api_keys WHERE org_id = $1 AND revoked_at IS NULL",
        )
        .bind(org)
        .fetch_one(conn),
    )
    .await
}
