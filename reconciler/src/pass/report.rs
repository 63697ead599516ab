//! What a pass did: the kinds of its actions (the `action` label of
//! `berth_reconciler_actions_total`) and its report.

#[cfg(doc)]
use super::PassConfig;

/// One kind of pass action; the `action` label of `berth_reconciler_actions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Hosts marked `lost` after [`PassConfig::host_lost_after`] of silence.
    HostLost,
    /// Sandboxes failed because their command timed out.
    CommandTimeout,
    /// `running` sandboxes failed because their guest stopped answering or vanished.
    GuestUnhealthy,
    /// Sandboxes failed because their host stayed `lost` past [`PassConfig::failover_after`]
    /// (no backup to restore, or not running), or because their restore was still deferred
    /// [`PassConfig::failover_retry_for`] after its first deferral.
    HostLostFailover,
    /// Sandboxes restored from their backup on another host because theirs stayed `lost` past
    /// [`PassConfig::failover_after`].
    FailoverRestored,
    /// Sandboxes whose `expires_at` passed: stopped or deleted as their `on_expiry` says.
    Expired,
    /// `running` sandboxes stopped after `auto_stop_minutes` idle.
    AutoStop,
    /// `stopped` or `failed-start` sandboxes deleted after `auto_delete_minutes`.
    AutoDelete,
    /// Tombstones purged after [`PassConfig::tombstone_retention`].
    TombstonePurge,
    /// Containers no row wants on their host (purged, deleted, placed elsewhere): a delete queued.
    OrphanDestroyed,
    /// Containers of their host's own stopped or failed sandbox still running: a stop queued.
    OrphanStopped,
    /// Snapshots failed because they stayed `creating` past [`PassConfig::snapshot_timeout`].
    SnapshotTimeout,
    /// Templates failed because their pull showed no sign of life for
    /// [`PassConfig::template_pull_timeout`].
    TemplatePullTimeout,
    /// `stopped` sandboxes archived after `auto_archive_days`.
    AutoArchive,
    /// `running` sandboxes backed up after `backup_interval_min`.
    AutoBackup,
    /// Sandboxes of draining hosts whose move began (archive, or a live move's stop).
    DrainBegun,
    /// Drain moves that ended: moved, failed, or forgotten (deleted).
    DrainEnded,
}

impl Action {
    /// The metrics label (`host_lost`, `command_timeout`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Action::HostLost => "host_lost",
            Action::CommandTimeout => "command_timeout",
            Action::GuestUnhealthy => "guest_unhealthy",
            Action::HostLostFailover => "host_lost_failover",
            Action::FailoverRestored => "failover_restored",
            Action::Expired => "expired",
            Action::AutoStop => "auto_stop",
            Action::AutoDelete => "auto_delete",
            Action::TombstonePurge => "tombstone_purge",
            Action::OrphanDestroyed => "orphan_destroyed",
            Action::OrphanStopped => "orphan_stopped",
            Action::SnapshotTimeout => "snapshot_timeout",
            Action::TemplatePullTimeout => "template_pull_timeout",
            Action::AutoArchive => "auto_archive",
            Action::AutoBackup => "auto_backup",
            Action::DrainBegun => "drain_begun",
            Action::DrainEnded => "drain_ended",
        }
    }
}

/// What a pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassReport {
    /// How many of each action the pass took, in the order it ran them.
    pub actions: Vec<(Action, u64)>,
    /// The pass stood down because every in-service host was silent.
    pub all_hosts_silent: bool,
    /// The lease was lost during the pass; the rest was skipped.
    pub deposed: bool,
    /// Hosts whose evidence was too old to judge ([`PassConfig::evidence_max_age`]).
    pub stale_hosts: u64,
    /// Guest failures a tripped circuit breaker held back this pass.
    pub breaker_held: u64,
}

impl PassReport {
    /// How many times `action` happened.
    pub fn count(&self, action: Action) -> u64 {
        self.actions
            .iter()
            .filter(|(a, _)| *a == action)
            .map(|(_, n)| n)
            .sum()
    }
}
