//! Key routes: an org key manages its own org's keys. `GET /v1/keys` lists them (never a
//! secret or a hash), `POST /v1/keys` makes one (the key is in that answer only),
//! `DELETE /v1/keys/{id}` revokes one ([`crate::service::keys`] runs them).
//!
//! # Guarantees
//! - Only the caller's org's keys are listed or revoked; another org's key id is `404`, as an
//!   unknown one.
//! - A revoked key is refused (`401`) by every API and proxy process as soon as the revocation
//!   commits ([`crate::revocations`]); this process forgets its cache before answering.
//! - An org has at most [`keys::MAX_ACTIVE_KEYS`] working keys; one more is `429`
//!   `quota_exceeded` (`limit: max_keys`) and writes nothing.
//! - A key may revoke itself (the answer is its last); revoking a revoked key again is `200`
//!   with its first revocation's time.
//!
//! `POST /v1/keys` does not honour `Idempotency-Key`: a replay would have to store the new key
//! in clear beside the org's idempotency records. A client that lost the answer lists its keys
//! and revokes the one it does not know.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use berth_schemas::ApiKeyId;
use berth_store::api_keys::KeyRow;
use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

use super::extract::{parse_path_id, NoParams, StrictQuery};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::service::keys;
use crate::AppState;

/// An API key as its org sees it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ApiKey {
    /// The key's id (what `DELETE /v1/keys/{id}` takes).
    #[schema(value_type = String)]
    pub id: ApiKeyId,
    /// Its first characters (`berth_` and four more), to tell keys apart.
    pub prefix: String,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it was revoked; `null` while it works.
    pub revoked_at: Option<DateTime<Utc>>,
}

impl From<KeyRow> for ApiKey {
    fn from(row: KeyRow) -> Self {
        Self {
            id: row.id,
            prefix: row.prefix,
            created_at: row.created_at,
            revoked_at: row.revoked_at,
        }
    }
}

/// A key just made: its row and the key itself, shown only in this answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CreatedKey {
    /// The key's row.
    #[serde(flatten)]
    pub key_info: ApiKey,
    /// The key (`berth_…`): send it as `Authorization: Bearer`. Only its hash is kept.
    pub key: String,
}

/// `GET /v1/keys`: the caller's org's keys, revoked ones included, oldest first.
#[utoipa::path(get, path = "/v1/keys", tag = "keys",
    responses((status = 200, body = [ApiKey]), (status = 400, description = "`invalid_request`: a query parameter"),
        (status = 401, description = "`unauthorized`")),
    security(("bearer" = [])))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    _query: StrictQuery<NoParams>,
) -> Result<Json<Vec<ApiKey>>, ApiError> {
    let rows = keys::list_keys(&app.db, caller.org_id).await?;
    Ok(Json(rows.into_iter().map(ApiKey::from).collect()))
}

/// `POST /v1/keys`: another key of the caller's org.
#[utoipa::path(post, path = "/v1/keys", tag = "keys",
    responses((status = 201, description = "Created; the key is in this answer only", body = CreatedKey),
        (status = 429, description = "`quota_exceeded` (`limit: max_keys`): the org has 100 working keys"),
        (status = 401, description = "`unauthorized`")),
    security(("bearer" = [])))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    _query: StrictQuery<NoParams>,
) -> Result<(StatusCode, Json<CreatedKey>), ApiError> {
    let (row, key) = keys::issue_key(&app.db, caller.org_id).await?;
    tracing::info!(org_id = %caller.org_id, key_id = %row.id, "api key created");
    Ok((
        StatusCode::CREATED,
        Json(CreatedKey {
            key_info: row.into(),
            key,
        }),
    ))
}

/// `DELETE /v1/keys/{id}`: revokes a key of the caller's org; refused everywhere at once.
#[utoipa::path(delete, path = "/v1/keys/{id}", tag = "keys", params(("id" = String, Path)),
    responses((status = 200, description = "Revoked (or already revoked)", body = ApiKey),
        (status = 404, description = "`not_found`: no such key in the caller's org"),
        (status = 401, description = "`unauthorized`")),
    security(("bearer" = [])))]
pub async fn revoke(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
) -> Result<Json<ApiKey>, ApiError> {
    let id: ApiKeyId = parse_path_id(&id, "key")?;
    let row = keys::revoke_key(&app.db, caller.org_id, id).await?;
    // This process refuses it before answering; the others on the commit's notification.
    app.guards.forget_keys();
    tracing::info!(org_id = %caller.org_id, key_id = %id, "api key revoked");
    Ok(Json(row.into()))
}
