//! Migrate (`sandbox.migrate`, issue 14: start elsewhere): a stopped sandbox whose own host
//! could not take it back is fetched onto this host from its durable stop snapshot and booted,
//! by the clone path under its own id (`resume`), as an unarchive is.
//!
//! This host may hold a copy of the sandbox from an earlier stay (it was stopped here, then
//! started elsewhere, and the delete of that copy has not reached this host yet). That copy is
//! stale: the sandbox ran and stopped elsewhere since. It is removed first, as a delete
//! would, so the bring-up seeds from the stored snapshot and never boots the stale disk. An
//! unarchive does the same: the sandbox may have been archived from this host, and the delete
//! that frees that disk (queued with `archived`) may not have come yet.
//!
//! # Crash safety
//! A record at the migrate's own generation is this command's (a redelivery after a crash):
//! it is kept, and the clone path finishes it.

use std::sync::Arc;

use berth_schemas::wire::Command;

use crate::error::HostdError;
use crate::host::Host;
use crate::record::SandboxRecord;

/// Removes `live`, this host's record of `cmd`'s sandbox, with everything it holds, when it is
/// older than the migrate (a stale copy); returns the record the migrate continues from:
/// `None` for a fresh clone, or its own record on a redelivery.
///
/// Errors: the delete's (the caller retries the command later).
pub async fn forget_stale_copy(
    host: &Arc<Host>,
    cmd: &Command,
    live: Option<SandboxRecord>,
) -> Result<Option<SandboxRecord>, HostdError> {
    let Some(record) = live else {
        return Ok(None);
    };
    if record.applied_generation >= cmd.generation {
        return Ok(Some(record));
    }
    tracing::info!(applied = %record.applied_generation,
        "a stale copy of a sandbox migrating here; removing it before the fetch");
    let (tombstone, _) = super::delete::delete(host, cmd, Some(record)).await?;
    if let Some(mut tombstone) = tombstone {
        // Its stop snapshot is not this host's to answer a start from (`archived_here`).
        tombstone.durable = None;
        tombstone.durable_by = None;
        host.store.bury(&tombstone)?;
        host.forget(cmd.sandbox_id);
    }
    Ok(None)
}
