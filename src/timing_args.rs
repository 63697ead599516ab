//! Operator flags (with env fallbacks) for the reconciler's timings: how often it passes, when
//! a silent host is lost, when its sandboxes fail over, how long each command may go
//! unanswered, how long inventory evidence must be and how old it may be, the circuit breaker
//! of guest failures, how long tombstones and idempotency keys are kept, and its leader lease
//! (issue 12, items 6 and 1); and how it judges hosts' health (item 2). Defaults are the
//! constants of `berth_reconciler` and `berth_schemas::host_state`; README "Configuration"
//! lists them all.

use berth_reconciler::health::HealthConfig;
use berth_reconciler::pass::{self, PassConfig};
use berth_reconciler::ReconcilerConfig;
use berth_schemas::host_state::{health, HealthPolicy};
use clap::Args;
use humantime::Duration;

/// `berth reconciler` / `berth dev`: the reconciler's timings, as `humantime` durations
/// (`10s`, `5m`, `1h 30m`).
#[derive(Args, Clone, Debug)]
pub struct ReconcilerTimingArgs {
    /// Time between two passes of the leader.
    #[arg(long, env = "BERTH_RECONCILE_INTERVAL", default_value_t = pass::DEFAULT_INTERVAL.into())]
    pub reconcile_interval: Duration,
    /// A host silent this long becomes `lost`.
    #[arg(long, env = "BERTH_HOST_LOST_AFTER", default_value_t = pass::DEFAULT_HOST_LOST_AFTER.into())]
    pub host_lost_after: Duration,
    /// Sandboxes on a host `lost` this much longer fail over: restored from their newest backup
    /// on another host, or `failed-start` (`host_lost`) without one.
    #[arg(long, env = "BERTH_FAILOVER_AFTER", default_value_t = pass::DEFAULT_FAILOVER_AFTER.into())]
    pub failover_after: Duration,
    /// A failover a pass defers (no host in service has room for the sandbox's backup, the
    /// hosts with room are stale or degraded, or the backup is being deleted or not ready) is
    /// tried again by each pass for this long, counted from the first pass that deferred it;
    /// the first pass after that which still cannot restore it makes the sandbox
    /// `failed-start` (`host_lost`), saying why.
    #[arg(long, env = "BERTH_FAILOVER_RETRY_FOR", default_value_t = pass::DEFAULT_FAILOVER_RETRY_FOR.into())]
    pub failover_retry_for: Duration,
    /// How long a `sandbox.create` may go unanswered before the sandbox is `failed-start`.
    #[arg(long, env = "BERTH_CREATE_TIMEOUT", default_value_t = pass::DEFAULT_CREATE_TIMEOUT.into())]
    pub create_timeout: Duration,
    /// How long a `sandbox.start` may go unanswered.
    #[arg(long, env = "BERTH_START_TIMEOUT", default_value_t = pass::DEFAULT_START_TIMEOUT.into())]
    pub start_timeout: Duration,
    /// How long a `sandbox.stop` may go unanswered.
    #[arg(long, env = "BERTH_STOP_TIMEOUT", default_value_t = pass::DEFAULT_STOP_TIMEOUT.into())]
    pub stop_timeout: Duration,
    /// A `running` sandbox is judged by its host's inventory only once a heartbeat this much
    /// newer than its last change arrived.
    #[arg(long, env = "BERTH_INVENTORY_GRACE", default_value_t = pass::DEFAULT_INVENTORY_GRACE.into())]
    pub inventory_grace: Duration,
    /// How long a `deleted` row is kept before it is purged.
    #[arg(long, env = "BERTH_TOMBSTONE_RETENTION", default_value_t = pass::DEFAULT_TOMBSTONE_RETENTION.into())]
    pub tombstone_retention: Duration,
    /// How long an `Idempotency-Key` is remembered.
    #[arg(long, env = "BERTH_IDEMPOTENCY_RETENTION", default_value_t = pass::DEFAULT_IDEMPOTENCY_RETENTION.into())]
    pub idempotency_retention: Duration,
    /// A template `pulling` with no sign of its pull (the start, or a layer's progress) for
    /// this long fails with `pull_timed_out` (the API process pulling it died).
    #[arg(long, env = "BERTH_TEMPLATE_PULL_TIMEOUT", default_value_t = pass::DEFAULT_TEMPLATE_PULL_TIMEOUT.into())]
    pub template_pull_timeout: Duration,
    /// At most this many rows per action in one pass.
    #[arg(long, env = "BERTH_RECONCILE_BATCH", default_value_t = pass::DEFAULT_BATCH,
          value_parser = clap::value_parser!(i64).range(1..))]
    pub reconcile_batch: i64,
    /// A host whose newest inventory (its heartbeat's send time) is older than this is not
    /// judged: no guest failed and no orphan compensated there until fresher evidence comes.
    #[arg(long, env = "BERTH_EVIDENCE_MAX_AGE", default_value_t = pass::DEFAULT_EVIDENCE_MAX_AGE.into())]
    pub evidence_max_age: Duration,
    /// The circuit breaker trips when a pass would fail more than this share (0–1) of one
    /// host's running sandboxes at once.
    #[arg(long, env = "BERTH_BREAKER_HOST_SHARE", default_value_t = pass::DEFAULT_BREAKER_HOST_SHARE,
          value_parser = share)]
    pub breaker_host_share: f64,
    /// ... or more than this share (0–1) of the fleet's running sandboxes.
    #[arg(long, env = "BERTH_BREAKER_FLEET_SHARE", default_value_t = pass::DEFAULT_BREAKER_FLEET_SHARE,
          value_parser = share)]
    pub breaker_fleet_share: f64,
    /// Fewer failures than this (in one host, or the fleet) never trip the breaker.
    #[arg(long, env = "BERTH_BREAKER_MIN_FAILURES", default_value_t = pass::DEFAULT_BREAKER_MIN_FAILURES)]
    pub breaker_min_failures: u64,
    /// A tripped breaker acts once its share stayed exceeded, on new evidence, for this many
    /// consecutive passes (1: at once); before that, only on `berth admin breaker-release`.
    #[arg(long, env = "BERTH_BREAKER_PERSIST_PASSES", default_value_t = pass::DEFAULT_BREAKER_PERSIST_PASSES,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub breaker_persist_passes: u32,
    /// How long the leader's lease lasts without renewal (another reconciler takes over after).
    #[arg(long, env = "BERTH_LEADER_LEASE", default_value_t = berth_reconciler::DEFAULT_LEASE_TTL.into())]
    pub leader_lease: Duration,
    /// Consecutive bad boots (creates or starts the host failed, never answered, or ran slower
    /// than `--host-slow-boot`) that make a host `degraded`.
    #[arg(long, env = "BERTH_HOST_DEGRADE_AFTER", default_value_t = health::DEFAULT_DEGRADE_AFTER,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub host_degrade_after: u32,
    /// How long a newly degraded host waits for its probe (each failed probe doubles it).
    #[arg(long, env = "BERTH_HOST_PROBE_BACKOFF", default_value_t = health::DEFAULT_INITIAL_BACKOFF.into())]
    pub host_probe_backoff: Duration,
    /// The longest wait between a degraded host's probes.
    #[arg(long, env = "BERTH_HOST_PROBE_BACKOFF_MAX", default_value_t = health::DEFAULT_MAX_BACKOFF.into())]
    pub host_probe_backoff_max: Duration,
    /// A create or start that succeeded but took longer than this on its host (the apply time
    /// its result reports) counts as a bad boot.
    #[arg(long, env = "BERTH_HOST_SLOW_BOOT", default_value_t = health::DEFAULT_SLOW_BOOT.into())]
    pub host_slow_boot: Duration,
    /// A failed create is retried only on a host heard from within this window (the same
    /// setting and variable as the API's placement window).
    #[arg(long, env = "BERTH_HEARTBEAT_FRESHNESS",
          default_value_t = berth_scheduler::DEFAULT_HEARTBEAT_FRESHNESS.into())]
    pub heartbeat_freshness: Duration,
    /// Sandboxes moving off a draining host at once (archives, and with a live drain stops and
    /// starts elsewhere).
    #[arg(long, env = "BERTH_DRAIN_PARALLEL", default_value_t = pass::DEFAULT_DRAIN_PARALLEL,
          value_parser = clap::value_parser!(i64).range(1..))]
    pub drain_parallel: i64,
    /// Host results applied at once, each in its own transaction on its own database
    /// connection (the process's pool grows to this plus 8, for the pass, the gauges and, in
    /// `berth dev`, the API).
    #[arg(long, env = "BERTH_RESULT_CONCURRENCY",
          default_value_t = berth_reconciler::results::APPLY_CONCURRENCY,
          value_parser = concurrency)]
    pub result_concurrency: usize,
}

impl ReconcilerTimingArgs {
    /// The pass's timings.
    pub fn pass(&self) -> PassConfig {
        PassConfig {
            interval: self.reconcile_interval.into(),
            host_lost_after: self.host_lost_after.into(),
            failover_after: self.failover_after.into(),
            failover_retry_for: self.failover_retry_for.into(),
            create_timeout: self.create_timeout.into(),
            start_timeout: self.start_timeout.into(),
            stop_timeout: self.stop_timeout.into(),
            inventory_grace: self.inventory_grace.into(),
            tombstone_retention: self.tombstone_retention.into(),
            idempotency_retention: self.idempotency_retention.into(),
            batch: self.reconcile_batch,
            evidence_max_age: self.evidence_max_age.into(),
            breaker: pass::GuestBreaker {
                host_share: self.breaker_host_share,
                fleet_share: self.breaker_fleet_share,
                min_failures: self.breaker_min_failures,
                persist_passes: self.breaker_persist_passes,
            },
            health: self.health(),
            snapshot_timeout: pass::DEFAULT_SNAPSHOT_TIMEOUT,
            archive_timeout: pass::DEFAULT_ARCHIVE_TIMEOUT,
            backup_unit: pass::DEFAULT_BACKUP_UNIT,
            template_pull_timeout: self.template_pull_timeout.into(),
            drain_parallel: self.drain_parallel,
        }
    }

    /// How host health is judged, and where a failed create may be retried.
    pub fn health(&self) -> HealthConfig {
        HealthConfig {
            policy: HealthPolicy {
                degrade_after: self.host_degrade_after,
                initial_backoff: self.host_probe_backoff.into(),
                max_backoff: self.host_probe_backoff_max.into(),
                slow_boot: self.host_slow_boot.into(),
            },
            heartbeat_freshness: self.heartbeat_freshness.into(),
            ..HealthConfig::default()
        }
    }

    /// Applies these timings to `config` (its pass and its lease).
    pub fn apply(&self, config: &mut ReconcilerConfig) {
        config.pass = self.pass();
        config.lease_ttl = self.leader_lease.into();
        config.result_concurrency = self.result_concurrency;
    }
}

/// A number of results applied at once: 1 to 64.
fn concurrency(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=64).contains(&n) => Ok(n),
        _ => Err(format!("{s:?} is not a number from 1 to 64")),
    }
}

/// A share between 0 and 1.
fn share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a share between 0 and 1")),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        timing: ReconcilerTimingArgs,
    }

    #[test]
    fn the_defaults_are_the_reconcilers_and_each_flag_sets_its_timing() {
        let defaults = Cli::try_parse_from(["berth"]).unwrap().timing;
        let pass = defaults.pass();
        let built_in = PassConfig::default();
        assert_eq!(pass.interval, built_in.interval);
        assert_eq!(pass.host_lost_after, built_in.host_lost_after);
        assert_eq!(pass.failover_after, built_in.failover_after);
        assert_eq!(pass.failover_retry_for, built_in.failover_retry_for);
        assert_eq!(pass.create_timeout, built_in.create_timeout);
        assert_eq!(pass.inventory_grace, built_in.inventory_grace);
        assert_eq!(pass.batch, built_in.batch);
        assert_eq!(pass.health, built_in.health);
        assert_eq!(pass.evidence_max_age, built_in.evidence_max_age);
        assert_eq!(pass.breaker, built_in.breaker);
        assert_eq!(pass.template_pull_timeout, built_in.template_pull_timeout);

        let set = Cli::try_parse_from([
            "berth",
            "--reconcile-interval",
            "2s",
            "--host-lost-after",
            "45s",
            "--failover-after",
            "1m 30s",
            "--failover-retry-for",
            "6m",
            "--create-timeout",
            "3m",
            "--start-timeout",
            "4m",
            "--stop-timeout",
            "5m",
            "--inventory-grace",
            "7s",
            "--tombstone-retention",
            "1h",
            "--idempotency-retention",
            "2h",
            "--reconcile-batch",
            "50",
            "--leader-lease",
            "20s",
            "--host-degrade-after",
            "5",
            "--host-probe-backoff",
            "3s",
            "--host-probe-backoff-max",
            "1m",
            "--host-slow-boot",
            "90s",
            "--heartbeat-freshness",
            "8s",
            "--evidence-max-age",
            "2m",
            "--breaker-host-share",
            "0.25",
            "--breaker-fleet-share",
            "0.05",
            "--breaker-min-failures",
            "9",
            "--breaker-persist-passes",
            "4",
            "--template-pull-timeout",
            "10m",
        ])
        .unwrap()
        .timing;
        let pass = set.pass();
        let s = std::time::Duration::from_secs;
        assert_eq!(pass.template_pull_timeout, s(600));
        assert_eq!(pass.failover_retry_for, s(360));
        assert_eq!(
            (pass.interval, pass.host_lost_after, pass.failover_after),
            (s(2), s(45), s(90))
        );
        assert_eq!(
            (pass.create_timeout, pass.start_timeout, pass.stop_timeout),
            (s(180), s(240), s(300))
        );
        assert_eq!(
            (
                pass.inventory_grace,
                pass.tombstone_retention,
                pass.idempotency_retention
            ),
            (s(7), s(3600), s(7200))
        );
        assert_eq!(pass.batch, 50);
        let health = pass.health;
        assert_eq!(health.policy.degrade_after, 5);
        assert_eq!(
            (
                health.policy.initial_backoff,
                health.policy.max_backoff,
                health.policy.slow_boot,
                health.heartbeat_freshness
            ),
            (s(3), s(60), s(90), s(8))
        );
        assert_eq!(pass.evidence_max_age, s(120));
        assert_eq!(
            pass.breaker,
            pass::GuestBreaker {
                host_share: 0.25,
                fleet_share: 0.05,
                min_failures: 9,
                persist_passes: 4
            }
        );
        let mut config = ReconcilerConfig::new(berth_schemas::Subjects::new("t").unwrap());
        set.apply(&mut config);
        assert_eq!(config.lease_ttl, s(20));

        for bad in [
            vec!["berth", "--host-lost-after", "soon"],
            vec!["berth", "--reconcile-batch", "0"],
            vec!["berth", "--host-degrade-after", "0"],
            vec!["berth", "--breaker-host-share", "1.5"],
            vec!["berth", "--breaker-fleet-share", "-0.1"],
            vec!["berth", "--breaker-persist-passes", "0"],
        ] {
            assert!(Cli::try_parse_from(&bad).is_err(), "{bad:?}");
        }
    }
}
