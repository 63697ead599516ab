//! Start elsewhere (issue 14, `migrating`): a start of a `stopped` sandbox lands on its own
//! host when that host can take it back; otherwise, when its stop is durable, the sandbox is
//! placed on another host (capacity reserved in this transaction, as a create's) and sent a
//! `sandbox.migrate` that fetches its stop snapshot there. The decisions are the state
//! machine's ([`away_from_home`], [`on_start_elsewhere`]); this module reads the host, places
//! and has the store write.

use std::time::Duration;

use berth_scheduler::placement;
use berth_schemas::state::{away_from_home, on_start_elsewhere, Away, Reason};
use berth_store::sandboxes::{self, Transition, Written};
use berth_store::{hosts, SandboxRow, StoreError};
use sqlx::PgConnection;
use tracing::info;

use super::sandboxes::{place_avoiding, PlacementPolicy};
use super::ServiceError;

/// How long a client refused because the stop is not durable yet should wait: the upload
/// after a stop usually finishes within seconds.
pub const NOT_DURABLE_RETRY_AFTER: Duration = Duration::from_secs(5);

/// Writes the start of the locked `stopped` sandbox `row` in the caller's transaction:
/// `transition` (`starting` on its own host) when that host can take it back, else a
/// migration to the host placement picks (never the old one) when the stop is durable. A
/// draining or cordoned host that cannot hand the sandbox on (not durable yet, no room
/// elsewhere) still starts it itself ([`Away::home_still_runs`]).
///
/// Errors, when its host cannot run it (gone, lost, silent, full): [`ServiceError::NoCapacity`]
/// (no other host has room), [`ServiceError::Unavailable`] with [`NOT_DURABLE_RETRY_AFTER`]
/// (the stop is not durable yet), or placement's `Unavailable` (the hosts with room are stale
/// or degraded). Nothing is written then.
pub(crate) async fn start_stopped(
    tx: &mut PgConnection,
    overcommit: placement::Overcommit,
    row: &SandboxRow,
    transition: &Transition<'_>,
) -> Result<Written, ServiceError> {
    let freshness = berth_scheduler::DEFAULT_HEARTBEAT_FRESHNESS;
    let home = match row.host_id {
        Some(id) => hosts::get(&mut *tx, id)
            .await?
            .map(|h| (h.state, h.heartbeat_age_seconds <= freshness.as_secs_f64())),
        None => None,
    };
    let away = match away_from_home(home) {
        Some(why) => why,
        // A full host reserves nothing and writes nothing: the transaction stays usable.
        None => match sandboxes::write_transition(&mut *tx, row, transition).await {
            Err(StoreError::NoCapacity { .. }) => Away::Full,
            written => return Ok(written?),
        },
    };
    let old = row
        .host_id
        .map_or_else(|| "none".to_owned(), |h| h.to_string());
    let durable = on_start_elsewhere(row.state, row.deleting(), row.durable_at.is_some());
    let placed = match durable {
        Some(_) => {
            let policy = PlacementPolicy {
                heartbeat_freshness: freshness,
                overcommit,
            };
            place_avoiding(&mut *tx, policy, row.resources, row.host_id).await
        }
        // Its host being full says nothing of the fleet (an attack run got `no_capacity`
        // while another host had room): a stop not durable yet is a passing condition.
        None => Err(ServiceError::Unavailable {
            message: format!(
                "the sandbox's host {old} is {away} and its stop is not durable yet (its \
                 stop snapshot is still uploading, or the upload failed), so it cannot start \
                 elsewhere; retry after {} s, or archive it",
                NOT_DURABLE_RETRY_AFTER.as_secs()
            ),
            retry_after: NOT_DURABLE_RETRY_AFTER,
        }),
    };
    let to = match placed {
        Ok(to) => to,
        // A draining or cordoned host still runs its own: the start lands there as before.
        // Placement reserved nothing, so the transaction is usable.
        Err(ServiceError::NoCapacity { .. } | ServiceError::Unavailable { .. })
            if away.home_still_runs() =>
        {
            info!(sandbox_id = %row.id, host_id = %old, %away,
                "cannot start elsewhere; starting on its own host");
            return Ok(sandboxes::write_transition(&mut *tx, row, transition).await?);
        }
        Err(error) => return Err(error),
    };
    let message = format!("start elsewhere: its host {old} is {away}");
    let (moved, command_id) = sandboxes::migrate(&mut *tx, row, to, Reason::UserRequest, &message)
        .await
        .map_err(ServiceError::from)?;
    info!(sandbox_id = %row.id, from = %old, host_id = %to, %away, command_id = %command_id,
        "start elsewhere: migrating");
    Ok(Written {
        row: moved,
        command_id: Some(command_id),
    })
}
