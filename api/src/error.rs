//! The API's error type and its one mapping to HTTP: `{"error":{"code","message"[,"field"]}}`.
//! Status mapping lives here only (STYLE.md habit 4).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_schemas::{SandboxId, SandboxState};
use berth_store::StoreError;
use serde_json::json;
use tracing::error;

use crate::service::ServiceError;

/// Every error an API route returns.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 401 `unauthorized`: no bearer key, or one that matches no live key.
    #[error("missing or invalid API key")]
    Unauthorized,
    /// 403 `forbidden`: the key is valid but may not use this route.
    #[error("{0}")]
    Forbidden(String),
    /// 429 `quota_exceeded`: the org's quota `limit` (e.g. `max_running`) would be passed.
    #[error("org quota {limit} = {value} reached")]
    QuotaExceeded {
        /// The quota's column name (`max_running`, …).
        limit: &'static str,
        /// The org's value of that quota.
        value: i64,
    },
    /// 429 `rate_limited`: the client address's or the key's request rate is spent; the
    /// response carries `Retry-After` (seconds).
    #[error("too many requests ({scope}); retry after {retry_after_secs} s")]
    RateLimited {
        /// Which rate: `per_ip`, `per_key` or `key_lookups_per_ip`.
        scope: &'static str,
        /// Whole seconds until a request would pass.
        retry_after_secs: u64,
    },
    /// 429 `too_many_concurrent`: the org already holds its cap of concurrent streams,
    /// transfers or execs on this API process.
    #[error("the org already holds {value} of {limit}")]
    TooManyConcurrent {
        /// The cap's name (`max_concurrent_streams`, `max_concurrent_transfers`,
        /// `max_concurrent_execs`).
        limit: &'static str,
        /// Its value.
        value: usize,
    },
    /// 413 `payload_too_large`: a file over the API's size limit. (A request body over
    /// [`crate::http::body::MAX_BODY_BYTES`] gets the same answer from [`json_errors`].)
    #[error("the file is larger than the {limit}-byte limit")]
    PayloadTooLarge {
        /// The limit, in bytes.
        limit: u64,
    },
    /// 404 `not_found`: no such resource in the caller's org (another org's looks the same).
    #[error("{0} not found")]
    NotFound(String),
    /// 400 `invalid_request`: malformed JSON or a value out of range; `field` names it.
    #[error("{message}")]
    InvalidRequest {
        /// The offending JSON field or query parameter; `None` when the body as a whole is bad.
        field: Option<String>,
        /// What is wrong, for the client.
        message: String,
    },
    /// 422 `unknown_template`.
    #[error("unknown template {0:?}")]
    UnknownTemplate(String),
    /// 409 `template_not_ready` / `template_exists`: see
    /// [`crate::service::ServiceError::TemplateConflict`]; carries the template's state.
    #[error("{message}")]
    TemplateConflict {
        /// The stable error code.
        code: &'static str,
        /// The template's state.
        state: String,
        /// What conflicted.
        message: String,
    },
    /// 409 `last_key`: a revocation of the org's last working key (see
    /// [`crate::service::keys::revoke_key`]).
    #[error("{0}")]
    LastKey(String),
    /// 422 `idempotency_key_reused`: the key was used for a different request.
    #[error("Idempotency-Key {0:?} was used for a different request")]
    IdempotencyKeyReused(String),
    /// 503 `no_capacity`: no ready host with a recent heartbeat has the headroom.
    #[error("no host has capacity for {vcpus} vCPUs and {memory_mib} MiB")]
    NoCapacity {
        /// The vCPUs asked for (whole vCPUs).
        vcpus: u32,
        /// The memory asked for, in MiB.
        memory_mib: u32,
    },
    /// 503 `unavailable`: hosts with room exist but none can take a sandbox now (stale
    /// heartbeats after a control-plane outage, or degraded hosts); the response carries
    /// `Retry-After` (seconds). Never said of a fleet that is really full (`no_capacity`).
    #[error("{message}")]
    Unavailable {
        /// What made the hosts with room unusable.
        message: String,
        /// Whole seconds until a retry may succeed.
        retry_after_secs: u64,
    },
    /// 503 `no_capacity` for a fork whose clones do not all fit; the response carries
    /// `Retry-After` (seconds) and the message counts the fork's sandboxes.
    #[error("{message}")]
    ForkNoCapacity {
        /// What did not fit, for the client.
        message: String,
        /// Whole seconds until a retry may find the room.
        retry_after_secs: u64,
    },
    /// 409 `snapshot_unavailable`: a start of a clone that never ran boots from its snapshot
    /// again, and that snapshot is no longer `ready`; carries the sandbox's state.
    #[error("{message}")]
    SnapshotUnavailable {
        /// The sandbox's state now.
        state: SandboxState,
        /// What is missing.
        message: String,
    },
    /// 409 `conflict`: a conflicting transition is in flight; carries the current state.
    #[error("{message}")]
    Conflict {
        /// The sandbox's state now, returned so the client can decide what to do.
        state: SandboxState,
        /// What conflicted, for the client.
        message: String,
    },
    /// 409 `conflict` for a host operator action; carries the host's state.
    #[error("{message}")]
    HostConflict {
        /// The host's state now, in its API spelling (`ready`, `draining`, …).
        state: String,
        /// What conflicted, for the operator.
        message: String,
    },
    /// 409 `conflict` of a wait (`GET …/wait`, `?wait=` on a create or lifecycle request):
    /// the sandbox settled in `state`, from which it cannot reach the target; carries the
    /// state and the sandbox's id (a create's client learns it here).
    #[error("{message}")]
    WaitConflict {
        /// The sandbox's state now.
        state: SandboxState,
        /// The sandbox waited on.
        sandbox_id: SandboxId,
        /// What happened, for the client.
        message: String,
    },
    /// 408 `timeout`: a wait's timeout passed before the sandbox reached the target; carries
    /// its state and id (the request it followed was accepted: waiting again is safe).
    #[error("{message}")]
    WaitTimeout {
        /// The sandbox's state when the wait ended.
        state: SandboxState,
        /// The sandbox waited on.
        sandbox_id: SandboxId,
        /// What happened, for the client.
        message: String,
    },
    /// A fenced write found the sandbox moved on (someone else's transition won): 409
    /// `conflict`; the client reads the sandbox again.
    #[error("{0}")]
    Fenced(String),
    /// 503 `host_unavailable`: the sandbox's host did not answer.
    #[error("host unavailable: {0}")]
    HostUnavailable(String),
    /// 502 `agent_error`: the in-sandbox agent failed.
    #[error("agent error: {0}")]
    Agent(String),
    /// 500 `internal`: logged with its cause; the client sees no detail.
    #[error("internal error")]
    Internal(String),
    /// 503 `not_configured`: a feature the operator has not configured (previews without a
    /// preview secret).
    #[error("{0}")]
    NotConfigured(String),
}

impl ApiError {
    /// The HTTP status and the stable error code.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            ApiError::QuotaExceeded { .. } => (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded"),
            ApiError::RateLimited { .. } => (StatusCode::TOO_MANY_REQUESTS, "rate_limited"),
            ApiError::TooManyConcurrent { .. } => {
                (StatusCode::TOO_MANY_REQUESTS, "too_many_concurrent")
            }
            ApiError::PayloadTooLarge { .. } => {
                (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large")
            }
            ApiError::InvalidRequest { .. } => (StatusCode::BAD_REQUEST, "invalid_request"),
            ApiError::UnknownTemplate(_) => (StatusCode::UNPROCESSABLE_ENTITY, "unknown_template"),
            ApiError::TemplateConflict { code, .. } => (StatusCode::CONFLICT, code),
            ApiError::IdempotencyKeyReused(_) => {
                (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused")
            }
            ApiError::LastKey(_) => (StatusCode::CONFLICT, "last_key"),
            ApiError::NoCapacity { .. } | ApiError::ForkNoCapacity { .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, "no_capacity")
            }
            ApiError::SnapshotUnavailable { .. } => (StatusCode::CONFLICT, "snapshot_unavailable"),
            ApiError::Unavailable { .. } => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ApiError::Conflict { .. }
            | ApiError::HostConflict { .. }
            | ApiError::Fenced(_)
            | ApiError::WaitConflict { .. } => (StatusCode::CONFLICT, "conflict"),
            ApiError::WaitTimeout { .. } => (StatusCode::REQUEST_TIMEOUT, "timeout"),
            ApiError::HostUnavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "host_unavailable"),
            ApiError::Agent(_) => (StatusCode::BAD_GATEWAY, "agent_error"),
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            ApiError::NotConfigured(_) => (StatusCode::SERVICE_UNAVAILABLE, "not_configured"),
        }
    }

    /// A 400 naming `field`.
    pub fn invalid(field: &str, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            field: Some(field.to_owned()),
            message: message.into(),
        }
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        match e {
            ServiceError::NotFound(what) => ApiError::NotFound(what),
            ServiceError::QuotaExceeded { limit, value } => {
                ApiError::QuotaExceeded { limit, value }
            }
            ServiceError::UnknownTemplate(name) => ApiError::UnknownTemplate(name),
            ServiceError::TemplateConflict {
                code,
                state,
                message,
            } => ApiError::TemplateConflict {
                code,
                state,
                message,
            },
            ServiceError::IdempotencyKeyReused(key) => ApiError::IdempotencyKeyReused(key),
            e @ ServiceError::LastKey(_) => ApiError::LastKey(e.to_string()),
            ServiceError::NoCapacity { vcpus, memory_mib } => {
                ApiError::NoCapacity { vcpus, memory_mib }
            }
            ServiceError::Unavailable {
                message,
                retry_after,
            } => ApiError::Unavailable {
                message,
                retry_after_secs: retry_after.as_secs_f64().ceil().max(1.0) as u64,
            },
            e @ ServiceError::ForkNoCapacity { retry_after, .. } => ApiError::ForkNoCapacity {
                message: e.to_string(),
                retry_after_secs: retry_after.as_secs_f64().ceil().max(1.0) as u64,
            },
            ServiceError::SnapshotUnavailable { state, message } => {
                ApiError::SnapshotUnavailable { state, message }
            }
            ServiceError::Conflict { state, message } => ApiError::Conflict { state, message },
            ServiceError::HostConflict { state, message }
            | ServiceError::SnapshotConflict { state, message } => {
                ApiError::HostConflict { state, message }
            }
            e @ ServiceError::TooManyWebhooks { .. } => ApiError::invalid("url", e.to_string()),
            ServiceError::InvalidRequest { field, message } => ApiError::invalid(field, message),
            e @ ServiceError::WaitConflict { sandbox, state, .. } => ApiError::WaitConflict {
                state,
                sandbox_id: sandbox,
                message: e.to_string(),
            },
            e @ ServiceError::WaitTimeout { sandbox, state, .. } => ApiError::WaitTimeout {
                state,
                sandbox_id: sandbox,
                message: e.to_string(),
            },
            ServiceError::Internal(cause) => ApiError::Internal(cause),
            ServiceError::Database(e) => e.into(),
            ServiceError::Store(e) => e.into(),
        }
    }
}

/// The store's typed errors: a fence miss is a 409 and a missing row a 404, never a 500.
impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Fenced { .. } => ApiError::Fenced(e.to_string()),
            StoreError::NotFound { what, id } => ApiError::NotFound(format!("{what} {id}")),
            StoreError::NoCapacity { need, .. } => ApiError::NoCapacity {
                vcpus: need.vcpus,
                memory_mib: need.memory_mib,
            },
            StoreError::Corrupt { .. } | StoreError::Database { .. } => {
                ApiError::Internal(e.to_string())
            }
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        ApiError::Internal(format!("database: {e}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        if let ApiError::Internal(cause) = &self {
            error!(%cause, "internal error");
        }
        let mut body = json!({ "code": code, "message": self.to_string() });
        match &self {
            ApiError::InvalidRequest {
                field: Some(field), ..
            } => body["field"] = json!(field),
            ApiError::Conflict { state, .. } | ApiError::SnapshotUnavailable { state, .. } => {
                body["state"] = json!(state)
            }
            ApiError::WaitConflict {
                state, sandbox_id, ..
            }
            | ApiError::WaitTimeout {
                state, sandbox_id, ..
            } => {
                body["state"] = json!(state);
                body["sandbox_id"] = json!(sandbox_id);
            }
            ApiError::HostConflict { state, .. } => body["state"] = json!(state),
            ApiError::TemplateConflict { state, .. } => body["state"] = json!(state),
            ApiError::QuotaExceeded { limit, value } => {
                body["limit"] = json!(limit);
                body["value"] = json!(value);
            }
            ApiError::TooManyConcurrent { limit, value } => {
                body["limit"] = json!(limit);
                body["value"] = json!(value);
            }
            ApiError::RateLimited { scope, .. } => body["limit"] = json!(scope),
            ApiError::PayloadTooLarge { limit } => body["limit"] = json!(limit),
            _ => {}
        }
        let mut response = (status, Json(json!({ "error": body }))).into_response();
        if let ApiError::RateLimited {
            retry_after_secs, ..
        }
        | ApiError::Unavailable {
            retry_after_secs, ..
        }
        | ApiError::ForkNoCapacity {
            retry_after_secs, ..
        } = &self
        {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(*retry_after_secs),
            );
        }
        response
    }
}

/// Gives every error response the JSON error shape: axum's own rejections (405 method not
/// allowed, 413 body too large, a query that does not parse) answer plain text or nothing. A
/// 413 gets the `limit` in bytes, as [`ApiError::PayloadTooLarge`] has it.
pub async fn json_errors(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let response = next.run(req).await;
    // A preview's answer is the sandbox's own (or a page for a browser): left alone.
    if response
        .extensions()
        .get::<crate::preview::page::PreviewResponse>()
        .is_some()
    {
        return response;
    }
    let (status, code, message, parts) = match plain_error(response).await {
        Ok(plain) => plain,
        Err(passed) => return passed,
    };
    let mut body = json!({ "code": code, "message": message });
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        // The router's one body limit (a streamed upload answers its own 413 in JSON).
        body["limit"] = json!(crate::http::body::MAX_BODY_BYTES);
    }
    let mut fixed = (status, Json(json!({ "error": body }))).into_response();
    for (name, value) in parts.headers.iter() {
        if name != axum::http::header::CONTENT_TYPE && name != axum::http::header::CONTENT_LENGTH {
            fixed.headers_mut().insert(name.clone(), value.clone());
        }
    }
    fixed
}

/// An error response that is not JSON (axum's own rejections: 405, 413, 415, a query that
/// does not parse), taken apart for a surface to answer in its own error shape: its status, a
/// `code` for it (`method_not_allowed`, `payload_too_large`, `unsupported_media_type`,
/// `invalid_request`, `internal`), its text (at most 64 KiB read; the status's reason when
/// empty) and its head. A success or a JSON answer comes back unchanged as `Err`.
pub(crate) async fn plain_error(
    response: Response,
) -> Result<
    (
        StatusCode,
        &'static str,
        String,
        axum::http::response::Parts,
    ),
    Response,
> {
    let status = response.status();
    let is_json = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return Err(response);
    }
    let code = match status {
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        s if s.is_client_error() => "invalid_request",
        _ => "internal",
    };
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_default();
    let message = match String::from_utf8_lossy(&text).trim() {
        // axum's "Failed to buffer the request body: length limit exceeded", in words.
        _ if status == StatusCode::PAYLOAD_TOO_LARGE => format!(
            "the request body is larger than the {}-byte limit",
            crate::http::body::MAX_BODY_BYTES
        ),
        "" => status.canonical_reason().unwrap_or("error").to_lowercase(),
        t => t.to_owned(),
    };
    Ok((status, code, message, parts))
}

#[cfg(test)]
mod tests {
    use berth_schemas::wire::Resources;
    use berth_schemas::{Generation, HostId, SandboxId};
    use berth_store::Op;

    use super::*;

    #[test]
    fn store_errors_map_to_409_404_503_and_only_the_rest_to_500() {
        let status = |e: StoreError| ApiError::from(e).status_and_code();
        assert_eq!(
            status(StoreError::Fenced {
                sandbox: SandboxId::new(),
                expected: Generation(3),
            }),
            (StatusCode::CONFLICT, "conflict"),
            "a fence miss is a conflict, never a 500"
        );
        assert_eq!(
            status(StoreError::NotFound {
                what: "host",
                id: "x".into(),
            }),
            (StatusCode::NOT_FOUND, "not_found")
        );
        assert_eq!(
            status(StoreError::NoCapacity {
                host: HostId::new(),
                need: Resources {
                    vcpus: 1,
                    memory_mib: 512,
                },
            }),
            (StatusCode::SERVICE_UNAVAILABLE, "no_capacity")
        );
        assert_eq!(
            status(StoreError::Database {
                op: Op::SandboxLock,
                source: sqlx::Error::PoolTimedOut,
            }),
            (StatusCode::INTERNAL_SERVER_ERROR, "internal")
        );
    }
}
