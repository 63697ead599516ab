//! API keys: bearer tokens stored only as SHA-256 hashes. Creates orgs and keys, and
//! resolves a key to its [`Principal`] (the lookup behind [`crate::auth`]'s extractors).
//!
//! Key format: `berth_` followed by 43 URL-safe base64 characters (32 random bytes). The key
//! is shown once, when created; only its hash and first characters are kept.

use base64::Engine;
use berth_schemas::{ApiKeyId, OrgId};
use berth_store::api_keys::{self, KeyRow, NewKey};
use berth_store::orgs::Quota;
use berth_store::StoreError;
use rand::RngCore;
use sha2::{Digest, Sha256};
use sqlx::{PgExecutor, PgPool};

use super::idempotency::{self, IdempotencyKey, Replayable, StoredResponse};

/// Every key starts with this.
pub const KEY_PREFIX: &str = "berth_";
/// How many characters of a key are kept in clear, to tell keys apart.
const SHOWN_PREFIX_LEN: usize = 10;

/// The SHA-256 of a key: what is stored and looked up.
pub fn hash(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// A new random key (not yet stored).
pub fn generate_key() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!(
        "{KEY_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

/// Errors of [`create_org`].
#[derive(Debug, thiserror::Error)]
pub enum CreateOrgError {
    /// Org names are unique; carries the name.
    #[error("an org named {0:?} already exists")]
    Exists(String),
    /// The name, trimmed, is empty or longer than 64 characters.
    #[error("org name must be 1 to 64 characters")]
    InvalidName,
    /// Postgres failed; nothing was created.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The org row could not be written.
    #[error(transparent)]
    Store(#[from] berth_store::StoreError),
}

/// Creates an org without quota and its first API key; returns the org id and the key, which
/// is shown only now (only its hash is stored). Operators create orgs with
/// [`create_org_with_quota`] and the configured default quota.
pub async fn create_org(db: &PgPool, name: &str) -> Result<(OrgId, String), CreateOrgError> {
    create_org_with_quota(db, name, Quota::default()).await
}

/// Creates an org with `quota` (its fields `None`: unlimited) and its first API key; returns
/// the org id and the key (shown only now).
///
/// Errors: as [`create_org`].
pub async fn create_org_with_quota(
    db: &PgPool,
    name: &str,
    quota: Quota,
) -> Result<(OrgId, String), CreateOrgError> {
    let name = name.trim();
    if name.is_empty() || name.chars().count() > 64 {
        return Err(CreateOrgError::InvalidName);
    }
    let mut tx = db.begin().await?;
    let Some(org) = berth_store::orgs::create(&mut *tx, name).await? else {
        return Err(CreateOrgError::Exists(name.to_owned()));
    };
    if !quota.is_unlimited() {
        berth_store::orgs::set_quota(&mut *tx, name, quota).await?;
    }
    let key = store_new_key(&mut *tx, Some(org)).await?;
    tx.commit().await?;
    Ok((org, key))
}

/// Creates another key for an existing org; returns it (shown once).
pub async fn create_key(db: &PgPool, org: OrgId) -> Result<String, StoreError> {
    store_new_key(db, Some(org)).await
}

/// The most keys an org may have working at once (`POST /v1/keys` past it: 429
/// `quota_exceeded`, `limit: max_keys`): keys are cheap to make and each costs a row forever.
pub const MAX_ACTIVE_KEYS: i64 = 100;

/// Creates another key for `org`; returns its row (no secret) and the key, shown only now.
///
/// With an `Idempotency-Key` (`idem`), the response `render` makes of the row is stored with
/// the key's row in one transaction, and the same request again replays it instead of making
/// a second key. `render` gets the row only: the secret is never stored (only its hash is
/// kept), so a replay names the key made (its `id` and `prefix`) without it.
///
/// Errors: [`ServiceError::QuotaExceeded`] (`max_keys`) with [`MAX_ACTIVE_KEYS`] working;
/// [`ServiceError::IdempotencyKeyReused`]; Postgres errors.
///
/// [`ServiceError::QuotaExceeded`]: super::ServiceError::QuotaExceeded
/// [`ServiceError::IdempotencyKeyReused`]: super::ServiceError::IdempotencyKeyReused
pub async fn issue_key(
    db: &PgPool,
    org: OrgId,
    idem: Option<&IdempotencyKey>,
    render: impl FnOnce(&KeyRow) -> Result<StoredResponse, super::ServiceError>,
) -> Result<Replayable<(KeyRow, String)>, super::ServiceError> {
    let mut tx = db.begin().await?;
    if let Some(key) = idem {
        if let Some(stored) = idempotency::replay(&mut tx, org, key).await? {
            return Ok(Replayable::Replayed(stored));
        }
    }
    if api_keys::lock_active_count(&mut tx, org).await? >= MAX_ACTIVE_KEYS {
        return Err(super::ServiceError::QuotaExceeded {
            limit: "max_keys",
            value: MAX_ACTIVE_KEYS,
        });
    }
    let key = generate_key();
    let row = insert_key(&mut *tx, Some(org), &key).await?;
    let fresh = render(&row)?;
    let answered = idempotency::commit(tx, db, org, idem, fresh.clone()).await?;
    if answered != fresh {
        // Another request with the key committed first and this key was rolled back: its
        // secret must not be handed out. (The key's lock, taken by the replay above, makes
        // this unreachable; it is checked all the same.)
        return Ok(Replayable::Replayed(answered));
    }
    Ok(Replayable::Fresh((row, key), answered))
}

/// One page of an org's keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyPage {
    /// At most the page size, oldest first.
    pub keys: Vec<KeyRow>,
    /// The last key of this page when another page follows: the next page's cursor.
    pub next: Option<ApiKeyId>,
}

/// One page of the org's keys, revoked ones included, oldest first; never a secret or a
/// hash: at most `limit` keys after the org's key `after` (the previous page's
/// [`KeyPage::next`]), from the first without it. `None` when `after` is not a key of `org`
/// (unknown, or another org's: the same answer).
pub async fn list_keys(
    db: &PgPool,
    org: OrgId,
    after: Option<ApiKeyId>,
    limit: u32,
) -> Result<Option<KeyPage>, StoreError> {
    let mut conn = db.acquire().await?;
    if let Some(after) = after {
        if api_keys::get(&mut *conn, org, after).await?.is_none() {
            return Ok(None);
        }
    }
    // One more than asked: whether another page follows.
    let mut keys = api_keys::list_page(&mut *conn, org, after, i64::from(limit) + 1).await?;
    let more = keys.len() > limit as usize;
    keys.truncate(limit as usize);
    let next = more.then(|| keys.last().map(|k| k.id)).flatten();
    Ok(Some(KeyPage { keys, next }))
}

/// Revokes the org's key `id` (again: a no-op that keeps the first revocation's time). Every
/// API and proxy process forgets this key's cached lookup at commit ([`crate::revocations`]), so it
/// is refused at once everywhere. The org's last working key is kept: revoking it would lock
/// the org out of its own API for good (only the operator makes keys for an org that has
/// none). The org's row is locked for the count, so two revocations of an org's last two keys
/// cannot both pass. The operator's `berth admin revoke-key` and `delete-org` are not bound by
/// this.
///
/// Errors: [`ServiceError::NotFound`] when `org` has no such key (another org's looks the same);
/// [`ServiceError::LastKey`] for the org's last working key.
///
/// [`ServiceError::NotFound`]: super::ServiceError::NotFound
/// [`ServiceError::LastKey`]: super::ServiceError::LastKey
pub async fn revoke_key(
    db: &PgPool,
    org: OrgId,
    id: ApiKeyId,
) -> Result<api_keys::RevokedKey, super::ServiceError> {
    let not_found = || super::ServiceError::NotFound(format!("key {id}"));
    let mut tx = db.begin().await?;
    let active = api_keys::lock_active_count(&mut tx, org).await?;
    let key = api_keys::get(&mut *tx, org, id)
        .await?
        .ok_or_else(not_found)?;
    if key.revoked_at.is_none() && active <= 1 {
        return Err(super::ServiceError::LastKey(id));
    }
    let revoked = api_keys::revoke(&mut *tx, Some(org), id)
        .await?
        .ok_or_else(not_found)?;
    tx.commit().await?;
    Ok(revoked)
}

/// Generates a key for `org` (`None`: an operator key), stores its hash, and returns it.
async fn store_new_key(db: impl PgExecutor<'_>, org: Option<OrgId>) -> Result<String, StoreError> {
    let key = generate_key();
    insert_key(db, org, &key).await?;
    Ok(key)
}

/// Stores `key`'s hash for `org` (`None`: an operator key); its row.
async fn insert_key(
    db: impl PgExecutor<'_>,
    org: Option<OrgId>,
    key: &str,
) -> Result<KeyRow, StoreError> {
    api_keys::insert(
        db,
        &NewKey {
            org_id: org,
            hash: &hash(key),
            prefix: &key[..SHOWN_PREFIX_LEN],
            is_admin: org.is_none(),
        },
    )
    .await
}

/// Who a key belongs to.
#[derive(Debug, Clone, Copy)]
pub struct Principal {
    /// The key that matched.
    pub key_id: ApiKeyId,
    /// The org of an org key; `None` for an operator (admin) key.
    pub org_id: Option<OrgId>,
    /// The key may use the operator routes (`/v1/hosts`).
    pub is_admin: bool,
}

/// Resolves a key; `None` for an unknown or revoked key.
pub async fn authenticate(db: &PgPool, key: &str) -> Result<Option<Principal>, StoreError> {
    authenticate_hash(db, &hash(key)).await
}

/// Resolves a key by its [`hash`]; `None` for an unknown or revoked key.
pub async fn authenticate_hash(
    db: &PgPool,
    hash: &[u8; 32],
) -> Result<Option<Principal>, StoreError> {
    let found = api_keys::find_active(db, hash).await?;
    Ok(found.map(|(key_id, org_id, is_admin)| Principal {
        key_id,
        org_id,
        is_admin,
    }))
}

/// Creates an operator key (no org; only the `/v1/hosts` routes accept it). Shown once.
pub async fn create_admin_key(db: &PgPool) -> Result<String, StoreError> {
    store_new_key(db, None).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_long_random_and_prefixed() {
        let a = generate_key();
        let b = generate_key();
        assert!(a.starts_with(KEY_PREFIX));
        assert_eq!(a.len(), KEY_PREFIX.len() + 43);
        assert_ne!(a, b);
        assert_ne!(hash(&a), hash(&b));
    }
}
