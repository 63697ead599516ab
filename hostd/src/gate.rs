//! Agent gates: per sandbox, the agent calls in flight (exec, files, pings), and a way to
//! close the gate and wait for them to finish — a gVisor checkpoint fails on any connected
//! TCP endpoint, so a memory stop first drains the agent's connections. The gates also keep
//! each sandbox's idle agent connections (see `agent::kept`), which belong to the sandbox's
//! current run: closing or opening a gate drops them.
//!
//! # Guarantees
//! - While a sandbox's gate is closed, [`AgentGates::enter`] refuses; calls already in
//!   flight finish normally and [`AgentGates::close_and_drain`] waits for them (up to its
//!   timeout).
//! - While a sandbox's gate is closed it has no idle connection: closing drops them (hostd
//!   closes first, so no endpoint is left connected or in TIME_WAIT inside the sandbox), and
//!   a call that ends while the gate is closed drops its connection instead of keeping it.
//! - Lock order: the gates, then the idle connections. No lock is held across an `.await`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use berth_schemas::SandboxId;
use tokio::sync::Notify;

#[derive(Debug, Default)]
struct GateState {
    in_flight: usize,
    closed: bool,
}

/// Every sandbox's gate (an absent entry is an open gate with nothing in flight).
#[derive(Debug, Default)]
pub struct AgentGates {
    gates: Mutex<HashMap<SandboxId, GateState>>,
    changed: Notify,
    closing: Notify,
    idle: Mutex<HashMap<SandboxId, Idle>>,
}

/// The most idle agent connections kept per sandbox (more at once are closed after use).
pub const MAX_IDLE_PER_SANDBOX: usize = 4;

/// A sandbox's idle agent connections, and whether its agent cannot keep one (an agent of an
/// older bundle answers each call on its own connection).
#[derive(Debug, Default)]
struct Idle {
    connections: Vec<tokio::net::TcpStream>,
    one_per_call: bool,
}

/// One agent call in flight; dropping it ends the call.
#[derive(Debug)]
#[must_use = "the call counts as in flight until the permit is dropped"]
pub struct Permit {
    gates: Arc<AgentGates>,
    sandbox: SandboxId,
}

impl AgentGates {
    /// Every gate open, nothing in flight.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Starts an agent call; `None` while the gate is closed.
    pub fn enter(self: &Arc<Self>, sandbox: SandboxId) -> Option<Permit> {
        let mut gates = self.lock();
        let gate = gates.entry(sandbox).or_default();
        if gate.closed {
            return None;
        }
        gate.in_flight += 1;
        Some(Permit {
            gates: self.clone(),
            sandbox,
        })
    }

    /// Closes the gate, then waits until no call is in flight or `timeout` passes. Returns
    /// whether it drained.
    pub async fn close_and_drain(&self, sandbox: SandboxId, timeout: Duration) -> bool {
        self.close(sandbox);
        let drained = async {
            loop {
                let notified = self.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.lock().get(&sandbox).is_none_or(|g| g.in_flight == 0) {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, drained).await.is_ok()
    }

    /// Closes the gate without waiting, until the returned guard drops: for a stop or a
    /// delete under way. Calls in flight go on (the teardown may cut them, and they can tell
    /// by [`AgentGates::enter`] refusing that the sandbox is going away, not failing); new
    /// calls are refused.
    pub fn close_while(self: &Arc<Self>, sandbox: SandboxId) -> ClosedGate {
        self.close(sandbox);
        ClosedGate {
            gates: self.clone(),
            sandbox,
        }
    }

    /// Whether the sandbox's gate is closed (a stop or a delete is under way).
    pub fn is_closed(&self, sandbox: SandboxId) -> bool {
        self.lock().get(&sandbox).is_some_and(|g| g.closed)
    }

    /// Closes the gate and drops the sandbox's idle connections.
    fn close(&self, sandbox: SandboxId) {
        let mut gates = self.lock();
        gates.entry(sandbox).or_default().closed = true;
        self.idle().remove(&sandbox);
        drop(gates);
        self.closing.notify_waiters();
    }

    /// Resolves once the sandbox's gate is closed (a stop or a delete under way): at once
    /// when it is.
    pub async fn closed(&self, sandbox: SandboxId) {
        loop {
            let notified = self.closing.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_closed(sandbox) {
                return;
            }
            notified.await;
        }
    }

    /// Opens the gate again (for a new run of the sandbox: the idle connections of the last
    /// one, if any, are dropped).
    pub fn open(&self, sandbox: SandboxId) {
        let mut gates = self.lock();
        self.idle().remove(&sandbox);
        if let Some(gate) = gates.get_mut(&sandbox) {
            gate.closed = false;
            if gate.in_flight == 0 {
                gates.remove(&sandbox);
            }
        }
    }

    /// An idle connection to the sandbox's agent, if one is kept.
    pub fn take_idle(&self, sandbox: SandboxId) -> Option<tokio::net::TcpStream> {
        self.idle().get_mut(&sandbox)?.connections.pop()
    }

    /// Keeps `connection` for the sandbox's next call, unless the gate is closed or
    /// [`MAX_IDLE_PER_SANDBOX`] are kept already (then it is closed).
    pub fn keep_idle(&self, sandbox: SandboxId, connection: tokio::net::TcpStream) {
        let gates = self.lock();
        if gates.get(&sandbox).is_some_and(|g| g.closed) {
            return;
        }
        let mut idle = self.idle();
        let kept = &mut idle.entry(sandbox).or_default().connections;
        if kept.len() < MAX_IDLE_PER_SANDBOX {
            kept.push(connection);
        }
    }

    /// Whether the sandbox's agent answers one call per connection (until its gate closes or
    /// opens again).
    pub fn one_per_call(&self, sandbox: SandboxId) -> bool {
        self.idle().get(&sandbox).is_some_and(|i| i.one_per_call)
    }

    /// Records that the sandbox's agent answers one call per connection.
    pub fn set_one_per_call(&self, sandbox: SandboxId) {
        let gates = self.lock();
        if gates.get(&sandbox).is_some_and(|g| g.closed) {
            return;
        }
        self.idle().entry(sandbox).or_default().one_per_call = true;
    }

    /// How many idle connections the sandbox has kept.
    pub fn idle_count(&self, sandbox: SandboxId) -> usize {
        self.idle().get(&sandbox).map_or(0, |i| i.connections.len())
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<SandboxId, GateState>> {
        // Entries are whole counters; a poisoned map is still consistent.
        self.gates.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn idle(&self) -> MutexGuard<'_, HashMap<SandboxId, Idle>> {
        // Whole connections; a poisoned map is still consistent.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A gate closed by [`AgentGates::close_while`]; dropping it opens the gate again.
#[derive(Debug)]
#[must_use = "the gate opens again when the guard drops"]
pub struct ClosedGate {
    gates: Arc<AgentGates>,
    sandbox: SandboxId,
}

impl Drop for ClosedGate {
    fn drop(&mut self) {
        self.gates.open(self.sandbox);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut gates = self.gates.lock();
        if let Some(gate) = gates.get_mut(&self.sandbox) {
            gate.in_flight = gate.in_flight.saturating_sub(1);
            if gate.in_flight == 0 && !gate.closed {
                gates.remove(&self.sandbox);
            }
        }
        drop(gates);
        self.gates.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_closed_gate_refuses_and_drains_calls_in_flight() {
        let gates = AgentGates::new();
        let sandbox = SandboxId::new();
        let permit = gates.enter(sandbox).expect("open gate");
        let drain = {
            let gates = gates.clone();
            tokio::spawn(
                async move { gates.close_and_drain(sandbox, Duration::from_secs(5)).await },
            )
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(gates.enter(sandbox).is_none(), "closed gates refuse");
        assert!(!drain.is_finished(), "a call is still in flight");
        drop(permit);
        assert!(drain.await.unwrap());
        gates.open(sandbox);
        assert!(gates.enter(sandbox).is_some());
    }

    #[test]
    fn a_gate_closed_for_a_teardown_refuses_until_its_guard_drops() {
        let gates = AgentGates::new();
        let sandbox = SandboxId::new();
        let in_flight = gates.enter(sandbox).expect("open gate");
        let closed = gates.close_while(sandbox);
        assert!(
            gates.enter(sandbox).is_none(),
            "refused during the teardown"
        );
        drop(in_flight);
        assert!(gates.enter(sandbox).is_none(), "still closed");
        drop(closed);
        assert!(gates.enter(sandbox).is_some(), "open again");
    }

    #[tokio::test]
    async fn draining_gives_up_at_the_timeout() {
        let gates = AgentGates::new();
        let sandbox = SandboxId::new();
        let _permit = gates.enter(sandbox).unwrap();
        assert!(
            !gates
                .close_and_drain(sandbox, Duration::from_millis(50))
                .await
        );
    }
}
