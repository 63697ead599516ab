//! Operator flags (with env fallbacks) for the API's limits and for the quota new orgs get.
//! Defaults are the constants of `berth_api::limits`; README "Configuration" lists them all.

use std::time::Duration;

use berth_api::limits::{self, LimitsConfig, Rate};
use clap::Args;

/// `berth api` / `berth dev`: connection, timeout, rate, size and concurrency limits. A zero
/// turns that limit off.
#[derive(Args, Clone, Debug)]
pub struct ApiLimitArgs {
    /// Largest file `PUT`/`GET …/files` moves, in bytes.
    #[arg(long, env = "BERTH_MAX_FILE_BYTES", default_value_t = limits::DEFAULT_MAX_FILE_BYTES)]
    pub max_file_bytes: u64,
    /// Most TCP connections served at once; more are closed as soon as accepted.
    #[arg(long, env = "BERTH_MAX_CONNECTIONS", default_value_t = limits::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Most TCP connections one client address may hold at once.
    #[arg(long, env = "BERTH_MAX_CONNECTIONS_PER_IP",
          default_value_t = limits::DEFAULT_MAX_CONNECTIONS_PER_IP)]
    pub max_connections_per_ip: usize,
    /// Time a client has to send a request's head (also the keep-alive idle timeout).
    #[arg(long, env = "BERTH_HEADER_READ_TIMEOUT", value_parser = humantime::parse_duration,
          default_value = "10s")]
    pub header_read_timeout: Duration,
    /// Longest pause between two pieces of a request body.
    #[arg(long, env = "BERTH_BODY_IDLE_TIMEOUT", value_parser = humantime::parse_duration,
          default_value = "30s")]
    pub body_idle_timeout: Duration,
    /// Requests per second per client address (sustained).
    #[arg(long, env = "BERTH_RATE_PER_IP", default_value_t = limits::DEFAULT_IP_RATE_PER_SECOND)]
    pub rate_per_ip: u32,
    /// Burst of requests per client address.
    #[arg(long, env = "BERTH_RATE_PER_IP_BURST", default_value_t = limits::DEFAULT_IP_BURST)]
    pub rate_per_ip_burst: u32,
    /// Requests per second per API key (sustained).
    #[arg(long, env = "BERTH_RATE_PER_KEY", default_value_t = limits::DEFAULT_KEY_RATE_PER_SECOND)]
    pub rate_per_key: u32,
    /// Burst of requests per API key.
    #[arg(long, env = "BERTH_RATE_PER_KEY_BURST", default_value_t = limits::DEFAULT_KEY_BURST)]
    pub rate_per_key_burst: u32,
    /// Key lookups in Postgres per second per client address (unknown keys, cache misses).
    #[arg(long, env = "BERTH_KEY_LOOKUPS_PER_IP", default_value_t = limits::DEFAULT_KEY_LOOKUPS_PER_SECOND)]
    pub key_lookups_per_ip: u32,
    /// Burst of key lookups per client address.
    #[arg(long, env = "BERTH_KEY_LOOKUPS_PER_IP_BURST", default_value_t = limits::DEFAULT_KEY_LOOKUP_BURST)]
    pub key_lookups_per_ip_burst: u32,
    /// How long a key lookup is cached: a revoked key keeps working this long at most.
    #[arg(long, env = "BERTH_KEY_CACHE_TTL", value_parser = humantime::parse_duration,
          default_value = "5s")]
    pub key_cache_ttl: Duration,
    /// Concurrent `exec/stream` and `GET /v1/events` streams per org.
    #[arg(long, env = "BERTH_ORG_MAX_STREAMS", default_value_t = limits::DEFAULT_ORG_MAX_STREAMS)]
    pub org_max_streams: usize,
    /// Concurrent file transfers per org.
    #[arg(long, env = "BERTH_ORG_MAX_TRANSFERS", default_value_t = limits::DEFAULT_ORG_MAX_TRANSFERS)]
    pub org_max_transfers: usize,
    /// Concurrent execs per org.
    #[arg(long, env = "BERTH_ORG_MAX_EXECS", default_value_t = limits::DEFAULT_ORG_MAX_EXECS)]
    pub org_max_execs: usize,
    /// Concurrent waits for a sandbox's state (`GET …/wait`, `?wait=`) per org.
    #[arg(long, env = "BERTH_ORG_MAX_WAITS", default_value_t = limits::DEFAULT_ORG_MAX_WAITS)]
    pub org_max_waits: usize,
}

impl ApiLimitArgs {
    /// The API's limits.
    pub fn config(&self) -> LimitsConfig {
        LimitsConfig {
            max_file_bytes: self.max_file_bytes,
            max_connections: self.max_connections,
            max_connections_per_ip: self.max_connections_per_ip,
            header_read_timeout: self.header_read_timeout,
            body_idle_timeout: self.body_idle_timeout,
            per_ip: Rate {
                per_second: self.rate_per_ip,
                burst: self.rate_per_ip_burst,
            },
            per_key: Rate {
                per_second: self.rate_per_key,
                burst: self.rate_per_key_burst,
            },
            key_lookups_per_ip: Rate {
                per_second: self.key_lookups_per_ip,
                burst: self.key_lookups_per_ip_burst,
            },
            key_cache_ttl: self.key_cache_ttl,
            org_max_streams: self.org_max_streams,
            org_max_transfers: self.org_max_transfers,
            org_max_execs: self.org_max_execs,
            org_max_waits: self.org_max_waits,
        }
    }
}

/// Default most capacity-holding sandboxes of a new org.
pub const DEFAULT_ORG_MAX_RUNNING: i32 = 10;
/// Default most vCPUs of a new org.
pub const DEFAULT_ORG_MAX_VCPUS: i32 = 20;
/// Default most memory of a new org, in MiB.
pub const DEFAULT_ORG_MAX_MEMORY_MIB: i64 = 20_480;

/// `berth admin create-org`: the quota a new org starts with (`set-quota` changes it later).
/// `0` leaves that limit unset (unlimited).
#[derive(Args, Clone, Debug)]
pub struct DefaultQuotaArgs {
    /// Most capacity-holding sandboxes of a new org.
    #[arg(long, env = "BERTH_DEFAULT_ORG_MAX_RUNNING", default_value_t = DEFAULT_ORG_MAX_RUNNING)]
    pub max_running: i32,
    /// Most vCPUs across them.
    #[arg(long, env = "BERTH_DEFAULT_ORG_MAX_VCPUS", default_value_t = DEFAULT_ORG_MAX_VCPUS)]
    pub max_vcpus: i32,
    /// Most memory across them, in MiB.
    #[arg(long, env = "BERTH_DEFAULT_ORG_MAX_MEMORY_MIB", default_value_t = DEFAULT_ORG_MAX_MEMORY_MIB)]
    pub max_memory_mib: i64,
}

impl DefaultQuotaArgs {
    /// The quota, zeros as unlimited.
    pub fn quota(&self) -> berth_store::orgs::Quota {
        berth_store::orgs::Quota {
            max_running: Some(self.max_running).filter(|v| *v > 0),
            max_vcpus: Some(self.max_vcpus).filter(|v| *v > 0),
            max_memory_mib: Some(self.max_memory_mib).filter(|v| *v > 0),
        }
    }
}

/// The operator's bounds on a sandbox's `disk_mib` (`berth api`, `berth dev`).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct DiskArgs {
    /// The writable disk of a sandbox whose create names no `disk_mib`, in MiB.
    #[arg(long, env = "BERTH_SANDBOX_DISK_DEFAULT_MIB", default_value_t = berth_api::model::DEFAULT_DISK_MIB)]
    sandbox_disk_default_mib: u32,
    /// The largest `disk_mib` a create may ask for, in MiB.
    #[arg(long, env = "BERTH_SANDBOX_DISK_MAX_MIB", default_value_t = berth_api::model::DEFAULT_MAX_DISK_MIB)]
    sandbox_disk_max_mib: u32,
    /// Let a sandbox's `network.egress` allow-list name private networks (RFC 1918, CGNAT);
    /// refused by default. Loopback, link-local (cloud metadata), multicast and reserved
    /// ranges are refused either way.
    #[arg(long, env = "BERTH_SANDBOX_EGRESS_ALLOW_PRIVATE")]
    pub(crate) sandbox_egress_allow_private: bool,
}

impl DiskArgs {
    /// The limits, checked.
    pub(crate) fn limits(&self) -> anyhow::Result<berth_api::model::DiskLimits> {
        Ok(berth_api::model::DiskLimits::new(
            self.sandbox_disk_default_mib,
            self.sandbox_disk_max_mib,
        )?)
    }
}
