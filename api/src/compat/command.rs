//! `POST /compat/opensandbox/execd/{id}/command`: runs a command and answers its events as
//! Server-Sent Events (`text/event-stream`, one `data: {json}` frame per event, flushed per
//! event), as OpenSandbox's execd does:
//!
//! ```text
//! data: {"type":"init","text":"<execution id>","timestamp":…}
//! data: {"type":"stdout","text":"one line, newline stripped","timestamp":…}
//! data: {"type":"stderr","text":"…","timestamp":…}
//! data: {"type":"ping","timestamp":…}                       (every 3 s of a long run)
//! data: {"type":"execution_complete","execution_time":12,"timestamp":…}      (exit 0)
//! data: {"type":"error","error":{"ename":"CommandExecError","evalue":"3","traceback":[]},…}
//! ```
//!
//! A non-zero exit is an `error` event whose `evalue` is the exit code, and no
//! `execution_complete` (the SDK reads the exit code from it). It runs on Berth's streamed exec
//! (`POST /v1/sandboxes/{id}/exec/stream`: flow-controlled, the org's stream cap), whose
//! output chunks are cut here into lines. `command` runs through `sh -c`; `argv` runs as is.
//! `background: true` starts it detached (stdin and output on `/dev/null`) and answers `init`
//! and `execution_complete` at once. Without `timeout` a command may run 10 minutes, Berth's
//! longest exec; `uid` and `gid` are refused (commands run as the sandbox's root).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use axum::body::{Body, BodyDataStream, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::execd::authorise;
use super::CompatError;
use crate::http::exec::MAX_EXEC_TIMEOUT_MS;
use crate::AppState;

/// How often a long run sends a `ping` event.
pub const PING_INTERVAL: Duration = Duration::from_secs(3);
/// How long starting a background command may take, in milliseconds (the `sh` that detaches
/// it returns at once).
pub const BACKGROUND_START_TIMEOUT_MS: u64 = 10_000;
/// The `sh -c` script that detaches `"$@"`.
const DETACH: &str = "\"$@\" </dev/null >/dev/null 2>&1 &";

/// The command body. Unknown fields are refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandBody {
    /// Shell text, run by `sh -c`. Exactly one of `command` and `argv`.
    pub command: Option<String>,
    /// A program and its arguments, run without a shell.
    pub argv: Option<Vec<String>>,
    /// Working directory (absolute).
    pub cwd: Option<String>,
    /// Environment over the sandbox's own.
    pub envs: Option<BTreeMap<String, String>>,
    /// Kill it after this many milliseconds (1 to 600000); absent or 0: 600000.
    pub timeout: Option<u64>,
    /// Start it detached and answer at once.
    pub background: Option<bool>,
    /// Refused: commands run as the sandbox's root.
    pub uid: Option<i64>,
    /// Refused.
    pub gid: Option<i64>,
}

impl CommandBody {
    /// Berth's exec body (`{cmd, timeout_ms, env, cwd}`) and whether it runs detached.
    ///
    /// Errors: 400 naming the field.
    pub fn exec_body(self) -> Result<(Value, bool), CompatError> {
        if self.uid.is_some() || self.gid.is_some() {
            return Err(CompatError::invalid(
                if self.uid.is_some() { "uid" } else { "gid" },
                "is not supported: commands run as the sandbox's root",
            ));
        }
        let mut cmd = match (self.command, self.argv) {
            (Some(text), None) if !text.trim().is_empty() => {
                vec!["sh".to_owned(), "-c".to_owned(), text]
            }
            (None, Some(argv)) if argv.first().is_some_and(|p| !p.is_empty()) => argv,
            (Some(_), Some(_)) => {
                return Err(CompatError::invalid(
                    "command",
                    "give command or argv, not both",
                ))
            }
            _ => {
                return Err(CompatError::invalid(
                    "command",
                    "give a non-empty command or argv",
                ))
            }
        };
        let background = self.background.unwrap_or(false);
        let timeout_ms = match self.timeout {
            _ if background => BACKGROUND_START_TIMEOUT_MS,
            None | Some(0) => MAX_EXEC_TIMEOUT_MS,
            Some(ms) if ms <= MAX_EXEC_TIMEOUT_MS => ms,
            Some(ms) => {
                return Err(CompatError::invalid(
                    "timeout",
                    format!("{ms} ms is more than Berth's longest exec, {MAX_EXEC_TIMEOUT_MS} ms"),
                ))
            }
        };
        if background {
            let mut detached = vec!["sh".into(), "-c".into(), DETACH.into(), "sh".into()];
            detached.append(&mut cmd);
            cmd = detached;
        }
        Ok((
            json!({
                "cmd": cmd,
                "timeout_ms": timeout_ms,
                "env": self.envs,
                "cwd": self.cwd,
            }),
            background,
        ))
    }
}

/// `POST /command` → 200 `text/event-stream` (see the module's docs); a refusal before the
/// run (bad body, not running, the stream cap) is an ordinary `{code, message}` error.
pub async fn run(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: Bytes,
) -> Result<Response, CompatError> {
    let (caller, _) = authorise(&app, &headers, &id).await?;
    let Json(body) = Json::<CommandBody>::from_bytes(&raw)
        .map_err(|e| CompatError::new(StatusCode::BAD_REQUEST, "invalid_request", e.body_text()))?;
    let (exec, _background) = body.exec_body()?;
    let started = Instant::now();
    let ndjson = crate::http::exec_stream::exec_stream(
        State(app),
        caller,
        Path(id),
        // The compat route's own query is not the native route's: it reads none of it.
        crate::http::extract::StrictQuery(crate::http::extract::NoParams {}),
        Bytes::from(exec.to_string()),
    )
    .await?;
    let mut events = Events {
        ndjson: ndjson.into_body().into_data_stream(),
        buffer: Vec::new(),
        partial: [String::new(), String::new()],
        queue: VecDeque::new(),
        ping: tokio::time::interval_at(started + PING_INTERVAL, PING_INTERVAL),
        started,
        done: false,
    };
    events.push(json!({"type": "init", "text": uuid::Uuid::new_v4().to_string()}));
    let frames = futures::stream::unfold(events, |mut events| async move {
        let frame = events.next_frame().await?;
        Some((
            Ok::<_, std::convert::Infallible>(Bytes::from(frame)),
            events,
        ))
    });
    Ok((
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(frames),
    )
        .into_response())
}

/// One command's events: Berth's NDJSON stream in, SSE frames out.
struct Events {
    ndjson: BodyDataStream,
    /// NDJSON bytes of a line not complete yet.
    buffer: Vec<u8>,
    /// stdout's and stderr's text since their last newline.
    partial: [String; 2],
    /// Frames ready to send.
    queue: VecDeque<String>,
    ping: tokio::time::Interval,
    started: Instant,
    /// The last event is queued.
    done: bool,
}

impl Events {
    /// Queues one event, stamped with the time in integer milliseconds.
    fn push(&mut self, mut event: Value) {
        event["timestamp"] = json!(chrono::Utc::now().timestamp_millis());
        self.queue.push_back(format!("data: {event}\n\n"));
    }

    /// The next frame, or `None` after the last.
    async fn next_frame(&mut self) -> Option<String> {
        loop {
            if let Some(frame) = self.queue.pop_front() {
                return Some(frame);
            }
            if self.done {
                return None;
            }
            tokio::select! {
                chunk = self.ndjson.next() => match chunk {
                    Some(Ok(bytes)) => self.take(&bytes),
                    Some(Err(e)) => self.fail("StreamError", &e.to_string()),
                    None => self.fail("StreamError", "the run ended without an exit status"),
                },
                _ = self.ping.tick() => self.push(json!({"type": "ping"})),
            }
        }
    }

    /// Takes NDJSON bytes; each complete line becomes events.
    fn take(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
        while let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.buffer.drain(..=end).collect();
            match serde_json::from_slice::<Value>(&line) {
                Ok(value) => self.line(value),
                Err(e) => self.fail("StreamError", &format!("an unreadable line: {e}")),
            }
        }
    }

    /// One NDJSON line of Berth's streamed exec.
    fn line(&mut self, value: Value) {
        if let Some(text) = value["stdout"].as_str() {
            self.output(0, text);
        } else if let Some(text) = value["stderr"].as_str() {
            self.output(1, text);
        } else if let Some(code) = value["exit_code"].as_i64() {
            self.flush();
            if value["timed_out"] == true {
                self.push(json!({"type": "stderr", "text": "berth: the command was killed at its timeout"}));
            }
            if code == 0 {
                let ms = self.started.elapsed().as_millis() as u64;
                self.push(json!({"type": "execution_complete", "execution_time": ms}));
            } else {
                self.push(json!({"type": "error", "error": {
                    "ename": "CommandExecError", "evalue": code.to_string(), "traceback": [],
                }}));
            }
            self.done = true;
        } else if let Some(error) = value.get("error") {
            let code = error["code"].as_str().unwrap_or("error").to_owned();
            let message = error["message"].as_str().unwrap_or_default().to_owned();
            self.fail(&code, &message);
        }
    }

    /// Output of stream `index` (0 stdout, 1 stderr): one event per complete line.
    fn output(&mut self, index: usize, text: &str) {
        self.partial[index].push_str(text);
        while let Some(end) = self.partial[index].find('\n') {
            let line: String = self.partial[index].drain(..=end).collect();
            self.emit(index, line.trim_end_matches('\n'));
        }
    }

    fn emit(&mut self, index: usize, line: &str) {
        let kind = if index == 0 { "stdout" } else { "stderr" };
        self.push(json!({"type": kind, "text": line}));
    }

    /// Sends what is left of each stream after its last newline.
    fn flush(&mut self) {
        for index in 0..2 {
            let rest = std::mem::take(&mut self.partial[index]);
            if !rest.is_empty() {
                self.emit(index, &rest);
            }
        }
    }

    /// Ends the stream with an `error` event that is no exit status.
    fn fail(&mut self, name: &str, message: &str) {
        self.flush();
        self.push(json!({"type": "error", "error": {
            "ename": name, "evalue": message, "traceback": [],
        }}));
        self.done = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_runs_through_sh_and_argv_as_is_and_background_detaches() {
        let (body, bg) = CommandBody {
            command: Some("echo hi".into()),
            ..Default::default()
        }
        .exec_body()
        .unwrap();
        assert_eq!(body["cmd"], json!(["sh", "-c", "echo hi"]));
        assert_eq!(body["timeout_ms"], MAX_EXEC_TIMEOUT_MS);
        assert!(!bg);
        let (body, bg) = CommandBody {
            argv: Some(vec!["sleep".into(), "9".into()]),
            background: Some(true),
            ..Default::default()
        }
        .exec_body()
        .unwrap();
        assert_eq!(body["cmd"], json!(["sh", "-c", DETACH, "sh", "sleep", "9"]));
        assert!(bg);
    }

    #[test]
    fn uid_both_forms_none_and_long_timeouts_are_refused() {
        for body in [
            CommandBody {
                command: Some("id".into()),
                uid: Some(1000),
                ..Default::default()
            },
            CommandBody {
                command: Some("id".into()),
                argv: Some(vec!["id".into()]),
                ..Default::default()
            },
            CommandBody::default(),
            CommandBody {
                command: Some("  ".into()),
                ..Default::default()
            },
            CommandBody {
                command: Some("id".into()),
                timeout: Some(MAX_EXEC_TIMEOUT_MS + 1),
                ..Default::default()
            },
        ] {
            assert_eq!(body.exec_body().unwrap_err().status, 400);
        }
    }
}
