//! [`ApiConfig`]: what the API needs besides its connections, with its defaults.

use std::net::SocketAddr;
use std::time::Duration;

use berth_schemas::Subjects;

use crate::http::events::EventStreamConfig;
use crate::limits::LimitsConfig;
use crate::model::DiskLimits;
use crate::preview::PreviewConfig;
use crate::webhooks::delivery::WebhookConfig;

/// Default listen address of the API.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// What the API needs besides its connections.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// The address the API listens on.
    pub listen: SocketAddr,
    /// The NATS subject names (their prefix isolates a deployment or a test).
    pub subjects: Subjects,
    /// Placement only chooses hosts heard from within this window.
    pub heartbeat_freshness: Duration,
    /// How far placement reserves beyond hosts' physical capacity.
    pub overcommit: berth_scheduler::placement::Overcommit,
    /// The relay publishes at most this many in-flight creates/starts per host.
    pub max_concurrent_starts: i64,
    /// Timing of `GET /v1/events`.
    pub events: EventStreamConfig,
    /// Timing and limits of webhook delivery.
    pub webhooks: WebhookConfig,
    /// The default and the largest `disk_mib` of a create.
    pub disk: DiskLimits,
    /// Connection, timeout, rate, size and concurrency limits (see [`LimitsConfig`]).
    pub limits: LimitsConfig,
    /// Whether the API's own listener answers `GET /metrics`. Off by default (`berth api
    /// --metrics-on-api` turns it on): what the metrics tell (routes, hosts, fleet size, other
    /// tenants' traffic) stays off the public listener, which answers 404 there like any
    /// unknown path; the operator serves them on a separate address (`--metrics-addr`).
    pub metrics_on_api: bool,
    /// Whether a sandbox's egress allow-list may name private networks (RFC 1918, CGNAT):
    /// off by default, so tenants reach only public addresses and what the hosts' operator
    /// allows (`berth hostd --sandbox-egress-allow`). Loopback, link-local (cloud metadata),
    /// multicast and reserved ranges are refused either way
    /// ([`berth_schemas::network::Network::check_tenant`]).
    pub sandbox_egress_private: bool,
    /// Preview URLs: the domain, the secret, the wake timeout (see [`PreviewConfig`]); off
    /// without a secret.
    pub preview: PreviewConfig,
    /// The object store snapshots live in (the hosts' `BERTH_OBJECT_STORE`), so deleting a
    /// snapshot removes its stored content; `None`: a delete removes the row and its chunk
    /// references only, leaving the content unreferenced.
    pub object_store: Option<berth_storage::StoreSettings>,
    /// The collector's store-wide sweep of orphans in `object_store` (interval, grace period,
    /// stale claims; see [`crate::sweep`]).
    pub sweep: crate::sweep::SweepConfig,
}

impl ApiConfig {
    /// Defaults for everything but the listen address and the subjects:
    /// [`berth_scheduler::DEFAULT_HEARTBEAT_FRESHNESS`], the default overcommit,
    /// [`crate::outbox::relay::DEFAULT_MAX_CONCURRENT_STARTS`], and the defaults of the event
    /// stream and of webhook delivery, and [`LimitsConfig::default`]; `/metrics` on the API's
    /// listener; [`DiskLimits::default`]; the sweep's defaults ([`crate::sweep::SweepConfig`]).
    pub fn new(listen: SocketAddr, subjects: Subjects) -> Self {
        Self {
            listen,
            subjects,
            heartbeat_freshness: berth_scheduler::DEFAULT_HEARTBEAT_FRESHNESS,
            overcommit: Default::default(),
            max_concurrent_starts: crate::outbox::relay::DEFAULT_MAX_CONCURRENT_STARTS,
            events: Default::default(),
            webhooks: Default::default(),
            disk: DiskLimits::default(),
            limits: Default::default(),
            metrics_on_api: false,
            sandbox_egress_private: false,
            preview: PreviewConfig::default(),
            object_store: None,
            sweep: crate::sweep::SweepConfig::default(),
        }
    }
}
