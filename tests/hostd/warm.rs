//! The warm pool on runc (issue 16 lever 1): a pool fills with the shape of a template's
//! create, offers its sandboxes in heartbeats apart from the inventory, and a create naming a
//! pooled sandbox takes it over indistinguishable from a fresh one (its own address, hostname,
//! cgroup limits; the create's env, entrypoint and egress); a pooled sandbox of another shape,
//! or one that died in the pool, is built anew; a graceful stop removes the pool, and so does
//! a host restarted without one.

use anyhow::{ensure, Context as _};
use berth_schemas::network::Egress;
use berth_schemas::wire::{Command, GuestStatus, Heartbeat, ResultOutcome};
use berth_schemas::{CommandKind, SandboxId};

use crate::harness::*;
use crate::runc::assert_cgroup_limits;
use crate::support::env::{eventually, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_sandbox_is_handed_to_a_create_of_its_shape_as_if_booted_for_it(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(warm_pool(h))).await
}

/// The next heartbeat whose warm pool satisfies `check`.
async fn heartbeat_where(
    h: &mut Harness,
    what: &str,
    check: impl Fn(&Heartbeat) -> bool,
) -> anyhow::Result<Heartbeat> {
    use futures::StreamExt as _;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let msg = tokio::time::timeout_at(deadline, h.heartbeats.next())
            .await
            .with_context(|| format!("no heartbeat where {what}"))?
            .context("heartbeat subscription ended")?;
        let hb: Heartbeat = berth_schemas::wire::decode(&msg.payload)?;
        if check(&hb) {
            return Ok(hb);
        }
    }
}

/// The one pooled sandbox of the next heartbeat offering one of `memory_mib` other than
/// `not`, tracked for the harness's cleanup.
async fn pooled(h: &mut Harness, not: &[SandboxId], memory_mib: u32) -> anyhow::Result<SandboxId> {
    let hb = heartbeat_where(h, "a new warm sandbox is offered", |hb| {
        hb.warm.len() == 1
            && !not.contains(&hb.warm[0].sandbox_id)
            && hb.warm[0].resources.memory_mib == memory_mib
    })
    .await?;
    let slot = &hb.warm[0];
    ensure!(
        !hb.inventory.iter().any(|i| i.sandbox_id == slot.sandbox_id),
        "a warm sandbox is in the inventory"
    );
    // (A sandbox of an older shape being removed may still count.)
    ensure!(
        hb.capacity.memory_mib <= h.config.capacity.memory_mib - slot.resources.memory_mib,
        "the warm sandbox's memory is not taken off the capacity: {:?}",
        hb.capacity
    );
    h.sandboxes
        .lock()
        .expect("not poisoned")
        .push(slot.sandbox_id);
    Ok(slot.sandbox_id)
}

/// `cmd` with an env, an entrypoint that leaves a mark, and no egress.
fn with_settings(mut cmd: Command) -> Command {
    let spec = cmd.spec.as_mut().expect("a create has a spec");
    spec.env = vec![("GREETING".into(), "hello from the create".into())];
    spec.entrypoint = vec![
        "sh".into(),
        "-c".into(),
        "echo ran > /tmp/entrypoint".into(),
    ];
    spec.network.egress = Egress::None;
    cmd
}

async fn warm_pool(h: &mut Harness) -> anyhow::Result<()> {
    h.stop_hostd().await?;
    h.config.warm_pool = "base=1".parse().map_err(anyhow::Error::msg)?;
    h.start_hostd();

    // A create shows the pool its shape; the pool boots one sandbox of it.
    let first = SandboxId::new();
    let created = h.send(&h.command(first, 1, CommandKind::Create)).await?;
    let first_address = succeeded_address(&created)?;
    let warm = pooled(h, &[], 256).await?;
    let table = berth_hostd::layout::firewall_table(h.host_id);
    let veth = h.names(warm).veth_host;

    // A create naming it takes it over: the create's settings, the pooled sandbox's own
    // address, hostname and limits.
    let handed = h
        .send(&with_settings(h.command(warm, 1, CommandKind::Create)))
        .await?;
    let address = succeeded_address(&handed)?;
    ensure!(address != first_address, "two sandboxes at {address}");
    let (code, out, _) = finished(
        &h.exec(
            warm,
            &["sh", "-c", "echo $GREETING; hostname"],
            EXEC_TIMEOUT_MS,
        )
        .await?,
    )?;
    ensure!(
        code == 0 && out == format!("hello from the create\n{}\n", h.names(warm).container_id),
        "env or hostname: {code} {out:?}"
    );
    eventually("the create's entrypoint ran", || async {
        h.exec(warm, &["cat", "/tmp/entrypoint"], EXEC_TIMEOUT_MS)
            .await
            .ok()
            .and_then(|r| finished(&r).ok())
            .is_some_and(|(code, out, _)| code == 0 && out == "ran\n")
    })
    .await;
    assert_cgroup_limits(h, warm, 256).await?;
    assert_booted_pid_in_own_cgroup(h, warm)?;
    let public = run("nft", &["list", "set", "inet", &table, "public"]).await?;
    ensure!(!public.contains(&veth), "egress none, yet public: {public}");
    h.heartbeat_with(warm, GuestStatus::Running).await?;

    // The pool refills; a graceful stop removes what it holds, whole, and the restarted host
    // pools again once a create shows it the shape.
    let gone = pooled(h, &[warm], 256).await?;
    h.stop_hostd().await?;
    assert_nothing_remains(h, gone).await?;
    h.start_hostd();
    let again = SandboxId::new();
    succeeded_address(&h.send(&h.command(again, 1, CommandKind::Create)).await?)?;
    let refill = pooled(h, &[warm, gone], 256).await?;

    // One of another shape (which the API never sends, but a host must not trust) is built
    // anew with the create's limits.
    let mut bigger = h.command(refill, 1, CommandKind::Create);
    bigger.spec.as_mut().expect("spec").resources.memory_mib = 512;
    let rebuilt = h.send(&bigger).await?;
    succeeded_address(&rebuilt)?;
    assert_cgroup_limits(h, refill, 512).await?;
    let (code, _, _) = finished(&h.exec(refill, &["true"], EXEC_TIMEOUT_MS).await?)?;
    ensure!(code == 0);

    // That create showed the pool a new shape. One of it that died in the pool is booted anew
    // by the create that names it.
    let dead = pooled(h, &[warm, gone, refill], 512).await?;
    let pid = std::fs::read_to_string(h.sandbox_dir(dead).join("init.pid"))?;
    run("kill", &["-9", pid.trim()]).await?;
    let mut revive = h.command(dead, 1, CommandKind::Create);
    revive.spec = bigger.spec.clone();
    let revived = h.send(&revive).await?;
    succeeded_address(&revived)?;
    let (code, _, _) = finished(&h.exec(dead, &["true"], EXEC_TIMEOUT_MS).await?)?;
    ensure!(code == 0, "the revived sandbox does not exec");

    // A killed hostd leaves its pool to the next start, which adopts it and offers it again.
    h.stop_hostd().await?;
    h.spawn_hostd_process(None)?;
    let shown = SandboxId::new();
    let mut show = h.command(shown, 1, CommandKind::Create);
    show.spec = bigger.spec.clone();
    succeeded_address(&h.send(&show).await?)?;
    let kept = pooled(h, &[warm, gone, refill, dead], 512).await?;
    h.process.take().context("no hostd process")?.kill().await?;
    h.start_hostd();
    heartbeat_where(h, "the restarted host offers the pool it kept", |hb| {
        hb.warm.iter().map(|s| s.sandbox_id).eq([kept])
    })
    .await?;

    // Deletes leave nothing of any of them; a host without a pool removes the one it kept.
    delete_then_unpool(h, &[first, again, warm, refill, dead, shown], 2, 512).await
}

/// Deletes `sandboxes` (at `generation`), each leaving nothing; then stops hostd (which
/// removes the pooled sandbox of `memory_mib` it holds, whole) and starts it without a pool.
async fn delete_then_unpool(
    h: &mut Harness,
    sandboxes: &[SandboxId],
    generation: i64,
    memory_mib: u32,
) -> anyhow::Result<()> {
    for &sandbox in sandboxes {
        let deleted = h
            .send(&h.command(sandbox, generation, CommandKind::Delete))
            .await?;
        ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
        assert_nothing_remains(h, sandbox).await?;
    }
    let last = pooled(h, sandboxes, memory_mib).await?;
    h.stop_hostd().await?;
    h.config.warm_pool = Default::default();
    h.start_hostd();
    heartbeat_where(h, "the pool is empty", |hb| hb.warm.is_empty()).await?;
    eventually("the last warm sandbox is removed", || async {
        !h.sandbox_dir(last).exists()
    })
    .await;
    assert_nothing_remains(h, last).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_gvisor_sandbox_is_handed_over_and_keeps_its_memory_across_a_stop(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(warm_gvisor(h))).await
}

async fn warm_gvisor(h: &mut Harness) -> anyhow::Result<()> {
    h.stop_hostd().await?;
    h.config.warm_pool = "base-gvisor=1".parse().map_err(anyhow::Error::msg)?;
    h.start_hostd();
    let shown = SandboxId::new();
    let create =
        |h: &Harness, id| h.command_with_template(id, 1, CommandKind::Create, "base-gvisor");
    succeeded_address(&h.send(&create(h, shown)).await?)?;
    let warm = pooled(h, &[], 256).await?;

    // Handed over: the create's env; a process started now survives a memory stop and start.
    let handed = h.send(&with_settings(create(h, warm))).await?;
    succeeded_address(&handed)?;
    let (code, out, _) = finished(
        &h.exec(
            warm,
            &[
                "sh",
                "-c",
                "sleep 1000 </dev/null >/dev/null 2>&1 & echo $GREETING $!",
            ],
            EXEC_TIMEOUT_MS,
        )
        .await?,
    )?;
    let pid = out
        .strip_prefix("hello from the create ")
        .with_context(|| format!("env not set: {code} {out:?}"))?
        .trim()
        .to_owned();
    stop_with_memory(h, warm, 2, "a handed-over gVisor sandbox").await?;
    let started = h.send(&h.command(warm, 3, CommandKind::Start)).await?;
    succeeded_address(&started)?;
    let (code, _, _) = finished(&h.exec(warm, &["kill", "-0", &pid], EXEC_TIMEOUT_MS).await?)?;
    ensure!(
        code == 0,
        "the process started before the stop is gone after the start"
    );

    delete_then_unpool(h, &[shown, warm], 4, 256).await
}
