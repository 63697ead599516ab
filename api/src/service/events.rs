//! Reading the `events` table: a sandbox's events (`GET /v1/sandboxes/{id}/events`), and the
//! published event log — rows the relay has published, in publish order (`seq`), rendered as
//! CloudEvents. Read by the SSE stream ([`crate::http::events`]) and the webhook fan-out
//! ([`crate::webhooks::delivery`]); written by the relay ([`crate::outbox::event_relay`]).
//!
//! # Guarantees
//! - The rows and their order are the store's ([`berth_store::events`]): `seq` values become
//!   visible in increasing order, so a resume point never skips an event.
//! - An event's CloudEvent `id` is its row id, on every path.

use berth_schemas::{EventId, OrgId, SandboxId};
use berth_store::{events, sandboxes};
use sqlx::PgPool;

pub use berth_store::events::{latest_seq, published_after, EventFilter, EventRecord};

use super::ServiceError;
use crate::model::Event;

/// The events of `org`'s sandbox `id`, oldest first.
///
/// Errors: [`ServiceError::NotFound`] when the sandbox is not `org`'s.
pub async fn of_sandbox(
    db: &PgPool,
    org: OrgId,
    id: SandboxId,
) -> Result<Vec<Event>, ServiceError> {
    let sandbox = super::sandboxes::get(db, org, id).await?;
    Ok(events::list_for_sandbox(db, org, sandbox.id)
        .await?
        .into_iter()
        .map(|e| Event {
            id: e.id.as_uuid(),
            sandbox_id: e.sandbox_id,
            kind: e.kind,
            from: e.from,
            to: e.to,
            reason: e.reason,
            generation: e.generation.0,
            message: e.message,
            last_stop: e.last_stop,
            last_stop_code: e.last_stop_code,
            last_stop_reason: e.last_stop_reason,
            at: e.at,
        })
        .collect())
}

/// Why a stream cannot start where it was asked to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamStart {
    /// Start after this publish position.
    After(i64),
    /// The resume point names no published event of the org.
    UnknownLastEvent,
}

/// Where an SSE stream of `org` starts: after the published event `last` (`None`: from the
/// oldest retained event; `Some(None)`: a resume point that is not an event id, which names
/// nothing).
///
/// Errors: [`ServiceError::NotFound`] when `filter` names a sandbox that is not `org`'s.
pub async fn stream_start(
    db: &PgPool,
    org: OrgId,
    filter: &EventFilter,
    last: Option<Option<EventId>>,
) -> Result<StreamStart, ServiceError> {
    if let Some(sandbox) = filter.sandbox_id {
        // Another org's sandbox (or none) is "not found", as on every sandbox route.
        if sandboxes::get(db, org, sandbox).await?.is_none() {
            return Err(ServiceError::NotFound(format!("sandbox {sandbox}")));
        }
    }
    Ok(match last {
        None => StreamStart::After(0),
        Some(None) => StreamStart::UnknownLastEvent,
        Some(Some(id)) => match events::seq_of(db, org, id).await? {
            Some(seq) => StreamStart::After(seq),
            None => StreamStart::UnknownLastEvent,
        },
    })
}

/// [`published_after`] on a connection of the pool.
pub async fn published_after_on(
    db: &PgPool,
    org: OrgId,
    after_seq: i64,
    filter: &EventFilter,
    limit: i64,
) -> Result<Vec<EventRecord>, ServiceError> {
    Ok(published_after(db, org, after_seq, filter, limit).await?)
}
