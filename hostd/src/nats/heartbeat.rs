//! Heartbeats: core-NATS publishes on `{p}.hb.<host_id>`, one at start and then every
//! interval (and at once when a warm pool sandbox becomes ready), carrying capacity, use,
//! runtimes, the observed inventory and the warm pool.
//!
//! Core NATS (at most once) on purpose: only the latest heartbeat matters, and `seq` lets the
//! consumer drop one that arrives late. Each heartbeat carries its send time (`sent_at_ms`,
//! the host's clock), against which the consumer measures its lag.

use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use berth_schemas::wire::{self, Heartbeat, Resources, RuntimeInfo};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::host::Host;

/// The default interval between heartbeats.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);

/// What every heartbeat of this hostd repeats.
#[derive(Debug, Clone)]
pub struct HeartbeatConfig {
    /// `{p}.hb.<host_id>`.
    pub subject: String,
    /// The host's human-readable name.
    pub name: String,
    /// What the host offers to sandboxes.
    pub capacity: Resources,
    /// Time between heartbeats.
    pub interval: Duration,
    /// The preview forwarder's advertised address, when this host runs one.
    pub forwarder: Option<String>,
}

/// Publishes heartbeats until `shutdown`. A round whose observation fails (the runtime does
/// not answer) is skipped with a warning rather than sent with a wrong inventory.
pub async fn run(
    host: Arc<Host>,
    nats: Client,
    config: HeartbeatConfig,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(config.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            // The first tick fires at once: one heartbeat right at start.
            _ = ticker.tick() => {}
            // A warm sandbox is ready: offer it now (the interval starts again).
            _ = host.warm.offered.notified() => ticker.reset(),
        }
        // The number and the time are taken before the observation: the inventory is no older
        // than either (see `HeartbeatSeq::next`).
        let sent_at_ms = unix_ms(std::time::SystemTime::now());
        let seq = host.heartbeat_seq.next(sent_at_ms);
        let (used, inventory) = match host.observe().await {
            Ok(observed) => observed,
            Err(e) => {
                tracing::warn!(error = %e.report(), "heartbeat skipped: observation failed");
                continue;
            }
        };
        let heartbeat = Heartbeat {
            host_id: host.host_id,
            name: config.name.clone(),
            seq,
            capacity: less(config.capacity, host.warm.held()),
            used,
            runtimes: host
                .runtimes
                .all()
                .iter()
                .map(|r| RuntimeInfo {
                    name: r.name().to_owned(),
                    memory_snapshot: r.memory_snapshot(),
                })
                .collect(),
            inventory,
            forwarder: config.forwarder.clone(),
            sent_at_ms,
            warm: host.warm.slots(),
        };
        if let Err(e) = nats
            .publish(config.subject.clone(), wire::encode(&heartbeat).into())
            .await
        {
            tracing::warn!(error = %e, seq, "heartbeat not published");
        }
    }
}

/// `t` in milliseconds since the Unix epoch (0 before it).
fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `capacity` less the memory `held_mib` (the warm pool's) takes of it (never below zero). An
/// idle warm sandbox holds its memory limit but spends no CPU time, and its vCPUs are a quota,
/// not a reservation: taking them off would leave a 2-vCPU host with a pool of two 1-vCPU
/// sandboxes no room at all for the creates the pool is for.
fn less(capacity: Resources, held_mib: u32) -> Resources {
    Resources {
        vcpus: capacity.vcpus,
        memory_mib: capacity.memory_mib.saturating_sub(held_mib),
    }
}
