//! `GET /v1/sandboxes/{id}/shell`: an interactive terminal session in a running sandbox, over
//! a WebSocket (`berth sandbox shell`).
//!
//! ```text
//! GET /v1/sandboxes/{id}/shell?rows=24&cols=80&cmd=/bin/sh&timeout_seconds=3600
//! Authorization: Bearer …   Upgrade: websocket
//! client → server  binary: keystrokes        text: {"resize":{"rows":50,"cols":120}}
//! server → client  binary: terminal output   text (last): {"exit_code":0,"timed_out":false,"oom_killed":false}
//!                                                       or {"error":{"code":…,"message":…}}
//! ```
//!
//! Refusals before the upgrade are ordinary HTTP errors (401, 404, 409 not running, 400 bad
//! parameters, 429 the org's streams at their cap). The process runs on a new pseudo-terminal
//! as the leader of its own session (the agent's `tty`); the session ends when it exits, at
//! `timeout_seconds`, or when the client closes (the terminal is hung up).
//!
//! # Bounded memory
//! Output is an [`AgentOp::Tty`] stream with the window and credits of `exec/stream`
//! ([`STREAM_WINDOW_CHUNKS`]): a credit is sent after a chunk was written to the WebSocket, so
//! a client that does not read stops the process at its terminal. Input is read from the
//! WebSocket one message at a time (at most [`MAX_SHELL_MESSAGE_BYTES`]); each piece of at most
//! [`MAX_TTY_INPUT_BYTES`] is sent as an [`AgentOp::TtyInput`] request and the next only after
//! the host answered that it was queued: a terminal that takes no input stops the client's
//! writes, not a buffer. A session counts against the org's `max_concurrent_streams`.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::response::Response;
use berth_schemas::wire::{
    self, AgentFailure, AgentOp, AgentReply, AgentRequest, ExecSpec, TtyInput, TtySize,
};
use berth_schemas::SandboxId;
use futures::{SinkExt, StreamExt};
use serde_json::json;
use tracing::instrument;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::http::exec::running_host;
use crate::http::exec_stream::STREAM_WINDOW_CHUNKS;
use crate::limits::Concurrent;
use crate::AppState;

/// The program a session runs when the request names none.
pub const DEFAULT_SHELL: &str = "/bin/sh";
/// A session's lifetime when the request names none, in seconds (one hour).
pub const DEFAULT_SESSION_SECONDS: u64 = 3600;
/// The longest session a request may ask for, in seconds (one day).
pub const MAX_SESSION_SECONDS: u64 = 24 * 3600;
/// The largest terminal side, in cells.
pub const MAX_TTY_CELLS: u16 = 1000;
/// The largest WebSocket message the API reads from a client, in bytes.
pub const MAX_SHELL_MESSAGE_BYTES: usize = 64 * 1024;
/// The most bytes of input one [`AgentOp::TtyInput`] carries (a larger message is split).
pub const MAX_TTY_INPUT_BYTES: usize = 16 * 1024;
/// How long the host may take to queue one input before the session is given up (a terminal
/// whose process reads no input for this long while the user types).
pub const TTY_INPUT_ACK_TIMEOUT: Duration = Duration::from_secs(60);
/// Extra time a session waits for the host beyond its own lifetime.
const SESSION_GRACE: Duration = Duration::from_secs(10);
/// The most argv entries `cmd` may carry.
const MAX_SHELL_ARGV: usize = 256;
/// The most bytes `cmd`, `env` and `cwd` may carry together.
const MAX_SHELL_REQUEST_BYTES: usize = 64 * 1024;

/// The parsed query of a session request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShellRequest {
    /// argv (`cmd`, repeated); [`DEFAULT_SHELL`] when absent.
    pub argv: Vec<String>,
    /// `env=KEY=VALUE`, repeated.
    pub env: BTreeMap<String, String>,
    /// `cwd`: an absolute path.
    pub cwd: Option<String>,
    /// `rows` × `cols`, default 24 × 80.
    pub size: TtySize,
    /// `timeout_seconds`.
    pub timeout: Duration,
}

impl ShellRequest {
    /// Reads the query's pairs.
    ///
    /// Errors: 400 naming the parameter: an unknown one, a size or timeout out of range, a
    /// relative `cwd`, an `env` without `=`, NUL bytes, too many or too long arguments.
    pub fn from_pairs(pairs: Vec<(String, String)>) -> Result<Self, ApiError> {
        let mut req = ShellRequest {
            argv: Vec::new(),
            env: BTreeMap::new(),
            cwd: None,
            size: TtySize { rows: 24, cols: 80 },
            timeout: Duration::from_secs(DEFAULT_SESSION_SECONDS),
        };
        let mut bytes = 0;
        let cells = |name: &str, value: &str| {
            value
                .parse::<u16>()
                .ok()
                .filter(|v| (1..=MAX_TTY_CELLS).contains(v))
                .ok_or_else(|| {
                    ApiError::invalid(name, format!("{name} must be 1 to {MAX_TTY_CELLS}"))
                })
        };
        for (name, value) in pairs {
            bytes += name.len() + value.len();
            if value.contains('\0') {
                return Err(ApiError::invalid(&name, format!("{name} cannot hold NUL")));
            }
            match name.as_str() {
                "cmd" => req.argv.push(value),
                "env" => {
                    let (key, val) = value
                        .split_once('=')
                        .filter(|(k, _)| !k.is_empty())
                        .ok_or_else(|| ApiError::invalid("env", "env must be KEY=VALUE"))?;
                    req.env.insert(key.to_owned(), val.to_owned());
                }
                "cwd" if value.starts_with('/') => req.cwd = Some(value),
                "cwd" => return Err(ApiError::invalid("cwd", "cwd must be an absolute path")),
                "rows" => req.size.rows = cells("rows", &value)?,
                "cols" => req.size.cols = cells("cols", &value)?,
                "timeout_seconds" => {
                    let secs = value
                        .parse::<u64>()
                        .ok()
                        .filter(|s| (1..=MAX_SESSION_SECONDS).contains(s))
                        .ok_or_else(|| {
                            ApiError::invalid(
                                "timeout_seconds",
                                format!("timeout_seconds must be 1 to {MAX_SESSION_SECONDS}"),
                            )
                        })?;
                    req.timeout = Duration::from_secs(secs);
                }
                other => {
                    return Err(ApiError::invalid(
                        other,
                        format!("unknown parameter {other}"),
                    ))
                }
            }
        }
        if req.argv.len() > MAX_SHELL_ARGV || bytes > MAX_SHELL_REQUEST_BYTES {
            return Err(ApiError::invalid(
                "cmd",
                format!("at most {MAX_SHELL_ARGV} arguments and {MAX_SHELL_REQUEST_BYTES} bytes"),
            ));
        }
        if req.argv.first().is_some_and(|p| p.is_empty()) {
            return Err(ApiError::invalid("cmd", "cmd names the program first"));
        }
        if req.argv.is_empty() {
            req.argv.push(DEFAULT_SHELL.to_owned());
        }
        Ok(req)
    }
}

/// `GET /v1/sandboxes/{id}/shell` (WebSocket)
#[utoipa::path(get, path = "/v1/sandboxes/{id}/shell",
    params(("id" = String, Path),
        ("cmd" = Option<Vec<String>>, Query, description = "argv, repeated; default /bin/sh"),
        ("env" = Option<Vec<String>>, Query, description = "KEY=VALUE, repeated"),
        ("cwd" = Option<String>, Query, description = "absolute working directory"),
        ("rows" = Option<u16>, Query, description = "terminal lines, default 24"),
        ("cols" = Option<u16>, Query, description = "terminal columns, default 80"),
        ("timeout_seconds" = Option<u64>, Query, description = "session lifetime, default 3600, at most 86400")),
    responses(
        (status = 101, description = "WebSocket: binary frames are terminal input and output; text from the client `{\"resize\":{\"rows\",\"cols\"}}`; the last text from the server `{\"exit_code\",\"timed_out\",\"oom_killed\"}` or `{\"error\":{\"code\",\"message\"}}`"),
        (status = 400, description = "`invalid_request`: a parameter out of range, or not a WebSocket request"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the sandbox is not running"),
        (status = 429, description = "`too_many_concurrent`: the org's streams are at their cap"),
    ), security(("bearer" = [])))]
#[instrument(skip_all, fields(org_id = %caller.org_id, sandbox_id = %id))]
pub async fn shell(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    query: Result<Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let Query(pairs) = query.map_err(super::extract::query_error)?;
    let request = ShellRequest::from_pairs(pairs)?;
    let upgrade = upgrade.map_err(|e| {
        ApiError::invalid(
            "upgrade",
            format!("a shell is a WebSocket: {}", e.body_text()),
        )
    })?;
    let permit = app.guards.concurrency(caller.org_id, Concurrent::Streams)?;
    let (sandbox, host) = running_host(&app, &caller, &id).await?;
    let session = Session {
        nats: app.nats.clone(),
        agent_subject: app.subjects.agent(host),
        sandbox_id: sandbox.id,
    };
    Ok(upgrade
        .max_message_size(MAX_SHELL_MESSAGE_BYTES)
        .max_frame_size(MAX_SHELL_MESSAGE_BYTES)
        .on_upgrade(move |socket| async move {
            metrics::counter!("berth_shell_sessions_total").increment(1);
            session.run(socket, request).await;
            drop(permit);
        }))
}

/// One session's way to its host.
struct Session {
    nats: async_nats::Client,
    agent_subject: String,
    sandbox_id: SandboxId,
}

/// Why a session ended, for the client's last text message.
enum End {
    Exit(serde_json::Value),
    Error(&'static str, String),
    /// The client closed or went away: nothing more to say.
    ClientGone,
}

impl Session {
    async fn run(self, socket: WebSocket, request: ShellRequest) {
        let (mut to_client, from_client) = socket.split();
        let end = self.pump(&mut to_client, from_client, request).await;
        let last = match end {
            End::Exit(value) => value,
            End::Error(code, message) => json!({"error": {"code": code, "message": message}}),
            End::ClientGone => return,
        };
        let _ = to_client.send(Message::Text(last.to_string().into())).await;
        let _ = to_client
            .send(Message::Close(Some(CloseFrame {
                code: axum::extract::ws::close_code::NORMAL,
                reason: "".into(),
            })))
            .await;
    }

    async fn pump(
        &self,
        to_client: &mut futures::stream::SplitSink<WebSocket, Message>,
        from_client: futures::stream::SplitStream<WebSocket>,
        request: ShellRequest,
    ) -> End {
        let inbox = self.nats.new_inbox();
        let mut replies = match self.nats.subscribe(inbox.clone()).await {
            Ok(replies) => replies,
            Err(e) => return End::Error("host_unavailable", e.to_string()),
        };
        let spec = ExecSpec {
            argv: request.argv,
            env: request.env.into_iter().collect(),
            cwd: request.cwd,
            stdin: Vec::new(),
            timeout_ms: request.timeout.as_millis() as u64,
        };
        let open = AgentRequest {
            sandbox_id: self.sandbox_id,
            op: AgentOp::Tty {
                spec,
                size: request.size,
                window: STREAM_WINDOW_CHUNKS,
            },
        };
        if let Err(e) = self
            .nats
            .publish_with_reply(
                self.agent_subject.clone(),
                inbox.clone(),
                wire::encode(&open).into(),
            )
            .await
        {
            return End::Error("host_unavailable", e.to_string());
        }
        // From here on, a session that ends early tells the host (which hangs the terminal up).
        let mut cancel = CancelOnDrop {
            session: self,
            inbox: inbox.clone(),
            armed: true,
        };
        let mut input = Box::pin(self.forward_input(from_client, inbox.clone()));
        let deadline = tokio::time::Instant::now() + request.timeout + SESSION_GRACE;
        let mut taken = 0u32;
        let mut input_done = false;
        loop {
            tokio::select! {
                next = tokio::time::timeout_at(deadline, replies.next()) => {
                    let Ok(Some(message)) = next else {
                        return End::Error("host_unavailable", "the host stopped answering".into());
                    };
                    match wire::decode::<AgentReply>(&message.payload) {
                        Ok(AgentReply::Output { data, .. }) => {
                            if to_client.send(Message::Binary(data.into())).await.is_err() {
                                return End::ClientGone;
                            }
                            taken += 1;
                            if taken >= STREAM_WINDOW_CHUNKS / 2 {
                                let chunks = std::mem::take(&mut taken);
                                self.send(AgentOp::StreamCredit { reply_to: inbox.clone(), chunks }).await;
                            }
                        }
                        Ok(AgentReply::Exec { exit_code, timed_out, oom_killed, .. }) => {
                            cancel.armed = false;
                            return End::Exit(json!({
                                "exit_code": exit_code,
                                "timed_out": timed_out,
                                "oom_killed": oom_killed,
                            }));
                        }
                        Ok(AgentReply::Failed(AgentFailure::NotFound | AgentFailure::NotRunning)) => {
                            cancel.armed = false;
                            return End::Error("conflict", "the sandbox is not running".into());
                        }
                        Ok(AgentReply::Failed(failure)) => {
                            cancel.armed = false;
                            return End::Error("agent_error", format!("{failure:?}"));
                        }
                        Ok(other) => return End::Error("internal", format!("unexpected reply {other:?}")),
                        Err(e) => return End::Error("internal", e.to_string()),
                    }
                }
                ended = &mut input, if !input_done => {
                    input_done = true;
                    match ended {
                        // The client closed: hang up (the host still answers with the exit,
                        // which nobody reads).
                        InputEnd::Closed => return End::ClientGone,
                        InputEnd::Refused(message) => return End::Error("invalid_request", message),
                        InputEnd::HostGone(message) => return End::Error("host_unavailable", message),
                        InputEnd::SessionGone => {}
                    }
                }
            }
        }
    }

    /// Reads the client's messages one at a time and sends each to the host, waiting for the
    /// host to queue it before reading the next.
    async fn forward_input(
        &self,
        mut from_client: futures::stream::SplitStream<WebSocket>,
        session: String,
    ) -> InputEnd {
        while let Some(message) = from_client.next().await {
            let inputs = match message {
                Ok(Message::Binary(data)) => data
                    .chunks(MAX_TTY_INPUT_BYTES)
                    .map(|c| TtyInput::Data(c.to_vec()))
                    .collect::<Vec<_>>(),
                Ok(Message::Text(text)) => match parse_control(text.as_str()) {
                    Ok(size) => vec![TtyInput::Resize(size)],
                    Err(message) => return InputEnd::Refused(message),
                },
                Ok(Message::Ping(_) | Message::Pong(_)) => continue,
                Ok(Message::Close(_)) | Err(_) => return InputEnd::Closed,
            };
            for input in inputs {
                let request = AgentRequest {
                    sandbox_id: self.sandbox_id,
                    op: AgentOp::TtyInput {
                        reply_to: session.clone(),
                        input,
                    },
                };
                let ack = tokio::time::timeout(
                    TTY_INPUT_ACK_TIMEOUT,
                    self.nats
                        .request(self.agent_subject.clone(), wire::encode(&request).into()),
                )
                .await;
                match ack {
                    Ok(Ok(reply)) => match wire::decode::<AgentReply>(&reply.payload) {
                        Ok(AgentReply::Done) => {}
                        // The session ended meanwhile: its exit is on its way.
                        Ok(AgentReply::Failed(AgentFailure::NotFound)) => {
                            return InputEnd::SessionGone
                        }
                        Ok(other) => {
                            return InputEnd::HostGone(format!("input refused: {other:?}"))
                        }
                        Err(e) => return InputEnd::HostGone(e.to_string()),
                    },
                    Ok(Err(e)) => return InputEnd::HostGone(format!("input not delivered: {e}")),
                    Err(_) => {
                        return InputEnd::HostGone(format!(
                            "the terminal took no input for {TTY_INPUT_ACK_TIMEOUT:?}"
                        ))
                    }
                }
            }
        }
        InputEnd::Closed
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
            tracing::warn!(error = %e, "shell flow control not sent");
        }
    }
}

/// How the input side of a session ended.
enum InputEnd {
    /// The client closed the WebSocket or went away.
    Closed,
    /// The client sent a text message that is not a resize.
    Refused(String),
    /// The host did not take an input.
    HostGone(String),
    /// The session had already ended on the host.
    SessionGone,
}

/// A client's text message: `{"resize":{"rows":R,"cols":C}}`.
fn parse_control(text: &str) -> Result<TtySize, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Control {
        resize: Size,
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Size {
        rows: u16,
        cols: u16,
    }
    let control: Control = serde_json::from_str(text)
        .map_err(|e| format!("a text message must be {{\"resize\":{{\"rows\",\"cols\"}}}}: {e}"))?;
    let Size { rows, cols } = control.resize;
    let ok = |v: u16| (1..=MAX_TTY_CELLS).contains(&v);
    if !ok(rows) || !ok(cols) {
        return Err(format!("rows and cols must be 1 to {MAX_TTY_CELLS}"));
    }
    Ok(TtySize { rows, cols })
}

/// Tells the host to end the session when the API side ends first.
struct CancelOnDrop<'a> {
    session: &'a Session,
    inbox: String,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let request = AgentRequest {
            sandbox_id: self.session.sandbox_id,
            op: AgentOp::StreamCancel {
                reply_to: self.inbox.clone(),
            },
        };
        let (nats, subject) = (
            self.session.nats.clone(),
            self.session.agent_subject.clone(),
        );
        runtime.spawn(async move {
            let _ = nats.publish(subject, wire::encode(&request).into()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_session_request_defaults_to_sh_at_24_by_80_for_an_hour() {
        let req = ShellRequest::from_pairs(vec![]).unwrap();
        assert_eq!(req.argv, vec![DEFAULT_SHELL]);
        assert_eq!(req.size, TtySize { rows: 24, cols: 80 });
        assert_eq!(req.timeout, Duration::from_secs(DEFAULT_SESSION_SECONDS));
        let req = ShellRequest::from_pairs(pairs(&[
            ("cmd", "bash"),
            ("cmd", "-l"),
            ("env", "A=b=c"),
            ("rows", "50"),
            ("cwd", "/tmp"),
        ]))
        .unwrap();
        assert_eq!(req.argv, vec!["bash", "-l"]);
        assert_eq!(req.env.get("A").map(String::as_str), Some("b=c"));
        assert_eq!(req.size.rows, 50);
    }

    #[test]
    fn bad_session_parameters_are_refused() {
        for bad in [
            ("rows", "0"),
            ("cols", "1001"),
            ("timeout_seconds", "0"),
            ("timeout_seconds", "86401"),
            ("cwd", "tmp"),
            ("env", "novalue"),
            ("cmd", ""),
            ("cmd", "a\0b"),
            ("what", "x"),
        ] {
            assert!(ShellRequest::from_pairs(pairs(&[bad])).is_err(), "{bad:?}");
        }
        assert!(parse_control(r#"{"resize":{"rows":5,"cols":6}}"#).is_ok());
        assert!(parse_control(r#"{"resize":{"rows":0,"cols":6}}"#).is_err());
        assert!(parse_control(r#"{"reboot":true}"#).is_err());
    }
}
