//! Agent operations of an OCI sandbox, forwarded to its in-sandbox agent: exec with env, cwd
//! and stdin (streamed or not, with OOM reporting and a liveness watch), and files (stat,
//! read, write, list, rename). The NATS face that receives them is `nats::agent`.

use std::net::SocketAddr;
use std::time::Duration;

use berth_schemas::wire::{
    AgentFailure, AgentOp, AgentReply, DirEntry, ExecSpec, FileKind, FileStat, TtySize,
};
use berth_schemas::SandboxId;

use crate::agent::client::{self, ExecResult};
use crate::agent::kept;
use crate::agent::protocol::{
    ErrorReply, Kind, Request, Response, Stat, CODE_NOT_FOUND, CODE_NOT_REGULAR, CODE_TOO_LARGE,
    MAX_FILE_CHUNK,
};
use crate::error::HostdError;
use crate::host::{Host, OutputSender};

/// How long one file operation may take at the agent.
pub const FILE_OP_TIMEOUT: Duration = Duration::from_secs(30);

/// How often a running exec checks that its sandbox still runs. A gVisor sandbox killed whole
/// (by its memory limit, say) resets no connection, so the agent's silence alone would only
/// end at the exec's timeout.
pub const EXEC_LIVENESS_INTERVAL: Duration = Duration::from_secs(1);

/// The exit code reported for an exec whose sandbox its memory limit killed (128 + SIGKILL).
const OOM_EXIT_CODE: i32 = 137;

/// Carries out one operation against the sandbox's agent at `address` (the caller holds the
/// sandbox's gate permit). A streamed exec sends its output to `output` as it arrives; asked
/// for without `output`, it fails.
pub async fn run(
    host: &Host,
    sandbox: SandboxId,
    address: SocketAddr,
    op: AgentOp,
    output: Option<OutputSender>,
) -> AgentReply {
    if let Some(path) = relative_path(&op) {
        return AgentReply::Failed(AgentFailure::Agent(format!(
            "path {path:?} is not absolute"
        )));
    }
    let kept = kept::Target {
        gates: host.gates.clone(),
        sandbox,
        address,
    };
    let outcome = match (op, output) {
        (AgentOp::Exec(spec), _) => return exec(host, sandbox, address, spec, None).await,
        (AgentOp::ExecStream(spec) | AgentOp::ExecStreamWindowed { spec, .. }, Some(output)) => {
            return exec(host, sandbox, address, spec, Some(output)).await
        }
        // Its output would have nowhere to go.
        (AgentOp::ExecStream(_) | AgentOp::ExecStreamWindowed { .. }, None) => {
            return AgentReply::Failed(AgentFailure::Agent(
                "a streamed exec needs the agent subject's streaming reply".into(),
            ))
        }
        (AgentOp::Stat { path }, _) => file_op(&kept, Request::Stat { path }).await,
        (AgentOp::Read { path, offset, len }, _) => {
            let len = u64::from(len).min(MAX_FILE_CHUNK);
            file_op(&kept, Request::Read { path, offset, len }).await
        }
        (
            AgentOp::Write {
                path,
                offset,
                data,
                truncate,
            },
            _,
        ) => {
            file_op(
                &kept,
                Request::Write {
                    path,
                    offset,
                    data,
                    truncate,
                },
            )
            .await
        }
        (AgentOp::List { path }, _) => file_op(&kept, Request::List { path }).await,
        (AgentOp::Rename { from, to }, _) => file_op(&kept, Request::Rename { from, to }).await,
        (AgentOp::Remove { path }, _) => file_op(&kept, Request::Remove { path }).await,
        // Flow control of a stream and terminal sessions, routed by `nats::agent` before
        // they reach this.
        (
            AgentOp::StreamCredit { .. }
            | AgentOp::StreamCancel { .. }
            | AgentOp::Tty { .. }
            | AgentOp::TtyInput { .. },
            _,
        ) => {
            return AgentReply::Failed(AgentFailure::Agent(
                "stream flow control is not an agent operation".into(),
            ))
        }
    };
    match outcome {
        Ok(reply) => reply,
        Err(e) => AgentReply::Failed(AgentFailure::Agent(e.report())),
    }
}

/// The first path of `op` that is not absolute.
fn relative_path(op: &AgentOp) -> Option<&str> {
    let paths: Vec<&str> = match op {
        AgentOp::Exec(_)
        | AgentOp::ExecStream(_)
        | AgentOp::ExecStreamWindowed { .. }
        | AgentOp::StreamCredit { .. }
        | AgentOp::StreamCancel { .. }
        | AgentOp::Tty { .. }
        | AgentOp::TtyInput { .. } => vec![],
        AgentOp::Stat { path }
        | AgentOp::Remove { path }
        | AgentOp::Read { path, .. }
        | AgentOp::Write { path, .. }
        | AgentOp::List { path } => vec![path],
        AgentOp::Rename { from, to } => vec![from, to],
    };
    paths.into_iter().find(|p| !p.starts_with('/'))
}

/// Runs an exec, counting the sandbox's OOM kills before and after it, and watching that the
/// sandbox still runs. With `output`, the agent streams the output there as it arrives.
/// The sandbox's own environment (its spec's `env`, when it has one) with the exec's over it:
/// the exec's value wins for a name both set. Each name once, the sandbox's first.
fn with_sandbox_env(
    sandbox: Option<Vec<(String, String)>>,
    exec: Vec<(String, String)>,
) -> Vec<(String, String)> {
    let mut merged = sandbox.unwrap_or_default();
    for (name, value) in exec {
        merged.retain(|(n, _)| *n != name);
        merged.push((name, value));
    }
    merged
}

async fn exec(
    host: &Host,
    sandbox: SandboxId,
    address: SocketAddr,
    spec: ExecSpec,
    output: Option<OutputSender>,
) -> AgentReply {
    let ExecSpec {
        argv,
        env,
        cwd,
        stdin,
        timeout_ms,
    } = spec;
    let env = with_sandbox_env(host.live(sandbox).map(|r| r.spec.env), env);
    let call: futures::future::BoxFuture<'_, Result<ExecResult, HostdError>> = match &output {
        Some(output) => Box::pin(client::exec_stream(
            address, argv, env, cwd, stdin, timeout_ms, output,
        )),
        None => {
            let target = kept::Target {
                gates: host.gates.clone(),
                sandbox,
                address,
            };
            Box::pin(async move { kept::exec(&target, argv, env, cwd, stdin, timeout_ms).await })
        }
    };
    supervise(host, sandbox, call).await
}

/// Runs a terminal session (see [`client::tty`]), watched like an exec: OOM kills counted,
/// a sandbox that stops meanwhile ends it. Unlike an exec, a session does not wait for its
/// own end when a stop or a delete closes the sandbox's gate: it is hung up (within
/// [`EXEC_LIVENESS_INTERVAL`]), so that a memory stop's drain finds no connection open and
/// the checkpoint keeps the sandbox's other processes (the session's own get `SIGHUP`).
pub async fn tty(
    host: &Host,
    sandbox: SandboxId,
    address: SocketAddr,
    spec: ExecSpec,
    size: TtySize,
    output: OutputSender,
    input: client::TtyInputReceiver,
) -> AgentReply {
    let call = Box::pin(async move {
        let session = client::tty(address, spec, size, &output, input);
        let closing = async {
            while !host.gates.is_closed(sandbox) {
                tokio::time::sleep(EXEC_LIVENESS_INTERVAL).await;
            }
        };
        tokio::select! {
            result = session => result,
            () = closing => Err(HostdError::Agent {
                address,
                reason: "the sandbox is stopping: the session was hung up".into(),
            }),
        }
    });
    supervise(host, sandbox, call).await
}

/// Awaits an exec's `call` while watching its sandbox: the OOM kills during it, and a sandbox
/// that stops running (which ends the call: its connection may never be reset).
async fn supervise(
    host: &Host,
    sandbox: SandboxId,
    call: futures::future::BoxFuture<'_, Result<ExecResult, HostdError>>,
) -> AgentReply {
    let counter = host.oom_counter(sandbox).await;
    let count = || counter.as_deref().and_then(crate::cgroup::read_oom_kills);
    let before = count();
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
            } else if !still_meant_to_run(host, sandbox) {
                // Stopped or deleted meanwhile: the requester's conflict, not an agent fault.
                AgentReply::Failed(AgentFailure::NotRunning)
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
        // A connection cut mid-exec by a stop or a delete taking the sandbox down: say so,
        // rather than pass on the broken read.
        Err(e) if !still_meant_to_run(host, sandbox) => {
            tracing::info!(error = %e.report(), "the sandbox stopped during an exec");
            AgentReply::Failed(AgentFailure::NotRunning)
        }
        Err(e) => AgentReply::Failed(AgentFailure::Agent(e.report())),
    }
}

/// Whether the sandbox is still meant to run here: its record says running and no stop or
/// delete has closed its gate. A sandbox that crashed on its own still is (its exec failed:
/// an agent fault); one a stop or delete is taking down is not.
fn still_meant_to_run(host: &Host, sandbox: SandboxId) -> bool {
    host.exec_target(sandbox).is_ok()
}

/// Sends a file request over a kept connection and maps the agent's answer.
async fn file_op(target: &kept::Target, request: Request) -> Result<AgentReply, HostdError> {
    let response = kept::call(target, &request, FILE_OP_TIMEOUT).await?;
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
        (Request::Rename { .. } | Request::Remove { .. }, Response::Ping(p)) if p.ok => {
            AgentReply::Done
        }
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
        Some(CODE_NOT_REGULAR) => AgentFailure::NotRegularFile,
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
