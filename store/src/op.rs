//! [`Op`]: every store operation by name. It labels `berth_db_query_duration_seconds{op}` and
//! every database error, so a slow or failing query is found by name, not by SQL text.

use std::fmt;
use std::future::Future;
use std::time::Instant;

use crate::StoreError;

/// The histogram every store operation records into, labelled `op`.
pub const QUERY_DURATION_METRIC: &str = "berth_db_query_duration_seconds";

macro_rules! ops {
    ($($variant:ident => $label:literal),+ $(,)?) => {
        /// A named store operation (the `op` metrics label).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Op {
            $($variant),+
        }

        impl Op {
            /// Every operation.
            pub const ALL: &'static [Op] = &[$(Op::$variant),+];

            /// The metrics label (`sandbox_insert`, …).
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Op::$variant => $label),+
                }
            }
        }
    };
}

ops! {
    Transaction => "transaction",
    SandboxInsert => "sandbox_insert",
    SandboxGet => "sandbox_get",
    SandboxLock => "sandbox_lock",
    SandboxList => "sandbox_list",
    SandboxTransition => "sandbox_transition",
    SandboxApplyResult => "sandbox_apply_result",
    SandboxTouch => "sandbox_touch",
    SandboxOrgUsage => "sandbox_org_usage",
    SandboxTimedOut => "sandbox_timed_out",
    SandboxUnhealthy => "sandbox_unhealthy",
    SandboxStranded => "sandbox_stranded",
    SandboxAutoStop => "sandbox_auto_stop",
    SandboxAutoDelete => "sandbox_auto_delete",
    SandboxPurge => "sandbox_purge",
    CapacityDrift => "capacity_drift",
    HostUpsert => "host_upsert",
    HostCandidates => "host_candidates",
    HostLock => "host_lock",
    HostReserve => "host_reserve",
    HostRelease => "host_release",
    HostMarkLost => "host_mark_lost",
    HostLiveness => "host_liveness",
    HostSetState => "host_set_state",
    HostList => "host_list",
    HostUnwantedInventory => "host_unwanted_inventory",
    CommandInsert => "command_insert",
    CommandComplete => "command_complete",
    CommandTimeOut => "command_time_out",
    CommandExists => "command_exists",
    CommandPurge => "command_purge",
    CommandNotify => "command_notify",
    CommandLatency => "command_latency",
    EventInsert => "event_insert",
    EventList => "event_list",
    LeaseAcquire => "lease_acquire",
    LeaseCheck => "lease_check",
    LeaseRelease => "lease_release",
    TemplateGet => "template_get",
    TemplateList => "template_list",
    TemplateUpsert => "template_upsert",
    IdempotencyPurge => "idempotency_purge",
    OrgQuota => "org_quota",
    OrgCount => "org_count",
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Runs one query as `op`: records its duration and names `op` in its error.
pub(crate) async fn timed<T>(
    op: Op,
    query: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, StoreError> {
    let started = Instant::now();
    let result = query.await;
    metrics::histogram!(QUERY_DURATION_METRIC, "op" => op.as_str())
        .record(started.elapsed().as_secs_f64());
    result.map_err(StoreError::database(op))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_has_a_distinct_snake_case_label() {
        let mut labels: Vec<_> = Op::ALL.iter().map(|op| op.as_str()).collect();
        assert!(labels
            .iter()
            .all(|l| l.chars().all(|c| c.is_ascii_lowercase() || c == '_')));
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Op::ALL.len());
    }
}
