//! `POST /v1/sandboxes/{id}/exec/stream`: runs a command and streams its output while it runs,
//! as newline-delimited JSON (`application/x-ndjson`):
//!
//! ```text
//! {"stdout":"one\n"}
//! {"stderr":"two\n"}
//! {"exit_code":3,"timed_out":false,"oom_killed":false}
//! ```
//!
//! The last line is the exit, or `{"error":{"code":…,"message":…}}` when the run broke off
//! after output had started; a failure before any output is an ordinary HTTP error. Output is
//! decoded as UTF-8 (invalid bytes replaced); a character split between two chunks is kept
//! whole.
//!
//! Path: the API subscribes to a fresh inbox, then publishes an [`AgentOp::ExecStream`] to
//! `{p}.agent.<host>` with the inbox as reply subject; hostd publishes the output as it
//! arrives, then the exit (see `berth_hostd::agent_ops`). Core NATS drops messages for a
//! subscriber that falls far behind, so a reader that can't keep up with a very chatty
//! process may miss output; the exit line still says how the process ended.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_schemas::wire::{self, AgentFailure, AgentOp, AgentReply, AgentRequest};
use futures::StreamExt;
use serde_json::json;
use tokio::time::Instant;
use tracing::instrument;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::http::exec::{exec_spec, not_running, running_host, EXEC_REPLY_GRACE};
use crate::model::ExecBody;
use crate::AppState;

/// `POST /v1/sandboxes/{id}/exec/stream`
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec/stream", params(("id" = String, Path)),
    request_body = ExecBody,
    responses(
        (status = 200, description = "NDJSON: `{\"stdout\":…}` / `{\"stderr\":…}` lines as output arrives, then `{\"exit_code\",\"timed_out\",\"oom_killed\"}`", content_type = "application/x-ndjson"),
        (status = 400, description = "`invalid_request`"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the sandbox is not running"),
        (status = 502, description = "`agent_error`"),
        (status = 503, description = "`host_unavailable`"),
    ), security(("bearer" = [])))]
#[instrument(skip_all, fields(org_id = %caller.org_id, sandbox_id = %id))]
pub async fn exec_stream(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, ApiError> {
    let Json(body) =
        Json::<ExecBody>::from_bytes(&raw).map_err(crate::http::extract::json_error)?;
    let spec = exec_spec(body)?;
    let (sandbox, host) = running_host(&app, &caller, &id).await?;
    let deadline = Instant::now() + Duration::from_millis(spec.timeout_ms) + EXEC_REPLY_GRACE;
    let unavailable = |what: String| ApiError::HostUnavailable(format!("host {host}: {what}"));

    let inbox = app.nats.new_inbox();
    let mut replies = app
        .nats
        .subscribe(inbox.clone())
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    let request = AgentRequest {
        sandbox_id: sandbox.id,
        op: AgentOp::ExecStream(spec),
    };
    app.nats
        .publish_with_reply(
            app.subjects.agent(host),
            inbox,
            wire::encode(&request).into(),
        )
        .await
        .map_err(|e| unavailable(e.to_string()))?;

    // The first message decides the status: a failure before any output is an HTTP error.
    let first = tokio::time::timeout_at(deadline, replies.next())
        .await
        .ok()
        .flatten()
        .ok_or_else(|| unavailable("no answer".into()))?;
    let first: AgentReply = wire::decode(&first.payload)
        .map_err(|e| ApiError::Internal(format!("exec reply from {host}: {e}")))?;
    if let AgentReply::Failed(failure) = first {
        return Err(match failure {
            AgentFailure::NotFound | AgentFailure::NotRunning => not_running(&sandbox),
            AgentFailure::Agent(message) => ApiError::Agent(message),
            other => ApiError::Agent(format!("{other:?}")),
        });
    }
    metrics::counter!("berth_exec_total", "outcome" => "streamed").increment(1);

    let state = Lines {
        replies,
        pending: Some(first),
        decoders: [Utf8Carry::default(), Utf8Carry::default()],
        deadline,
        done: false,
    };
    let lines = futures::stream::unfold(state, |mut state| async move {
        let line = state.next_line().await?;
        Some((Ok::<_, Infallible>(Bytes::from(line)), state))
    });
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

/// The state of one response stream.
struct Lines {
    replies: async_nats::Subscriber,
    pending: Option<AgentReply>,
    /// stdout, stderr.
    decoders: [Utf8Carry; 2],
    deadline: Instant,
    done: bool,
}

impl Lines {
    /// The next line(s) to send, or `None` after the last.
    async fn next_line(&mut self) -> Option<String> {
        loop {
            if self.done {
                return None;
            }
            let reply = match self.pending.take() {
                Some(reply) => reply,
                None => match tokio::time::timeout_at(self.deadline, self.replies.next()).await {
                    Ok(Some(message)) => match wire::decode::<AgentReply>(&message.payload) {
                        Ok(reply) => reply,
                        Err(e) => return self.end_with_error("internal", &e.to_string()),
                    },
                    _ => {
                        return self
                            .end_with_error("host_unavailable", "the host stopped answering")
                    }
                },
            };
            match reply {
                AgentReply::Output { fd, data } => {
                    let text = self.decode(fd, &data);
                    if !text.is_empty() {
                        return Some(text);
                    }
                }
                AgentReply::Exec {
                    exit_code,
                    stdout,
                    stderr,
                    timed_out,
                    oom_killed,
                } => {
                    self.done = true;
                    // Output carried by the exit itself (a host that could not stream).
                    let mut out = self.decode(1, &stdout);
                    out.push_str(&self.decode(2, &stderr));
                    for (i, name) in ["stdout", "stderr"].into_iter().enumerate() {
                        let rest = self.decoders[i].finish();
                        if !rest.is_empty() {
                            out.push_str(&line(json!({ name: rest })));
                        }
                    }
                    out.push_str(&line(json!({
                        "exit_code": exit_code,
                        "timed_out": timed_out,
                        "oom_killed": oom_killed,
                    })));
                    return Some(out);
                }
                AgentReply::Failed(failure) => {
                    return self.end_with_error("agent_error", &format!("{failure:?}"))
                }
                other => {
                    return self.end_with_error("internal", &format!("unexpected reply {other:?}"))
                }
            }
        }
    }

    /// `{"stdout":…}` / `{"stderr":…}` for the complete characters of `data`.
    fn decode(&mut self, fd: u8, data: &[u8]) -> String {
        let (index, name) = match fd {
            2 => (1, "stderr"),
            _ => (0, "stdout"),
        };
        let text = self.decoders[index].push(data);
        if text.is_empty() {
            String::new()
        } else {
            line(json!({ name: text }))
        }
    }

    fn end_with_error(&mut self, code: &str, message: &str) -> Option<String> {
        self.done = true;
        Some(line(json!({"error": {"code": code, "message": message}})))
    }
}

fn line(value: serde_json::Value) -> String {
    let mut text = value.to_string();
    text.push('\n');
    text
}

/// UTF-8 decoding across chunk boundaries: complete characters come out, an incomplete one at
/// the end waits for the next chunk; invalid bytes become U+FFFD.
#[derive(Debug, Default)]
struct Utf8Carry {
    pending: Vec<u8>,
}

impl Utf8Carry {
    fn push(&mut self, data: &[u8]) -> String {
        self.pending.extend_from_slice(data);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(text) => {
                    out.push_str(text);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(valid).expect("checked valid"));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[bad..];
                        }
                        // An incomplete character at the end: keep it for the next chunk.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// Whatever is left (an incomplete character at the very end), replaced.
    fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_character_split_between_chunks_is_kept_whole() {
        let mut d = Utf8Carry::default();
        let snow = "☃".as_bytes();
        assert_eq!(d.push(&[b'a', snow[0]]), "a");
        assert_eq!(d.push(&snow[1..]), "☃");
        assert_eq!(d.push(b"\xffb"), "\u{fffd}b");
        assert_eq!(d.push(&snow[..2]), "");
        assert_eq!(d.finish(), "\u{fffd}");
    }
}
