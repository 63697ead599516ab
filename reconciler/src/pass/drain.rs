//! The drive of draining hosts (issue 14, "Drain moves sandboxes"): each pass moves the
//! sandboxes of every `draining` host off it, at most [`PassConfig::drain_parallel`] in flight
//! per host, and follows the moves in flight to their end. What to do with each sandbox is
//! [`berth_schemas::host_state::drain`]'s decision; the transitions are the state machine's
//! ([`on_request`], [`away_from_home`], [`on_start_elsewhere`]) and the writes the store's, the
//! same as a user's archive, stop and start of a stopped sandbox whose host is draining.
//!
//! - A `stopped` sandbox is archived (reason `drain`): its stop snapshot is in the object store
//!   (already, when the stop is durable), its local disk freed; a later start unarchives it on
//!   whatever host placement picks. It is archived only when some other host has room for it
//!   now: on a fleet of one, a start of it would otherwise find no host, where the draining host
//!   still starts its own.
//! - With `live`, a `running` sandbox is stopped (reason `drain`; gVisor keeps its memory),
//!   and once its stop is durable, migrated to the host placement picks (never the drained
//!   one) and booted there from the stop snapshot: it ends `running` on that host, on gVisor
//!   with its processes. It is stopped only when some other host has room for it now.
//! - A move that cannot finish fails with its reason and stays failed until the host is drained
//!   again. A sandbox the drain stopped that cannot move is started again on its own host.
//!
//! # Guarantees
//! - Every write is fenced by the lease ([`fenced`]) and by the sandbox's generation (the rows
//!   are locked: a user's request on the same sandbox waits, or the pass skips it).
//! - Bounded: a draining host has at most [`PassConfig::drain_parallel`] moves in flight; a
//!   drain that ended (uncordon, cordon) begins none, but its moves in flight finish.
//! - A drain never strands a running sandbox stopped: a live move that fails starts it again at
//!   home (a `draining` host still runs its own), unless its stop failed or its host is gone.

use std::time::Duration;

use berth_scheduler::placement::{self, Candidate, Placement};
use berth_schemas::host_state::drain::{
    drain_request, on_drain_progress, DrainFailure, DrainKind, DrainPhase, DrainStep, Tracked,
};
use berth_schemas::state::{away_from_home, on_request, on_start_elsewhere, Decision, Request};
use berth_schemas::{HostId, Reason};
use berth_store::drain::{self, Move};
use berth_store::hosts::{self, Overcommit};
use berth_store::leases::Lease;
use berth_store::sandboxes::{self, Transition};
use berth_store::{SandboxRow, StoreError};
use sqlx::{PgConnection, PgPool};
use tracing::{info, warn};

use super::{commit, fenced, PassConfig, PassError};

/// Default [`PassConfig::drain_parallel`]: moves in flight per draining host.
pub const DEFAULT_DRAIN_PARALLEL: i64 = 4;

/// Moves the sandboxes of draining hosts: follows the moves in flight, then begins new ones.
/// Returns (moves begun, moves ended: done, failed or forgotten).
pub(super) async fn drive(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
) -> Result<(u64, u64), PassError> {
    let ended = follow(db, config, lease).await?;
    let mut begun = 0;
    for host in drain::draining(db).await? {
        let slots = config.drain_parallel - host.in_flight;
        if slots > 0 {
            begun += begin(db, config, lease, host.id, host.live, slots).await?;
        }
    }
    Ok((begun, ended))
}

/// Begins up to `slots` moves off `host`: archives its stopped sandboxes, and with `live`
/// stops its running ones, each only when another host has room for it now (else the move
/// fails: `no room`).
async fn begin(
    db: &PgPool,
    config: &PassConfig,
    lease: &Lease,
    host: HostId,
    live: bool,
    slots: i64,
) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let rows = drain::lock_untracked(&mut tx, host, live, slots).await?;
    // Room elsewhere, counting the running sandboxes this pass is about to move: none is stopped
    // for a move no host can take (a move in flight from an earlier pass is not counted; a
    // start that then finds no room starts it again at home).
    let health = &config.health;
    let mut room = if rows.is_empty() {
        Vec::new()
    } else {
        placement::candidates(&mut tx, health.heartbeat_freshness, health.overcommit).await?
    };
    room.retain(|c| c.id != host);
    let mut n = 0;
    for row in &rows {
        let Some((kind, request)) = drain_request(row.state, row.deleting(), live) else {
            continue;
        };
        if !claim_room(&mut room, row, kind == DrainKind::Live) {
            drain::track(
                &mut tx,
                row.id,
                host,
                kind,
                DrainPhase::Failed,
                Some(DrainFailure::NoRoom),
            )
            .await?;
            warn!(sandbox_id = %row.id, host_id = %host, "drain: no other host has room; it stays");
            n += 1;
            continue;
        }
        let Ok(Decision::Transition {
            to,
            command,
            capacity,
        }) = on_request(row.state, row.deleting(), request)
        else {
            continue;
        };
        let message = match kind {
            DrainKind::Archive => format!("drain: archived off host {host}"),
            DrainKind::Live => format!("drain: stopped to move it off host {host}"),
        };
        sandboxes::write_transition(
            &mut tx,
            row,
            &transition(to, Some(command), capacity, &message),
        )
        .await?;
        let phase = match kind {
            DrainKind::Archive => DrainPhase::Moving,
            DrainKind::Live => DrainPhase::Stopping,
        };
        drain::track(&mut tx, row.id, host, kind, phase, None).await?;
        info!(sandbox_id = %row.id, host_id = %host, kind = kind.as_str(), "drain: move begun");
        n += 1;
    }
    commit(tx).await?;
    Ok(n)
}

/// Whether a candidate in `room` fits `row`'s resources; with `take` (a running sandbox, whose
/// start elsewhere will reserve them) they are taken from the best one.
fn claim_room(room: &mut [Candidate], row: &SandboxRow, take: bool) -> bool {
    let need = row.resources;
    let Some(best) = placement::rank(room, need).first().copied() else {
        return false;
    };
    if take {
        if let Some(c) = room.iter_mut().find(|c| c.id == best) {
            c.reserved.vcpus += need.vcpus;
            c.reserved.memory_mib += need.memory_mib;
        }
    }
    true
}

/// Follows every move in flight one step ([`on_drain_progress`]); how many ended.
async fn follow(db: &PgPool, config: &PassConfig, lease: &Lease) -> Result<u64, PassError> {
    let mut tx = fenced(db, lease).await?;
    let mut n = 0;
    for m in drain::lock_in_flight(&mut tx, config.batch).await? {
        let row = &m.row;
        let tracked = Tracked {
            kind: m.kind,
            phase: m.phase,
            state: row.state,
            deleting: row.deleting(),
            at_home: row.host_id == Some(m.host),
            durable: row.durable_at.is_some(),
            waited: Duration::from_secs_f64(m.waited_seconds),
        };
        match on_drain_progress(&tracked, config.archive_timeout) {
            DrainStep::Wait => continue,
            DrainStep::Done => {
                drain::forget(&mut tx, row.id).await?;
                info!(sandbox_id = %row.id, host_id = %m.host, to = ?row.host_id,
                    state = %row.state.as_str(), "drain: moved off its host");
            }
            DrainStep::Forget => drain::forget(&mut tx, row.id).await?,
            DrainStep::Start => {
                if !start_elsewhere(&mut tx, config, &m).await? {
                    continue;
                }
            }
            DrainStep::Fail { why, restart } => fail(&mut tx, &m, why, restart).await?,
        }
        n += 1;
    }
    commit(tx).await?;
    Ok(n)
}

/// A live move whose stop is durable: migrates it to the host placement picks (never the
/// drained one), as a user's start of a stopped sandbox on a draining host would. When the
/// drain ended meanwhile (the host takes it back) it starts at home and the move is forgotten;
/// when no other host has room it starts at home and the move fails. Returns whether the move
/// ended.
async fn start_elsewhere(
    tx: &mut PgConnection,
    config: &PassConfig,
    m: &Move,
) -> Result<bool, PassError> {
    let row = &m.row;
    let health = &config.health;
    let fresh = health.heartbeat_freshness.as_secs_f64();
    let home = hosts::get(&mut *tx, m.host)
        .await?
        .map(|h| (h.state, h.heartbeat_age_seconds <= fresh));
    let Some(away) = away_from_home(home) else {
        let message = format!("drain of host {} ended: started again on it", m.host);
        start_at_home(tx, row, &message).await?;
        drain::forget(&mut *tx, row.id).await?;
        return Ok(true);
    };
    if on_start_elsewhere(row.state, row.deleting(), row.durable_at.is_some()).is_none() {
        return Ok(false);
    }
    let placed = placement::place(
        &mut *tx,
        row.resources,
        health.heartbeat_freshness,
        health.overcommit,
        Some(m.host),
    )
    .await?;
    let Placement::Placed { host: to, .. } = placed else {
        fail(tx, m, DrainFailure::NoRoom, away.home_still_runs()).await?;
        return Ok(true);
    };
    let message = format!("drain: moved off host {} ({away})", m.host);
    let (_, command_id) = sandboxes::migrate(&mut *tx, row, to, Reason::Drain, &message).await?;
    drain::track(&mut *tx, row.id, m.host, m.kind, DrainPhase::Moving, None).await?;
    info!(sandbox_id = %row.id, from = %m.host, host_id = %to, command_id = %command_id,
        "drain: migrating");
    Ok(false)
}

/// Records the move of `m` failed for `why`; with `restart`, starts its sandbox again on its
/// own host first (the drain stopped it).
async fn fail(
    tx: &mut PgConnection,
    m: &Move,
    why: DrainFailure,
    restart: bool,
) -> Result<(), PassError> {
    let row = &m.row;
    if restart {
        let message = format!("drain: could not move off host {}: {why}", m.host);
        start_at_home(tx, row, &message).await?;
    }
    drain::track(
        &mut *tx,
        row.id,
        m.host,
        m.kind,
        DrainPhase::Failed,
        Some(why),
    )
    .await?;
    warn!(sandbox_id = %row.id, host_id = %m.host, reason = why.as_str(), restart,
        "drain: move failed");
    Ok(())
}

/// Starts the locked `stopped` sandbox `row` on its own host (reason `drain`), as a user's
/// start would. A host without room for it leaves it `stopped` (logged).
async fn start_at_home(
    tx: &mut PgConnection,
    row: &SandboxRow,
    message: &str,
) -> Result<(), PassError> {
    let Ok(Decision::Transition {
        to,
        command,
        capacity,
    }) = on_request(row.state, row.deleting(), Request::Start)
    else {
        return Ok(());
    };
    match sandboxes::write_transition(
        &mut *tx,
        row,
        &transition(to, Some(command), capacity, message),
    )
    .await
    {
        Ok(_) => Ok(()),
        // Nothing was reserved or written: the transaction stays usable.
        Err(StoreError::NoCapacity { host, .. }) => {
            warn!(sandbox_id = %row.id, host_id = %host,
                "drain: its own host has no room to start it again; it stays stopped");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

fn transition(
    to: berth_schemas::SandboxState,
    command: Option<berth_schemas::CommandKind>,
    capacity: berth_schemas::Capacity,
    message: &str,
) -> Transition<'_> {
    Transition {
        to,
        command,
        capacity,
        reason: Reason::Drain,
        delete: false,
        message: Some(message),
        activity: false,
        overcommit: Overcommit::default(),
        snapshot: None,
    }
}
