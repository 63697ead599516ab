//! [`SandboxWatch`]: wakes requests waiting on a sandbox's state the moment it changes, from
//! Postgres `LISTEN berth_sandbox_changed` (a trigger of migration 0014 notifies the sandbox's
//! id when a row is made or its state or `deleted_at` changes; delivered at commit).
//!
//! One listener connection per API process, opened by the first wait and shared by all: each
//! waiter registers for its sandbox before it reads the row, then sleeps until that sandbox's
//! notification (or a reconnect) and reads it again. No polling.
//!
//! # Guarantees
//! - No missed change: a waiter registers before reading, and a notification delivered after
//!   the registration wakes it; a change committed between its registration and its read is
//!   seen by the read.
//! - A lost connection is replaced (LISTEN again) and only then every waiter is woken to read
//!   its row again, since notifications sent while the connection was down are lost.
//!
//! # Errors
//! [`SandboxWatch::subscribe`] fails when no listener connection can be opened.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_schemas::SandboxId;
use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::{watch, OnceCell};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// The channel migration 0014's trigger notifies on.
pub const SANDBOX_CHANGED_CHANNEL: &str = "berth_sandbox_changed";
/// Wait after a failed (re)connection of the listener before the next attempt.
pub const RECONNECT_DELAY: Duration = Duration::from_millis(500);

/// The shared listener; cheap to clone. Stops its task when the last clone is dropped or
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
    /// One counter per sandbox someone waits on, bumped by its notification.
    waiters: Mutex<HashMap<SandboxId, watch::Sender<u64>>>,
    /// Bumped after every (re)connection: everyone reads again.
    epoch: watch::Sender<u64>,
}

struct Handle {
    db: PgPool,
    started: OnceCell<()>,
    stop: CancellationToken,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl SandboxWatch {
    /// A watch over `db`; its listener connects on the first [`SandboxWatch::subscribe`].
    pub fn new(db: PgPool) -> Self {
        Self {
            shared: Arc::new(Shared {
                waiters: Mutex::new(HashMap::new()),
                epoch: watch::channel(0).0,
            }),
            handle: Arc::new(Handle {
                db,
                started: OnceCell::new(),
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Stops the listener task (the API's shutdown).
    pub fn stop(&self) {
        self.handle.stop.cancel();
    }

    /// Registers for `id`'s changes; the listener is listening when this returns.
    ///
    /// Errors: the listener's first connection or `LISTEN` failed.
    pub async fn subscribe(&self, id: SandboxId) -> Result<Subscription, sqlx::Error> {
        self.handle
            .started
            .get_or_try_init(|| async {
                let listener = listen(&self.handle.db).await?;
                tokio::spawn(follow(
                    listener,
                    self.handle.db.clone(),
                    self.shared.clone(),
                    self.handle.stop.clone(),
                ));
                Ok::<(), sqlx::Error>(())
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
    /// its notification arrived, or the listener reconnected. Pending forever once the
    /// listener stopped (the caller's timeout ends the wait).
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

async fn listen(db: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(db).await?;
    listener.listen(SANDBOX_CHANGED_CHANNEL).await?;
    Ok(listener)
}

/// Wakes the waiters of each notified sandbox until `stop`; on a lost connection, listens
/// again and then wakes everyone.
async fn follow(
    mut listener: PgListener,
    db: PgPool,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    loop {
        let received = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.try_recv() => r,
        };
        match received {
            Ok(Some(notification)) => {
                let Ok(id) = notification.payload().parse::<SandboxId>() else {
                    warn!(
                        payload = notification.payload(),
                        "unreadable sandbox notification"
                    );
                    continue;
                };
                let waiters = shared.waiters.lock().expect("waiters lock");
                if let Some(tx) = waiters.get(&id) {
                    tx.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
            // `Ok(None)`: the connection closed; an error: it failed. Either way notifications
            // may be lost: listen on a fresh connection, then let every waiter read again.
            other => {
                if let Err(error) = other {
                    warn!(%error, "sandbox change listener failed; reconnecting");
                }
                listener = loop {
                    match listen(&db).await {
                        Ok(l) => break l,
                        Err(error) => {
                            warn!(%error, "sandbox change listener cannot reconnect yet");
                            tokio::select! {
                                _ = stop.cancelled() => return,
                                _ = tokio::time::sleep(RECONNECT_DELAY) => {}
                            }
                        }
                    }
                };
                debug!("sandbox change listener reconnected; waking every waiter");
                shared.epoch.send_modify(|n| *n = n.wrapping_add(1));
            }
        }
    }
}
