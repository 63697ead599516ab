//! The snapshot resource as the API shows it (issue 13 item 3).

use berth_schemas::ids::SnapshotId;
use berth_schemas::state::snapshot::SnapshotState;
use berth_schemas::SandboxId;
use berth_store::snapshots::SnapshotRow;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// A snapshot: a sandbox's disk (and on gVisor its memory) stored in the object store.
/// `state`: `creating` (its host is capturing or uploading it), `ready` (durable in the object
/// store, never earlier), `failed` (`reason` says why; its sandbox is untouched).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Snapshot {
    /// The snapshot's id.
    #[schema(value_type = String, format = Uuid)]
    pub id: SnapshotId,
    /// The sandbox it was taken of (which may since be deleted: a snapshot outlives it).
    #[schema(value_type = String, format = Uuid)]
    pub sandbox_id: SandboxId,
    /// `snapshot` (`POST …/snapshot`, a fork) or `backup` (the disk only: `POST …/backup` or
    /// the periodic backups of `backup_interval_min`).
    pub kind: String,
    /// `creating`, `ready` or `failed`.
    pub state: SnapshotState,
    /// Why it failed; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What it holds once ready: `disk`, or `disk_and_memory` (gVisor: a restore continues the
    /// processes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holds: Option<String>,
    /// The sandbox's template.
    pub template: String,
    /// The sandbox's runtime (`runc`, `runsc`).
    pub runtime: String,
    /// The snapshot this one stores only the changes against, while it exists.
    #[schema(value_type = Option<String>, format = Uuid)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_id: Option<SnapshotId>,
    /// Bytes of the files it holds, once ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logical_bytes: Option<i64>,
    /// Compressed bytes of the content it references, once ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stored_bytes: Option<i64>,
    /// Compressed bytes it added over its parent, once ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_bytes: Option<i64>,
    /// How long the sandbox was frozen to take it, milliseconds, once ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused_ms: Option<i32>,
    /// When it was requested.
    pub created_at: DateTime<Utc>,
    /// When it became ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready_at: Option<DateTime<Utc>>,
    /// When it is deleted unless deleted before.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
}

impl From<SnapshotRow> for Snapshot {
    fn from(r: SnapshotRow) -> Self {
        Snapshot {
            id: r.id,
            sandbox_id: r.sandbox_id,
            kind: r.kind,
            state: r.state,
            reason: r.reason,
            holds: r.holds,
            template: r.template,
            runtime: r.runtime,
            parent_id: r.parent_id,
            logical_bytes: r.logical_bytes,
            stored_bytes: r.stored_bytes,
            new_bytes: r.new_bytes,
            paused_ms: r.paused_ms,
            created_at: r.created_at,
            ready_at: r.ready_at,
            expires_at: r.expires_at,
        }
    }
}

/// `GET /v1/sandboxes/{id}/snapshots`: the sandbox's snapshots, oldest first.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SnapshotList {
    /// The snapshots.
    pub snapshots: Vec<Snapshot>,
}

/// `POST /v1/sandboxes/{id}/restore` and `POST /v1/sandboxes/{id}/clone`: the snapshot to boot
/// from, one of that sandbox's own, `ready`. Unknown fields are refused.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FromSnapshot {
    /// The snapshot's id.
    #[schema(value_type = String, format = Uuid)]
    pub snapshot_id: SnapshotId,
}

/// `POST /v1/sandboxes/{id}/restore-from-backup`: which backup; `{}` or no body restores the
/// newest ready one (`last_backup_id`). Unknown fields are refused.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FromBackup {
    /// One of the sandbox's own ready backups; its newest when absent.
    #[schema(value_type = Option<String>, format = Uuid)]
    #[serde(default)]
    pub backup_id: Option<SnapshotId>,
}

/// `POST /v1/sandboxes/{id}/fork`: how many clones. Unknown fields are refused.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// How many new sandboxes, 1 to 16.
    pub count: u32,
}

/// What a fork made: the snapshot (`creating`: the clones boot once it is `ready`) and the new
/// sandboxes (`resuming`), in one response.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Fork {
    /// The snapshot the clones boot from.
    pub snapshot: Snapshot,
    /// The new sandboxes, each with its own id.
    pub sandboxes: Vec<crate::model::Sandbox>,
}
