//! `berth admin breaker-list` and `berth admin breaker-release`: an operator's view of the
//! reconciler's circuit breakers of guest failures, and their word to let a tripped one act
//! (README, "Operations": the circuit breaker).

use std::fmt::Write;

use anyhow::bail;
use berth_schemas::HostId;
use berth_store::breakers::{self, Scope};
use sqlx::PgPool;

/// How many recent host events `breaker-list` shows.
pub const RECENT_EVENTS: i64 = 20;

/// The stored trips and the newest host events, as text.
///
/// Errors: the database's.
pub async fn list(db: &PgPool) -> anyhow::Result<String> {
    let mut out = String::new();
    let trips = breakers::trips(db).await?;
    if trips.is_empty() {
        writeln!(out, "no circuit breaker is tripped")?;
    }
    for t in trips {
        let scope = match t.scope {
            Scope::Host(id) => format!("host {id}"),
            Scope::Fleet => "fleet".to_owned(),
        };
        let state = match &t.released {
            Some((at, by)) => format!("released by {by} at {at}"),
            None => "holding".to_owned(),
        };
        writeln!(
            out,
            "{scope}: tripped at {}, {} passes, {} of {} running sandboxes would fail; {state}",
            t.tripped_at, t.passes, t.would_fail, t.running
        )?;
    }
    let events = breakers::recent_events(db, RECENT_EVENTS).await?;
    if !events.is_empty() {
        writeln!(out, "recent host events:")?;
    }
    for e in events {
        let scope = e
            .host
            .map_or_else(|| "fleet".to_owned(), |h| format!("host {h}"));
        writeln!(out, "  {} {} {scope}: {}", e.at, e.kind, e.message)?;
    }
    Ok(out)
}

/// Releases the trip of `host` (or of the fleet when `None`): the next pass fails the guests
/// the evidence shows failed there.
///
/// Errors: no such trip; the database's.
pub async fn release(db: &PgPool, host: Option<HostId>) -> anyhow::Result<()> {
    let scope = host.map_or(Scope::Fleet, Scope::Host);
    if !breakers::release(db, scope).await? {
        bail!("no circuit breaker of {} is tripped", scope.key());
    }
    Ok(())
}
