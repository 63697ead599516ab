//! hostd's metrics (the `metrics` facade; the binary installs the Prometheus exporter).
//!
//! Labels are bounded: runtime, operation, command kind, outcome. Never sandbox ids.

use std::time::Duration;

use berth_schemas::CommandKind;

/// Histogram of runtime operations (`runc run`, `state`, `delete`, …), in seconds.
/// Labels: `runtime`, `operation`.
pub const RUNTIME_OPERATION_DURATION: &str = "berth_hostd_runtime_operation_duration_seconds";

/// Counter of container lists that fell back from reading a runtime's state files
/// (`crate::runtime::statefile`) to running its `list` command. Labels: `runtime`, `reason`
/// (`read`, `parse`, `unexpected`).
pub const RUNTIME_STATE_FALLBACKS: &str = "berth_hostd_runtime_state_fallbacks_total";

/// Counter of commands handled. Labels: `kind` (`sandbox.create`, …), `outcome`.
pub const COMMANDS_TOTAL: &str = "berth_hostd_commands_total";

/// How a command ended, as the `outcome` label of [`COMMANDS_TOTAL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandOutcome {
    /// Applied and succeeded.
    Succeeded,
    /// Applied and failed.
    Failed,
    /// Refused: older than the applied generation.
    RefusedStale,
    /// A redelivery answered from the stored result.
    Replayed,
    /// Not finished; the message was nak'd for a later retry.
    Retried,
}

impl CommandOutcome {
    /// The metrics label value.
    pub fn as_str(self) -> &'static str {
        match self {
            CommandOutcome::Succeeded => "succeeded",
            CommandOutcome::Failed => "failed",
            CommandOutcome::RefusedStale => "refused_stale",
            CommandOutcome::Replayed => "replayed",
            CommandOutcome::Retried => "retried",
        }
    }
}

/// Records one runtime operation's duration.
pub fn runtime_operation(runtime: &'static str, operation: &'static str, elapsed: Duration) {
    ::metrics::histogram!(RUNTIME_OPERATION_DURATION, "runtime" => runtime, "operation" => operation)
        .record(elapsed.as_secs_f64());
}

/// Counts one fallback from a runtime's state files to its `list` command.
pub fn runtime_state_fallback(runtime: &'static str, reason: &'static str) {
    ::metrics::counter!(RUNTIME_STATE_FALLBACKS, "runtime" => runtime, "reason" => reason)
        .increment(1);
}

/// Makes the [`RUNTIME_STATE_FALLBACKS`] series of `runtime` and `reason` exist, at 0 if new.
pub fn runtime_state_fallbacks_exist(runtime: &'static str, reason: &'static str) {
    ::metrics::counter!(RUNTIME_STATE_FALLBACKS, "runtime" => runtime, "reason" => reason)
        .increment(0);
}

/// Counts one handled command.
pub fn command(kind: CommandKind, outcome: CommandOutcome) {
    ::metrics::counter!(COMMANDS_TOTAL, "kind" => kind.as_str(), "outcome" => outcome.as_str())
        .increment(1);
}
