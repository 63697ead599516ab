//! A migrate (`sandbox.migrate`, issue 14: start elsewhere) that reaches a host still holding
//! a copy of the sandbox from an earlier stay: the copy is stale (the sandbox ran and stopped
//! elsewhere since), so hostd deletes it and boots the stop snapshot the command names, from
//! the object store, never the copy's disk.

use anyhow::{bail, ensure};
use berth_schemas::wire::{ResultOutcome, SnapshotOrder};
use berth_schemas::{CommandKind, SandboxId};

use crate::harness::*;

async fn sh(h: &Harness, sandbox: SandboxId, script: &str) -> anyhow::Result<String> {
    let reply = h
        .exec(sandbox, &["sh", "-c", script], EXEC_TIMEOUT_MS)
        .await?;
    let (code, out, _) = finished(&reply)?;
    ensure!(code == 0, "{script}: {reply:?}");
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrate_to_a_host_holding_a_stale_copy_boots_the_stored_stop_not_the_copy(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(stale_copy(h))).await
}

async fn stale_copy(h: &mut Harness) -> anyhow::Result<()> {
    let sandbox = SandboxId::new();
    succeeded_address(&h.send(&h.command(sandbox, 1, CommandKind::Create)).await?)?;
    sh(h, sandbox, "echo stored > /root/f").await?;
    let stop = h.command(sandbox, 2, CommandKind::Stop);
    h.send(&stop).await?;
    // The stop's second result: its snapshot is stored.
    let ResultOutcome::Durable(stored) = h.result_of(stop.id).await?.outcome else {
        bail!("the stop's second result is not its durability report");
    };
    // The copy this host keeps moves on: it is the stale one from here.
    succeeded_address(&h.send(&h.command(sandbox, 3, CommandKind::Start)).await?)?;
    sh(h, sandbox, "echo stale > /root/f").await?;
    h.send(&h.command(sandbox, 4, CommandKind::Stop)).await?;

    let mut migrate = h.command(sandbox, 5, CommandKind::Migrate);
    migrate.snapshot = Some(SnapshotOrder {
        snapshot_id: stored.snapshot_id,
        parent: None,
        disk_only: false,
    });
    succeeded_address(&h.send(&migrate).await?)?;
    let f = sh(h, sandbox, "cat /root/f").await?;
    ensure!(f == "stored\n", "booted the stale copy: {f:?}");

    let deleted = h.send(&h.command(sandbox, 6, CommandKind::Delete)).await?;
    ensure!(
        matches!(deleted.outcome, ResultOutcome::Succeeded { .. }),
        "{deleted:?}"
    );
    assert_nothing_remains(h, sandbox).await
}
