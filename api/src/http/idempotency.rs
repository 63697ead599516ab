//! The HTTP half of `Idempotency-Key` (on every POST): reading the header, rendering a response
//! to store, and answering a stored one. Storage is [`crate::service::idempotency`].

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_schemas::OrgId;

use crate::error::ApiError;
pub use crate::service::idempotency::IdempotencyKey as Idempotency;
use crate::service::idempotency::{self, Replayable, StoredResponse};
use crate::service::ServiceError;
use crate::AppState;

/// The request header.
pub const HEADER: &str = "idempotency-key";
/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

impl Idempotency {
    /// Reads the header of a request `method path` with `body`; `None` when absent.
    ///
    /// Errors: 400 `invalid_request` (field `Idempotency-Key`) when given twice (which one
    /// would the retry match?), empty, longer than [`MAX_KEY_LEN`] or not visible ASCII.
    pub fn from_headers(
        headers: &HeaderMap,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> Result<Option<Self>, ApiError> {
        let mut all = headers.get_all(HEADER).iter();
        let Some(raw) = all.next() else {
            return Ok(None);
        };
        if all.next().is_some() {
            return Err(ApiError::invalid(
                "Idempotency-Key",
                "Idempotency-Key is given more than once: send one",
            ));
        }
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
        Ok(Some(Self::new(key.to_owned(), method, path, body)))
    }

    /// The stored response for this key, if any, rendered.
    ///
    /// Errors: [`ApiError::IdempotencyKeyReused`] when the key was used for another request.
    pub async fn replay(&self, app: &AppState, org: OrgId) -> Result<Option<Response>, ApiError> {
        Ok(idempotency::replay_on(&app.db, org, self)
            .await?
            .map(render))
    }

    /// Stores `status` with `body` outside any transaction (for exec, which is not
    /// transactional). Returns `false` when another request with the same key stored first.
    pub async fn store(
        &self,
        app: &AppState,
        org: OrgId,
        status: StatusCode,
        body: &serde_json::Value,
    ) -> Result<bool, ApiError> {
        let response = StoredResponse {
            status: status.as_u16(),
            body: body.clone(),
        };
        Ok(idempotency::store_on(&app.db, org, self, &response).await?)
    }
}

/// The response to store for answering `status` with `body`.
///
/// Errors: [`ServiceError::Internal`] when `body` does not serialize.
pub fn stored<T: serde::Serialize>(
    status: StatusCode,
    body: &T,
) -> Result<StoredResponse, ServiceError> {
    Ok(StoredResponse {
        status: status.as_u16(),
        body: serde_json::to_value(body).map_err(|e| ServiceError::Internal(e.to_string()))?,
    })
}

/// Answers a stored response: its status and its JSON body.
pub fn render(response: StoredResponse) -> Response {
    let status = StatusCode::from_u16(response.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(response.body)).into_response()
}

/// Answers what a replayable use case answered, fresh or replayed.
pub fn render_replayable<T>(outcome: Replayable<T>) -> Response {
    render(outcome.into_response())
}
