//! Key routes: an org key manages its own org's keys. `GET /v1/keys` lists them a page at a
//! time, as `GET /v1/sandboxes` does (`limit`, `cursor`; never a secret or a hash), `POST /v1/keys` makes one (the key is in that answer only),
//! `DELETE /v1/keys/{id}` revokes one ([`crate::service::keys`] runs them).
//!
//! # Guarantees
//! - Only the caller's org's keys are listed or revoked; another org's key id is `404`, as an
//!   unknown one.
//! - A revoked key is refused (`401`) by every API and proxy process as soon as the revocation
//!   commits ([`crate::revocations`]); this process forgets its cache before answering.
//! - An org has at most [`keys::MAX_ACTIVE_KEYS`] working keys; one more is `429`
//!   `quota_exceeded` (`limit: max_keys`) and writes nothing.
//! - A key may revoke itself (the answer is its last), unless it is the org's last working key:
//!   that is `409` `last_key` (the org would be locked out of its own API); revoking a revoked
//!   key again is `200` with its first revocation's time.
//! - `POST /v1/keys` takes no fields: an empty body or `{}`; anything else is `400`, a body
//!   over [`MAX_BODY_BYTES`] `413`.
//! - `POST /v1/keys` honours `Idempotency-Key` as every POST does (the same request again makes
//!   no second key; another body under the key is `422`), but the secret is never stored, in
//!   the idempotency records or anywhere: a replay answers the same `201` and key row with
//!   `key: null`. A client that lost the first answer revokes that `id` and asks again with a
//!   new `Idempotency-Key`.
//!
//! [`MAX_BODY_BYTES`]: super::body::MAX_BODY_BYTES

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_schemas::ApiKeyId;
use berth_store::api_keys::KeyRow;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::body::{json_or_empty, NoFields};
use super::extract::{parse_path_id, KnownParams, NoParams, StrictQuery};
use super::idempotency::{render, stored, Idempotency};
use super::sandboxes::{DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::service::idempotency::Replayable;
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
    /// The key (`berth_…`): send it as `Authorization: Bearer`. Only its hash is kept, so a
    /// replay of the request (`Idempotency-Key`) answers `null` here.
    pub key: Option<String>,
}

/// The query of `GET /v1/keys`: the page, as `GET /v1/sandboxes` takes it.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct KeyListQuery {
    /// Page size, 1 to [`MAX_PAGE_SIZE`] (500); default [`DEFAULT_PAGE_SIZE`] (50).
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

impl KnownParams for KeyListQuery {
    const NAMES: &'static [&'static str] = &["limit", "cursor"];
}

/// `GET /v1/keys` response: one page of the org's keys, oldest first.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct KeyList {
    /// One page of the caller's org's keys, revoked ones included, oldest first.
    pub keys: Vec<ApiKey>,
    /// Pass as `cursor` for the next page; `null` on the last page.
    pub next_cursor: Option<String>,
}

/// `GET /v1/keys`: the caller's org's keys, revoked ones included, oldest first,
/// cursor-paginated.
#[utoipa::path(get, path = "/v1/keys", tag = "keys", params(KeyListQuery),
    responses((status = 200, body = KeyList),
        (status = 400, description = "`invalid_request`: an unknown query parameter, a `limit` out of 1–500, or a `cursor` this API did not return for the org (`field` names it)"),
        (status = 401, description = "`unauthorized`")),
    security(("bearer" = [])))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    StrictQuery(query): StrictQuery<KeyListQuery>,
) -> Result<Json<KeyList>, ApiError> {
    let limit = query.limit.unwrap_or(DEFAULT_PAGE_SIZE);
    if !(1..=MAX_PAGE_SIZE).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            format!("limit must be between 1 and {MAX_PAGE_SIZE}"),
        ));
    }
    let bad_cursor = || ApiError::invalid("cursor", "cursor is not one this API returned");
    let after = query
        .cursor
        .as_deref()
        .map(str::parse::<ApiKeyId>)
        .transpose()
        .map_err(|_| bad_cursor())?;
    let page = keys::list_keys(&app.db, caller.org_id, after, limit)
        .await?
        .ok_or_else(bad_cursor)?;
    Ok(Json(KeyList {
        keys: page.keys.into_iter().map(ApiKey::from).collect(),
        next_cursor: page.next.map(|id| id.to_string()),
    }))
}

/// `POST /v1/keys`: another key of the caller's org. Takes `{}` or no body.
#[utoipa::path(post, path = "/v1/keys", tag = "keys",
    request_body(content = Option<NoFields>, description = "`{}` or no body"),
    responses((status = 201, description = "Created; the key is in this answer only (a replay of an `Idempotency-Key` answers the same key's row with `key: null`)", body = CreatedKey),
        (status = 400, description = "`invalid_request`: a body other than `{}` or none, or a repeated `Idempotency-Key`"),
        (status = 413, description = "`payload_too_large`: a body over `limit` bytes"),
        (status = 422, description = "`idempotency_key_reused`: the Idempotency-Key was used for a different request"),
        (status = 429, description = "`quota_exceeded` (`limit: max_keys`): the org has 100 working keys"),
        (status = 401, description = "`unauthorized`")),
    security(("bearer" = [])))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    _query: StrictQuery<NoParams>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let NoFields {} = json_or_empty(&body)?;
    let idem = Idempotency::from_headers(&headers, "POST", "/v1/keys", &body)?;
    // What a replay answers: the row, never the secret.
    let without_secret = |row: &KeyRow| {
        stored(
            StatusCode::CREATED,
            &CreatedKey {
                key_info: row.clone().into(),
                key: None,
            },
        )
    };
    match keys::issue_key(&app.db, caller.org_id, idem.as_ref(), without_secret).await? {
        Replayable::Fresh((row, key), _) => {
            tracing::info!(org_id = %caller.org_id, key_id = %row.id, "api key created");
            Ok((
                StatusCode::CREATED,
                Json(CreatedKey {
                    key_info: row.into(),
                    key: Some(key),
                }),
            )
                .into_response())
        }
        Replayable::Replayed(stored) => Ok(render(stored)),
    }
}

/// `DELETE /v1/keys/{id}`: revokes a key of the caller's org; refused everywhere at once.
#[utoipa::path(delete, path = "/v1/keys/{id}", tag = "keys", params(("id" = String, Path)),
    responses((status = 200, description = "Revoked (or already revoked)", body = ApiKey),
        (status = 404, description = "`not_found`: no such key in the caller's org"),
        (status = 409, description = "`last_key`: the org's last working key (the org would be locked out)"),
        (status = 401, description = "`unauthorized`")),
    security(("bearer" = [])))]
pub async fn revoke(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
) -> Result<Json<ApiKey>, ApiError> {
    let id: ApiKeyId = parse_path_id(&id, "key")?;
    let revoked = keys::revoke_key(&app.db, caller.org_id, id).await?;
    // This process refuses it before answering; the others on the commit's notification. Only
    // this key: another org's cached keys are none of this revocation's business.
    match <[u8; 32]>::try_from(revoked.key_hash.as_slice()) {
        Ok(hash) => app.guards.forget_key(&hash),
        Err(_) => app.guards.forget_keys(),
    }
    tracing::info!(org_id = %caller.org_id, key_id = %id, "api key revoked");
    Ok(Json(revoked.row.into()))
}
