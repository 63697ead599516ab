//! hostd's side of the agent protocol (tokio).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::protocol::{ExecOutput, Request, Response, MAX_EXEC_TIMEOUT_MS, MAX_LINE_BYTES};
use crate::error::HostdError;
use crate::host::OutputSender;

/// How long a ping (connect, request, answer) may take.
pub const PING_TIMEOUT: Duration = Duration::from_secs(1);

/// How long connecting to an agent may take. A live agent answers in milliseconds; a dead
/// gVisor sandbox answers nothing (no reset), which would otherwise hold a call until its
/// whole timeout.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Extra time an exec answer may take beyond the command's own timeout (spawn, output
/// transfer, the agent's reader grace).
pub const EXEC_REPLY_GRACE: Duration = Duration::from_secs(5);

/// Sends one request and reads the one-line answer, all within `timeout`.
///
/// Errors: [`HostdError::AgentTimeout`]; [`HostdError::Agent`] on connection or parse errors.
pub async fn call(
    address: SocketAddr,
    request: &Request,
    timeout: Duration,
) -> Result<Response, HostdError> {
    let agent_err = |reason: String| HostdError::Agent { address, reason };
    let exchange = async {
        let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
            .await
            .map_err(|_| agent_err(format!("connect: no answer within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| agent_err(format!("connect: {e}")))?;
        let mut line = serde_json::to_vec(request).map_err(|e| agent_err(e.to_string()))?;
        line.push(b'\n');
        stream
            .write_all(&line)
            .await
            .map_err(|e| agent_err(format!("send: {e}")))?;
        let mut answer = String::new();
        BufReader::new(stream.take(MAX_LINE_BYTES))
            .read_line(&mut answer)
            .await
            .map_err(|e| agent_err(format!("receive: {e}")))?;
        serde_json::from_str::<Response>(&answer)
            .map_err(|e| agent_err(format!("bad answer {:?}: {e}", truncate(&answer))))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| HostdError::AgentTimeout {
            address,
            waited: timeout,
        })?
}

/// Pings the agent.
///
/// Errors: as [`call`], plus [`HostdError::Agent`] when the answer is not `{"ok":true}`.
pub async fn ping(address: SocketAddr) -> Result<(), HostdError> {
    match call(address, &Request::Ping, PING_TIMEOUT).await? {
        Response::Ping(p) if p.ok => Ok(()),
        other => Err(HostdError::Agent {
            address,
            reason: format!("unexpected ping answer {other:?}"),
        }),
    }
}

/// What an exec came to, from hostd's point of view.
#[derive(Debug)]
pub enum ExecResult {
    /// The process ran (to completion or to its timeout).
    Finished(ExecOutput),
    /// The agent answered with an error (empty argv, spawn failed).
    Refused(String),
}

/// Runs `argv` in the sandbox.
///
/// Errors: as [`call`]; the overall wait is `timeout_ms` (clamped to
/// [`MAX_EXEC_TIMEOUT_MS`]) + [`EXEC_REPLY_GRACE`].
pub async fn exec(
    address: SocketAddr,
    argv: Vec<String>,
    timeout_ms: u64,
) -> Result<ExecResult, HostdError> {
    exec_with(address, argv, Vec::new(), None, Vec::new(), timeout_ms).await
}

/// Runs `argv` in the sandbox with extra environment, a working directory and stdin.
///
/// Errors: as [`exec`].
pub async fn exec_with(
    address: SocketAddr,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: Option<String>,
    stdin: Vec<u8>,
    timeout_ms: u64,
) -> Result<ExecResult, HostdError> {
    let (request, wait) = exec_request(argv, env, cwd, stdin, timeout_ms);
    exec_answer(address, call(address, &request, wait).await?)
}

/// A (not streamed) exec request and how long its answer may take: `timeout_ms` clamped to
/// [`MAX_EXEC_TIMEOUT_MS`], plus [`EXEC_REPLY_GRACE`].
pub(crate) fn exec_request(
    argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: Option<String>,
    stdin: Vec<u8>,
    timeout_ms: u64,
) -> (Request, Duration) {
    let timeout_ms = timeout_ms.min(MAX_EXEC_TIMEOUT_MS);
    let wait = Duration::from_millis(timeout_ms) + EXEC_REPLY_GRACE;
    let request = Request::Exec {
        argv,
        timeout_ms,
        env,
        cwd,
        stdin,
        stream: false,
    };
    (request, wait)
}

/// What an exec's answer means.
///
/// Errors: [`HostdError::Agent`] for an answer that is no exec's.
pub(crate) fn exec_answer(
    address: SocketAddr,
    response: Response,
) -> Result<ExecResult, HostdError> {
    match response {
        Response::Exec(out) => Ok(ExecResult::Finished(out)),
        Response::Error(e) => Ok(ExecResult::Refused(e.error)),
        other => Err(HostdError::Agent {
            address,
            reason: format!("unexpected answer to an exec: {other:?}"),
        }),
    }
}

/// Runs a process in the sandbox, sending its output to `output` as `(fd, bytes)` as the agent
/// streams it (fd 1 stdout, 2 stderr); the result carries no output. While `output` is full
/// this stops reading the agent, whose writes then block, and so do the process's (its pipe
/// fills): backpressure from the consumer to the process.
///
/// Errors: as [`exec`]; [`HostdError::Agent`] when `output`'s receiver went away (the
/// requester stopped listening: the connection is dropped, the process runs on to its
/// timeout with its output discarded by the agent).
pub async fn exec_stream(
    address: SocketAddr,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: Option<String>,
    stdin: Vec<u8>,
    timeout_ms: u64,
    output: &OutputSender,
) -> Result<ExecResult, HostdError> {
    let agent_err = |reason: String| HostdError::Agent { address, reason };
    let timeout_ms = timeout_ms.min(MAX_EXEC_TIMEOUT_MS);
    let wait = Duration::from_millis(timeout_ms) + EXEC_REPLY_GRACE;
    let request = Request::Exec {
        argv,
        timeout_ms,
        env,
        cwd,
        stdin,
        stream: true,
    };
    let exchange = async {
        let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
            .await
            .map_err(|_| agent_err(format!("connect: no answer within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| agent_err(format!("connect: {e}")))?;
        let mut line = serde_json::to_vec(&request).map_err(|e| agent_err(e.to_string()))?;
        line.push(b'\n');
        stream
            .write_all(&line)
            .await
            .map_err(|e| agent_err(format!("send: {e}")))?;
        let mut reader = BufReader::new(stream);
        loop {
            let mut answer = String::new();
            let read = (&mut reader)
                .take(MAX_LINE_BYTES)
                .read_line(&mut answer)
                .await
                .map_err(|e| agent_err(format!("receive: {e}")))?;
            if read == 0 {
                return Err(agent_err("the agent closed the stream early".into()));
            }
            match serde_json::from_str::<Response>(&answer)
                .map_err(|e| agent_err(format!("bad answer {:?}: {e}", truncate(&answer))))?
            {
                Response::Output(chunk) => {
                    if output.send((chunk.fd, chunk.data)).await.is_err() {
                        return Err(agent_err("the requester stopped listening".into()));
                    }
                }
                Response::Exec(out) => return Ok(ExecResult::Finished(out)),
                Response::Error(e) => return Ok(ExecResult::Refused(e.error)),
                other => {
                    return Err(agent_err(format!(
                        "unexpected answer to an exec: {other:?}"
                    )))
                }
            }
        }
    };
    tokio::time::timeout(wait, exchange)
        .await
        .map_err(|_| HostdError::AgentTimeout {
            address,
            waited: wait,
        })?
}

/// What a terminal session gets from its requester: [`berth_schemas::wire::TtyInput`]s, one
/// at a time (a bounded channel: while the agent does not take them, the sender waits).
pub type TtyInputReceiver = tokio::sync::mpsc::Receiver<berth_schemas::wire::TtyInput>;

/// Runs a process on a new pseudo-terminal in the sandbox (see the agent's `tty`): its output
/// goes to `output` as `(1, bytes)`, what `input` brings is written to the terminal, and the
/// session ends with the process. When `input` closes (the requester went away) or `output`'s
/// receiver does, the connection is closed, which hangs the terminal up.
///
/// Errors: as [`exec_stream`].
pub async fn tty(
    address: SocketAddr,
    spec: berth_schemas::wire::ExecSpec,
    size: berth_schemas::wire::TtySize,
    output: &OutputSender,
    mut input: TtyInputReceiver,
) -> Result<ExecResult, HostdError> {
    use super::protocol::TtyFrame;
    use berth_schemas::wire::TtyInput;
    let agent_err = |reason: String| HostdError::Agent { address, reason };
    let timeout_ms = spec.timeout_ms.min(MAX_EXEC_TIMEOUT_MS);
    let wait = Duration::from_millis(timeout_ms) + EXEC_REPLY_GRACE;
    let request = Request::Tty {
        argv: spec.argv,
        timeout_ms,
        env: spec.env,
        cwd: spec.cwd,
        rows: size.rows,
        cols: size.cols,
    };
    let exchange = async {
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
            .await
            .map_err(|_| agent_err(format!("connect: no answer within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| agent_err(format!("connect: {e}")))?;
        let (read_half, mut write_half) = stream.into_split();
        let mut line = serde_json::to_vec(&request).map_err(|e| agent_err(e.to_string()))?;
        line.push(b'\n');
        write_half
            .write_all(&line)
            .await
            .map_err(|e| agent_err(format!("send: {e}")))?;
        // Lines are read by their own task: `read_line` is not cancel-safe, a channel is.
        let (lines_tx, mut lines) = tokio::sync::mpsc::channel::<Result<String, String>>(1);
        let reading = tokio::spawn(async move {
            let mut reader = BufReader::new(read_half);
            loop {
                let mut answer = String::new();
                let read = (&mut reader)
                    .take(MAX_LINE_BYTES)
                    .read_line(&mut answer)
                    .await;
                let next = match read {
                    Ok(0) => Err("the agent closed the session early".to_owned()),
                    Ok(_) => Ok(answer),
                    Err(e) => Err(format!("receive: {e}")),
                };
                let last = next.is_err();
                if lines_tx.send(next).await.is_err() || last {
                    return;
                }
            }
        });
        let _stop_reading = AbortOnDrop(reading);
        let mut input_open = true;
        loop {
            tokio::select! {
                answer = lines.recv() => {
                    let answer = answer
                        .unwrap_or_else(|| Err("the agent closed the session early".into()))
                        .map_err(agent_err)?;
                    match serde_json::from_str::<Response>(&answer).map_err(|e| {
                        agent_err(format!("bad answer {:?}: {e}", truncate(&answer)))
                    })? {
                        Response::Output(chunk) => {
                            if output.send((chunk.fd, chunk.data)).await.is_err() {
                                return Err(agent_err("the requester stopped listening".into()));
                            }
                        }
                        Response::Exec(out) => return Ok(ExecResult::Finished(out)),
                        Response::Error(e) => return Ok(ExecResult::Refused(e.error)),
                        other => {
                            return Err(agent_err(format!(
                                "unexpected answer to a tty: {other:?}"
                            )))
                        }
                    }
                }
                next = input.recv(), if input_open => {
                    let frame = match next {
                        Some(TtyInput::Data(data)) => TtyFrame::Input(data),
                        Some(TtyInput::Resize(size)) => TtyFrame::Resize {
                            rows: size.rows,
                            cols: size.cols,
                        },
                        // The requester went away: closing our side hangs the terminal up;
                        // the agent still answers with the exit.
                        None => {
                            input_open = false;
                            let _ = write_half.shutdown().await;
                            continue;
                        }
                    };
                    let mut line =
                        serde_json::to_vec(&frame).map_err(|e| agent_err(e.to_string()))?;
                    line.push(b'\n');
                    write_half
                        .write_all(&line)
                        .await
                        .map_err(|e| agent_err(format!("send: {e}")))?;
                }
            }
        }
    };
    tokio::time::timeout(wait, exchange)
        .await
        .map_err(|_| HostdError::AgentTimeout {
            address,
            waited: wait,
        })?
}

/// Aborts a task when dropped (a session that ends stops its reader).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// At most the first 200 characters of `s` (for error messages).
pub(crate) fn truncate(s: &str) -> &str {
    const SHOWN: usize = 200;
    match s.char_indices().nth(SHOWN) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start_agent() -> SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || super::super::server::serve(listener));
        addr
    }

    #[tokio::test]
    async fn the_client_pings_and_execs_against_the_real_server() {
        let addr = start_agent();
        ping(addr).await.unwrap();
        let argv = vec!["echo".into(), "hello".into()];
        match exec(addr, argv, 5_000).await.unwrap() {
            ExecResult::Finished(out) => {
                assert_eq!(out.stdout, b"hello\n");
                assert_eq!(out.exit_code, 0);
            }
            other => panic!("unexpected {other:?}"),
        }
        match exec(addr, vec!["/no/such".into()], 1_000).await.unwrap() {
            ExecResult::Finished(out) => {
                assert_eq!(
                    out.exit_code, 127,
                    "a missing program exits like in a shell"
                );
                assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn pinging_a_closed_port_fails_quickly() {
        let addr = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        assert!(ping(addr).await.is_err());
    }
}
