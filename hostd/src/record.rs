//! The local per-sandbox record: the generation fence, the results of applied commands, and
//! what the host holds for the sandbox (its spec, phase and addresses).
//!
//! # Guarantees
//! - Records are written atomically (write a temporary file, fsync, rename), so a crash leaves
//!   either the old or the new record, never half of one.
//! - A record outlives its sandbox as a *tombstone* (`<state_dir>/tombstones/<id>.json`): a
//!   redelivered or stale command for a deleted sandbox is still answered from it instead of
//!   building the sandbox again. Tombstones older than [`TOMBSTONE_RETENTION`] are purged.
//!
//! # Assumptions
//! Only one task touches a given sandbox's record at a time (commands of one sandbox are
//! processed in order, see `commands`).

use std::fs;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use berth_schemas::wire::{CommandResult, ResultOutcome, SandboxSpec, StopDurable};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, SandboxId};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::address::LinkAddresses;
use crate::error::HostdError;
use crate::layout::StateLayout;

/// How many command results a record remembers (oldest dropped first). Redelivery happens
/// within the consumer's ack wait, so the last few suffice.
pub const MAX_REMEMBERED_RESULTS: usize = 32;

/// How long a tombstone answers redelivered commands of a deleted sandbox.
pub const TOMBSTONE_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// What the host last made of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// A create (or a start without a record) is under way or was interrupted.
    Creating,
    /// Should run: the last applied command left it running.
    Running,
    /// Disk kept, no container.
    Stopped,
    /// Tombstone: deleted.
    Deleted,
    /// Tombstone: the create failed and everything it built was removed.
    FailedCreate,
}

/// A command result as remembered for idempotent redelivery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResult {
    /// The command applied.
    pub command_id: CommandId,
    /// The generation it carried.
    pub generation: Generation,
    /// Its kind.
    pub kind: CommandKind,
    /// How it ended (what is republished on redelivery).
    pub outcome: ResultOutcome,
}

impl StoredResult {
    /// The wire result for this stored outcome; `heartbeat_seq` is the host's newest heartbeat
    /// sequence, read after the command was applied ([`crate::host::HeartbeatSeq::current`]).
    pub fn to_wire(
        &self,
        host_id: HostId,
        sandbox_id: SandboxId,
        heartbeat_seq: u64,
    ) -> CommandResult {
        CommandResult {
            command_id: self.command_id,
            sandbox_id,
            host_id,
            generation: self.generation,
            kind: self.kind,
            outcome: self.outcome.clone(),
            heartbeat_seq,
            // Set by `apply::apply` once the apply ends.
            apply_ms: 0,
        }
    }
}

/// One sandbox's local record (or tombstone).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxRecord {
    /// The sandbox.
    pub sandbox_id: SandboxId,
    /// What it was created from.
    pub spec: SandboxSpec,
    /// The runtime the sandbox was built with (`runc`).
    pub runtime: String,
    /// Where it is in its local lifecycle.
    pub phase: Phase,
    /// The generation of the last command applied (the fence).
    pub applied_generation: Generation,
    /// The sandbox's /30, once reserved.
    pub link: Option<LinkAddresses>,
    /// Results of the last [`MAX_REMEMBERED_RESULTS`] applied commands, oldest first.
    pub results: Vec<StoredResult>,
    /// When the record was last written.
    pub updated_at: DateTime<Utc>,
    /// The stop snapshot of the sandbox's current stopped disk, once stored in the object store
    /// (issue 14); cleared by every command that changes the disk (a start). Records written
    /// before it read as `None`.
    #[serde(default)]
    pub durable: Option<StopDurable>,
    /// The `sandbox.archive` that uploaded `durable` (`None`: a stop's background upload did):
    /// a redelivery of that archive after a crash reuses it instead of storing the disk again
    /// as a copy no row names. Records written before it read as `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub durable_by: Option<CommandId>,
    /// A sandbox of this host's warm pool ([`crate::warm`]): booted under an id the host drew,
    /// with a placeholder spec (the pool's shape, no org, env, entrypoint or egress), not in
    /// the heartbeat's inventory. Cleared when a create hands it over. Records written before
    /// it read as `false`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub warm: bool,
}

impl SandboxRecord {
    /// A fresh record for a sandbox about to be created.
    pub fn new(
        sandbox_id: SandboxId,
        spec: SandboxSpec,
        runtime: &str,
        generation: Generation,
    ) -> Self {
        Self {
            sandbox_id,
            spec,
            runtime: runtime.to_owned(),
            phase: Phase::Creating,
            applied_generation: generation,
            link: None,
            results: Vec::new(),
            updated_at: Utc::now(),
            durable: None,
            durable_by: None,
            warm: false,
        }
    }

    /// The stored result of `command_id`, if it was applied.
    pub fn result_of(&self, command_id: CommandId) -> Option<&StoredResult> {
        self.results.iter().find(|r| r.command_id == command_id)
    }

    /// Marks a command applied: raises the fence and remembers its result.
    pub fn remember(&mut self, result: StoredResult) {
        self.applied_generation = self.applied_generation.max(result.generation);
        self.results.retain(|r| r.command_id != result.command_id);
        self.results.push(result);
        let excess = self.results.len().saturating_sub(MAX_REMEMBERED_RESULTS);
        self.results.drain(..excess);
        self.updated_at = Utc::now();
    }

    /// Whether this is a tombstone.
    pub fn is_tombstone(&self) -> bool {
        matches!(self.phase, Phase::Deleted | Phase::FailedCreate)
    }
}

/// Reads and writes records and tombstones under a [`StateLayout`]. Synchronous: records are
/// a few KiB and written once per command.
#[derive(Debug, Clone)]
pub struct RecordStore {
    layout: StateLayout,
}

impl RecordStore {
    /// A store of the records below `layout`.
    pub fn new(layout: StateLayout) -> Self {
        Self { layout }
    }

    /// Every live record under `sandboxes/`. A sandbox dir without a readable record is
    /// logged and skipped (it can only come from a crash before the first record write).
    ///
    /// Errors: [`HostdError::Io`] when the sandboxes dir cannot be listed.
    pub fn load_live(&self) -> Result<Vec<SandboxRecord>, HostdError> {
        let dir = self.layout.sandboxes_dir();
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(HostdError::io(format!("list {}", dir.display()))(e)),
        };
        let mut records = Vec::new();
        for entry in entries {
            let entry = entry.map_err(HostdError::io(format!("list {}", dir.display())))?;
            let Some(id) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<SandboxId>().ok())
            else {
                continue;
            };
            match read_json::<SandboxRecord>(&self.layout.sandbox(id).record()) {
                Ok(Some(r)) => records.push(r),
                Ok(None) => tracing::warn!(sandbox_id = %id, "sandbox dir without a record"),
                Err(e) => {
                    tracing::warn!(sandbox_id = %id, error = %e.report(), "unreadable record")
                }
            }
        }
        Ok(records)
    }

    /// The sandbox's live record, else its tombstone, else `None`.
    ///
    /// Errors: [`HostdError::Io`], [`HostdError::StateFile`].
    pub fn load(&self, id: SandboxId) -> Result<Option<SandboxRecord>, HostdError> {
        if let Some(r) = read_json(&self.layout.sandbox(id).record())? {
            return Ok(Some(r));
        }
        read_json(&self.layout.tombstone(id))
    }

    /// Writes the live record (creating the sandbox dir) atomically.
    ///
    /// Errors: [`HostdError::Io`].
    pub fn save(&self, record: &SandboxRecord) -> Result<(), HostdError> {
        let paths = self.layout.sandbox(record.sandbox_id);
        fs::create_dir_all(paths.dir())
            .map_err(HostdError::io(format!("create {}", paths.dir().display())))?;
        write_json_atomic(&paths.record(), record)
    }

    /// Writes the record as a tombstone. The caller removes the sandbox dir afterwards.
    ///
    /// Errors: [`HostdError::Io`].
    pub fn bury(&self, record: &SandboxRecord) -> Result<(), HostdError> {
        let dir = self.layout.tombstones_dir();
        fs::create_dir_all(&dir).map_err(HostdError::io(format!("create {}", dir.display())))?;
        write_json_atomic(&self.layout.tombstone(record.sandbox_id), record)
    }

    /// Removes the tombstone of a sandbox that is being created again; a no-op without one.
    pub fn unbury(&self, id: SandboxId) -> Result<(), HostdError> {
        let path = self.layout.tombstone(id);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(HostdError::io(format!("remove {}", path.display()))(e))
            }
            _ => Ok(()),
        }
    }

    /// Deletes tombstones not updated within `retention`; returns how many.
    pub fn purge_tombstones(&self, retention: Duration) -> usize {
        let Ok(entries) = fs::read_dir(self.layout.tombstones_dir()) else {
            return 0;
        };
        let cutoff = Utc::now() - chrono::Duration::from_std(retention).unwrap_or_default();
        let mut purged = 0;
        for entry in entries.flatten() {
            let path = entry.path();
            let old = match read_json::<SandboxRecord>(&path) {
                Ok(Some(r)) => r.updated_at < cutoff,
                _ => false,
            };
            if old && fs::remove_file(&path).is_ok() {
                purged += 1;
            }
        }
        purged
    }
}

/// Reads a JSON file; `None` when it does not exist.
fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, HostdError> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(HostdError::io(format!("read {}", path.display()))(e)),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|source| HostdError::StateFile {
            path: path.to_path_buf(),
            source,
        })
}

/// Writes `value` as JSON to `path` atomically: temporary sibling, fsync, rename.
///
/// Errors: [`HostdError::Io`], [`HostdError::StateFile`].
pub(crate) fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<(), HostdError> {
    let bytes = serde_json::to_vec_pretty(value).map_err(|source| HostdError::StateFile {
        path: path.to_path_buf(),
        source,
    })?;
    let tmp = path.with_extension("json.tmp");
    let write = || -> std::io::Result<()> {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    };
    write().map_err(HostdError::io(format!("write {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_schemas::wire::Resources;
    use berth_schemas::OrgId;

    fn record() -> SandboxRecord {
        SandboxRecord::new(
            SandboxId::new(),
            SandboxSpec {
                org_id: OrgId::new(),
                template: "base".into(),
                resources: Resources {
                    vcpus: 1,
                    memory_mib: 128,
                },
                runtime: Default::default(),
                disk_mib: 64,
                network: Default::default(),
                env: Vec::new(),
                entrypoint: Vec::new(),
                image: None,
            },
            "runc",
            Generation(1),
        )
    }

    fn result(generation: i64) -> StoredResult {
        StoredResult {
            command_id: CommandId::new(),
            generation: Generation(generation),
            kind: CommandKind::Start,
            outcome: ResultOutcome::Succeeded {
                address: None,
                last_stop: None,
            },
        }
    }

    #[test]
    fn remembering_a_result_raises_the_fence_and_keeps_the_result() {
        let mut r = record();
        let res = result(4);
        r.remember(res.clone());
        assert_eq!(r.applied_generation, Generation(4));
        assert_eq!(r.result_of(res.command_id), Some(&res));
    }

    #[test]
    fn only_the_most_recent_results_are_remembered() {
        let mut r = record();
        let first = result(1);
        r.remember(first.clone());
        for g in 2..=(MAX_REMEMBERED_RESULTS as i64 + 1) {
            r.remember(result(g));
        }
        assert_eq!(r.results.len(), MAX_REMEMBERED_RESULTS);
        assert!(r.result_of(first.command_id).is_none());
    }

    #[test]
    fn records_round_trip_and_tombstones_are_found_after_the_dir_is_gone() {
        let dir = std::env::temp_dir().join(format!("berth-record-test-{}", uuid::Uuid::new_v4()));
        let store = RecordStore::new(StateLayout::new(&dir));
        let mut r = record();
        store.save(&r).unwrap();
        assert_eq!(store.load(r.sandbox_id).unwrap(), Some(r.clone()));
        assert_eq!(store.load_live().unwrap(), vec![r.clone()]);

        r.phase = Phase::Deleted;
        store.bury(&r).unwrap();
        fs::remove_dir_all(StateLayout::new(&dir).sandbox(r.sandbox_id).dir()).unwrap();
        assert_eq!(store.load(r.sandbox_id).unwrap(), Some(r.clone()));
        assert!(store.load_live().unwrap().is_empty());
        assert_eq!(store.purge_tombstones(Duration::from_secs(3600)), 0);
        assert_eq!(store.purge_tombstones(Duration::ZERO), 1);
        assert_eq!(store.load(r.sandbox_id).unwrap(), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}
