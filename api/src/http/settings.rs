//! The settings and waiting routes of a sandbox: `PATCH /v1/sandboxes/{id}`,
//! `POST /v1/sandboxes/{id}/renew` and `GET /v1/sandboxes/{id}/wait`, and the `?wait=`
//! parameter the create and lifecycle routes share ([`WaitQuery`]).

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use berth_schemas::state::WaitTarget;
use berth_schemas::SandboxId;
use chrono::Utc;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::events::StreamShutdown;
use super::extract::{NoParams, StrictQuery};
use super::idempotency::{render_replayable, stored, Idempotency};
use super::sandboxes::parse_id;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::limits::{ConcurrencyPermit, Concurrent};
use crate::model::settings::{PatchSandbox, RenewSandbox};
use crate::model::Sandbox;
use crate::service::wait::{DEFAULT_WAIT_TIMEOUT, MAX_WAIT_TIMEOUT};
use crate::service::{settings, wait};
use crate::AppState;

/// `PATCH /v1/sandboxes/{id}`
#[utoipa::path(patch, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    request_body = PatchSandbox,
    description = "Changes a sandbox's settings: `metadata` is merged (a `null` value deletes its key); `auto_stop_minutes`, `auto_delete_minutes` and `expires_at` are set, or cleared by `null`; `on_expiry` is set. A changed `auto_stop_minutes` counts from now (the idle clock is re-armed); a changed `auto_delete_minutes` too. Emits a `sandbox.updated` event naming the fields. Takes an `Idempotency-Key`.",
    responses(
        (status = 200, description = "The sandbox as it is now (an empty body changes nothing)", body = Sandbox),
        (status = 400, description = "`invalid_request`: an unknown field, minutes out of range, an `expires_at` in the past or more than a year ahead, metadata that is not string-or-null valued or would exceed 64 keys or 256 bytes per key or value (the field is named), or a query parameter (named; the route takes none)"),
        (status = 404, description = "`not_found` (also another org's sandbox)"),
        (status = 409, description = "`conflict`: the sandbox is being deleted or deleted; `state` is its state"),
        (status = 422, description = "`idempotency_key_reused`"),
    ), security(("bearer" = [])))]
pub async fn patch(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let idem = Idempotency::from_headers(&headers, "PATCH", &format!("/v1/sandboxes/{id}"), &body)?;
    let id = parse_id(&id)?;
    let patch: PatchSandbox = super::body::json(&body)?;
    let patch = patch.validate(Utc::now())?;
    let outcome = settings::patch(&app.db, caller.org_id, id, patch, idem.as_ref(), |s| {
        stored(StatusCode::OK, s)
    })
    .await?;
    Ok(render_replayable(outcome))
}

/// `POST /v1/sandboxes/{id}/renew`
#[utoipa::path(post, path = "/v1/sandboxes/{id}/renew", tag = "sandboxes", params(("id" = String, Path)),
    request_body = RenewSandbox,
    description = "Moves the sandbox's expiry: to `expires_at`, or `extend_seconds` past its current expiry (from now when it has none or it passed). Emits a `sandbox.updated` event. Takes an `Idempotency-Key`.",
    responses(
        (status = 200, description = "The sandbox with its new `expires_at`", body = Sandbox),
        (status = 400, description = "`invalid_request`: neither or both fields, an `expires_at` in the past, an expiry more than a year ahead, or a query parameter (named; the route takes none)"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the sandbox is being deleted or deleted"),
    ), security(("bearer" = [])))]
pub async fn renew(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let path = format!("/v1/sandboxes/{id}/renew");
    let idem = Idempotency::from_headers(&headers, "POST", &path, &body)?;
    let id = parse_id(&id)?;
    let renew: RenewSandbox = super::body::json(&body)?;
    let renewal = renew.validate(Utc::now())?;
    let outcome = settings::renew(&app.db, caller.org_id, id, renewal, idem.as_ref(), |s| {
        stored(StatusCode::OK, s)
    })
    .await?;
    Ok(render_replayable(outcome))
}

/// `?wait=` and `?timeout=` of the create and lifecycle routes. Unknown parameters are refused.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// Answer only once the sandbox is in this state (`running`, `stopped` or `deleted`):
    /// 200 with the sandbox, 409 when it settles where it cannot get there, 408 on timeout.
    pub wait: Option<String>,
    /// How long `wait` may take: `30s`, `2m`, or seconds; default 30 s, at most 5 minutes.
    pub timeout: Option<String>,
}

/// A parsed wait: the target and how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitFor {
    /// The state waited for.
    pub target: WaitTarget,
    /// How long at most.
    pub timeout: Duration,
}

/// Parses a wait `timeout`: a `humantime` duration (`30s`, `1m 30s`) or whole seconds;
/// [`DEFAULT_WAIT_TIMEOUT`] when absent.
///
/// Errors: 400 naming `timeout` when it does not parse or exceeds [`MAX_WAIT_TIMEOUT`].
pub fn parse_timeout(raw: Option<&str>) -> Result<Duration, ApiError> {
    let Some(raw) = raw.map(str::trim) else {
        return Ok(DEFAULT_WAIT_TIMEOUT);
    };
    let timeout = match raw.parse::<u64>() {
        Ok(secs) => Duration::from_secs(secs),
        Err(_) => humantime::parse_duration(raw).map_err(|e| {
            ApiError::invalid("timeout", format!("timeout {raw:?} is not a duration: {e}"))
        })?,
    };
    if timeout > MAX_WAIT_TIMEOUT {
        return Err(ApiError::invalid(
            "timeout",
            format!(
                "timeout is at most {}",
                humantime::format_duration(MAX_WAIT_TIMEOUT)
            ),
        ));
    }
    Ok(timeout)
}

/// Parses a wait target (`running`, `stopped`, `deleted`) given as `field`.
///
/// Errors: 400 naming `field`.
pub fn parse_target(field: &str, raw: &str) -> Result<WaitTarget, ApiError> {
    raw.parse().map_err(|_| {
        ApiError::invalid(
            field,
            format!("{field} must be running, stopped or deleted, got {raw:?}"),
        )
    })
}

impl WaitQuery {
    /// The wait asked for, if any.
    ///
    /// Errors: 400 naming `wait` or `timeout`; a `timeout` without `wait`.
    pub fn parse(&self) -> Result<Option<WaitFor>, ApiError> {
        let Some(target) = &self.wait else {
            if self.timeout.is_some() {
                return Err(ApiError::invalid("timeout", "timeout needs wait"));
            }
            return Ok(None);
        };
        Ok(Some(WaitFor {
            target: parse_target("wait", target)?,
            timeout: parse_timeout(self.timeout.as_deref())?,
        }))
    }
}

/// The server's shutdown token (a never-cancelled one where none is installed).
pub(crate) fn stop_token(shutdown: Option<Extension<StreamShutdown>>) -> CancellationToken {
    shutdown.map(|Extension(s)| s.0).unwrap_or_default()
}

/// A slot of the org's concurrent waits, taken before the request it follows changes
/// anything (so a create never commits and then answers 429).
///
/// Errors: 429 `too_many_concurrent` (`max_concurrent_waits`).
pub(crate) fn wait_slot(
    app: &AppState,
    caller: &Caller,
    wait: Option<WaitFor>,
) -> Result<Option<(WaitFor, ConcurrencyPermit)>, ApiError> {
    wait.map(|w| Ok((w, app.guards.concurrency(caller.org_id, Concurrent::Waits)?)))
        .transpose()
}

/// Waits as `wait` says on the caller's sandbox `id` and answers it with 200; `_slot` is held
/// until then.
pub(crate) async fn answer_when(
    app: &AppState,
    caller: &Caller,
    id: SandboxId,
    (wait, _slot): (WaitFor, ConcurrencyPermit),
    stop: &CancellationToken,
) -> Result<Response, ApiError> {
    let sandbox = wait::wait(
        &app.db,
        &app.watch,
        caller.org_id,
        id,
        wait.target,
        wait.timeout,
        stop,
    )
    .await?;
    Ok((StatusCode::OK, Json(sandbox)).into_response())
}

/// `GET /v1/sandboxes/{id}/wait` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct WaitStateQuery {
    /// The state to wait for: `running`, `stopped` or `deleted`.
    pub state: String,
    /// How long at most: `30s`, `2m`, or seconds; default 30 s, at most 5 minutes.
    pub timeout: Option<String>,
}

/// `GET /v1/sandboxes/{id}/wait`
#[utoipa::path(get, path = "/v1/sandboxes/{id}/wait", tag = "sandboxes",
    params(("id" = String, Path), WaitStateQuery),
    description = "Answers as soon as the sandbox is in `state`, woken by the database's notification of its state change (no polling). A sandbox that settles elsewhere (`running`, `stopped`, `failed-start` other than the target) or is being deleted cannot get there without a new request: 409 at once (unless its own auto-stop, auto-delete or expiry will take it there: then the wait holds). The same wait is `?wait=<state>&timeout=` on `POST /v1/sandboxes` and the lifecycle requests.",
    responses(
        (status = 200, description = "The sandbox, in `state`", body = Sandbox),
        (status = 400, description = "`invalid_request`: a `state` other than running, stopped or deleted; a `timeout` that does not parse or exceeds 5 minutes"),
        (status = 404, description = "`not_found`"),
        (status = 408, description = "`timeout`: not there within `timeout`; `state` is its state, `sandbox_id` its id"),
        (status = 409, description = "`conflict`: settled where it cannot get there; `state` is its state, `sandbox_id` its id"),
        (status = 429, description = "`too_many_concurrent`: the org holds `max_concurrent_waits` open waits on this API process"),
    ), security(("bearer" = [])))]
pub async fn wait_for(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    shutdown: Option<Extension<StreamShutdown>>,
    query: Result<Query<WaitStateQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let Query(q) = query.map_err(super::extract::query_error)?;
    let wait = WaitFor {
        target: parse_target("state", &q.state)?,
        timeout: parse_timeout(q.timeout.as_deref())?,
    };
    let slot = wait_slot(&app, &caller, Some(wait))?.expect("a wait was given");
    answer_when(&app, &caller, id, slot, &stop_token(shutdown)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_parse_as_durations_or_seconds_within_the_maximum() {
        assert_eq!(parse_timeout(None).unwrap(), DEFAULT_WAIT_TIMEOUT);
        assert_eq!(parse_timeout(Some("30s")).unwrap(), Duration::from_secs(30));
        assert_eq!(parse_timeout(Some("45")).unwrap(), Duration::from_secs(45));
        assert_eq!(
            parse_timeout(Some("1m 30s")).unwrap(),
            Duration::from_secs(90)
        );
        assert_eq!(parse_timeout(Some("0s")).unwrap(), Duration::ZERO);
        for bad in ["soon", "-1", "301s", "6m", "1h"] {
            assert!(parse_timeout(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_wait_query_needs_a_known_target_and_a_timeout_only_with_it() {
        let q = |wait: Option<&str>, timeout: Option<&str>| WaitQuery {
            wait: wait.map(str::to_owned),
            timeout: timeout.map(str::to_owned),
        };
        assert_eq!(q(None, None).parse().unwrap(), None);
        assert_eq!(
            q(Some("running"), Some("5s")).parse().unwrap(),
            Some(WaitFor {
                target: WaitTarget::Running,
                timeout: Duration::from_secs(5)
            })
        );
        assert!(q(Some("starting"), None).parse().is_err());
        assert!(q(None, Some("5s")).parse().is_err());
    }
}
