//! [`SandboxWatch`]: wakes requests waiting on a sandbox's state soon after it changes, from the
//! sandbox's events: every state change writes an event in its transaction, and the outbox
//! relay publishes it on `{p}.events.sandbox.<org>.<sandbox>` once committed. One core NATS
//! subscription to `{p}.events.sandbox.>` per API process, opened by the first wait and shared
//! by all: each waiter registers for its sandbox before it reads the row, then sleeps until an
//! event of that sandbox (or the fallback tick) and reads it again. (Until migration 0025 a
//! Postgres `NOTIFY` in the state change's transaction did this; it serialized every commit.)
//!
//! # Guarantees
//! - No missed change: a waiter registers before reading, and the subscription was active at
//!   the server (flushed) before the first registration; an event published after that wakes
//!   it, and a change committed before its read is seen by the read.
//! - A lost wake (an event published while the connection was down, a relay that died between
//!   commit and publish) costs at most [`FALLBACK_TICK`]: every waiter reads again each tick.
//!
//! # Errors
//! [`SandboxWatch::subscribe`] fails when the subscription cannot be made (the client closed).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_schemas::{SandboxId, Subjects};
use futures::StreamExt;
use tokio::sync::{watch, OnceCell};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// How often every waiter reads its row again whatever it heard: the bound on a lost wake.
pub const FALLBACK_TICK: Duration = Duration::from_secs(1);
/// Wait after a failed (re)subscription before the next attempt.
pub const RECONNECT_DELAY: Duration = Duration::from_millis(500);

/// The shared subscription; cheap to clone. Stops its task when the last clone is dropped or
/// [`SandboxWatch::stop`] is called.
#[derive(Clone)]
pub struct SandboxWatch {
    shared: Arc<Shared>,
    handle: Arc<Handle>,
}

impl std::fmt::Debug for SandboxWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxWatch").finish_non_exhaustive()
    }
}

struct Shared {
    /// One counter per sandbox someone waits on, bumped by its events.
    waiters: Mutex<HashMap<SandboxId, watch::Sender<u64>>>,
    /// Bumped every [`FALLBACK_TICK`] and after a resubscription: everyone reads again.
    epoch: watch::Sender<u64>,
}

struct Handle {
    nats: async_nats::Client,
    subjects: Subjects,
    started: OnceCell<()>,
    stop: CancellationToken,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Why a watch could not subscribe.
#[derive(Debug, thiserror::Error)]
#[error("sandbox event subscription: {0}")]
pub struct WatchError(String);

impl SandboxWatch {
    /// A watch of the sandbox events under `subjects` on `nats`; it subscribes on the first
    /// [`SandboxWatch::subscribe`].
    pub fn new(nats: async_nats::Client, subjects: Subjects) -> Self {
        Self {
            shared: Arc::new(Shared {
                waiters: Mutex::new(HashMap::new()),
                epoch: watch::channel(0).0,
            }),
            handle: Arc::new(Handle {
                nats,
                subjects,
                started: OnceCell::new(),
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Stops the subscription's task (the API's shutdown).
    pub fn stop(&self) {
        self.handle.stop.cancel();
    }

    /// Registers for `id`'s changes; the subscription is active at the server when this
    /// returns.
    ///
    /// Errors: [`WatchError`] when the first subscription could not be made or flushed.
    pub async fn subscribe(&self, id: SandboxId) -> Result<Subscription, WatchError> {
        self.handle
            .started
            .get_or_try_init(|| async {
                let events = subscribe_events(&self.handle.nats, &self.handle.subjects).await?;
                tokio::spawn(follow(
                    events,
                    self.handle.nats.clone(),
                    self.handle.subjects.clone(),
                    self.shared.clone(),
                    self.handle.stop.clone(),
                ));
                Ok::<(), WatchError>(())
            })
            .await?;
        let changes = {
            let mut waiters = self.shared.waiters.lock().expect("waiters lock");
            waiters
                .entry(id)
                .or_insert_with(|| watch::channel(0).0)
                .subscribe()
        };
        Ok(Subscription {
            id,
            changes,
            epoch: self.shared.epoch.subscribe(),
            shared: self.shared.clone(),
        })
    }
}

/// One waiter's registration; unregisters when dropped.
pub struct Subscription {
    id: SandboxId,
    changes: watch::Receiver<u64>,
    epoch: watch::Receiver<u64>,
    shared: Arc<Shared>,
}

impl Subscription {
    /// Returns when the sandbox may have changed since the last call (or the registration):
    /// an event of it arrived, or the fallback tick passed. Pending forever once the watch
    /// stopped (the caller's timeout ends the wait).
    pub async fn changed(&mut self) {
        tokio::select! {
            Ok(()) = self.changes.changed() => {}
            Ok(()) = self.epoch.changed() => {}
            else => std::future::pending().await,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut waiters = self.shared.waiters.lock().expect("waiters lock");
        // This receiver is the last one: no one else waits on the sandbox.
        if waiters
            .get(&self.id)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
            waiters.remove(&self.id);
        }
    }
}

/// Subscribes to every sandbox event and makes sure the server has the subscription.
async fn subscribe_events(
    nats: &async_nats::Client,
    subjects: &Subjects,
) -> Result<async_nats::Subscriber, WatchError> {
    let events = nats
        .subscribe(subjects.sandbox_events_all())
        .await
        .map_err(|e| WatchError(e.to_string()))?;
    nats.flush().await.map_err(|e| WatchError(e.to_string()))?;
    Ok(events)
}

/// Wakes the waiters of each sandbox an event names, and everyone each [`FALLBACK_TICK`],
/// until `stop`; subscribes again (then wakes everyone) if the subscription ends.
async fn follow(
    mut events: async_nats::Subscriber,
    nats: async_nats::Client,
    subjects: Subjects,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(FALLBACK_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let received = tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {
                if !shared.waiters.lock().expect("waiters lock").is_empty() {
                    shared.epoch.send_modify(|n| *n = n.wrapping_add(1));
                }
                continue;
            }
            m = events.next() => m,
        };
        match received {
            Some(message) => {
                // `{p}.events.sandbox.<org>.<sandbox>`: the sandbox is the last token.
                let id = message
                    .subject
                    .rsplit('.')
                    .next()
                    .and_then(|t| t.parse::<SandboxId>().ok());
                let Some(id) = id else {
                    debug!(subject = %message.subject, "an event subject without a sandbox id");
                    continue;
                };
                let waiters = shared.waiters.lock().expect("waiters lock");
                if let Some(tx) = waiters.get(&id) {
                    tx.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
            None => {
                warn!("sandbox event subscription ended; subscribing again");
                events = loop {
                    match subscribe_events(&nats, &subjects).await {
                        Ok(e) => break e,
                        Err(error) => {
                            warn!(%error, "sandbox event subscription cannot be made yet");
                            tokio::select! {
                                _ = stop.cancelled() => return,
                                _ = tokio::time::sleep(RECONNECT_DELAY) => {}
                            }
                        }
                    }
                };
                shared.epoch.send_modify(|n| *n = n.wrapping_add(1));
            }
        }
    }
}
