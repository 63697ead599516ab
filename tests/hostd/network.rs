//! Sandbox networking through hostd: isolation between sandboxes and from the host, and the
//! stray networks a restarted hostd sweeps. Egress policies, spoofing and IPv6 are
//! `egress.rs`'s.

use anyhow::{ensure, Context as _};
use berth_hostd::layout::SandboxNames;
use berth_schemas::wire::ResultOutcome;
use berth_schemas::{CommandKind, HostId, SandboxId};
use futures::StreamExt;

use crate::harness::*;
use crate::support::env::run;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sandboxes_cannot_reach_each_other_or_the_host_but_hostd_reaches_both(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(isolation(h))).await
}

async fn isolation(h: &mut Harness) -> anyhow::Result<()> {
    let (a, b) = (SandboxId::new(), SandboxId::new());
    let addr_a = succeeded_address(&h.send(&h.command(a, 1, CommandKind::Create)).await?)?;
    let addr_b = succeeded_address(&h.send(&h.command(b, 1, CommandKind::Create)).await?)?;
    // A listener of the host, on every address (the sandbox's gateway included).
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await?;
    let port = listener.local_addr()?.port().to_string();
    let gateway_a = {
        let ip: std::net::Ipv4Addr = addr_a.parse()?;
        std::net::Ipv4Addr::from(u32::from(ip) - 1).to_string()
    };
    let nc = |target: &str, port: &str| {
        format!("nc -w 2 {target} {port} </dev/null >/dev/null 2>&1; echo $?")
    };

    // The control: a sandbox reaches its own agent.
    let (_, own, _) = finished(
        &h.exec(a, &["sh", "-c", &nc(&addr_a, "18047")], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(
        own.trim() == "0",
        "a sandbox can't reach its own agent: {own}"
    );
    // Neither sandbox reaches the other's agent; A does not reach the host's listener.
    let (_, a_to_b, _) = finished(
        &h.exec(a, &["sh", "-c", &nc(&addr_b, "18047")], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(a_to_b.trim() != "0", "sandbox A reached sandbox B");
    let (_, b_to_a, _) = finished(
        &h.exec(b, &["sh", "-c", &nc(&addr_a, "18047")], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(b_to_a.trim() != "0", "sandbox B reached sandbox A");
    let (_, to_host, _) = finished(
        &h.exec(a, &["sh", "-c", &nc(&gateway_a, &port)], EXEC_TIMEOUT_MS)
            .await?,
    )?;
    ensure!(
        to_host.trim() != "0",
        "sandbox A opened a connection to the host"
    );
    // hostd reaches both agents.
    for sandbox in [a, b] {
        let (code, out, _) = finished(&h.exec(sandbox, &["echo", "up"], EXEC_TIMEOUT_MS).await?)?;
        ensure!(code == 0 && out == "up\n");
    }
    // The rules live in this hostd's own table, one set element per sandbox.
    let table = berth_hostd::layout::firewall_table(h.host_id);
    let rules = run("nft", &["list", "table", "inet", &table]).await?;
    for addr in [&addr_a, &addr_b] {
        let network = {
            let ip: std::net::Ipv4Addr = addr.parse()?;
            std::net::Ipv4Addr::from(u32::from(ip) & !3).to_string()
        };
        ensure!(
            rules.contains(&format!("{network}/30")),
            "{network} missing: {rules}"
        );
    }

    // Delete removes the sandbox's element.
    let deleted = h.send(&h.command(a, 2, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    let rules = run("nft", &["list", "table", "inet", &table]).await?;
    let network_a = {
        let ip: std::net::Ipv4Addr = addr_a.parse()?;
        std::net::Ipv4Addr::from(u32::from(ip) & !3).to_string()
    };
    ensure!(
        !rules.contains(&format!("{network_a}/30")),
        "element of A remains: {rules}"
    );
    let deleted = h.send(&h.command(b, 2, CommandKind::Delete)).await?;
    ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    drop(listener);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_hostd_sweeps_its_stray_network_and_keeps_other_hosts_objects(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(sweep_strays(h))).await
}

async fn sweep_strays(h: &mut Harness) -> anyhow::Result<()> {
    h.stop_hostd().await?;
    let pool = berth_hostd::address::AddressPool::new(h.config.address_pool);
    // Ours: marked with this host's id, no record.
    let ours = SandboxId::new();
    let ours_names = h.names(ours);
    h.sandboxes.lock().expect("not poisoned").push(ours);
    berth_hostd::netns::ensure(
        &ours_names,
        &pool.link(berth_hostd::address::Slot(7)),
        &berth_hostd::netns::owner_alias(h.host_id, ours),
    )
    .await?;
    // Another host's: the same shape, another host id. It must survive.
    let other_host = HostId::new();
    let theirs = SandboxId::new();
    let their_names = SandboxNames::derive(other_host, theirs);
    berth_hostd::netns::ensure(
        &their_names,
        &pool.link(berth_hostd::address::Slot(8)),
        &berth_hostd::netns::owner_alias(other_host, theirs),
    )
    .await?;
    h.start_hostd();
    // The first heartbeat follows the sweep.
    let deadline = tokio::time::Instant::now() + HEARTBEAT_TIMEOUT;
    tokio::time::timeout_at(deadline, h.heartbeats.next())
        .await
        .context("no heartbeat after the restart")?;
    let netns = run("ip", &["netns", "list"]).await?;
    let links = run("ip", &["-o", "link"]).await?;
    let theirs_kept = netns.contains(&their_names.netns) && links.contains(&their_names.veth_host);
    let _ = run("ip", &["link", "del", &their_names.veth_host]).await;
    let _ = run("ip", &["netns", "del", &their_names.netns]).await;
    ensure!(
        !netns.contains(&ours_names.netns),
        "our stray netns survived"
    );
    ensure!(
        !links.contains(&ours_names.veth_host),
        "our stray veth survived"
    );
    ensure!(theirs_kept, "another host's network was swept");
    Ok(())
}
