//! What keeps one client, key or org from taking the API process for itself: request rates per
//! client address and per key (429 `rate_limited` with `Retry-After`), a separate budget of
//! key lookups per address (so a flood of bad keys stops reaching Postgres), a short-lived
//! cache of key lookups, and per-org caps on concurrent exec streams, file transfers and execs
//! (429 `too_many_concurrent`). The settings are [`LimitsConfig`]; the server-level ones
//! (connections, timeouts) are applied by [`crate::server`].
//!
//! # Guarantees
//! - A request over its address's or its key's rate is refused before any handler work, and
//!   says when to retry (`Retry-After`, whole seconds, rounded up).
//! - A key not in the cache costs one token of its address's lookup budget before Postgres is
//!   asked; with the budget spent, the request is refused without a query.
//! - A permit of [`Guards::concurrency`] is released when it drops, on every path (a finished
//!   response, a client that went away, an error).
//!
//! # Assumptions
//! Limits are per API process: N API processes behind a balancer allow N times as much. The
//! client address is the TCP peer; behind a proxy every client shares the proxy's address
//! (give the per-address limits room for that, or turn them off with 0).
//!
//! A revoked key is forgotten by every process's cache at once, when the revocation commits
//! ([`crate::revocations`] calls [`Guards::forget_keys`]); only while a process's listener is
//! reconnecting can a revoked key it cached keep working, for at most
//! [`LimitsConfig::key_cache_ttl`].

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_schemas::{ApiKeyId, OrgId};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};

use crate::error::ApiError;
use crate::service::keys::Principal;

/// Default largest file a `PUT` or `GET …/files` moves, in bytes (1 GiB).
pub const DEFAULT_MAX_FILE_BYTES: u64 = 1 << 30;
/// Default most TCP connections the API holds open at once.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default of [`LimitsConfig::max_connections_per_ip`]: one client address may hold this many of
/// the [`DEFAULT_MAX_CONNECTIONS`] at once, so no single address can take them all.
pub const DEFAULT_MAX_CONNECTIONS_PER_IP: usize = 64;
/// Default time a client has to send a request's head (line and headers), counted from the
/// connection's start or the end of the previous response (so it is also the keep-alive idle
/// timeout).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default longest pause between two pieces of a request body.
pub const DEFAULT_BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default requests per second per client address (sustained).
pub const DEFAULT_IP_RATE_PER_SECOND: u32 = 100;
/// Default burst per client address.
pub const DEFAULT_IP_BURST: u32 = 400;
/// Default requests per second per API key (sustained).
pub const DEFAULT_KEY_RATE_PER_SECOND: u32 = 50;
/// Default burst per API key.
pub const DEFAULT_KEY_BURST: u32 = 200;
/// Default key lookups in Postgres per second per client address (cache misses: unknown keys,
/// and known keys once per cache TTL).
pub const DEFAULT_KEY_LOOKUPS_PER_SECOND: u32 = 2;
/// Default burst of key lookups per client address.
pub const DEFAULT_KEY_LOOKUP_BURST: u32 = 20;
/// Default time a key lookup is cached.
pub const DEFAULT_KEY_CACHE_TTL: Duration = Duration::from_secs(5);
/// Most keys the lookup cache holds; past that, expired entries go, then all of them.
pub const KEY_CACHE_CAPACITY: usize = 10_000;
/// Default concurrent `exec/stream` and `GET /v1/events` streams per org.
pub const DEFAULT_ORG_MAX_STREAMS: usize = 16;
/// Default concurrent file transfers (`GET`/`PUT …/files`) per org.
pub const DEFAULT_ORG_MAX_TRANSFERS: usize = 8;
/// Default concurrent `exec` calls per org.
pub const DEFAULT_ORG_MAX_EXECS: usize = 32;
/// Default concurrent waits (`GET …/wait`, `?wait=`) per org.
pub const DEFAULT_ORG_MAX_WAITS: usize = 64;
/// How often idle rate-limit state is dropped.
pub const RATE_STATE_SWEEP: Duration = Duration::from_secs(60);

/// A rate: `per_second` sustained, `burst` at once. `per_second == 0` turns it off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    /// Requests replenished per second; 0: no limit.
    pub per_second: u32,
    /// Requests allowed at once (at least 1 when the rate is on).
    pub burst: u32,
}

impl Rate {
    /// No limit.
    pub const OFF: Rate = Rate {
        per_second: 0,
        burst: 0,
    };

    fn quota(self) -> Option<Quota> {
        let per_second = NonZeroU32::new(self.per_second)?;
        let burst = NonZeroU32::new(self.burst).unwrap_or(NonZeroU32::MIN);
        Some(Quota::per_second(per_second).allow_burst(burst))
    }
}

/// The API's operator limits, with [`Default`] the documented defaults (README
/// "Configuration"). A zero count or rate turns that limit off.
#[derive(Debug, Clone)]
pub struct LimitsConfig {
    /// Largest file `PUT`/`GET …/files` moves, in bytes; larger is 413 `payload_too_large`.
    pub max_file_bytes: u64,
    /// Most TCP connections open at once; more are closed as soon as accepted.
    pub max_connections: usize,
    /// Most TCP connections one client address may hold open at once; more from it are closed
    /// as soon as accepted (others still get in).
    pub max_connections_per_ip: usize,
    /// Time allowed for a request head (also the keep-alive idle timeout).
    pub header_read_timeout: Duration,
    /// Longest pause between two pieces of a request body.
    pub body_idle_timeout: Duration,
    /// Requests per client address.
    pub per_ip: Rate,
    /// Requests per API key.
    pub per_key: Rate,
    /// Key lookups in Postgres per client address.
    pub key_lookups_per_ip: Rate,
    /// How long a key lookup is cached (0: not cached).
    pub key_cache_ttl: Duration,
    /// Concurrent `exec/stream` and event streams per org.
    pub org_max_streams: usize,
    /// Concurrent file transfers per org.
    pub org_max_transfers: usize,
    /// Concurrent execs per org.
    pub org_max_execs: usize,
    /// Concurrent waits for a sandbox's state per org.
    pub org_max_waits: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_ip: DEFAULT_MAX_CONNECTIONS_PER_IP,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_idle_timeout: DEFAULT_BODY_IDLE_TIMEOUT,
            per_ip: Rate {
                per_second: DEFAULT_IP_RATE_PER_SECOND,
                burst: DEFAULT_IP_BURST,
            },
            per_key: Rate {
                per_second: DEFAULT_KEY_RATE_PER_SECOND,
                burst: DEFAULT_KEY_BURST,
            },
            key_lookups_per_ip: Rate {
                per_second: DEFAULT_KEY_LOOKUPS_PER_SECOND,
                burst: DEFAULT_KEY_LOOKUP_BURST,
            },
            key_cache_ttl: DEFAULT_KEY_CACHE_TTL,
            org_max_streams: DEFAULT_ORG_MAX_STREAMS,
            org_max_transfers: DEFAULT_ORG_MAX_TRANSFERS,
            org_max_execs: DEFAULT_ORG_MAX_EXECS,
            org_max_waits: DEFAULT_ORG_MAX_WAITS,
        }
    }
}

impl LimitsConfig {
    /// The defaults without the request-rate limits (per address, per key, lookups) and the
    /// per-address connection cap: for load tests that drive one key from one address
    /// (`berth bench --runtime sim`).
    pub fn without_rate_limits() -> Self {
        Self {
            max_connections_per_ip: 0,
            per_ip: Rate::OFF,
            per_key: Rate::OFF,
            key_lookups_per_ip: Rate::OFF,
            ..Self::default()
        }
    }
}

/// What a per-org concurrency cap counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Concurrent {
    /// `exec/stream` responses and `GET /v1/events` streams.
    Streams,
    /// `GET`/`PUT …/files`.
    Transfers,
    /// `POST …/exec`.
    Execs,
    /// `GET …/wait` and `?wait=` on a create or lifecycle request.
    Waits,
}

impl Concurrent {
    /// The name of the cap, as the 429 body's `limit` gives it.
    pub fn limit_name(self) -> &'static str {
        match self {
            Concurrent::Streams => "max_concurrent_streams",
            Concurrent::Transfers => "max_concurrent_transfers",
            Concurrent::Execs => "max_concurrent_execs",
            Concurrent::Waits => "max_concurrent_waits",
        }
    }
}

type Limiter<K> = DefaultKeyedRateLimiter<K>;

/// The API's runtime limit state: rate limiters, the key cache, concurrency counts. One per
/// process, shared by every request through [`crate::AppState`].
pub struct Guards {
    config: LimitsConfig,
    per_ip: Option<Limiter<IpAddr>>,
    per_key: Option<Limiter<ApiKeyId>>,
    lookups_per_ip: Option<Limiter<IpAddr>>,
    clock: DefaultClock,
    keys: Mutex<HashMap<[u8; 32], (Principal, Instant)>>,
    in_flight: Mutex<HashMap<(OrgId, Concurrent), usize>>,
}

impl std::fmt::Debug for Guards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guards")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Guards {
    /// Fresh state for `config`.
    pub fn new(config: LimitsConfig) -> Arc<Self> {
        Arc::new(Self {
            per_ip: config.per_ip.quota().map(Limiter::keyed),
            per_key: config.per_key.quota().map(Limiter::keyed),
            lookups_per_ip: config.key_lookups_per_ip.quota().map(Limiter::keyed),
            clock: DefaultClock::default(),
            keys: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(HashMap::new()),
            config,
        })
    }

    /// The settings these guards enforce.
    pub fn config(&self) -> &LimitsConfig {
        &self.config
    }

    /// Counts one request of `ip`.
    ///
    /// Errors: [`ApiError::RateLimited`] when its rate is spent.
    pub fn check_ip(&self, ip: IpAddr) -> Result<(), ApiError> {
        self.check(self.per_ip.as_ref(), &ip, "per_ip")
    }

    /// Counts one request of `key`.
    ///
    /// Errors: [`ApiError::RateLimited`] when its rate is spent.
    pub fn check_key(&self, key: ApiKeyId) -> Result<(), ApiError> {
        self.check(self.per_key.as_ref(), &key, "per_key")
    }

    /// Counts one key lookup in Postgres for `ip` (unknown when the request came without a
    /// peer address, as in-process tests send it: not limited).
    ///
    /// Errors: [`ApiError::RateLimited`] when the address's lookup budget is spent.
    pub fn check_lookup(&self, ip: Option<IpAddr>) -> Result<(), ApiError> {
        match ip {
            Some(ip) => self.check(self.lookups_per_ip.as_ref(), &ip, "key_lookups_per_ip"),
            None => Ok(()),
        }
    }

    fn check<K: Clone + std::hash::Hash + Eq>(
        &self,
        limiter: Option<&Limiter<K>>,
        key: &K,
        scope: &'static str,
    ) -> Result<(), ApiError> {
        let Some(limiter) = limiter else {
            return Ok(());
        };
        limiter.check_key(key).map_err(|not_until| {
            let wait = not_until.wait_time_from(self.clock.now());
            metrics::counter!("berth_api_rate_limited_total", "scope" => scope).increment(1);
            ApiError::RateLimited {
                scope,
                retry_after_secs: wait.as_secs() + u64::from(wait.subsec_nanos() > 0),
            }
        })
    }

    /// The cached principal of the key whose SHA-256 is `hash`, if looked up within the TTL.
    pub fn cached_key(&self, hash: &[u8; 32]) -> Option<Principal> {
        let keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        keys.get(hash)
            .filter(|(_, at)| at.elapsed() < self.config.key_cache_ttl)
            .map(|(principal, _)| *principal)
    }

    /// Caches a successful lookup (unknown keys are not cached: they are limited instead).
    pub fn cache_key(&self, hash: [u8; 32], principal: Principal) {
        if self.config.key_cache_ttl.is_zero() {
            return;
        }
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if keys.len() >= KEY_CACHE_CAPACITY {
            let ttl = self.config.key_cache_ttl;
            keys.retain(|_, (_, at)| at.elapsed() < ttl);
            if keys.len() >= KEY_CACHE_CAPACITY {
                keys.clear();
            }
        }
        keys.insert(hash, (principal, Instant::now()));
    }

    /// Takes one of the org's `kind` slots, released when the permit drops.
    ///
    /// Errors: [`ApiError::TooManyConcurrent`] when the org holds its cap already.
    pub fn concurrency(
        self: &Arc<Self>,
        org: OrgId,
        kind: Concurrent,
    ) -> Result<ConcurrencyPermit, ApiError> {
        let cap = match kind {
            Concurrent::Streams => self.config.org_max_streams,
            Concurrent::Transfers => self.config.org_max_transfers,
            Concurrent::Execs => self.config.org_max_execs,
            Concurrent::Waits => self.config.org_max_waits,
        };
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        let count = in_flight.entry((org, kind)).or_default();
        if cap != 0 && *count >= cap {
            metrics::counter!("berth_api_concurrency_refused_total", "limit" => kind.limit_name())
                .increment(1);
            return Err(ApiError::TooManyConcurrent {
                limit: kind.limit_name(),
                value: cap,
            });
        }
        *count += 1;
        Ok(ConcurrencyPermit {
            guards: self.clone(),
            org,
            kind,
        })
    }

    /// Forgets the cached lookup of the key whose SHA-256 is `hash` (revoked anywhere): its next
    /// request asks Postgres again. Every other key stays cached, so one org's revocations
    /// never cost another's requests a lookup.
    pub fn forget_key(&self, hash: &[u8; 32]) {
        self.keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(hash);
    }

    /// Forgets every cached key lookup: the next request of each key asks Postgres again (one
    /// token of its address's lookup budget, as after the cache's TTL). For when revocations
    /// may have been missed (a lost listener connection) or one did not name its key.
    pub fn forget_keys(&self) {
        self.keys.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Drops rate-limit state of idle keys and addresses (bounded memory under a flood of
    /// addresses), and expired cached keys.
    pub fn sweep(&self) {
        for limiter in [&self.per_ip, &self.lookups_per_ip].into_iter().flatten() {
            limiter.retain_recent();
        }
        if let Some(limiter) = &self.per_key {
            limiter.retain_recent();
        }
        let ttl = self.config.key_cache_ttl;
        self.keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, (_, at)| at.elapsed() < ttl);
    }
}

/// One of an org's concurrency slots; dropping it gives the slot back.
#[derive(Debug)]
#[must_use = "the slot is held until the permit drops"]
pub struct ConcurrencyPermit {
    guards: Arc<Guards>,
    org: OrgId,
    kind: Concurrent,
}

impl Drop for ConcurrencyPermit {
    fn drop(&mut self) {
        let mut in_flight = self
            .guards
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(count) = in_flight.get_mut(&(self.org, self.kind)) {
            *count -= 1;
            if *count == 0 {
                in_flight.remove(&(self.org, self.kind));
            }
        }
    }
}

/// Refuses a request over its address's rate (`/healthz`, `/readyz` and `/metrics` are not
/// counted). Requests without a peer address (in-process tests) pass.
pub async fn per_ip(
    axum::extract::State(guards): axum::extract::State<Arc<Guards>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let exempt = matches!(req.uri().path(), "/healthz" | "/readyz" | "/metrics");
    if !exempt {
        if let Some(ip) = peer_ip(req.extensions()) {
            if let Err(e) = guards.check_ip(ip) {
                return e.into_response();
            }
        }
    }
    next.run(req).await
}

/// The client a per-address limit counts an address under: an IPv4 address itself (an
/// IPv4-mapped IPv6 one as its IPv4 address), an IPv6 address by its /64, since one subscriber
/// is usually given a whole /64 and could otherwise take a fresh bucket per request.
pub fn client_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// The client's address as the per-address limits count it ([`client_of`]), when the server
/// recorded it.
pub fn peer_ip(extensions: &axum::http::Extensions) -> Option<IpAddr> {
    extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|info| client_of(info.0.ip()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_clients_are_counted_by_their_64_and_mapped_ones_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff:1:2:3".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(client_of(a), client_of(b));
        assert_ne!(client_of(a), client_of(c));
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert_eq!(client_of(mapped), "192.0.2.1".parse::<IpAddr>().unwrap());
        let v4: IpAddr = "192.0.2.1".parse().unwrap();
        assert_eq!(client_of(v4), v4);
    }

    #[test]
    fn a_rate_refuses_past_its_burst_and_says_when_to_retry() {
        let guards = Guards::new(LimitsConfig {
            per_key: Rate {
                per_second: 1,
                burst: 3,
            },
            ..LimitsConfig::default()
        });
        let key = ApiKeyId(uuid::Uuid::new_v4());
        for _ in 0..3 {
            guards.check_key(key).unwrap();
        }
        match guards.check_key(key) {
            Err(ApiError::RateLimited {
                retry_after_secs, ..
            }) => assert_eq!(retry_after_secs, 1),
            other => panic!("expected a refusal, got {other:?}"),
        }
        // Another key has its own budget.
        guards.check_key(ApiKeyId(uuid::Uuid::new_v4())).unwrap();
    }

    #[test]
    fn a_concurrency_slot_comes_back_when_its_permit_drops() {
        let guards = Guards::new(LimitsConfig {
            org_max_execs: 2,
            ..LimitsConfig::default()
        });
        let org = OrgId(uuid::Uuid::new_v4());
        let a = guards.concurrency(org, Concurrent::Execs).unwrap();
        let _b = guards.concurrency(org, Concurrent::Execs).unwrap();
        assert!(matches!(
            guards.concurrency(org, Concurrent::Execs),
            Err(ApiError::TooManyConcurrent {
                limit: "max_concurrent_execs",
                value: 2
            })
        ));
        // Other kinds and other orgs are counted apart.
        let _s = guards.concurrency(org, Concurrent::Streams).unwrap();
        let _o = guards
            .concurrency(OrgId(uuid::Uuid::new_v4()), Concurrent::Execs)
            .unwrap();
        drop(a);
        let _again = guards.concurrency(org, Concurrent::Execs).unwrap();
    }

    #[test]
    fn zero_turns_a_limit_off() {
        let guards = Guards::new(LimitsConfig {
            org_max_execs: 0,
            ..LimitsConfig::without_rate_limits()
        });
        let org = OrgId(uuid::Uuid::new_v4());
        let permits: Vec<_> = (0..100)
            .map(|_| guards.concurrency(org, Concurrent::Execs).unwrap())
            .collect();
        assert_eq!(permits.len(), 100);
        for _ in 0..1000 {
            guards.check_ip("127.0.0.1".parse().unwrap()).unwrap();
        }
    }
}
