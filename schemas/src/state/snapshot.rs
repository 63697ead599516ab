//! The snapshot lifecycle (issue 13 item 3): pure decisions for a snapshot request against its
//! sandbox's state, a host's report on a snapshot, a snapshot that never finished, and a
//! delete. A snapshot is a resource of its own: `creating` → `ready` | `failed`; it outlives
//! its sandbox until deleted or expired.
//!
//! # Snapshot request × sandbox state
//!
//! | sandbox state                          | snapshot                                        |
//! |----------------------------------------|-------------------------------------------------|
//! | running                                | accepted: frozen briefly, memory too on gVisor   |
//! | being deleted, or any other state      | 409 with the state                              |
//!
//! A stopped sandbox's disk is unmounted and its memory image is its stop's; snapshotting it
//! is not offered yet (start it, or snapshot before stopping).
//!
//! The sandbox's own state and generation do not change: a snapshot does not move it, so it
//! races no lifecycle command; the host takes it under the sandbox's lock.
//!
//! # Host report × snapshot state
//!
//! | snapshot state | durable (manifest stored)  | failed            |
//! |----------------|----------------------------|-------------------|
//! | creating       | ready                      | failed + reason   |
//! | ready          | ignore (duplicate)         | ignore            |
//! | failed         | delete the stored content  | ignore            |
//!
//! `ready` is written only from a report that the manifest is stored, never earlier (DESIGN.md
//! guarantee 9). A `failed` snapshot whose upload later landed (it timed out first) is not
//! revived: its stored content is deleted (compensation), so nothing is ready that was reported
//! failed. A `creating` snapshot past its deadline fails with [`SNAPSHOT_TIMED_OUT`].

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::{SandboxState, UnknownState};

/// The `reason` of a snapshot that never finished in time.
pub const SNAPSHOT_TIMED_OUT: &str = "snapshot timed out: its host never reported it";

/// A snapshot's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum SnapshotState {
    /// Requested; its host is capturing or uploading it. Not usable yet.
    Creating,
    /// Durable in the object store: restores and clones may use it.
    Ready,
    /// Capture or upload failed, or it timed out; `reason` says why. Its sandbox is untouched.
    Failed,
}

impl SnapshotState {
    /// Every state.
    pub const ALL: [SnapshotState; 3] = [
        SnapshotState::Creating,
        SnapshotState::Ready,
        SnapshotState::Failed,
    ];

    /// The database and API spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotState::Creating => "creating",
            SnapshotState::Ready => "ready",
            SnapshotState::Failed => "failed",
        }
    }
}

impl fmt::Display for SnapshotState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SnapshotState {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SnapshotState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// How the host takes a snapshot of a sandbox in a given state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capture {
    /// Running: freeze (runc: cgroup freezer; gVisor: `runsc checkpoint` keeping it running),
    /// capture, thaw, then upload.
    Live,
}

/// Why a snapshot request or delete was refused (HTTP 409 `conflict`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotRefusal {
    /// The sandbox is in a state a snapshot cannot be taken in.
    #[error("cannot snapshot a sandbox that is {state}")]
    SandboxState {
        /// The sandbox's state.
        state: SandboxState,
    },
    /// The sandbox is being deleted.
    #[error("cannot snapshot a sandbox that is being deleted")]
    Deleting,
    /// A snapshot still being created cannot be deleted; its host is writing it.
    #[error("cannot delete a snapshot that is {state}")]
    Busy {
        /// The snapshot's state.
        state: SnapshotState,
    },
}

/// Decides a snapshot request against its sandbox (the first table in the module docs).
///
/// Errors: [`SnapshotRefusal::Deleting`], [`SnapshotRefusal::SandboxState`].
pub fn on_snapshot_request(
    sandbox: SandboxState,
    deleting: bool,
) -> Result<Capture, SnapshotRefusal> {
    if deleting {
        return Err(SnapshotRefusal::Deleting);
    }
    match sandbox {
        SandboxState::Running => Ok(Capture::Live),
        state => Err(SnapshotRefusal::SandboxState { state }),
    }
}

/// What a host reported about a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotReport {
    /// Its manifest is stored: every chunk and the manifest are durable.
    Durable,
    /// Capture or upload failed; nothing was reported durable.
    Failed,
}

/// What to do with a host's report (the second table in the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotDecision {
    /// Write this state (with the report's sizes, `paused_ms` or reason) and its event.
    Apply(SnapshotState),
    /// The snapshot already failed: delete what the late upload stored; the row stays failed.
    DeleteContent,
    /// A duplicate or contradicting late report: change nothing.
    Ignore,
}

/// Decides a host's report against the snapshot's state.
pub fn on_snapshot_report(state: SnapshotState, report: SnapshotReport) -> SnapshotDecision {
    use SnapshotReport as R;
    use SnapshotState as S;
    match (state, report) {
        (S::Creating, R::Durable) => SnapshotDecision::Apply(S::Ready),
        (S::Creating, R::Failed) => SnapshotDecision::Apply(S::Failed),
        (S::Failed, R::Durable) => SnapshotDecision::DeleteContent,
        (S::Ready, _) | (S::Failed, R::Failed) => SnapshotDecision::Ignore,
    }
}

/// A snapshot past its deadline: `Some(Failed)` (with [`SNAPSHOT_TIMED_OUT`]) while it is
/// creating, `None` once it settled.
pub fn on_snapshot_timeout(state: SnapshotState) -> Option<SnapshotState> {
    (state == SnapshotState::Creating).then_some(SnapshotState::Failed)
}

/// Why `POST /v1/sandboxes/{id}/clone` was refused because of its source sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CloneRefusal {
    /// The source is a tombstone: 404 `not_found`, as the sandbox's other routes answer (its
    /// snapshots still clone through `POST /v1/sandboxes {snapshot_id}`).
    #[error("sandbox is deleted")]
    Deleted,
    /// The source is being deleted: 409 `conflict`.
    #[error("cannot clone a sandbox that is {state} (being deleted)")]
    Deleting {
        /// The source's state.
        state: SandboxState,
    },
    /// The source is in a transition (or a state) a clone does not take its settings from:
    /// 409 `conflict` with the state.
    #[error("cannot clone a sandbox that is {state}")]
    SandboxState {
        /// The source's state.
        state: SandboxState,
    },
}

/// Decides a clone of one of sandbox's snapshots against the source sandbox (the clone takes
/// its settings): accepted while it is settled — `running`, `stopped`, `failed-start`,
/// `archived` — and refused while a transition is in flight (`stopping`, `resuming`, …),
/// while it is being deleted, and once it is deleted ([`CloneRefusal`]).
///
/// | source state                                    | clone                        |
/// |-------------------------------------------------|------------------------------|
/// | running, stopped, failed-start, archived        | accepted                     |
/// | being deleted (any state)                       | 409                          |
/// | deleted                                         | 404                          |
/// | any other state                                 | 409 with the state           |
///
/// Errors: [`CloneRefusal`].
pub fn on_clone_request(source: SandboxState, deleting: bool) -> Result<(), CloneRefusal> {
    use SandboxState as S;
    match source {
        S::Deleted => Err(CloneRefusal::Deleted),
        state if deleting => Err(CloneRefusal::Deleting { state }),
        S::Running | S::Stopped | S::FailedStart | S::Archived => Ok(()),
        S::Pending
        | S::Provisioning
        | S::Starting
        | S::Stopping
        | S::Resuming
        | S::Restoring
        | S::Migrating
        | S::Archiving
        | S::Unarchiving
        | S::FailedProvision
        | S::Lost => Err(CloneRefusal::SandboxState { state: source }),
    }
}

/// Decides `DELETE /v1/snapshots/{id}`: a ready or failed snapshot goes (its row and the stored
/// content no other snapshot references); a creating one is refused.
///
/// Errors: [`SnapshotRefusal::Busy`].
pub fn on_snapshot_delete(state: SnapshotState) -> Result<(), SnapshotRefusal> {
    match state {
        SnapshotState::Creating => Err(SnapshotRefusal::Busy { state }),
        SnapshotState::Ready | SnapshotState::Failed => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxState as Sb;
    use SnapshotState as S;

    #[test]
    fn only_a_running_sandbox_not_being_deleted_can_be_snapshotted() {
        for state in Sb::ALL {
            let expected = match state {
                Sb::Running => Ok(Capture::Live),
                _ => Err(SnapshotRefusal::SandboxState { state }),
            };
            assert_eq!(on_snapshot_request(state, false), expected, "{state}");
            assert_eq!(
                on_snapshot_request(state, true),
                Err(SnapshotRefusal::Deleting),
                "{state} deleting"
            );
        }
    }

    #[test]
    fn a_clone_takes_a_settled_source_only_and_a_deleted_one_is_not_found() {
        for state in Sb::ALL {
            let expected = match state {
                Sb::Deleted => Err(CloneRefusal::Deleted),
                Sb::Running | Sb::Stopped | Sb::FailedStart | Sb::Archived => Ok(()),
                _ => Err(CloneRefusal::SandboxState { state }),
            };
            assert_eq!(on_clone_request(state, false), expected, "{state}");
            let deleting = match state {
                Sb::Deleted => Err(CloneRefusal::Deleted),
                _ => Err(CloneRefusal::Deleting { state }),
            };
            assert_eq!(on_clone_request(state, true), deleting, "{state} deleting");
        }
        assert_eq!(
            on_clone_request(Sb::Stopping, false)
                .unwrap_err()
                .to_string(),
            "cannot clone a sandbox that is stopping"
        );
    }

    #[test]
    fn reports_follow_the_table_for_every_state() {
        use SnapshotDecision as D;
        use SnapshotReport as R;
        let table = [
            (S::Creating, D::Apply(S::Ready), D::Apply(S::Failed)),
            (S::Ready, D::Ignore, D::Ignore),
            (S::Failed, D::DeleteContent, D::Ignore),
        ];
        assert_eq!(table.len(), S::ALL.len());
        for (state, durable, failed) in table {
            assert_eq!(
                on_snapshot_report(state, R::Durable),
                durable,
                "durable in {state}"
            );
            assert_eq!(
                on_snapshot_report(state, R::Failed),
                failed,
                "failed in {state}"
            );
        }
    }

    #[test]
    fn only_a_creating_snapshot_times_out_and_only_a_settled_one_is_deleted() {
        for state in S::ALL {
            assert_eq!(
                on_snapshot_timeout(state),
                (state == S::Creating).then_some(S::Failed)
            );
            assert_eq!(on_snapshot_delete(state).is_err(), state == S::Creating);
            assert_eq!(state.as_str().parse::<S>().unwrap(), state);
        }
        assert!("deleted".parse::<S>().is_err());
    }
}
