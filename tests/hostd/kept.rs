//! hostd's kept agent connections (`berth_hostd::agent::kept`) against a real runc sandbox:
//! calls share a connection (seen from the host's TCP table), concurrent execs each get their
//! own, and a stop and start, or an agent that dies and is started again, are reached on a
//! new connection.

use std::net::Ipv4Addr;

use anyhow::{ensure, Context as _};
use berth_schemas::wire::{AgentReply, GuestStatus};
use berth_schemas::{CommandKind, SandboxId};

use crate::harness::*;
use crate::support::env::eventually;

/// `/proc/net/tcp` states.
const ESTABLISHED: &str = "01";
const TIME_WAIT: &str = "06";

/// How many of the host's TCP sockets to `sandbox:18047` are in `state`.
fn sockets_to_agent(sandbox: Ipv4Addr, state: &str) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    // Addresses are little-endian hex on x86: 10.1.2.3 is 0302010A.
    let octets = sandbox.octets();
    let remote = format!(
        "{:02X}{:02X}{:02X}{:02X}:{:04X}",
        octets[3],
        octets[2],
        octets[1],
        octets[0],
        berth_hostd::agent::protocol::AGENT_PORT
    );
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.get(2) == Some(&remote.as_str()) && fields.get(3) == Some(&state)
        })
        .count()
}

async fn echo(h: &Harness, sandbox: SandboxId, word: &str) -> anyhow::Result<()> {
    let reply = h.exec(sandbox, &["echo", word], EXEC_TIMEOUT_MS).await?;
    let (code, out, _) = finished(&reply)?;
    ensure!(code == 0 && out == format!("{word}\n"), "{reply:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execs_share_a_kept_agent_connection_run_concurrently_and_reconnect_after_a_restart(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(kept_connections(h))).await
}

async fn kept_connections(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    let created = h.send(&h.command(sandbox, 1, CommandKind::Create)).await?;
    let address: Ipv4Addr = succeeded_address(&created)?
        .split(':')
        .next()
        .unwrap_or_default()
        .parse()
        .context("the sandbox's address")?;

    // Calls one after another: a connection kept, none closed per call (the host's liveness
    // pings of each heartbeat go over kept connections too).
    echo(h, sandbox, "first").await?;
    let closed_before = sockets_to_agent(address, TIME_WAIT);
    for i in 0..10 {
        echo(h, sandbox, &format!("call{i}")).await?;
    }
    // One for the calls (a heartbeat's liveness ping that overlaps one takes a second).
    let cap = berth_hostd::gate::MAX_IDLE_PER_SANDBOX;
    let open = sockets_to_agent(address, ESTABLISHED);
    ensure!((1..=2).contains(&open), "kept connections: {open}");
    ensure!(
        sockets_to_agent(address, TIME_WAIT) <= closed_before,
        "ten calls closed connections: {} in TIME_WAIT, {closed_before} before",
        sockets_to_agent(address, TIME_WAIT)
    );

    // Six at once: each waits until all six have started, so they must run concurrently.
    let barrier = "mkdir -p /tmp/b; touch /tmp/b/$0; \
                   while [ $(ls /tmp/b | wc -l) -lt 6 ]; do sleep 0.01; done; echo $0";
    let shared: &Harness = h;
    let calls = (0..6).map(move |i| {
        let name = format!("c{i}");
        let h = shared;
        async move {
            let reply = h
                .exec(sandbox, &["sh", "-c", barrier, &name], EXEC_TIMEOUT_MS)
                .await?;
            let (code, out, timed_out) = finished(&reply)?;
            ensure!(
                code == 0 && !timed_out && out == format!("{name}\n"),
                "{reply:?}"
            );
            anyhow::Ok(())
        }
    });
    for outcome in futures::future::join_all(calls).await {
        outcome?;
    }
    eventually("at most the cap of connections stays kept", || {
        let kept = sockets_to_agent(address, ESTABLISHED);
        async move { kept <= cap }
    })
    .await;

    // A stop drops the kept connections; after the start a new one reaches the new agent.
    let stopped = h.send(&h.command(sandbox, 2, CommandKind::Stop)).await?;
    ensure!(matches!(
        stopped.outcome,
        berth_schemas::wire::ResultOutcome::Succeeded { .. }
    ));
    ensure!(
        sockets_to_agent(address, ESTABLISHED) == 0,
        "no connection outlives the stop"
    );
    succeeded_address(&h.send(&h.command(sandbox, 3, CommandKind::Start)).await?)?;
    echo(h, sandbox, "after-start").await?;

    // The agent dies under a call on a kept connection: that call fails (never run twice);
    // after a start the new agent is reached.
    echo(h, sandbox, "warm").await?;
    let reply = h
        .exec(sandbox, &["sh", "-c", "kill -9 $PPID"], EXEC_TIMEOUT_MS)
        .await?;
    ensure!(
        matches!(reply, AgentReply::Failed(_)),
        "the exec outlived its agent: {reply:?}"
    );
    h.heartbeat_with(sandbox, GuestStatus::Unhealthy).await?;
    succeeded_address(&h.send(&h.command(sandbox, 4, CommandKind::Start)).await?)?;
    echo(h, sandbox, "after-restart").await?;
    let open = sockets_to_agent(address, ESTABLISHED);
    ensure!((1..=cap).contains(&open), "kept connections: {open}");

    let deleted = h.send(&h.command(sandbox, 5, CommandKind::Delete)).await?;
    ensure!(matches!(
        deleted.outcome,
        berth_schemas::wire::ResultOutcome::Succeeded { .. }
    ));
    ensure!(sockets_to_agent(address, ESTABLISHED) == 0);
    Ok(())
}
