//! Where a sandbox's preview traffic goes: its row (org, host, state, preview settings) and
//! its host's forwarder address, read from Postgres and cached.
//!
//! # Guarantees
//! - Only a `running` sandbox's route is cached, for at most [`ROUTE_TTL`]; every lifecycle
//!   event of the sandbox (on `{p}.events.sandbox.…`, see [`evict_on_events`]) evicts it, and
//!   so does a forwarder that says it does not hold the sandbox running. A sleeping sandbox is
//!   read from Postgres on every request.
//! - An unknown or deleted (or being deleted) sandbox is remembered as missing for
//!   [`MISS_TTL`], so a flood of requests for made-up ids costs one query per id and
//!   [`MISS_TTL`], not one per request; its events evict it too (a sandbox's id is made by the
//!   API at create, so no request names it before it exists). At most [`MISS_CAPACITY`] ids
//!   are remembered: past that the expired ones go, then all of them.
//! - A host's forwarder address is cached for at most [`FORWARDER_TTL`] and evicted when a
//!   connection to it fails.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use berth_schemas::{HostId, OrgId, SandboxId, SandboxState, Subjects};
use berth_store::sandboxes::SandboxRow;
use futures::StreamExt;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::page::Page;
use super::Preview;

/// How long a running sandbox's route is trusted without an event.
pub const ROUTE_TTL: Duration = Duration::from_secs(30);
/// How long a host's forwarder address is trusted.
pub const FORWARDER_TTL: Duration = Duration::from_secs(30);
/// How long an unknown or deleted sandbox is answered `404` without asking Postgres again.
pub const MISS_TTL: Duration = Duration::from_secs(5);
/// Most unknown sandboxes remembered at once.
pub const MISS_CAPACITY: usize = 10_000;

/// What the proxy needs of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The sandbox.
    pub sandbox: SandboxId,
    /// Its org (a key must be of it).
    pub org: OrgId,
    /// Its host.
    pub host: HostId,
    /// Its state when read.
    pub state: SandboxState,
    /// Whether a request may start it.
    pub auto_resume: bool,
    /// Ports open without a key.
    pub public_ports: Vec<u16>,
}

impl Route {
    /// The route of a row, unless the row is deleted, being deleted, or placed nowhere.
    pub fn of(row: SandboxRow) -> Option<Self> {
        if row.deleting() || row.state == SandboxState::Deleted {
            return None;
        }
        Some(Self {
            sandbox: row.id,
            org: row.org_id,
            host: row.host_id?,
            state: row.state,
            auto_resume: row.auto_resume,
            public_ports: row.public_ports,
        })
    }
}

/// The caches of routes and forwarder addresses.
#[derive(Debug, Default)]
pub struct RouteCache {
    routes: Mutex<HashMap<SandboxId, (Route, Instant)>>,
    forwarders: Mutex<HashMap<HostId, (String, Instant)>>,
    misses: Mutex<Misses>,
}

/// Sandboxes found missing, and when (bounded by [`MISS_CAPACITY`]).
#[derive(Debug, Default)]
struct Misses(HashMap<SandboxId, Instant>);

impl Misses {
    /// Whether `sandbox` was found missing less than [`MISS_TTL`] before `now`.
    fn holds(&mut self, sandbox: SandboxId, now: Instant) -> bool {
        match self.0.get(&sandbox) {
            Some(at) if now.saturating_duration_since(*at) < MISS_TTL => true,
            Some(_) => {
                self.0.remove(&sandbox);
                false
            }
            None => false,
        }
    }

    /// Remembers `sandbox` as missing at `now`, making room first when full.
    fn insert(&mut self, sandbox: SandboxId, now: Instant) {
        if self.0.len() >= MISS_CAPACITY {
            self.0
                .retain(|_, at| now.saturating_duration_since(*at) < MISS_TTL);
            if self.0.len() >= MISS_CAPACITY {
                self.0.clear();
            }
        }
        self.0.insert(sandbox, now);
    }
}

impl RouteCache {
    /// The sandbox's route; `None` when it does not exist or is deleted (or being deleted).
    pub async fn get(&self, db: &PgPool, sandbox: SandboxId) -> Result<Option<Route>, Page> {
        if let Some(route) = self.cached(sandbox) {
            return Ok(Some(route));
        }
        if self
            .misses
            .lock()
            .expect("never poisoned")
            .holds(sandbox, Instant::now())
        {
            return Ok(None);
        }
        let route = self.read(db, sandbox).await?;
        Ok(route)
    }

    /// The sandbox's route read from Postgres (cached when it runs, remembered as missing when
    /// there is none).
    pub async fn read(&self, db: &PgPool, sandbox: SandboxId) -> Result<Option<Route>, Page> {
        let route = berth_store::sandboxes::find(db, sandbox)
            .await?
            .and_then(Route::of);
        if let Some(r) = route.as_ref().filter(|r| r.state == SandboxState::Running) {
            self.routes
                .lock()
                .expect("never poisoned")
                .insert(sandbox, (r.clone(), Instant::now()));
        }
        if route.is_none() {
            self.misses
                .lock()
                .expect("never poisoned")
                .insert(sandbox, Instant::now());
        }
        Ok(route)
    }

    fn cached(&self, sandbox: SandboxId) -> Option<Route> {
        let mut routes = self.routes.lock().expect("never poisoned");
        match routes.get(&sandbox) {
            Some((r, at)) if at.elapsed() < ROUTE_TTL => Some(r.clone()),
            Some(_) => {
                routes.remove(&sandbox);
                None
            }
            None => None,
        }
    }

    /// Forgets the sandbox's route (and that it was missing).
    pub fn evict(&self, sandbox: SandboxId) {
        self.routes.lock().expect("never poisoned").remove(&sandbox);
        self.misses
            .lock()
            .expect("never poisoned")
            .0
            .remove(&sandbox);
    }

    /// Forgets the host's forwarder address.
    pub fn evict_host(&self, host: HostId) {
        self.forwarders
            .lock()
            .expect("never poisoned")
            .remove(&host);
    }

    /// Where `host`'s forwarder listens.
    ///
    /// Errors: a 502 page when the host runs none (or is unknown).
    pub async fn forwarder(&self, db: &PgPool, host: HostId) -> Result<String, Page> {
        if let Some((addr, at)) = self
            .forwarders
            .lock()
            .expect("never poisoned")
            .get(&host)
            .cloned()
        {
            if at.elapsed() < FORWARDER_TTL {
                return Ok(addr);
            }
        }
        let addr = berth_store::hosts::forwarder(db, host)
            .await?
            .ok_or_else(|| {
                Page::new(
                    StatusCode::BAD_GATEWAY,
                    "The sandbox's host serves no previews.",
                )
            })?;
        self.forwarders
            .lock()
            .expect("never poisoned")
            .insert(host, (addr.clone(), Instant::now()));
        Ok(addr)
    }
}

/// The sandbox id of a `{p}.events.sandbox.<org>.<sandbox>` subject.
fn sandbox_of(subject: &str) -> Option<SandboxId> {
    subject.rsplit('.').next()?.parse().ok()
}

/// Evicts a sandbox's cached route on each of its lifecycle events, until `shutdown`.
pub async fn evict_on_events(
    preview: Arc<Preview>,
    nats: async_nats::Client,
    subjects: Subjects,
    shutdown: CancellationToken,
) {
    let subject = format!("{}.events.sandbox.>", subjects.prefix());
    let mut sub = match nats.subscribe(subject.clone()).await {
        Ok(sub) => sub,
        Err(e) => {
            tracing::warn!(error = %e, %subject, "preview routes will expire by time only");
            return;
        }
    };
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            message = sub.next() => match message {
                Some(m) => {
                    if let Some(id) = sandbox_of(m.subject.as_str()) {
                        preview.routes.evict(id);
                    }
                }
                None => break,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sandbox_of_an_event_subject_is_its_last_token() {
        let (org, id) = (OrgId::new(), SandboxId::new());
        let s = Subjects::default().sandbox_events(org, id);
        assert_eq!(sandbox_of(&s), Some(id));
        assert_eq!(sandbox_of("berth.events.webhook.x.y"), None);
    }

    #[test]
    fn a_missing_sandbox_is_remembered_for_the_ttl_and_the_memory_is_bounded() {
        let mut misses = Misses::default();
        let t0 = Instant::now();
        let id = SandboxId::new();
        assert!(!misses.holds(id, t0));
        misses.insert(id, t0);
        assert!(misses.holds(id, t0 + MISS_TTL / 2));
        assert!(!misses.holds(id, t0 + MISS_TTL));
        assert!(
            misses.0.is_empty(),
            "an expired miss is dropped when looked at"
        );
        for _ in 0..MISS_CAPACITY {
            misses.insert(SandboxId::new(), t0);
        }
        assert_eq!(misses.0.len(), MISS_CAPACITY);
        // Full of live entries: they all go, and the new one is kept.
        misses.insert(id, t0 + Duration::from_secs(1));
        assert_eq!(misses.0.len(), 1);
        assert!(misses.holds(id, t0 + Duration::from_secs(1)));
        // Full with expired entries: only those go.
        for _ in 0..MISS_CAPACITY - 1 {
            misses.insert(SandboxId::new(), t0);
        }
        let later = t0 + Duration::from_secs(1) + MISS_TTL - Duration::from_millis(1);
        misses.insert(SandboxId::new(), later);
        assert_eq!(misses.0.len(), 2, "the live miss and the new one");
        assert!(misses.holds(id, later));
    }
}
