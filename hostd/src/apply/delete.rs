//! Delete: remove whatever the sandbox holds, by derived names, so a delete also finishes a
//! delete or create that crashed half-way; leave a tombstone record.
//!
//! # Guarantees
//! Idempotent and converging: every step succeeds when what it removes is gone. A failure is
//! returned for the caller to retry the whole delete later.

use berth_schemas::wire::{Command, ResultOutcome};
use berth_schemas::SandboxId;
use tracing::Instrument as _;

use crate::disk::remove_sandbox_dir;
use crate::error::HostdError;
use crate::host::Host;
use crate::record::{Phase, SandboxRecord};

/// Deletes `cmd`'s sandbox: its container in whatever runtime holds it, then what the backend
/// holds for it (network, mount) and its dir. Returns the tombstone. Its address goes back to
/// the pool once the backend says its network is gone ([`crate::host::Backend::network_gone`]:
/// the kernel removes a deleted namespace's veth pair after the delete answered).
///
/// Errors: any step's error; the caller retries later.
pub async fn delete(
    host: &Host,
    cmd: &Command,
    record: Option<SandboxRecord>,
) -> Result<(Option<SandboxRecord>, ResultOutcome), HostdError> {
    remove_everything(host, cmd.sandbox_id, record.as_ref()).await?;
    // Without a record and without a spec (a purged row's destroy of a container this host no
    // longer has a record for) there is nothing to keep: no tombstone.
    let tombstone = record
        .or_else(|| super::new_record(host, cmd))
        .map(|mut tombstone| {
            tombstone.phase = Phase::Deleted;
            tombstone.link = None;
            tombstone
        });
    tracing::info!("sandbox deleted");
    let outcome = ResultOutcome::Succeeded {
        address: None,
        last_stop: None,
    };
    Ok((tombstone, outcome))
}

/// Removes whatever `id` holds on this host, by derived names: its container in whatever
/// runtime holds it (the one `record` names, else each), then what the backend holds for it
/// (network, mounts) and its dir with the record file. Its address goes back to the pool once
/// the backend says its network is gone. A delete's work, and a warm pool sandbox's removal
/// ([`crate::warm`]).
///
/// Errors: any step's error; what is gone stays gone, and a retry finishes the rest.
pub async fn remove_everything(
    host: &Host,
    id: SandboxId,
    record: Option<&SandboxRecord>,
) -> Result<(), HostdError> {
    let names = host.names(id);
    // The runtime its record names; a record-less delete does not know which, and asks each
    // (a runtime asked for a container it does not hold still costs its start: ~25 ms for
    // runsc).
    let runtimes = match record.map(|r| host.runtime_of(r)) {
        Some(Ok(runtime)) => vec![runtime],
        _ => host.runtimes.all().to_vec(),
    };
    async {
        for runtime in runtimes {
            runtime.destroy(&names.container_id).await?;
        }
        Ok::<_, HostdError>(())
    }
    .instrument(crate::apply::step("destroy"))
    .await?;
    host.backend
        .tear_down(host, id, record)
        .instrument(crate::apply::step("tear_down"))
        .await?;
    // The address goes back to the pool once the kernel removed the veth that holds it.
    if let Some(release) = host.allocator.release_later(id) {
        let (allocator, gone) = (host.allocator.clone(), host.backend.network_gone(host, id));
        tokio::spawn(async move {
            gone.await;
            allocator.finish_release(release);
        });
    }
    host.forget_oom_counter(id);
    crate::fault::crash_point(crate::fault::Step::TornDown);
    remove_sandbox_dir(&host.layout.sandbox(id))
        .instrument(crate::apply::step("remove_dir"))
        .await?;
    Ok(())
}
