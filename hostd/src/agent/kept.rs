//! Kept agent connections: hostd's calls to a sandbox's agent go over connections it keeps
//! open between calls (`{"op":"keep"}`, see `protocol`) instead of a connect per call.
//!
//! A call takes an idle connection of the sandbox from its gate ([`AgentGates::take_idle`]),
//! or opens one; it sends its request line and reads one answer line; a connection that
//! answered whole goes back to the gate, anything else is closed. Concurrent calls on one
//! sandbox each take their own connection.
//!
//! # Guarantees
//! - A connection belongs to one run of one sandbox: closing or opening its gate (stop,
//!   delete, start, a snapshot's drain) drops the idle ones, so a restarted agent is reached
//!   on a new connection.
//! - A kept connection the agent closed meanwhile (its sandbox restarted on its own) is seen
//!   as closed before use and dropped. A reused connection that fails before any byte of the
//!   answer arrived is retried once on a new connection (the agent it reached did not read
//!   the request, or is gone); a new connection is never retried.
//! - An agent of an older bundle, which refuses `keep`, is asked one call per connection
//!   until the sandbox's gate closes or opens again.
//!
//! # Errors
//! As [`client::call`]: [`HostdError::AgentTimeout`] past the call's timeout,
//! [`HostdError::Agent`] for connection and parse errors.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use berth_schemas::SandboxId;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::client::{self, CONNECT_TIMEOUT};
use super::protocol::{Request, Response, MAX_LINE_BYTES};
use crate::error::HostdError;
use crate::gate::AgentGates;

/// The sandbox an agent call is for: its gate (which keeps its idle connections) and address.
#[derive(Debug, Clone)]
pub struct Target {
    /// Every sandbox's gates (and idle connections).
    pub gates: Arc<AgentGates>,
    /// The sandbox.
    pub sandbox: SandboxId,
    /// Its agent's address.
    pub address: SocketAddr,
}

/// How an exchange on one connection failed.
enum Failure {
    /// Before any byte of the answer arrived: the request may not have been read.
    BeforeAnswer(String),
    /// Later: the answer was cut or malformed.
    Answer(String),
}

/// Sends `request` to the sandbox's agent over a kept connection and reads the answer, all
/// within `timeout` (see the module docs).
///
/// Errors: see the module docs.
pub async fn call(
    target: &Target,
    request: &Request,
    timeout: Duration,
) -> Result<Response, HostdError> {
    let address = target.address;
    let exchange = async {
        if target.gates.one_per_call(target.sandbox) {
            return Err(None);
        }
        let mut line = serde_json::to_vec(request).map_err(|e| Some(e.to_string()))?;
        line.push(b'\n');
        if let Some(mut kept) = take_live(target) {
            match exchange(&mut kept, &line).await {
                Ok(response) => {
                    target.gates.keep_idle(target.sandbox, kept);
                    return Ok(response);
                }
                Err(Failure::Answer(reason)) => return Err(Some(reason)),
                // Closed or reset before it answered: try once on a new connection.
                Err(Failure::BeforeAnswer(reason)) => {
                    tracing::debug!(%address, reason, "a kept agent connection was gone");
                }
            }
        }
        let Some(mut fresh) = open(target).await.map_err(Some)? else {
            return Err(None);
        };
        match exchange(&mut fresh, &line).await {
            Ok(response) => {
                target.gates.keep_idle(target.sandbox, fresh);
                Ok(response)
            }
            Err(Failure::BeforeAnswer(reason) | Failure::Answer(reason)) => Err(Some(reason)),
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Err(_) => Err(HostdError::AgentTimeout {
            address,
            waited: timeout,
        }),
        Ok(Ok(response)) => Ok(response),
        Ok(Err(Some(reason))) => Err(HostdError::Agent { address, reason }),
        // The agent keeps no connection: one call on its own connection, in what is left of
        // the timeout (the refusal took a round trip).
        Ok(Err(None)) => client::call(address, request, timeout).await,
    }
}

/// An idle connection of the sandbox that is still open (one the agent closed reads as EOF).
fn take_live(target: &Target) -> Option<TcpStream> {
    while let Some(stream) = target.gates.take_idle(target.sandbox) {
        let mut probe = [0u8; 1];
        match stream.try_read(&mut probe) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Some(stream),
            // EOF, a reset, or bytes nobody asked for: not usable.
            _ => continue,
        }
    }
    None
}

/// Opens a kept connection: `Some` when the agent agreed to keep it, `None` when it answers
/// one call per connection (recorded on the gate).
async fn open(target: &Target) -> Result<Option<TcpStream>, String> {
    let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target.address))
        .await
        .map_err(|_| format!("connect: no answer within {CONNECT_TIMEOUT:?}"))?
        .map_err(|e| format!("connect: {e}"))?;
    stream
        .set_nodelay(true)
        .map_err(|e| format!("nodelay: {e}"))?;
    let mut line = serde_json::to_vec(&Request::Keep).map_err(|e| e.to_string())?;
    line.push(b'\n');
    let answer = exchange(&mut stream, &line).await.map_err(|f| match f {
        Failure::BeforeAnswer(r) | Failure::Answer(r) => r,
    })?;
    match answer {
        Response::Ping(p) if p.ok => Ok(Some(stream)),
        Response::Error(_) => {
            target.gates.set_one_per_call(target.sandbox);
            Ok(None)
        }
        other => Err(format!("unexpected answer to keep: {other:?}")),
    }
}

/// Writes `line` and reads one answer line; the connection stays usable only on `Ok` (the
/// agent sends nothing it was not asked for, so nothing is left buffered).
async fn exchange(stream: &mut TcpStream, line: &[u8]) -> Result<Response, Failure> {
    stream
        .write_all(line)
        .await
        .map_err(|e| Failure::BeforeAnswer(format!("send: {e}")))?;
    let mut reader = BufReader::new(&mut *stream);
    let mut answer = String::new();
    let read = (&mut reader)
        .take(MAX_LINE_BYTES)
        .read_line(&mut answer)
        .await;
    let leftover = !reader.buffer().is_empty();
    match read {
        Ok(0) => Err(Failure::BeforeAnswer(
            "the agent closed the connection".into(),
        )),
        Err(e) if answer.is_empty() => Err(Failure::BeforeAnswer(format!("receive: {e}"))),
        Err(e) => Err(Failure::Answer(format!("receive: {e}"))),
        Ok(_) if !answer.ends_with('\n') || leftover => {
            Err(Failure::Answer("a cut or overlong answer".into()))
        }
        Ok(_) => serde_json::from_str::<Response>(&answer).map_err(|e| {
            Failure::Answer(format!("bad answer {:?}: {e}", client::truncate(&answer)))
        }),
    }
}

/// Pings the sandbox's agent over a kept connection, within [`client::PING_TIMEOUT`].
///
/// Errors: as [`call`], plus [`HostdError::Agent`] when the answer is not `{"ok":true}`.
pub async fn ping(target: &Target) -> Result<(), HostdError> {
    match call(target, &Request::Ping, client::PING_TIMEOUT).await? {
        Response::Ping(p) if p.ok => Ok(()),
        other => Err(HostdError::Agent {
            address: target.address,
            reason: format!("unexpected ping answer {other:?}"),
        }),
    }
}

/// Runs `argv` in the sandbox over a kept connection, with extra environment, a working
/// directory and stdin, as [`client::exec_with`] does on a connection of its own.
///
/// Errors: as [`call`]; the overall wait is `timeout_ms` (clamped) + the reply grace.
pub async fn exec(
    target: &Target,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: Option<String>,
    stdin: Vec<u8>,
    timeout_ms: u64,
) -> Result<client::ExecResult, HostdError> {
    let (request, wait) = client::exec_request(argv, env, cwd, stdin, timeout_ms);
    client::exec_answer(target.address, call(target, &request, wait).await?)
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader as StdBufReader, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::agent::client::ExecResult;

    const TIMEOUT: Duration = Duration::from_secs(10);

    fn target(address: SocketAddr) -> Target {
        Target {
            gates: AgentGates::new(),
            sandbox: SandboxId::new(),
            address,
        }
    }

    /// The real agent server on loopback.
    fn start_agent() -> SocketAddr {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || super::super::server::serve(listener));
        addr
    }

    /// A server that answers `answer(line)` to each line of a connection, for at most
    /// `lines_per_connection` lines, then closes; counts the connections it accepted.
    fn start_scripted(
        lines_per_connection: usize,
        answer: fn(&str) -> &'static str,
    ) -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                count.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || {
                    let mut reader = StdBufReader::new(stream.try_clone().unwrap());
                    for _ in 0..lines_per_connection {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let _ = stream.write_all(answer(&line).as_bytes());
                    }
                });
            }
        });
        (addr, accepted)
    }

    #[tokio::test]
    async fn calls_share_one_kept_connection_and_concurrent_calls_each_take_their_own() {
        let t = target(start_agent());
        for i in 0..5 {
            let argv = vec!["echo".into(), format!("call {i}")];
            match exec(&t, argv, vec![], None, vec![], 5_000).await.unwrap() {
                ExecResult::Finished(out) => {
                    assert_eq!(out.stdout, format!("call {i}\n").as_bytes())
                }
                other => panic!("unexpected {other:?}"),
            }
            assert_eq!(t.gates.idle_count(t.sandbox), 1, "one connection, kept");
        }
        // Six at once: each must run while the others do (each waits for all six to start).
        let dir = std::env::temp_dir().join(format!("berth-kept-{}", SandboxId::new()));
        std::fs::create_dir_all(&dir).unwrap();
        let barrier = dir.to_string_lossy().into_owned();
        let script =
            "touch \"$0/$1\"; while [ $(ls \"$0\" | wc -l) -lt 6 ]; do sleep 0.01; done; echo $1";
        let calls = (0..6).map(|i| {
            let argv = ["sh", "-c", script, &barrier, &i.to_string()]
                .map(str::to_owned)
                .to_vec();
            let t = t.clone();
            async move { exec(&t, argv, vec![], None, vec![], 10_000).await }
        });
        for (i, result) in futures::future::join_all(calls)
            .await
            .into_iter()
            .enumerate()
        {
            match result.unwrap() {
                ExecResult::Finished(out) => assert_eq!(out.stdout, format!("{i}\n").as_bytes()),
                other => panic!("unexpected {other:?}"),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            t.gates.idle_count(t.sandbox),
            crate::gate::MAX_IDLE_PER_SANDBOX,
            "at most the cap is kept"
        );
        // Closing the gate (a stop) drops them; the next run opens a new one.
        drop(t.gates.close_while(t.sandbox));
        assert_eq!(t.gates.idle_count(t.sandbox), 0);
        let pong = call(&t, &Request::Ping, TIMEOUT).await.unwrap();
        assert!(matches!(pong, Response::Ping(p) if p.ok));
    }

    #[tokio::test]
    async fn a_kept_connection_the_agent_closed_is_replaced_by_a_new_one() {
        // Each connection: the keep, one call, then the agent goes away (closes).
        let (addr, accepted) = start_scripted(2, |_| "{\"ok\":true}\n");
        let t = target(addr);
        for round in 1..=3 {
            let pong = call(&t, &Request::Ping, TIMEOUT).await.unwrap();
            assert!(matches!(pong, Response::Ping(p) if p.ok));
            assert_eq!(accepted.load(Ordering::SeqCst), round);
            // The next call must find it closed: wait until the close arrived.
            let conn = t.gates.take_idle(t.sandbox).expect("kept after the call");
            let closed = tokio::time::timeout(TIMEOUT, conn.peek(&mut [0u8; 1])).await;
            assert!(matches!(closed, Ok(Ok(0))), "never closed: {closed:?}");
            t.gates.keep_idle(t.sandbox, conn);
        }
    }

    #[tokio::test]
    async fn an_agent_that_refuses_keep_is_asked_one_call_per_connection() {
        // An agent of an older bundle: `keep` is an unknown op; one answer per connection.
        let (addr, accepted) = start_scripted(1, |line| {
            if line.contains("keep") {
                "{\"error\":\"bad request: unknown variant `keep`\"}\n"
            } else {
                "{\"ok\":true}\n"
            }
        });
        let t = target(addr);
        for _ in 0..3 {
            let pong = call(&t, &Request::Ping, TIMEOUT).await.unwrap();
            assert!(matches!(pong, Response::Ping(p) if p.ok));
        }
        assert!(t.gates.one_per_call(t.sandbox));
        assert_eq!(t.gates.idle_count(t.sandbox), 0);
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            4,
            "the refused keep, then one per call"
        );
    }

    #[tokio::test]
    async fn an_agent_that_never_answers_times_the_call_out() {
        // Accepts and holds each connection, reading nothing.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let held: Vec<_> = listener.incoming().collect();
            drop(held);
        });
        let t = target(addr);
        let err = call(&t, &Request::Ping, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(err, HostdError::AgentTimeout { .. }), "{err:?}");
        assert_eq!(t.gates.idle_count(t.sandbox), 0);
    }
}
