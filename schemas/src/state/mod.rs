//! The sandbox lifecycle state machine: pure functions from (state, request), (state, result)
//! and (state, observation) to a decision or a typed refusal. No I/O here; the store writes what
//! these functions decide, and nobody else decides.
//!
//! - [`on_request`] (`request.rs`): a user's (or the reconciler's automatic) start/stop/delete.
//! - [`on_result`] (`result.rs`): a host's result, including the compensation of a late success.
//! - `converge.rs`: what the reconciler's pass does with a command that timed out
//!   ([`on_timeout`]), a guest that stopped answering or vanished ([`on_guest_failure`]), a host
//!   that was lost ([`on_host_lost`]) and a container a host reports that no row wants there
//!   ([`on_inventory`]).
//! - [`snapshot`]: the snapshot resource's own lifecycle (`creating` → `ready` | `failed`) and
//!   which sandbox states a snapshot may be taken in.
//! - `settle.rs`: an expiry the pass applies ([`on_expiry`]) and what a waiting request answers
//!   ([`wait_verdict`]).
//!
//! Every decision carries its [`Capacity`] change, so capacity (guarantee 4) is decided here
//! and applied by the store in the same transaction as the state write.
//!
//! Source: the seed platform's lifecycle documentation (`shared/reference/003_…txt`, "Read the
//! states") and DESIGN.md "Lifecycle". There is no paused state: `pause` is an alias of `stop`,
//! `resume` an alias of `start`.
//!
//! # Request × state
//!
//! `=` means "already at or heading to that target: return the sandbox, change nothing";
//! `409` means a conflicting transition is in flight; otherwise the new state and the command
//! queued. A sandbox being deleted (`deleted_at` set) answers `=` to delete and `409` to
//! everything else.
//!
//! | state          | start / resume          | stop / pause    | delete                 | snapshot                | restore                | archive                | restore-from-backup |
//! |----------------|-------------------------|-----------------|------------------------|-------------------------|------------------------|------------------------|-------------------------|
//! | provisioning   | =                       | 409             | stopping + delete      | 409                     | 409                    | 409                    | 409 |
//! | starting       | =                       | 409             | stopping + delete      | 409                     | 409                    | 409                    | 409 |
//! | running        | =                       | stopping + stop | stopping + delete      | + snapshot (state kept) | resuming + restore     | 409                    | restoring + migrate (B) |
//! | stopping       | 409                     | =               | stopping + delete      | 409                     | 409                    | 409                    | 409 |
//! | stopped        | starting + start, or migrating + migrate (M) | = | stopping + delete | 409                | resuming + restore (R) | archiving + archive    | restoring + migrate (B) |
//! | resuming       | =                       | 409             | stopping + delete      | 409                     | 409                    | 409                    | 409 |
//! | restoring      | =                       | 409             | stopping + delete      | 409                     | 409                    | 409                    | = |
//! | migrating      | =                       | 409             | stopping + delete (O)  | 409                     | 409                    | 409                    | 409 |
//! | archiving      | 409                     | =               | stopping + delete      | 409                     | 409                    | =                      | 409 |
//! | archived       | unarchiving + unarchive (P) | =           | deleted + delete (T)   | 409                     | 409                    | =                      | restoring + migrate (B) |
//! | unarchiving    | =                       | 409             | stopping + delete      | 409                     | 409                    | 409                    | 409 |
//! | failed-start   | starting + start        | =               | stopping + delete      | 409                     | resuming + restore (R) | 409                    | restoring + migrate (B) |
//! | failed-start (S) | resuming + clone (R)  | =               | stopping + delete      | 409                     | (none of its own: 404) | 409                    | restoring + migrate (B) |
//! | deleted        | 409                     | 409             | =                      | 409                     | 409                    | 409                    | 409 |
//!
//! `(P)`: placement picks a host (any host, not the one it was archived from) and reserves the
//! sandbox's capacity there in the same transaction, as a create does; the unarchive fetches
//! its stop snapshot from the object store and boots it (on gVisor from its memory). `(T)`: an
//! archived sandbox holds no capacity, so its delete writes the tombstone at once (the old
//! host's delete only buries its record, or frees a disk the delete queued with `archived` has
//! not freed yet). A start during `archiving` is refused (409): the
//! upload is not cancelled; once `archived`, a start unarchives. `archiving` settles `archived`
//! on the host's confirmation that the stop snapshot is stored whole (the host keeps the disk;
//! the control plane, having checked the chunks against concurrent removals, queues the
//! `sandbox.delete` that frees it with `archived`), or back to `stopped` (with its disk, the
//! reason in the event) when the upload failed or timed out, or when that check refused the
//! copy (a host success applied as a failure: `archiving` + failed → `stopped`).
//! `unarchiving` settles `running`, or `archived` (capacity released) when the host failed
//! it, or `failed-start` (capacity released) when it timed out.
//!
//! `(B)`: restore from backup (`POST …/restore-from-backup`, and the reconciler's failover of
//! a running sandbox whose host was lost): the sandbox needs a `ready` backup of its own
//! (`last_backup_id`, or the one the request names; else 409 `no_backup`). What its old host
//! held is released and placement picks a host (any in service, the old one included) and
//! reserves there, in one transaction; the row moves there `restoring` at the next generation
//! with a `sandbox.migrate` naming the backup, the old host (when another) gets a
//! `sandbox.delete` at that generation, and the durable stop it had is superseded: the backup's
//! disk replaces whatever the sandbox had since, and memory is never restored.
//! `seed_snapshot` names the backup until the sandbox runs, so `restoring` settles `running`,
//! or `failed-start` (capacity released) when the host failed it or it timed out — and a start
//! of it then boots the backup again (the `(S)` row).
//!
//! `(M)`: start elsewhere ([`on_start_elsewhere`], `migrate.rs`). The caller first asks
//! whether the sandbox's own host can take it back ([`away_from_home`]: not when it is gone,
//! `lost`, silent past the heartbeat freshness, `draining`, `cordoned`, or full for the
//! sandbox's resources). When it can, the start is `starting` there as before. When it cannot
//! and the stop is durable (`durable_at`), placement picks another host and reserves there in
//! the same transaction, the row moves to it `migrating` (remembering the host it came from)
//! and a `sandbox.migrate` names the durable stop snapshot. When the stop is not durable, the
//! start is refused (503: `no_capacity` when the home host is only full, `unavailable` with
//! `Retry-After` otherwise) and nothing changes. `migrating` settles `running` (and the old
//! host gets a `sandbox.delete` that frees its stale disk; its result is off the placement),
//! or back `stopped` on the host it came from (capacity released on the new one, the reason in
//! the event) when the new host failed it or the reconciler timed it out (the new host then
//! gets a `sandbox.delete` at the next generation). `(O)`: a delete while `migrating` also
//! sends the old host a `sandbox.delete`, and collects the stored stop snapshot as for an
//! archived sandbox.
//!
//! `(R)`: the transition reserves the sandbox's capacity on its host again. A restore also
//! needs a `ready` snapshot of that same sandbox (else 409 / 404 at the API). A clone or fork
//! (`POST …/clone`, `…/fork`, `POST /v1/sandboxes {snapshot_id}`) writes a *new* row in
//! `resuming` with its `sandbox.clone` command ([`CommandKind::Clone`]); the source sandbox's
//! state only matters to a fork, whose snapshot needs it `running`. `resuming` settles to
//! `running` on the host's success, `failed-start` on its failure or after the reconciler's
//! timeout; a delete during `resuming` is accepted like in every state, and the clone's late
//! success is then fenced (its generation is older) and destroyed by the delete.
//!
//! `(S)`: a clone that never ran (`sandboxes.seed_snapshot` set: written from a snapshot, its
//! boot failed or timed out) has no disk of its own on its host — a failed clone removes what it
//! seeded — so a start boots it from its snapshot again (a `sandbox.clone` at the next
//! generation, [`on_request_unseeded`]), never the bare template; the API refuses that start
//! with 409 `snapshot_unavailable` once the snapshot is no longer `ready` (deleted, say): such a
//! sandbox can only be deleted. A restore needs a snapshot of the sandbox's own, which a clone
//! that never ran cannot have. `seed_snapshot` is cleared when the sandbox first runs.
//!
//! `snapshot` (`POST …/snapshot`, [`snapshot::on_snapshot_request`]) neither moves the sandbox
//! nor bumps its generation: it writes a `creating` snapshot row and queues
//! `sandbox.snapshot` at the current generation; the snapshot has its own states
//! ([`snapshot`]). A sandbox being deleted answers 409 to it.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Every state of the public sandbox enum. Serialized in kebab-case (`failed-start`).
///
/// `Pending`, `FailedProvision` and `Lost` exist for SDK compatibility and are never written
/// (see [`SandboxState::is_written`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum SandboxState {
    /// SDK compatibility only; never written.
    Pending,
    /// The row exists and its `sandbox.create` is queued; the host has not reported yet.
    Provisioning,
    /// A start of a stopped (or failed-start) sandbox is in flight.
    Starting,
    /// The guest agent answered; the container runs on its host.
    Running,
    /// A stop or delete is in flight; the guest runs until the host confirms.
    Stopping,
    /// No guest process; the disk (and the memory, where the runtime can) is saved on the host.
    Stopped,
    /// A clone, fork or snapshot restore is booting (`sandbox.restore`, `sandbox.clone`).
    Resuming,
    /// Being rebuilt from a backup (`POST …/restore-from-backup`, or the failover of a sandbox
    /// whose host was lost): its backup's disk is fetched onto the host placement picked and
    /// cold-booted (issue 14); it holds capacity there.
    Restoring,
    /// A stopped sandbox whose own host cannot take it back (gone, lost, draining, cordoned or
    /// full) is being fetched from its durable stop snapshot onto the host placement picked,
    /// then booted (a start, issue 14); it holds capacity there.
    Migrating,
    /// A stopped sandbox's stop snapshot is being made durable in object storage; its local
    /// disk is freed once the control plane accepts the stored copy and writes `archived`
    /// (`POST …/archive`, auto-archive).
    Archiving,
    /// Stored only in object storage: no host holds its capacity, and the delete queued with
    /// this state frees the disk its host kept until then.
    Archived,
    /// Being fetched from object storage onto the host placement picked, then booted (a start
    /// of an archived sandbox); it holds capacity there.
    Unarchiving,
    /// A boot failed or timed out, or its guest or host was lost; a start may be retried.
    FailedStart,
    /// SDK compatibility only; never written (a failed create is `failed-start`).
    FailedProvision,
    /// SDK compatibility only; never written (a sandbox on a lost host becomes `failed-start`).
    Lost,
    /// A tombstone: the host destroyed it; the row stays until it is purged.
    Deleted,
}

impl SandboxState {
    /// Every state, in declaration order.
    pub const ALL: [SandboxState; 16] = [
        SandboxState::Pending,
        SandboxState::Provisioning,
        SandboxState::Starting,
        SandboxState::Running,
        SandboxState::Stopping,
        SandboxState::Stopped,
        SandboxState::Resuming,
        SandboxState::Restoring,
        SandboxState::Migrating,
        SandboxState::Archiving,
        SandboxState::Archived,
        SandboxState::Unarchiving,
        SandboxState::FailedStart,
        SandboxState::FailedProvision,
        SandboxState::Lost,
        SandboxState::Deleted,
    ];

    /// The wire and database spelling (`failed-start`).
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Pending => "pending",
            SandboxState::Provisioning => "provisioning",
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Stopping => "stopping",
            SandboxState::Stopped => "stopped",
            SandboxState::Resuming => "resuming",
            SandboxState::Restoring => "restoring",
            SandboxState::Migrating => "migrating",
            SandboxState::Archiving => "archiving",
            SandboxState::Archived => "archived",
            SandboxState::Unarchiving => "unarchiving",
            SandboxState::FailedStart => "failed-start",
            SandboxState::FailedProvision => "failed-provision",
            SandboxState::Lost => "lost",
            SandboxState::Deleted => "deleted",
        }
    }

    /// Whether the control plane ever writes this state to a row. `pending`,
    /// `failed-provision` and `lost` are listed only for SDK compatibility.
    pub fn is_written(self) -> bool {
        !matches!(
            self,
            SandboxState::Pending | SandboxState::FailedProvision | SandboxState::Lost
        )
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The string did not name a sandbox state (or a command kind, or a host state).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown state or kind {0:?}")]
pub struct UnknownState(pub String);

impl FromStr for SandboxState {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SandboxState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// A user's lifecycle request. `resume` maps to `Start` and `pause` to `Stop`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Request {
    /// `POST …/start` or `…/resume`: boot a stopped or failed sandbox.
    Start,
    /// `POST …/stop` or `…/pause` (or auto-stop): stop the guest, keeping the disk.
    Stop,
    /// `DELETE /v1/sandboxes/{id}` (or auto-delete): destroy it; accepted in every state.
    Delete,
    /// `POST …/restore {snapshot_id}`: rebuild a running or stopped sandbox from one of its
    /// own ready snapshots (issue 13 item 5).
    Restore,
    /// `POST …/archive` (or auto-archive): upload a stopped sandbox and free its local disk
    /// (issue 14).
    Archive,
    /// `POST …/restore-from-backup` (or the reconciler's failover from a lost host): cold-boot
    /// the sandbox's backup on the host placement picks (issue 14).
    RestoreFromBackup,
}

impl Request {
    /// The request's name as the API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Request::Start => "start",
            Request::Stop => "stop",
            Request::Delete => "delete",
            Request::Restore => "restore",
            Request::Archive => "archive",
            Request::RestoreFromBackup => "restore-from-backup",
        }
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The kind of a host command. Its numeric order is part of the wire format: append only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CommandKind {
    /// Provision from a template and boot.
    Create,
    /// Boot a stopped sandbox from its saved disk (or memory snapshot).
    Start,
    /// Stop, keeping the disk (and memory where the runtime can).
    Stop,
    /// Destroy the container, network and files.
    Delete,
    /// Take a snapshot ([`crate::wire::Command::snapshot`]): the sandbox's state and generation
    /// do not change ([`snapshot`]).
    Snapshot,
    /// Rebuild a sandbox (running or stopped) from one of its own snapshots
    /// ([`crate::wire::Command::snapshot`] names it): files written after it are gone, and
    /// on a memory snapshot its processes continue from it. The sandbox is `resuming`.
    Restore,
    /// Build a new sandbox from a snapshot (a clone or a fork;
    /// [`crate::wire::Command::snapshot`] names it), from the host's cached chunks or the
    /// object store. The sandbox is `resuming`.
    Clone,
    /// Make a stopped sandbox's stop snapshot durable and whole (reuse the one
    /// [`crate::wire::Command::snapshot`] names when every chunk of it is stored, else upload
    /// the disk anew), keeping the local disk (issue 14): the control plane frees it with a
    /// `sandbox.delete` once it writes `archived`. The sandbox is `archiving`; success is
    /// [`crate::wire::ResultOutcome::Durable`].
    Archive,
    /// Fetch an archived sandbox's stop snapshot ([`crate::wire::Command::snapshot`] names it)
    /// from the object store onto the host placement picked, then boot it (issue 14). The
    /// sandbox is `unarchiving`.
    Unarchive,
    /// Fetch a stopped sandbox's durable stop snapshot ([`crate::wire::Command::snapshot`]
    /// names it) from the object store onto another host, because its own host cannot take
    /// it back (gone, lost, draining, cordoned or full), then boot it there (issue 14: start
    /// elsewhere). The sandbox is `migrating`; on gVisor a memory stop's processes continue.
    Migrate,
}

impl CommandKind {
    /// The kind's name as stored in `commands.kind` (`sandbox.create`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            CommandKind::Create => "sandbox.create",
            CommandKind::Start => "sandbox.start",
            CommandKind::Stop => "sandbox.stop",
            CommandKind::Delete => "sandbox.delete",
            CommandKind::Snapshot => "sandbox.snapshot",
            CommandKind::Restore => "sandbox.restore",
            CommandKind::Clone => "sandbox.clone",
            CommandKind::Archive => "sandbox.archive",
            CommandKind::Unarchive => "sandbox.unarchive",
            CommandKind::Migrate => "sandbox.migrate",
        }
    }
}

impl CommandKind {
    /// Every kind, in wire order.
    pub const ALL: [CommandKind; 10] = [
        CommandKind::Create,
        CommandKind::Start,
        CommandKind::Stop,
        CommandKind::Delete,
        CommandKind::Snapshot,
        CommandKind::Restore,
        CommandKind::Clone,
        CommandKind::Archive,
        CommandKind::Unarchive,
        CommandKind::Migrate,
    ];
}

impl FromStr for CommandKind {
    type Err = UnknownState;
    /// Parses the `commands.kind` spelling (`sandbox.create`, …).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CommandKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

impl fmt::Display for CommandKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a decision changes the sandbox's hold on its host's capacity (guarantee 4). The store
/// applies it in the same transaction as the state write; applying `Reserve` to a sandbox that
/// already holds capacity, or `Release` to one that does not, changes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Capacity {
    /// The hold stays as it is.
    Keep,
    /// The sandbox needs its resources on its host again (a start after a stop or failure).
    Reserve,
    /// The sandbox no longer needs its resources (stopped, failed, deleted).
    Release,
}

/// Why a state changed; stored on every event row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// A user's API request.
    UserRequest,
    /// A host reported the command's result.
    HostReport,
    /// A command's host never answered in time.
    Timeout,
    /// `auto_stop_minutes` passed without activity.
    AutoStop,
    /// `auto_delete_minutes` passed while stopped.
    AutoDelete,
    /// The sandbox's host was lost.
    HostLost,
    /// The runtime failed (boot, restore, stop).
    RuntimeError,
    /// The control plane undid a late or contradicting host action.
    Compensation,
    /// The sandbox's host failed its create by its own fault; the create was sent to another
    /// host ([`retries_elsewhere`]).
    RetriedElsewhere,
    /// `expires_at` passed; the sandbox's `on_expiry` action was applied.
    Expired,
    /// `auto_archive_days` passed while stopped.
    AutoArchive,
    /// `backup_interval_min` passed since the last backup of a running sandbox.
    AutoBackup,
    /// Its host is being drained: the reconciler's drive moves it off
    /// ([`crate::host_state::drain`]).
    Drain,
}

impl Reason {
    /// The snake_case spelling stored in `events.reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::UserRequest => "user_request",
            Reason::HostReport => "host_report",
            Reason::Timeout => "timeout",
            Reason::AutoStop => "auto_stop",
            Reason::AutoDelete => "auto_delete",
            Reason::HostLost => "host_lost",
            Reason::RuntimeError => "runtime_error",
            Reason::Compensation => "compensation",
            Reason::RetriedElsewhere => "retried_elsewhere",
            Reason::Expired => "expired",
            Reason::AutoArchive => "auto_archive",
            Reason::AutoBackup => "auto_backup",
            Reason::Drain => "drain",
        }
    }
}

pub mod breaker;
mod converge;
mod migrate;
mod request;
mod result;
mod settle;
pub mod snapshot;

pub use converge::{
    on_failover_deferred, on_guest_failure, on_host_lost, on_inventory, on_timeout, Deferral,
    Failure, GuestFailure, HostLoss, InventoryVerdict, FAILS_OVER, HOST_LOST_MESSAGE,
    STRANDED_ON_LOST_HOST, TIMED_COMMANDS, UNWANTED_RUNNING_ON_ITS_HOST,
};
pub use migrate::{away_from_home, on_start_elsewhere, Away};
pub use request::{on_request, on_request_unseeded, Decision, Refusal, RESTORES_FROM_BACKUP};
pub use result::{on_result, retries_elsewhere, Fault, Outcome, ResultDecision, MAX_CREATE_HOSTS};
pub use settle::{on_expiry, wait_verdict, Expiry, ExpiryAction, Timers, WaitTarget, WaitVerdict};

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxState as S;

    #[test]
    fn every_state_round_trips_through_its_spelling() {
        for s in S::ALL {
            assert_eq!(s.as_str().parse::<S>().unwrap(), s);
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.as_str())
            );
        }
        assert!("paused".parse::<S>().is_err());
    }

    #[test]
    fn three_public_states_are_never_written() {
        let unwritten: Vec<_> = S::ALL.into_iter().filter(|s| !s.is_written()).collect();
        assert_eq!(unwritten, [S::Pending, S::FailedProvision, S::Lost]);
    }
}
