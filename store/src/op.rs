//! [`Op`]: every store operation by name. It labels `berth_db_query_duration_seconds{op}` and
//! every database error, so a slow or failing query is found by name, not by SQL text.

use std::fmt;
use std::future::Future;
use std::time::Instant;

use crate::StoreError;

/// The histogram every store operation records into, labelled `op`.
pub const QUERY_DURATION_METRIC: &str = "berth_db_query_duration_seconds";

macro_rules! ops {
    ($($(#[doc = $doc:literal])* $variant:ident => $label:literal),+ $(,)?) => {
        /// A named store operation (the `op` metrics label).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Op {
            $($(#[doc = $doc])* $variant),+
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
    /// `BEGIN`/`COMMIT` and other plumbing outside a named operation.
    Transaction => "transaction",
    /// [`crate::sandboxes::create`]: the new row of a create.
    SandboxInsert => "sandbox_insert",
    /// [`crate::sandboxes::get`]: one row by id, unlocked.
    SandboxGet => "sandbox_get",
    /// [`crate::sandboxes::lock`]: one row `FOR UPDATE` before a transition.
    SandboxLock => "sandbox_lock",
    /// [`crate::sandboxes::list`] and `count_by_state`: an org's page, or counts per state.
    SandboxList => "sandbox_list",
    /// [`crate::sandboxes::write_transition`]: a fenced state write of a request or failure.
    SandboxTransition => "sandbox_transition",
    /// [`crate::sandboxes::write_result`]: a fenced state write of a host result.
    SandboxApplyResult => "sandbox_apply_result",
    /// [`crate::sandboxes::touch`]: records activity (resets the auto-stop clock).
    SandboxTouch => "sandbox_touch",
    /// [`crate::sandboxes::org_usage`]: what an org's sandboxes hold, for its quota.
    SandboxOrgUsage => "sandbox_org_usage",
    /// [`crate::sandboxes::lock_timed_out`]: rows whose open command outlived its timeout.
    SandboxTimedOut => "sandbox_timed_out",
    /// [`crate::commands::advance_results_watermark`]: move the results watermark forward.
    ResultsWatermarkAdvance => "results_watermark_advance",
    /// [`crate::commands::results_watermark_lag`]: how far the results watermark trails.
    ResultsWatermarkLag => "results_watermark_lag",
    /// [`crate::commands::database_now`]: the database's clock.
    DatabaseNow => "database_now",
    /// [`crate::sandboxes::lock_failed_guests`]: `running` rows whose guest failed.
    SandboxUnhealthy => "sandbox_unhealthy",
    /// [`crate::sandboxes::lock_stranded`]: rows on a host that was lost.
    SandboxStranded => "sandbox_stranded",
    /// [`crate::sandboxes::note_failover_deferred`]: the first deferral of a stranded row's
    /// failover recorded.
    SandboxFailoverDeferred => "sandbox_failover_deferred",
    /// [`crate::sandboxes::lock_due`] with `Due::AutoStop`: `running` rows idle past `auto_stop_minutes`.
    SandboxAutoStop => "sandbox_auto_stop",
    /// [`crate::sandboxes::lock_due`] with `Due::AutoDelete`: `stopped`/`failed-start` rows past
    /// `auto_delete_minutes`.
    SandboxAutoDelete => "sandbox_auto_delete",
    /// [`crate::sandboxes::lock_due`] with `Due::AutoArchive`: `stopped` rows past
    /// `auto_archive_days`.
    SandboxAutoArchive => "sandbox_auto_archive",
    /// [`crate::snapshots::lock_backups_due`]: running sandboxes whose periodic backup is due.
    SandboxAutoBackup => "sandbox_auto_backup",
    /// [`crate::sandboxes::write_durable`]: a stop snapshot confirmed durable (fenced).
    SandboxDurable => "sandbox_durable",
    /// [`crate::sandboxes::unarchive`]: an archived sandbox placed and sent its unarchive.
    SandboxUnarchive => "sandbox_unarchive",
    /// [`crate::sandboxes::migrate`]: a stopped sandbox placed on another host and sent its
    /// migrate; [`crate::sandboxes::leave_old_host`]: the old host's stale copy deleted.
    SandboxMigrate => "sandbox_migrate",
    /// [`crate::sandboxes::restore_from_backup`]: a sandbox moved to the host placement chose
    /// and sent a migrate of its backup (a restore from backup, a failover).
    SandboxRestoreBackup => "sandbox_restore_backup",
    /// [`crate::sandboxes::update_settings`]: a fenced write of a sandbox's settings (PATCH,
    /// renew).
    SandboxUpdateSettings => "sandbox_update_settings",
    /// [`crate::sandboxes::lock_expired`]: rows whose `expires_at` has passed.
    SandboxExpired => "sandbox_expired",
    /// [`crate::sandboxes::clear_expiry`]: clears an applied expiry.
    SandboxClearExpiry => "sandbox_clear_expiry",
    /// [`crate::sandboxes::purge_tombstones`]: deletes old `deleted` rows.
    SandboxPurge => "sandbox_purge",
    /// [`crate::sandboxes::capacity_drift`]: hosts whose reserved sums disagree (guarantee 4).
    CapacityDrift => "capacity_drift",
    /// [`crate::heartbeats::upsert`] (and [`crate::hosts::upsert_heartbeat`], a batch of one):
    /// a batch of heartbeats in one statement.
    HostUpsert => "host_upsert",
    /// [`crate::warm::replace`]: a heartbeat batch's warm slots replace its hosts' rows.
    WarmReplace => "warm_replace",
    /// [`crate::warm::claim`]: a create takes one warm slot of its host and shape.
    WarmClaim => "warm_claim",
    /// [`crate::warm::hosts_with_slot`]: the hosts holding a fresh warm slot of a shape.
    WarmHosts => "warm_hosts",
    /// [`crate::warm::of_host`]: a host's stored warm slots.
    WarmList => "warm_list",
    /// [`crate::hosts::forwarder`]: where a host's preview forwarder listens.
    HostForwarder => "host_forwarder",
    /// [`crate::hosts::placeable`]: the hosts a sandbox may be placed on.
    HostCandidates => "host_candidates",
    /// [`crate::hosts::lock_if_free`]: one host `FOR UPDATE` unless another transaction holds it.
    HostLock => "host_lock",
    /// [`crate::hosts::reserve`]: adds a sandbox's resources to a host's reserved sums.
    HostReserve => "host_reserve",
    /// `hosts::release` (crate-private): subtracts a sandbox's resources from them.
    HostRelease => "host_release",
    /// [`crate::hosts::mark_silent_lost`]: marks silent hosts `lost`.
    HostMarkLost => "host_mark_lost",
    /// [`crate::hosts::liveness`]: how many hosts are in service, and how many of those are alive.
    HostLiveness => "host_liveness",
    /// [`crate::hosts::apply_event`]: a fenced host state write.
    HostSetState => "host_set_state",
    /// [`crate::hosts::list`], `get` and `states_and_ages`: host reads.
    HostList => "host_list",
    /// [`crate::hosts::unwanted_containers`]: containers a host reports that no row wants.
    HostUnwantedInventory => "host_unwanted_inventory",
    /// [`crate::hosts::register`] and [`crate::hosts::unregister`]: registers a host (and its
    /// NATS key), or forgets it.
    HostRegister => "host_register",
    /// [`crate::hosts::registered`] and [`crate::hosts::registrations`]: which hosts are
    /// registered.
    HostRegistered => "host_registered",
    /// [`crate::host_health::record`]: a host's health after a boot's outcome or a probe.
    HostHealthRecord => "host_health_record",
    /// [`crate::host_health::room_elsewhere`]: hosts with room that placement could not use
    /// (stale heartbeat, degraded), when nothing was placeable.
    HostRoomElsewhere => "host_room_elsewhere",
    /// [`crate::host_health::in_service`]: how many hosts take new sandboxes and how many an
    /// operator holds out (cordoned, draining), when nothing was placeable.
    HostInService => "host_in_service",
    /// [`crate::host_health::conditions`]: every host's health (operators, gauges).
    HostHealthList => "host_health_list",
    /// [`crate::host_health::backdate_heartbeats`]: ages hosts' `last_seen` (tests, drills).
    HostBackdate => "host_backdate",
    /// [`crate::sandboxes::move_create`]: a failed create sent to another host.
    SandboxMoveCreate => "sandbox_move_create",
    /// [`crate::commands::creates_issued`]: how many hosts a sandbox's create was sent to.
    CommandCreatesIssued => "command_creates_issued",
    /// [`crate::heartbeats::stale_evidence`]: hosts whose newest inventory is too old to judge by.
    HeartbeatEvidence => "heartbeat_evidence",
    /// [`crate::sandboxes::guest_tallies`]: per host, running sandboxes and those the pass would fail.
    SandboxGuestTally => "sandbox_guest_tally",
    /// [`crate::breakers`]: circuit breaker trips and host events, read and written.
    Breaker => "breaker",
    /// [`crate::sandboxes::execd_token`]: a sandbox's OpenSandbox execd token, made once.
    SandboxExecdToken => "sandbox_execd_token",
    /// [`crate::sandboxes::find_with_execd_token`]: a sandbox and its execd token, any org.
    SandboxFindExecd => "sandbox_find_execd",
    /// [`crate::sandboxes::list_in_states`]: an org's sandboxes in any of some states.
    SandboxListStates => "sandbox_list_states",
    /// [`crate::snapshots::create`]: a new `creating` snapshot row.
    SnapshotInsert => "snapshot_insert",
    /// [`crate::snapshots::get`], `get_any`, `lock` and `list_for_sandbox`: snapshot reads.
    SnapshotGet => "snapshot_get",
    /// [`crate::snapshots::write_ready`] and [`crate::snapshots::write_failed`]: a snapshot
    /// settles (only from `creating`).
    SnapshotSettle => "snapshot_settle",
    /// [`crate::snapshots::org_usage`]: an org's snapshot count and stored bytes, for its quota.
    SnapshotOrgUsage => "snapshot_org_usage",
    /// [`crate::snapshots::delete`]: a snapshot row and its chunk references.
    SnapshotDelete => "snapshot_delete",
    /// [`crate::snapshots::lock_timed_out`] and [`crate::snapshots::lock_expired`]: the pass's
    /// selections.
    SnapshotDue => "snapshot_due",
    /// [`crate::chunks`]: queueing, claiming and finishing the removal of unreferenced chunks,
    /// and a settling snapshot's check of its chunks against them.
    ChunkRemoval => "chunk_removal",
    /// [`crate::sweep`]: the object store sweep's looks for unnamed manifests and chunks, its
    /// manifest claims and its lock.
    ObjectSweep => "object_sweep",
    /// [`crate::commands::insert`]: a command into the outbox.
    CommandInsert => "command_insert",
    /// [`crate::commands::complete_issued`]: checks a result's command and sets its outcome.
    CommandComplete => "command_complete",
    /// [`crate::commands::time_out_open`]: completes open commands as `timeout`.
    CommandTimeOut => "command_time_out",
    /// [`crate::commands::exists`]: whether a command was already queued.
    CommandExists => "command_exists",
    /// [`crate::commands::issued`]: a command as issued, to check a result against.
    CommandIssued => "command_issued",
    /// [`crate::commands::purge_completed`]: deletes the completed commands of purged sandboxes.
    CommandPurge => "command_purge",
    /// [`crate::commands::claim_publishable`]: the command relay's batch.
    CommandClaim => "command_claim",
    /// [`crate::commands::mark_published`]: acked commands marked, failed ones counted.
    CommandMarkPublished => "command_mark_published",
    /// [`crate::commands::backlog`]: the command outbox's size and age.
    CommandBacklog => "command_backlog",
    /// [`crate::events::insert`]: an event row in the state change's transaction.
    EventInsert => "event_insert",
    /// [`crate::events::list_for_sandbox`], [`crate::events::published_after`] and the other
    /// reads of published events.
    EventList => "event_list",
    /// [`crate::events::claim_unpublished`]: the event relay's batch.
    EventClaim => "event_claim",
    /// [`crate::events::mark_published`]: acked events marked, with their `seq`.
    EventMarkPublished => "event_mark_published",
    /// [`crate::events::backlog`]: the event outbox's size and age.
    EventBacklog => "event_backlog",
    /// The guest-failure events a pass wrote (`berth bench`'s false-failure count).
    EventGuestFailures => "event_guest_failures",
    /// [`crate::leases::acquire`]: takes or renews a lease.
    LeaseAcquire => "lease_acquire",
    /// [`crate::leases::Lease::check`]: the fencing check of a lease.
    LeaseCheck => "lease_check",
    /// [`crate::leases::release`]: gives a lease up.
    LeaseRelease => "lease_release",
    /// [`crate::templates::get`]: one template by name.
    TemplateGet => "template_get",
    /// [`crate::templates::list`]: every template.
    TemplateList => "template_list",
    /// [`crate::templates::upsert`]: registers or updates a template.
    TemplateUpsert => "template_upsert",
    /// [`crate::templates::insert_image`]: registers a template pulled from an image.
    TemplateInsertImage => "template_insert_image",
    /// [`crate::templates::restart_pull`]: a failed image template pulled again.
    TemplateRestartPull => "template_restart_pull",
    /// [`crate::templates::finish_pull`]: a pull's outcome written, fenced on `pulling`.
    TemplateFinishPull => "template_finish_pull",
    /// [`crate::templates::add_event`]: one event of a template.
    TemplateEventInsert => "template_event_insert",
    /// [`crate::templates::events`]: a template's events.
    TemplateEventList => "template_event_list",
    /// [`crate::templates::get_shared`]: one template, locked against its deletion.
    TemplateGetShared => "template_get_shared",
    /// [`crate::templates::delete`]: an image template removed, unless sandboxes use it.
    TemplateDelete => "template_delete",
    /// [`crate::templates::fail_stale_pulls`]: pulls with no sign of life failed.
    TemplateFailStalePulls => "template_fail_stale_pulls",
    /// [`crate::idempotency::purge`]: deletes expired idempotency keys.
    IdempotencyPurge => "idempotency_purge",
    /// [`crate::idempotency::lock`]: a key held for the request's transaction.
    IdempotencyLock => "idempotency_lock",
    /// [`crate::idempotency::find`]: the response stored under a key.
    IdempotencyFind => "idempotency_find",
    /// [`crate::idempotency::insert`]: a response stored under a key.
    IdempotencyInsert => "idempotency_insert",
    /// [`crate::api_keys::insert`]: a new API key's hash.
    ApiKeyInsert => "api_key_insert",
    /// [`crate::api_keys::find_active`]: the key a request presents.
    ApiKeyFind => "api_key_find",
    /// [`crate::api_keys::list`] and `get`: an org's keys, without their hashes.
    ApiKeyList => "api_key_list",
    /// [`crate::api_keys::lock_active_count`]: an org's working keys, its row locked.
    ApiKeyCount => "api_key_count",
    /// [`crate::api_keys::revoke`] and `revoke_all_of_org`: keys revoked.
    ApiKeyRevoke => "api_key_revoke",
    /// [`crate::orgs::find_by_name`] and `tombstone`: an org by name, an org deleted.
    OrgDelete => "org_delete",
    /// [`crate::ping`]: readiness.
    Ping => "ping",
    /// [`crate::drain::begin`] and `end`: a host's drain set or ended.
    DrainSet => "drain_set",
    /// [`crate::drain::draining`], `lock_untracked` and `lock_in_flight`: the drive's reads.
    DrainLock => "drain_lock",
    /// [`crate::drain::track`] and `forget`: a drain move recorded or forgotten.
    DrainTrack => "drain_track",
    /// [`crate::drain::progress`]: a host's drain progress.
    DrainProgress => "drain_progress",
    /// [`crate::orgs::lock_quota`] and `set_quota`: an org's quota row.
    OrgQuota => "org_quota",
    /// [`crate::orgs::create`]: a new org.
    OrgCreate => "org_create",
    /// [`crate::orgs::count`]: how many orgs exist.
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
