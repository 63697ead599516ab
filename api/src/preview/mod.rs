//! The preview proxy: HTTP/1.1, h2c, WebSocket and Server-Sent-Event traffic to a port inside
//! a sandbox, through its host's port forwarder (`berth_hostd::forwarder`), never around it.
//!
//! Two ways in, one handler ([`Preview::handle`]):
//! - by host name, `{port}-{sandbox_id}.{preview_domain}`, on the proxy's own listener
//!   ([`server`], `berth proxy`);
//! - by path, `/v1/sandboxes/{id}/ports/{port}/…`, on the API and on the proxy's listener.
//!
//! Each request: find the sandbox ([`routes`]: Postgres, cached while it runs and evicted by
//! its lifecycle events); check the caller ([`access`]: a key of the owning org, a preview
//! token, or a public port); wake it when it sleeps ([`wake`]); count the request as activity
//! for auto-stop; forward it ([`forward`]).
//!
//! # Guarantees
//! - On `berth proxy`'s listener every request but `/healthz` counts against its client
//!   address's rate ([`crate::limits::LimitsConfig::per_ip`], the API's); one over it is `429`
//!   with `Retry-After` (an HTML page), before any lookup. (On the API the API's own per-address
//!   limit counts the path route.) An unknown or deleted sandbox is remembered for
//!   [`routes::MISS_TTL`] (at most [`routes::MISS_CAPACITY`] of them), so a flood of made-up ids
//!   does not become a flood of queries.
//! - A sandbox that does not exist, is deleted or being deleted, or belongs to another org
//!   than the caller's key is `404`; a request without a key or token for a private port, or
//!   with a bad or expired token, is `401`. Every `Authorization` (and `Proxy-Authorization`)
//!   value that carries a Berth key, in any spelling, the token header, the token query
//!   parameter and the token cookie are removed before the request is forwarded, whoever the
//!   key belongs to.
//! - A valid token in the query parameter of a `GET`/`HEAD` is answered with `303` to the same
//!   URL without it, setting the token as an `HttpOnly`, `SameSite=Lax` cookie scoped to the
//!   preview host (by host name) or to `/v1/sandboxes/{id}/ports/{port}/` (by path) that
//!   expires with the token; the cookie is accepted afterwards ([`access`]).
//! - A stopped (or stopping) sandbox with `auto_resume` is started through the same lifecycle
//!   use case as `POST …/start` (so concurrent wakers start it once: the second finds it
//!   `starting`, which is a no-op), and the request is held until it runs, at most
//!   [`PreviewConfig::wake_timeout`], then `503` with `Retry-After`. Without `auto_resume`:
//!   `409` naming the state, and nothing is started. A deleted sandbox is never started. An
//!   expiry that stops a sandbox turns its `auto_resume` off (the reconciler's pass), so a
//!   preview request never restarts what its owner's deadline stopped.
//! - Nothing listening on the port: `502` with a short page; a sandbox that sends no response
//!   head within [`PreviewConfig::response_timeout`]: `504`.
//! - A tunnel (WebSocket, any upgrade) is closed when it moves no byte either way for
//!   [`PreviewConfig::tunnel_idle_timeout`], and when the token (or token cookie) that opened
//!   it expires ([`tunnel`]); so is any other response body (an event stream) a token opened.
//! - A sandbox's `Set-Cookie` loses its `Domain` (by path: is confined to the port's prefix),
//!   one named like the share link's cookie is dropped, and by path the response runs as an
//!   opaque origin (`Content-Security-Policy: sandbox`, [`confine`]).

pub mod access;
pub mod confine;
pub mod forward;
pub mod page;
pub mod routes;
pub mod server;
pub mod target;
pub mod tunnel;
pub mod wake;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use berth_schemas::preview::{self, Key};
use berth_schemas::{SandboxId, SandboxState};
use sqlx::PgPool;

use crate::limits::Guards;
pub use target::Target;

/// Default preview domain: `{port}-{id}.preview.localhost` (browsers resolve `*.localhost`
/// to loopback, so the dev stack needs no DNS).
pub const DEFAULT_PREVIEW_DOMAIN: &str = "preview.localhost";
/// Default listen address of `berth proxy`.
pub const DEFAULT_PROXY_LISTEN: &str = "127.0.0.1:8090";
/// Default bound on how long a request to a sleeping sandbox is held while it starts.
pub const DEFAULT_WAKE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default lifetime of a preview token.
pub const DEFAULT_TOKEN_TTL: Duration = Duration::from_secs(3600);
/// The longest lifetime a preview token may be asked for.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(24 * 3600);
/// A forwarded request stamps the sandbox's activity at most this often (one write per
/// sandbox per interval, not one per request).
pub const ACTIVITY_INTERVAL: Duration = Duration::from_secs(10);
/// Default bound on the wait for the sandbox's response head once a request is sent to it:
/// past it the client gets `504` (Cloudflare gives an origin the same 100 s before its 524).
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(100);
/// Default idle limit of a tunnel (a WebSocket or any other upgrade): one that moves no byte
/// either way for this long is closed. Five minutes outlasts the keep-alive pings of common
/// WebSocket clients (30 to 60 s) and still frees what an abandoned tab holds.
pub const DEFAULT_TUNNEL_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// The preview settings shared by the API and `berth proxy`.
#[derive(Clone)]
pub struct PreviewConfig {
    /// `{port}-{id}.{domain}` names a sandbox port (a `:port` suffix is allowed and ignored
    /// when matching the Host header).
    pub domain: String,
    /// The scheme of the URLs the token route hands out (`https` behind a TLS front,
    /// `http` for the dev stack).
    pub scheme: String,
    /// The operator's preview secret; `None`: previews are off (the routes answer 503).
    pub secret: Option<Arc<Vec<u8>>>,
    /// How long a request to a sleeping sandbox is held while it starts.
    pub wake_timeout: Duration,
    /// A token's lifetime when the request names none.
    pub token_ttl: Duration,
    /// How long a forwarded request waits for the sandbox's response head (then `504`);
    /// zero: unbounded.
    pub response_timeout: Duration,
    /// How long a tunnel (WebSocket, any upgrade) may move no byte either way before it is
    /// closed; zero: unbounded.
    pub tunnel_idle_timeout: Duration,
}

impl std::fmt::Debug for PreviewConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreviewConfig")
            .field("domain", &self.domain)
            .field("scheme", &self.scheme)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("wake_timeout", &self.wake_timeout)
            .field("token_ttl", &self.token_ttl)
            .field("response_timeout", &self.response_timeout)
            .field("tunnel_idle_timeout", &self.tunnel_idle_timeout)
            .finish()
    }
}

impl Default for PreviewConfig {
    /// [`DEFAULT_PREVIEW_DOMAIN`], `http`, no secret (off), [`DEFAULT_WAKE_TIMEOUT`],
    /// [`DEFAULT_TOKEN_TTL`], [`DEFAULT_RESPONSE_TIMEOUT`], [`DEFAULT_TUNNEL_IDLE_TIMEOUT`].
    fn default() -> Self {
        Self {
            domain: DEFAULT_PREVIEW_DOMAIN.to_owned(),
            scheme: "http".to_owned(),
            secret: None,
            wake_timeout: DEFAULT_WAKE_TIMEOUT,
            token_ttl: DEFAULT_TOKEN_TTL,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            tunnel_idle_timeout: DEFAULT_TUNNEL_IDLE_TIMEOUT,
        }
    }
}

impl PreviewConfig {
    /// The key preview tokens are signed with, when previews are on.
    pub fn token_key(&self) -> Option<Key> {
        self.secret.as_ref().map(|s| preview::token_key(s))
    }

    /// The preview URL of `port` of `sandbox` (by host name).
    pub fn url(&self, sandbox: SandboxId, port: u16) -> String {
        format!("{}://{port}-{sandbox}.{}/", self.scheme, self.domain)
    }
}

/// The proxy: its database, its caches and its settings. One per process (the API's and
/// `berth proxy`'s).
pub struct Preview {
    pub(crate) db: PgPool,
    pub(crate) guards: Arc<Guards>,
    pub(crate) config: PreviewConfig,
    pub(crate) overcommit: berth_scheduler::placement::Overcommit,
    pub(crate) routes: routes::RouteCache,
    touched: Mutex<HashMap<SandboxId, Instant>>,
}

impl std::fmt::Debug for Preview {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Preview")
            .field("config", &self.config)
            .finish()
    }
}

impl Preview {
    /// A proxy on `db`; keys are checked through `guards` (its key cache and lookup budget).
    pub fn new(
        db: PgPool,
        guards: Arc<Guards>,
        config: PreviewConfig,
        overcommit: berth_scheduler::placement::Overcommit,
    ) -> Arc<Self> {
        Arc::new(Self {
            db,
            guards,
            config,
            overcommit,
            routes: routes::RouteCache::default(),
            touched: Mutex::new(HashMap::new()),
        })
    }

    /// Its settings.
    pub fn config(&self) -> &PreviewConfig {
        &self.config
    }

    /// Serves one preview request for `target` (its path already rewritten to the sandbox's
    /// own); `peer` is the client's address (for `X-Forwarded-For` and the key lookup budget).
    pub async fn handle(
        &self,
        mut req: Request<Body>,
        mut target: Target,
        peer: Option<IpAddr>,
    ) -> Response {
        let started = Instant::now();
        let response = match self.handle_inner(&mut req, &mut target, peer).await {
            Ok(response) => response,
            Err(page) => page.into_response(),
        };
        metrics::counter!("berth_preview_requests_total", "status" => response.status().as_u16().to_string())
            .increment(1);
        metrics::histogram!("berth_preview_request_duration_seconds")
            .record(started.elapsed().as_secs_f64());
        page::mark(response)
    }

    async fn handle_inner(
        &self,
        req: &mut Request<Body>,
        target: &mut Target,
        peer: Option<IpAddr>,
    ) -> Result<Response, page::Page> {
        if target.port == berth_schemas::preview::AGENT_PORT {
            // Berth's own channel into the sandbox: no token or public port opens it.
            return Err(page::Page::new(
                StatusCode::FORBIDDEN,
                "This port is Berth's agent's: it is never previewed.",
            ));
        }
        let Some(secret) = self.config.secret.clone() else {
            return Err(page::Page::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "Previews are not configured on this server.",
            ));
        };
        let route = self
            .routes
            .get(&self.db, target.sandbox)
            .await?
            .ok_or_else(|| page::Page::not_found(target.sandbox))?;
        let grant = access::authorize(self, req, &route, target, peer).await?;
        if let Some(token) = grant.set_cookie {
            // A shared link: the browser keeps the token as a cookie and reloads the page
            // without it, so its images, scripts and links are let in too.
            return Ok(access::cookie_redirect(
                &self.config,
                req.uri(),
                target,
                &token,
                grant.expires,
            ));
        }
        let route = if route.state == SandboxState::Running {
            route
        } else {
            wake::until_running(self, &route).await?
        };
        self.mark_active(target.sandbox).await;
        let forwarder = self.routes.forwarder(&self.db, route.host).await?;
        let key = preview::forwarder_key(&secret, route.host);
        let outgoing = std::mem::replace(req, Request::new(Body::empty()));
        let bounds = forward::Bounds {
            response: Some(self.config.response_timeout).filter(|t| !t.is_zero()),
            tunnel: tunnel::TunnelLimits::new(self.config.tunnel_idle_timeout, grant.expires),
        };
        match forward::forward(&forwarder, &key, target, outgoing, peer, bounds).await {
            Ok(response) => Ok(response),
            Err(e) => {
                if e.stale_route() {
                    self.routes.evict(target.sandbox);
                    self.routes.evict_host(route.host);
                }
                Err(e.page(target.port))
            }
        }
    }

    /// Stamps the sandbox's activity (auto-stop measures from it), at most once per
    /// [`ACTIVITY_INTERVAL`] per sandbox from this process.
    async fn mark_active(&self, sandbox: SandboxId) {
        let due = {
            let mut touched = self.touched.lock().expect("never poisoned");
            let now = Instant::now();
            touched.retain(|_, at| now.duration_since(*at) < ACTIVITY_INTERVAL);
            match touched.get(&sandbox) {
                Some(_) => false,
                None => {
                    touched.insert(sandbox, now);
                    true
                }
            }
        };
        if due {
            if let Err(e) = berth_store::sandboxes::touch(&self.db, sandbox).await {
                tracing::warn!(sandbox_id = %sandbox, error = %e, "preview activity not recorded");
            }
        }
    }
}
