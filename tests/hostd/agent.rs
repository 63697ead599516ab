//! Requests to the in-sandbox agent through hostd: exec with env, cwd and stdin, file moves,
//! an OOM kill, a dying agent, and streamed exec (with and without flow control).

use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use berth_schemas::wire::{
    self, AgentFailure, AgentOp, AgentReply, AgentRequest, FileKind, GuestStatus, ResultOutcome,
};
use berth_schemas::{CommandKind, SandboxId};
use futures::StreamExt;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_requests_run_with_env_cwd_stdin_move_files_and_report_an_oom_kill(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(agent_requests(h))).await
}

async fn agent_requests(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    succeeded_address(&h.send(&h.command(sandbox, 1, CommandKind::Create)).await?)?;

    // Exec with env, cwd and stdin.
    let mut spec = exec_spec(&["sh", "-c", "echo $GREETING; pwd; cat"], EXEC_TIMEOUT_MS);
    spec.env = vec![("GREETING".into(), "hi".into())];
    spec.cwd = Some("/tmp".into());
    spec.stdin = b"from stdin".to_vec();
    match h.agent(sandbox, AgentOp::Exec(spec)).await? {
        AgentReply::Exec {
            exit_code: 0,
            stdout,
            oom_killed: false,
            ..
        } => ensure!(stdout == b"hi\n/tmp\nfrom stdin", "{stdout:?}"),
        other => bail!("exec: {other:?}"),
    }

    // Files: write in two chunks, read back, stat, list, rename; a missing path is named.
    let write = |offset: u64, data: &[u8], truncate: bool| AgentOp::Write {
        path: "/root/dir/f.part".into(),
        offset,
        data: data.to_vec(),
        truncate,
    };
    ensure!(h.agent(sandbox, write(0, b"hello ", true)).await? == AgentReply::Written { bytes: 6 });
    ensure!(h.agent(sandbox, write(6, b"world", false)).await? == AgentReply::Written { bytes: 5 });
    let renamed = h
        .agent(
            sandbox,
            AgentOp::Rename {
                from: "/root/dir/f.part".into(),
                to: "/root/dir/f".into(),
            },
        )
        .await?;
    ensure!(renamed == AgentReply::Done, "{renamed:?}");
    let read = h
        .agent(
            sandbox,
            AgentOp::Read {
                path: "/root/dir/f".into(),
                offset: 0,
                len: 1 << 20,
            },
        )
        .await?;
    ensure!(
        read == AgentReply::Data {
            data: b"hello world".to_vec(),
            eof: true
        },
        "{read:?}"
    );
    match h
        .agent(
            sandbox,
            AgentOp::List {
                path: "/root/dir".into(),
            },
        )
        .await?
    {
        AgentReply::Listing(entries) => ensure!(
            entries.len() == 1
                && entries[0].name == "f"
                && entries[0].stat.kind == FileKind::File
                && entries[0].stat.size == 11,
            "{entries:?}"
        ),
        other => bail!("list: {other:?}"),
    }
    let missing = h
        .agent(
            sandbox,
            AgentOp::Stat {
                path: "/nope".into(),
            },
        )
        .await?;
    ensure!(
        missing == AgentReply::Failed(AgentFailure::NoSuchPath),
        "{missing:?}"
    );

    // A memory hog is killed by the sandbox's memory limit (256 MiB), and the exec says so.
    let hog = exec_spec(
        &["dd", "if=/dev/zero", "of=/dev/null", "bs=400M", "count=1"],
        30_000,
    );
    match h.agent(sandbox, AgentOp::Exec(hog)).await? {
        AgentReply::Exec {
            exit_code,
            oom_killed,
            ..
        } => ensure!(
            exit_code == 137 && oom_killed,
            "memory hog: exit {exit_code}, oom_killed {oom_killed}"
        ),
        other => bail!("memory hog: {other:?}"),
    }
    // The sandbox survives it.
    let (code, _, _) = finished(&h.exec(sandbox, &["true"], EXEC_TIMEOUT_MS).await?)?;
    ensure!(code == 0);
    // An exec past its timeout is killed.
    match h
        .agent(sandbox, AgentOp::Exec(exec_spec(&["sleep", "30"], 300)))
        .await?
    {
        AgentReply::Exec {
            timed_out: true,
            exit_code: 137,
            oom_killed: false,
            ..
        } => {}
        other => bail!("timeout: {other:?}"),
    }

    // Unknown sandboxes and relative paths are refused.
    let unknown = h
        .agent(SandboxId::new(), AgentOp::Stat { path: "/".into() })
        .await?;
    ensure!(
        unknown == AgentReply::Failed(AgentFailure::NotFound),
        "{unknown:?}"
    );
    let relative = h
        .agent(sandbox, AgentOp::Stat { path: "etc".into() })
        .await?;
    ensure!(
        matches!(relative, AgentReply::Failed(AgentFailure::Agent(_))),
        "{relative:?}"
    );

    let deleted = h.send(&h.command(sandbox, 2, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_whose_agent_dies_is_reported_unhealthy() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(agent_dies(h))).await
}

async fn agent_dies(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    succeeded_address(&h.send(&h.command(sandbox, 1, CommandKind::Create)).await?)?;
    h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    // The exec's parent is the agent's server process: kill it.
    let reply = h
        .exec(sandbox, &["sh", "-c", "kill -9 $PPID"], EXEC_TIMEOUT_MS)
        .await?;
    ensure!(
        matches!(reply, AgentReply::Failed(AgentFailure::Agent(_))),
        "the exec outlived its agent: {reply:?}"
    );
    h.heartbeat_with(sandbox, GuestStatus::Unhealthy).await?;
    // A start brings it back.
    succeeded_address(&h.send(&h.command(sandbox, 2, CommandKind::Start)).await?)?;
    h.heartbeat_with(sandbox, GuestStatus::Running).await?;
    let deleted = h.send(&h.command(sandbox, 3, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_exec_delivers_output_while_the_process_runs() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(streamed_exec(h))).await
}

async fn streamed_exec(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    succeeded_address(&h.send(&h.command(sandbox, 1, CommandKind::Create)).await?)?;
    let inbox = h.nats.new_inbox();
    let mut replies = h.nats.subscribe(inbox.clone()).await?;
    let request = AgentRequest {
        sandbox_id: sandbox,
        op: AgentOp::ExecStream(exec_spec(
            &["sh", "-c", "echo one; sleep 2; echo two >&2; exit 3"],
            EXEC_TIMEOUT_MS,
        )),
    };
    h.nats
        .publish_with_reply(
            h.subjects.agent(h.host_id),
            inbox,
            wire::encode(&request).into(),
        )
        .await?;
    let started = std::time::Instant::now();
    let mut chunks = Vec::new();
    let (exit, last_at) = loop {
        let message = tokio::time::timeout(EXEC_REQUEST_TIMEOUT, replies.next())
            .await
            .context("no streamed reply")?
            .context("subscription ended")?;
        match wire::decode::<AgentReply>(&message.payload)? {
            AgentReply::Output { fd, data } => chunks.push((fd, data, started.elapsed())),
            AgentReply::Exec {
                exit_code,
                stdout,
                stderr,
                ..
            } => {
                ensure!(stdout.is_empty() && stderr.is_empty(), "output came twice");
                break (exit_code, started.elapsed());
            }
            other => bail!("streamed exec: {other:?}"),
        }
    };
    ensure!(exit == 3, "exit {exit}");
    let texts: Vec<(u8, &[u8])> = chunks
        .iter()
        .map(|(fd, d, _)| (*fd, d.as_slice()))
        .collect();
    ensure!(
        texts == [(1, &b"one\n"[..]), (2, &b"two\n"[..])],
        "{texts:?}"
    );
    ensure!(
        last_at - chunks[0].2 >= Duration::from_secs(1),
        "the first chunk came only at the end: {:?} vs {last_at:?}",
        chunks[0].2
    );
    let deleted = h.send(&h.command(sandbox, 2, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_windowed_stream_publishes_only_against_credit() -> anyhow::Result<()> {
    with_harness(|h| Box::pin(windowed_stream(h))).await
}

/// The next message of a streamed exec.
async fn next_reply(replies: &mut async_nats::Subscriber) -> anyhow::Result<AgentReply> {
    let message = tokio::time::timeout(EXEC_REQUEST_TIMEOUT, replies.next())
        .await
        .context("no streamed reply")?
        .context("subscription ended")?;
    Ok(wire::decode::<AgentReply>(&message.payload)?)
}

/// Publishes a flow-control op (no reply subject) on the host's agent subject.
async fn control(h: &Harness, sandbox: SandboxId, op: AgentOp) -> anyhow::Result<()> {
    let request = AgentRequest {
        sandbox_id: sandbox,
        op,
    };
    h.nats
        .publish(h.subjects.agent(h.host_id), wire::encode(&request).into())
        .await?;
    Ok(())
}

async fn windowed_stream(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    succeeded_address(&h.send(&h.command(sandbox, 1, CommandKind::Create)).await?)?;
    let inbox = h.nats.new_inbox();
    let mut replies = h.nats.subscribe(inbox.clone()).await?;
    // About 1.3 MB of output: far more than a window of 2 messages.
    let request = AgentRequest {
        sandbox_id: sandbox,
        op: AgentOp::ExecStreamWindowed {
            spec: exec_spec(&["seq", "1", "200000"], EXEC_TIMEOUT_MS),
            window: 2,
        },
    };
    h.nats
        .publish_with_reply(
            h.subjects.agent(h.host_id),
            inbox.clone(),
            wire::encode(&request).into(),
        )
        .await?;
    let mut outputs = 0;
    // The window, then credit for three more.
    for _ in 0..2 {
        ensure!(matches!(
            next_reply(&mut replies).await?,
            AgentReply::Output { .. }
        ));
        outputs += 1;
    }
    control(
        h,
        sandbox,
        AgentOp::StreamCredit {
            reply_to: inbox.clone(),
            chunks: 3,
        },
    )
    .await?;
    for _ in 0..3 {
        ensure!(matches!(
            next_reply(&mut replies).await?,
            AgentReply::Output { .. }
        ));
        outputs += 1;
    }
    // With no credit left, nothing more can have been published: after a cancel, the next
    // message is the final one.
    control(
        h,
        sandbox,
        AgentOp::StreamCancel {
            reply_to: inbox.clone(),
        },
    )
    .await?;
    let last = next_reply(&mut replies).await?;
    ensure!(
        matches!(last, AgentReply::Failed(AgentFailure::Agent(_))),
        "after {outputs} outputs: {last:?}"
    );
    let deleted = h.send(&h.command(sandbox, 2, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    Ok(())
}
