//! Agent operations through the host: core-NATS request/reply on `{p}.agent.<host_id>`
//! ([`AgentRequest`] → [`AgentReply`]): exec with env, cwd and stdin (and OOM reporting), and
//! files (stat, read, write, list, rename), each forwarded to the sandbox's agent. A streamed
//! exec ([`AgentOp::ExecStream`]) answers with several messages on the reply subject: its
//! output as it arrives, then the exit; they are published in order from one connection.
//!
//! The API never reaches a sandbox address: it asks the host, which holds the sandbox's
//! agent gate permit for the call's length (see `gate`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use berth_schemas::wire::{
    self, AgentFailure, AgentOp, AgentReply, AgentRequest, DirEntry, ExecError, ExecSpec, FileKind,
    FileStat,
};
use berth_schemas::Subjects;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::agent::client::{self, ExecResult};
use crate::agent::protocol::{
    ErrorReply, Kind, Request, Response, Stat, CODE_NOT_FOUND, CODE_TOO_LARGE, MAX_FILE_CHUNK,
};
use crate::error::HostdError;
use crate::host::Host;

/// How long one file operation may take at the agent.
pub const FILE_OP_TIMEOUT: Duration = Duration::from_secs(30);

/// How often a running exec checks that its sandbox still runs. A gVisor sandbox killed whole
/// (by its memory limit, say) resets no connection, so the agent's silence alone would only
/// end at the exec's timeout.
pub const EXEC_LIVENESS_INTERVAL: Duration = Duration::from_secs(1);

/// The exit code reported for an exec whose sandbox its memory limit killed (128 + SIGKILL).
const OOM_EXIT_CODE: i32 = 137;

/// Serves agent requests until `shutdown`, each in its own task.
///
/// Errors: [`HostdError::Nats`] when the subscription cannot be made.
pub async fn serve(
    host: Arc<Host>,
    nats: Client,
    subjects: Subjects,
    shutdown: CancellationToken,
) -> Result<(), HostdError> {
    let subject = subjects.agent(host.host_id);
    let client = nats.clone();
    crate::requests::serve(
        &nats,
        subject,
        "subscribe to agent requests",
        shutdown,
        |message, reply_to| answer(host.clone(), client.clone(), message, reply_to),
    )
    .await
}

async fn answer(
    host: Arc<Host>,
    nats: Client,
    message: async_nats::Message,
    reply_to: async_nats::Subject,
) {
    let reply = match wire::decode::<AgentRequest>(&message.payload) {
        Ok(request) => {
            let span = tracing::info_span!(
                "agent_op",
                host_id = %host.host_id,
                sandbox_id = %request.sandbox_id,
            );
            let output = match request.op {
                AgentOp::ExecStream(_) => Some(forward_output(nats.clone(), reply_to.clone())),
                _ => None,
            };
            match output {
                Some((sender, forwarder)) => {
                    let reply = run_streamed(&host, request, sender).instrument(span).await;
                    // Every chunk is out before the final message.
                    let _ = forwarder.await;
                    reply
                }
                None => run(&host, request).instrument(span).await,
            }
        }
        Err(e) => AgentReply::Failed(AgentFailure::Agent(format!("malformed agent request: {e}"))),
    };
    if let Err(e) = nats.publish(reply_to, wire::encode(&reply).into()).await {
        tracing::warn!(error = %e, "agent reply not sent");
    }
}

/// Chunks of a streamed exec's output, as they come from the agent.
type OutputSender = tokio::sync::mpsc::UnboundedSender<(u8, Vec<u8>)>;

/// A channel whose chunks a task publishes, in order, as [`AgentReply::Output`] to
/// `reply_to`; the task ends when every sender is dropped.
fn forward_output(
    nats: Client,
    reply_to: async_nats::Subject,
) -> (OutputSender, tokio::task::JoinHandle<()>) {
    let (sender, mut chunks) = tokio::sync::mpsc::unbounded_channel::<(u8, Vec<u8>)>();
    let task = tokio::spawn(async move {
        while let Some((fd, data)) = chunks.recv().await {
            let message = wire::encode(&AgentReply::Output { fd, data });
            if let Err(e) = nats.publish(reply_to.clone(), message.into()).await {
                tracing::warn!(error = %e, "streamed output not sent");
            }
        }
    });
    (sender, task)
}

/// Carries out a streamed exec: output goes to `output` as it arrives; the result is the
/// final message.
async fn run_streamed(host: &Host, request: AgentRequest, output: OutputSender) -> AgentReply {
    let AgentOp::ExecStream(spec) = request.op else {
        return run(host, request).await;
    };
    let sandbox = request.sandbox_id;
    let (address, _permit) = match host.exec_target(sandbox) {
        Ok(target) => target,
        Err(ExecError::NotFound) => return AgentReply::Failed(AgentFailure::NotFound),
        Err(_) => return AgentReply::Failed(AgentFailure::NotRunning),
    };
    if host.runtimes.simulated() {
        return crate::runtime::sim::agent(&AgentOp::ExecStream(spec));
    }
    exec(host, sandbox, address, spec, Some(output)).await
}

/// Carries out one request against the sandbox's agent.
pub async fn run(host: &Host, request: AgentRequest) -> AgentReply {
    let sandbox = request.sandbox_id;
    let (address, _permit) = match host.exec_target(sandbox) {
        Ok(target) => target,
        Err(ExecError::NotFound) => return AgentReply::Failed(AgentFailure::NotFound),
        Err(_) => return AgentReply::Failed(AgentFailure::NotRunning),
    };
    if host.runtimes.simulated() {
        return crate::runtime::sim::agent(&request.op);
    }
    if let Some(path) = relative_path(&request.op) {
        return AgentReply::Failed(AgentFailure::Agent(format!(
            "path {path:?} is not absolute"
        )));
    }
    let outcome = match request.op {
        AgentOp::Exec(spec) => return exec(host, sandbox, address, spec, None).await,
        // Streamed through `run_streamed`; asked for here, its output has nowhere to go.
        AgentOp::ExecStream(_) => {
            return AgentReply::Failed(AgentFailure::Agent(
                "a streamed exec needs the agent subject's streaming reply".into(),
            ))
        }
        AgentOp::Stat { path } => file_op(address, Request::Stat { path }).await,
        AgentOp::Read { path, offset, len } => {
            let len = u64::from(len).min(MAX_FILE_CHUNK);
            file_op(address, Request::Read { path, offset, len }).await
        }
        AgentOp::Write {
            path,
            offset,
            data,
            truncate,
        } => {
            file_op(
                address,
                Request::Write {
                    path,
                    offset,
                    data,
                    truncate,
                },
            )
            .await
        }
        AgentOp::List { path } => file_op(address, Request::List { path }).await,
        AgentOp::Rename { from, to } => file_op(address, Request::Rename { from, to }).await,
    };
    match outcome {
        Ok(reply) => reply,
        Err(e) => AgentReply::Failed(AgentFailure::Agent(e.report())),
    }
}

/// The first path of `op` that is not absolute.
fn relative_path(op: &AgentOp) -> Option<&str> {
    let paths: Vec<&str> = match op {
        AgentOp::Exec(_) | AgentOp::ExecStream(_) => vec![],
        AgentOp::Stat { path }
        | AgentOp::Read { path, .. }
        | AgentOp::Write { path, .. }
        | AgentOp::List { path } => vec![path],
        AgentOp::Rename { from, to } => vec![from, to],
    };
    paths.into_iter().find(|p| !p.starts_with('/'))
}

/// Runs an exec, counting the sandbox's OOM kills before and after it, and watching that the
/// sandbox still runs. With `output`, the agent streams the output there as it arrives.
async fn exec(
    host: &Host,
    sandbox: berth_schemas::SandboxId,
    address: SocketAddr,
    spec: ExecSpec,
    output: Option<OutputSender>,
) -> AgentReply {
    let counter = host.oom_counter(sandbox).await;
    let count = || counter.as_deref().and_then(crate::cgroup::read_oom_kills);
    let before = count();
    let ExecSpec {
        argv,
        env,
        cwd,
        stdin,
        timeout_ms,
    } = spec;
    let call: futures::future::BoxFuture<'_, Result<ExecResult, HostdError>> = match output {
        Some(output) => Box::pin(client::exec_stream(
            address,
            argv,
            env,
            cwd,
            stdin,
            timeout_ms,
            move |fd, data| {
                let _ = output.send((fd, data));
            },
        )),
        None => Box::pin(client::exec_with(
            address, argv, env, cwd, stdin, timeout_ms,
        )),
    };
    let result = tokio::select! {
        result = call => result,
        () = host.stopped_running(sandbox, EXEC_LIVENESS_INTERVAL) => {
            let oom_killed = matches!((before, count()), (Some(b), Some(a)) if a > b);
            tracing::warn!(oom_killed, "the sandbox stopped during an exec");
            return if oom_killed {
                AgentReply::Exec {
                    exit_code: OOM_EXIT_CODE,
                    stdout: Vec::new(),
                    stderr: b"the sandbox was killed by its memory limit\n".to_vec(),
                    timed_out: false,
                    oom_killed,
                }
            } else {
                AgentReply::Failed(AgentFailure::Agent(
                    "the sandbox stopped during the exec".into(),
                ))
            };
        }
    };
    match result {
        Ok(ExecResult::Finished(out)) => {
            let after = count();
            let oom_killed = matches!((before, after), (Some(b), Some(a)) if a > b);
            tracing::debug!(
                exit_code = out.exit_code,
                timed_out = out.timed_out,
                oom_killed,
                "exec finished"
            );
            if oom_killed {
                tracing::info!(exit_code = out.exit_code, "exec ended with an OOM kill");
            }
            AgentReply::Exec {
                exit_code: out.exit_code,
                stdout: out.stdout,
                stderr: out.stderr,
                timed_out: out.timed_out,
                oom_killed,
            }
        }
        Ok(ExecResult::Refused(reason)) => AgentReply::Failed(AgentFailure::Agent(reason)),
        Err(e) => AgentReply::Failed(AgentFailure::Agent(e.report())),
    }
}

/// Sends a file request and maps the agent's answer.
async fn file_op(address: SocketAddr, request: Request) -> Result<AgentReply, HostdError> {
    let response = client::call(address, &request, FILE_OP_TIMEOUT).await?;
    Ok(match (request, response) {
        (_, Response::Error(e)) => AgentReply::Failed(failure(e)),
        (Request::Stat { .. }, Response::Stat(s)) => AgentReply::Stat(file_stat(s.stat)),
        (Request::Read { .. }, Response::Data(d)) => AgentReply::Data {
            data: d.data,
            eof: d.eof,
        },
        (Request::Write { .. }, Response::Written(w)) => AgentReply::Written { bytes: w.written },
        (Request::List { .. }, Response::List(l)) => AgentReply::Listing(
            l.entries
                .into_iter()
                .map(|e| DirEntry {
                    name: e.name,
                    stat: file_stat(e.stat),
                })
                .collect(),
        ),
        (Request::Rename { .. }, Response::Ping(p)) if p.ok => AgentReply::Done,
        (_, other) => AgentReply::Failed(AgentFailure::Agent(format!(
            "unexpected agent answer {other:?}"
        ))),
    })
}

fn failure(e: ErrorReply) -> AgentFailure {
    match e.code.as_deref() {
        Some(CODE_NOT_FOUND) => AgentFailure::NoSuchPath,
        Some(CODE_TOO_LARGE) => AgentFailure::TooLarge {
            limit: MAX_FILE_CHUNK,
        },
        _ => AgentFailure::Agent(e.error),
    }
}

fn file_stat(s: Stat) -> FileStat {
    FileStat {
        kind: match s.kind {
            Kind::File => FileKind::File,
            Kind::Dir => FileKind::Dir,
            Kind::Symlink => FileKind::Symlink,
            Kind::Other => FileKind::Other,
        },
        size: s.size,
        mode: s.mode,
        modified_unix: s.modified,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_are_caught_before_reaching_the_agent() {
        let op = AgentOp::Rename {
            from: "/a".into(),
            to: "b".into(),
        };
        assert_eq!(relative_path(&op), Some("b"));
        assert_eq!(relative_path(&AgentOp::List { path: "/".into() }), None);
    }
}
