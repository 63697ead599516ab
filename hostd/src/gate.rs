//! Agent gates: per sandbox, the agent calls in flight (exec, files, pings), and a way to
//! close the gate and wait for them to finish — a gVisor checkpoint fails on any connected
//! TCP endpoint, so a memory stop first drains the agent's connections.
//!
//! # Guarantees
//! - While a sandbox's gate is closed, [`AgentGates::enter`] refuses; calls already in
//!   flight finish normally and [`AgentGates::close_and_drain`] waits for them (up to its
//!   timeout).
//! - The lock is never held across an `.await`.

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
        self.lock().entry(sandbox).or_default().closed = true;
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
        self.lock().entry(sandbox).or_default().closed = true;
        ClosedGate {
            gates: self.clone(),
            sandbox,
        }
    }

    /// Whether the sandbox's gate is closed (a stop or a delete is under way).
    pub fn is_closed(&self, sandbox: SandboxId) -> bool {
        self.lock().get(&sandbox).is_some_and(|g| g.closed)
    }

    /// Opens the gate again.
    pub fn open(&self, sandbox: SandboxId) {
        let mut gates = self.lock();
        if let Some(gate) = gates.get_mut(&sandbox) {
            gate.closed = false;
            if gate.in_flight == 0 {
                gates.remove(&sandbox);
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<SandboxId, GateState>> {
        // Entries are whole counters; a poisoned map is still consistent.
        self.gates.lock().unwrap_or_else(|e| e.into_inner())
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
