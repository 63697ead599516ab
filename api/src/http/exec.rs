//! `POST /v1/sandboxes/{id}/exec`: runs a command inside a running sandbox.
//!
//! Path: API → NATS request/reply on `{p}.agent.<host>` ([`AgentOp::Exec`]) → hostd → the
//! sandbox's agent. The API never reaches a sandbox address directly.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_schemas::wire::{self, AgentFailure, AgentOp, AgentReply, AgentRequest, ExecSpec};
use berth_schemas::{HostId, SandboxId};
use tracing::instrument;

use super::extract::{NoParams, StrictQuery};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::http::idempotency::Idempotency;
use crate::limits::Concurrent;
use crate::model::{ExecBody, ExecOutput, Sandbox};
use crate::AppState;

/// Timeout when the request names none, in milliseconds.
pub const DEFAULT_EXEC_TIMEOUT_MS: u64 = 30_000;
/// The longest timeout a request may ask for, in milliseconds (10 minutes).
pub const MAX_EXEC_TIMEOUT_MS: u64 = 600_000;
/// Extra time the API waits for the host's reply beyond the exec timeout.
pub const EXEC_REPLY_GRACE: Duration = Duration::from_secs(5);
/// The most argv entries an exec may carry.
pub const MAX_ARGV: usize = 4096;
/// The most bytes an exec's `stdin` may carry.
pub const MAX_STDIN_BYTES: usize = 256 * 1024;
/// The most bytes `cmd`, `env`, `cwd` and `stdin` may carry together: the request travels to
/// the host as one NATS message (1 MiB by default), with room to spare.
pub const MAX_EXEC_REQUEST_BYTES: usize = 512 * 1024;

/// `POST /v1/sandboxes/{id}/exec`
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", params(("id" = String, Path)),
    request_body = ExecBody,
    responses(
        (status = 200, description = "The process ended (or was killed at its timeout)", body = ExecOutput),
        (status = 400, description = "`invalid_request`: empty `cmd`, a timeout out of range, or a query parameter (named; the route takes none)"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the sandbox is not running, or stopped or was deleted during the exec"),
        (status = 429, description = "`too_many_concurrent`: the org's execs are at their cap"),
        (status = 502, description = "`agent_error`: the in-sandbox agent failed"),
        (status = 503, description = "`host_unavailable`: the host did not answer"),
    ), security(("bearer" = [])))]
#[instrument(skip_all, fields(org_id = %caller.org_id, sandbox_id = %id))]
pub async fn exec(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
    headers: HeaderMap,
    raw: Bytes,
) -> Result<Response, ApiError> {
    let path = format!("/v1/sandboxes/{id}/exec");
    let idem = Idempotency::from_headers(&headers, "POST", &path, &raw)?;
    if let Some(idem) = &idem {
        if let Some(stored) = idem.replay(&app, caller.org_id).await? {
            return Ok(stored);
        }
    }
    let body: ExecBody = super::body::json(&raw)?;
    let spec = exec_spec(body)?;
    let timeout_ms = spec.timeout_ms;
    let _permit = app.guards.concurrency(caller.org_id, Concurrent::Execs)?;
    let (sandbox, host) = running_host(&app, &caller, &id).await?;
    let started = std::time::Instant::now();
    let wait = Duration::from_millis(timeout_ms) + EXEC_REPLY_GRACE;
    let reply = run(&app, host, sandbox.id, spec, wait).await?;
    let outcome = match &reply {
        Ok(_) => "finished",
        Err(_) => "failed",
    };
    metrics::counter!("berth_exec_total", "outcome" => outcome).increment(1);
    metrics::histogram!("berth_exec_duration_seconds").record(started.elapsed().as_secs_f64());
    match reply {
        Ok(output) => {
            let output =
                serde_json::to_value(output).map_err(|e| ApiError::Internal(e.to_string()))?;
            if let Some(idem) = &idem {
                // Exec is not transactional: store after it ran. A lost race stores nothing.
                idem.store(&app, caller.org_id, StatusCode::OK, &output)
                    .await?;
            }
            Ok((StatusCode::OK, Json(output)).into_response())
        }
        Err(AgentFailure::NotFound | AgentFailure::NotRunning) => {
            Err(stopped_meanwhile(&app, &caller, &sandbox).await)
        }
        Err(AgentFailure::Agent(message)) => Err(ApiError::Agent(message)),
        Err(other) => Err(ApiError::Agent(format!("{other:?}"))),
    }
}

/// Validates an exec body into what the agent runs.
///
/// Errors: [`ApiError::InvalidRequest`] naming the field.
pub(crate) fn exec_spec(body: ExecBody) -> Result<ExecSpec, ApiError> {
    if body.cmd.is_empty() || body.cmd.len() > MAX_ARGV {
        return Err(ApiError::invalid(
            "cmd",
            format!("cmd must hold 1 to {MAX_ARGV} arguments"),
        ));
    }
    let timeout_ms = body.timeout_ms.unwrap_or(DEFAULT_EXEC_TIMEOUT_MS);
    if !(1..=MAX_EXEC_TIMEOUT_MS).contains(&timeout_ms) {
        return Err(ApiError::invalid(
            "timeout_ms",
            format!("timeout_ms must be between 1 and {MAX_EXEC_TIMEOUT_MS}"),
        ));
    }
    if let Some(cwd) = &body.cwd {
        if !cwd.starts_with('/') {
            return Err(ApiError::invalid("cwd", "cwd must be an absolute path"));
        }
    }
    let stdin = body.stdin.unwrap_or_default().into_bytes();
    if stdin.len() > MAX_STDIN_BYTES {
        return Err(ApiError::invalid(
            "stdin",
            format!("stdin must be at most {MAX_STDIN_BYTES} bytes"),
        ));
    }
    let env: Vec<(String, String)> = body.env.unwrap_or_default().into_iter().collect();
    if body.cmd.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::invalid(
            "cmd",
            "cmd arguments cannot contain NUL bytes",
        ));
    }
    if body.cmd[0].is_empty() {
        return Err(ApiError::invalid(
            "cmd",
            "cmd[0] names the program and cannot be empty",
        ));
    }
    if env
        .iter()
        .any(|(k, v)| k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0'))
    {
        return Err(ApiError::invalid(
            "env",
            "env names are non-empty without '=' or NUL; values hold no NUL",
        ));
    }
    let total = body.cmd.iter().map(String::len).sum::<usize>()
        + env.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
        + body.cwd.as_ref().map_or(0, String::len)
        + stdin.len();
    if total > MAX_EXEC_REQUEST_BYTES {
        return Err(ApiError::invalid(
            "cmd",
            format!(
                "cmd, env, cwd and stdin together must be at most {MAX_EXEC_REQUEST_BYTES} bytes; \
                 upload larger input with PUT /v1/sandboxes/{{id}}/files"
            ),
        ));
    }
    Ok(ExecSpec {
        argv: body.cmd,
        env,
        cwd: body.cwd,
        stdin,
        timeout_ms,
    })
}

/// 409 for a sandbox that does not run.
pub(crate) fn not_running(sandbox: &Sandbox) -> ApiError {
    ApiError::Conflict {
        state: sandbox.state,
        message: format!("exec needs a running sandbox; it is {}", sandbox.state),
    }
}

/// 409 for a sandbox that stopped (or was deleted) while a request ran in it, with the state
/// it has now; 404 when it is gone altogether.
pub(crate) async fn stopped_meanwhile(
    app: &AppState,
    caller: &Caller,
    sandbox: &Sandbox,
) -> ApiError {
    match crate::http::sandboxes::fetch(app, caller, sandbox.id).await {
        Ok(now) => ApiError::Conflict {
            state: now.state,
            message: format!("the sandbox stopped during the exec; it is {}", now.state),
        },
        Err(e) => e,
    }
}

/// The caller's sandbox `id` and its host, when it runs; marks it active.
///
/// Errors: [`ApiError::NotFound`]; [`ApiError::Conflict`] when it does not run.
pub(crate) async fn running_host(
    app: &AppState,
    caller: &Caller,
    id: &str,
) -> Result<(Sandbox, HostId), ApiError> {
    crate::http::sandboxes::running_and_active(app, caller, id, not_running).await
}

/// Runs an exec through the host's agent subject (`{p}.agent.<host>`), which also reports OOM
/// kills. Returns the process's output, or why the host or agent did not run it.
///
/// Errors: [`ApiError::HostUnavailable`]; [`ApiError::Internal`] for an undecodable reply or
/// one of another kind.
pub(crate) async fn run(
    app: &AppState,
    host: HostId,
    sandbox: SandboxId,
    spec: ExecSpec,
    wait: Duration,
) -> Result<Result<ExecOutput, AgentFailure>, ApiError> {
    let request = AgentRequest {
        sandbox_id: sandbox,
        op: AgentOp::Exec(spec),
    };
    let reply = app
        .nats
        .send_request(
            app.subjects.agent(host),
            async_nats::Request::new()
                .payload(wire::encode(&request).into())
                .timeout(Some(wait)),
        )
        .await
        .map_err(|e| crate::http::files::host_unavailable(host, wait, e))?;
    let reply: AgentReply = wire::decode(&reply.payload)
        .map_err(|e| ApiError::Internal(format!("exec reply from {host}: {e}")))?;
    match reply {
        AgentReply::Exec {
            exit_code,
            stdout,
            stderr,
            timed_out,
            oom_killed,
        } => Ok(Ok(ExecOutput {
            exit_code,
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            timed_out,
            oom_killed,
        })),
        AgentReply::Failed(failure) => Ok(Err(failure)),
        other => Err(ApiError::Internal(format!(
            "unexpected exec reply from {host}: {other:?}"
        ))),
    }
}
