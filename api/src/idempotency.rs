//! `Idempotency-Key` on every POST: the same key with the same request replays the stored
//! response; the same key with a different request is `422 idempotency_key_reused`.
//!
//! Keys are scoped by org. A state-changing route stores its response in the same
//! transaction as the change, so a retry after a crash either finds the stored response or
//! finds that nothing happened — never a second sandbox. Only 2xx responses are stored: an
//! error changed nothing, so a retry decides again. Source: Stripe's idempotent requests and
//! the IETF draft "The Idempotency-Key HTTP Header Field".

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_schemas::OrgId;
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, Row};

use crate::error::ApiError;

/// The request header.
pub const HEADER: &str = "idempotency-key";
/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// A request's key and the fingerprint of what it asked (method, path, body bytes).
#[derive(Debug, Clone)]
pub struct Idempotency {
    pub key: String,
    fingerprint: Vec<u8>,
}

impl Idempotency {
    /// Reads the header; `None` when absent.
    ///
    /// Errors: 400 `invalid_request` (field `Idempotency-Key`) when empty, longer than
    /// [`MAX_KEY_LEN`] or not visible ASCII.
    pub fn from_headers(
        headers: &HeaderMap,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> Result<Option<Self>, ApiError> {
        let Some(raw) = headers.get(HEADER) else {
            return Ok(None);
        };
        let key = raw
            .to_str()
            .ok()
            .filter(|k| {
                !k.is_empty() && k.len() <= MAX_KEY_LEN && k.bytes().all(|b| b.is_ascii_graphic())
            })
            .ok_or_else(|| {
                ApiError::invalid(
                    "Idempotency-Key",
                    format!("Idempotency-Key must be 1 to {MAX_KEY_LEN} visible ASCII characters"),
                )
            })?;
        let mut h = Sha256::new();
        for part in [method.as_bytes(), b"\0", path.as_bytes(), b"\0", body] {
            h.update(part);
        }
        Ok(Some(Self {
            key: key.to_owned(),
            fingerprint: h.finalize().to_vec(),
        }))
    }

    /// A stored response for this key, if any.
    ///
    /// Errors: [`ApiError::IdempotencyKeyReused`] when the key was used for another request.
    pub async fn replay(
        &self,
        conn: &mut PgConnection,
        org: OrgId,
    ) -> Result<Option<Response>, ApiError> {
        let Some(row) = sqlx::query(
            "SELECT fingerprint, status, response FROM idempotency_keys
              WHERE org_id = $1 AND key = $2",
        )
        .bind(org)
        .bind(&self.key)
        .fetch_optional(conn)
        .await?
        else {
            return Ok(None);
        };
        let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
        if fingerprint != self.fingerprint {
            return Err(ApiError::IdempotencyKeyReused(self.key.clone()));
        }
        let status: i32 = row.try_get("status")?;
        let status = StatusCode::from_u16(u16::try_from(status).unwrap_or(500))
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body: serde_json::Value = row.try_get("response")?;
        Ok(Some((status, Json(body)).into_response()))
    }

    /// Stores the response in the caller's transaction. Returns `false` when another request
    /// with the same key committed first (the caller rolls back and replays that one).
    pub async fn store(
        &self,
        conn: &mut PgConnection,
        org: OrgId,
        status: StatusCode,
        response: &serde_json::Value,
    ) -> Result<bool, ApiError> {
        let inserted = sqlx::query(
            "INSERT INTO idempotency_keys (org_id, key, fingerprint, status, response)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (org_id, key) DO NOTHING",
        )
        .bind(org)
        .bind(&self.key)
        .bind(&self.fingerprint)
        .bind(i32::from(status.as_u16()))
        .bind(response)
        .execute(conn)
        .await?;
        Ok(inserted.rows_affected() == 1)
    }
}

/// Stores `body` under the request's key (if it carried one) in the caller's transaction and
/// commits, answering `status` with `body`. When a concurrent request with the same key
/// committed first, rolls back and answers what that one answered.
///
/// Errors: database errors; [`ApiError::IdempotencyKeyReused`] from the replay.
pub async fn commit_with_replay<T: serde::Serialize>(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    db: &sqlx::PgPool,
    org: OrgId,
    idem: Option<&Idempotency>,
    status: StatusCode,
    body: &T,
) -> Result<Response, ApiError> {
    let body = serde_json::to_value(body).map_err(|e| ApiError::Internal(e.to_string()))?;
    if let Some(idem) = idem {
        if !idem.store(&mut tx, org, status, &body).await? {
            tx.rollback().await?;
            let mut conn = db.acquire().await?;
            return match idem.replay(&mut conn, org).await? {
                Some(stored) => Ok(stored),
                None => Err(ApiError::Internal("idempotency row vanished".into())),
            };
        }
    }
    tx.commit().await?;
    Ok((status, Json(body)).into_response())
}
