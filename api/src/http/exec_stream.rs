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
//! arrives, then the exit (see `berth_hostd::nats::agent`).
//!
//! # Flow control
//! The request is an [`AgentOp::ExecStreamWindowed`]: the host publishes at most
//! [`STREAM_WINDOW_CHUNKS`] output messages ahead of what this stream has taken, and the stream
//! credits them back ([`AgentOp::StreamCredit`]) as the response body is polled, i.e. as the
//! client reads. A client that stops reading stops the credits: the host stops reading the
//! agent and the process blocks on its full pipe, so the API holds at most a window of
//! output per stream (64 messages of at most 16 KiB: 1 MiB) whatever the process writes. The
//! window is sized so that a fast reader is not slowed: 50 MB of output took 1.6–2.0 s with a
//! window of 64 (as without flow control) and 2.7–3.6 s with 16. A reader stalled for the
//! host's stall timeout (60 s) ends its own stream; a client that goes away cancels it
//! ([`AgentOp::StreamCancel`]). Either way the process runs on to its `timeout_ms`.
//! Streams count against the org's `max_concurrent_streams` (429 `too_many_concurrent`).

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use berth_schemas::wire::{self, AgentFailure, AgentOp, AgentReply, AgentRequest};
use futures::StreamExt;
use serde_json::json;
use tokio::time::Instant;
use tracing::instrument;

use super::extract::{NoParams, StrictQuery};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::http::exec::{exec_spec, running_host, stopped_meanwhile, EXEC_REPLY_GRACE};
use crate::limits::{ConcurrencyPermit, Concurrent};
use crate::model::ExecBody;
use crate::AppState;

/// `POST /v1/sandboxes/{id}/exec/stream`
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec/stream", params(("id" = String, Path)),
    request_body = ExecBody,
    responses(
        (status = 200, description = "NDJSON: `{\"stdout\":…}` / `{\"stderr\":…}` lines as output arrives, then `{\"exit_code\",\"timed_out\",\"oom_killed\"}`", content_type = "application/x-ndjson"),
        (status = 400, description = "`invalid_request`: empty `cmd`, a timeout out of range, or a query parameter (named; the route takes none)"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the sandbox is not running"),
        (status = 429, description = "`too_many_concurrent`: the org's streams are at their cap"),
        (status = 502, description = "`agent_error`"),
        (status = 503, description = "`host_unavailable`"),
    ), security(("bearer" = [])))]
#[instrument(skip_all, fields(org_id = %caller.org_id, sandbox_id = %id))]
pub async fn exec_stream(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    _query: StrictQuery<NoParams>,
    raw: Bytes,
) -> Result<Response, ApiError> {
    let body: ExecBody = crate::http::body::json(&raw)?;
    let spec = exec_spec(body)?;
    let permit = app.guards.concurrency(caller.org_id, Concurrent::Streams)?;
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
        op: AgentOp::ExecStreamWindowed {
            spec,
            window: STREAM_WINDOW_CHUNKS,
        },
    };
    let agent_subject = app.subjects.agent(host);
    app.nats
        .publish_with_reply(
            agent_subject.clone(),
            inbox.clone(),
            wire::encode(&request).into(),
        )
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    let mut flow = Flow {
        nats: app.nats.clone(),
        agent_subject,
        sandbox_id: sandbox.id,
        inbox,
        taken: 0,
        open: true,
    };

    // The first message decides the status: a failure before any output is an HTTP error.
    let first = tokio::time::timeout_at(deadline, replies.next())
        .await
        .ok()
        .flatten()
        .ok_or_else(|| unavailable("no answer".into()))?;
    let first: AgentReply = wire::decode(&first.payload)
        .map_err(|e| ApiError::Internal(format!("exec reply from {host}: {e}")))?;
    if let AgentReply::Failed(failure) = first {
        flow.open = false;
        return Err(match failure {
            AgentFailure::NotFound | AgentFailure::NotRunning => {
                stopped_meanwhile(&app, &caller, &sandbox).await
            }
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
        flow,
        _permit: permit,
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

/// Output messages the host may publish ahead of what a stream has taken (its window); each
/// carries at most the agent's 16 KiB read, so a stream holds at most 1 MiB in the API.
pub const STREAM_WINDOW_CHUNKS: u32 = 64;

/// The credit side of one windowed stream.
struct Flow {
    nats: async_nats::Client,
    agent_subject: String,
    sandbox_id: berth_schemas::SandboxId,
    /// The reply subject, which names the stream to the host.
    inbox: String,
    /// Output messages taken since the last credit.
    taken: u32,
    /// The host may still send: cancel it when the stream is dropped early.
    open: bool,
}

impl Flow {
    /// Counts one output message taken; credits the host half a window at a time.
    async fn took_one(&mut self) {
        self.taken += 1;
        if self.taken >= STREAM_WINDOW_CHUNKS / 2 {
            let chunks = std::mem::take(&mut self.taken);
            self.send(AgentOp::StreamCredit {
                reply_to: self.inbox.clone(),
                chunks,
            })
            .await;
        }
    }

    async fn send(&self, op: AgentOp) {
        let request = AgentRequest {
            sandbox_id: self.sandbox_id,
            op,
        };
        if let Err(e) = self
            .nats
            .publish(self.agent_subject.clone(), wire::encode(&request).into())
            .await
        {
            tracing::warn!(error = %e, "stream flow control not sent");
        }
    }
}

impl Drop for Flow {
    /// A stream dropped before its end (the client went away): tell the host to stop.
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let request = AgentRequest {
            sandbox_id: self.sandbox_id,
            op: AgentOp::StreamCancel {
                reply_to: self.inbox.clone(),
            },
        };
        let (nats, subject) = (self.nats.clone(), self.agent_subject.clone());
        runtime.spawn(async move {
            let _ = nats.publish(subject, wire::encode(&request).into()).await;
        });
    }
}

/// The state of one response stream.
struct Lines {
    replies: async_nats::Subscriber,
    pending: Option<AgentReply>,
    /// stdout, stderr.
    decoders: [Utf8Carry; 2],
    deadline: Instant,
    done: bool,
    flow: Flow,
    _permit: ConcurrencyPermit,
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
                    self.flow.took_one().await;
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
                    self.flow.open = false;
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
                AgentReply::Failed(AgentFailure::NotFound | AgentFailure::NotRunning) => {
                    return self.end_with_error("conflict", "the sandbox stopped during the exec")
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
        // A final failure from the host ends it there; a local one (no answer, a bad message)
        // leaves the host to be told.
        self.flow.open = code == "host_unavailable" || code == "internal";
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
