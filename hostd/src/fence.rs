//! The generation fence and at-most-once check, pure: what to do with a command given the
//! sandbox's local record (live or tombstone).
//!
//! # Guarantees (DESIGN.md guarantee 2)
//! - A command whose id was applied is answered with its stored result, never applied again.
//! - A command older than the last applied generation is refused without acting.
//! - Anything else is applied.

use berth_schemas::wire::Command;
use berth_schemas::Generation;

use crate::record::{SandboxRecord, StoredResult};

/// What [`check`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fence {
    /// Already applied: republish this result.
    Replay(StoredResult),
    /// Older than what was applied: refuse, do nothing.
    RefuseStale {
        /// The generation the record last applied.
        applied: Generation,
    },
    /// Apply it.
    Apply,
}

/// Decides what to do with `command` given the sandbox's record (`None`: never seen).
pub fn check(record: Option<&SandboxRecord>, command: &Command) -> Fence {
    let Some(record) = record else {
        return Fence::Apply;
    };
    if let Some(stored) = record.result_of(command.id) {
        return Fence::Replay(stored.clone());
    }
    if command.generation < record.applied_generation {
        return Fence::RefuseStale {
            applied: record.applied_generation,
        };
    }
    Fence::Apply
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_schemas::wire::{ResultOutcome, SandboxSpec};
    use berth_schemas::{CommandId, CommandKind, OrgId, SandboxId};

    fn command(generation: i64, kind: CommandKind) -> Command {
        Command {
            snapshot: None,
            id: CommandId::new(),
            sandbox_id: SandboxId::new(),
            generation: Generation(generation),
            kind,
            spec: Some(SandboxSpec {
                org_id: OrgId::new(),
                template: "base".into(),
                resources: Default::default(),
                runtime: Default::default(),
                disk_mib: 64,
                network: Default::default(),
                env: Vec::new(),
                entrypoint: Vec::new(),
                image: None,
            }),
        }
    }

    fn record_applied_at(cmd: &Command) -> SandboxRecord {
        let mut r = SandboxRecord::new(
            cmd.sandbox_id,
            cmd.spec.clone().unwrap(),
            "runc",
            Generation(1),
        );
        r.remember(StoredResult {
            command_id: cmd.id,
            generation: cmd.generation,
            kind: cmd.kind,
            outcome: ResultOutcome::Succeeded {
                address: Some("10.0.0.2".into()),
                last_stop: None,
            },
        });
        r
    }

    #[test]
    fn a_command_for_an_unknown_sandbox_is_applied() {
        assert_eq!(check(None, &command(1, CommandKind::Create)), Fence::Apply);
    }

    #[test]
    fn a_redelivered_command_replays_its_stored_result() {
        let create = command(1, CommandKind::Create);
        let record = record_applied_at(&create);
        match check(Some(&record), &create) {
            Fence::Replay(stored) => assert_eq!(stored.command_id, create.id),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn a_command_older_than_the_applied_generation_is_refused() {
        let start = command(3, CommandKind::Start);
        let record = record_applied_at(&start);
        let mut stale = command(2, CommandKind::Stop);
        stale.sandbox_id = start.sandbox_id;
        assert_eq!(
            check(Some(&record), &stale),
            Fence::RefuseStale {
                applied: Generation(3)
            }
        );
    }

    #[test]
    fn a_new_command_at_the_same_or_a_newer_generation_is_applied() {
        let start = command(3, CommandKind::Start);
        let record = record_applied_at(&start);
        for generation in [3, 4] {
            let mut next = command(generation, CommandKind::Stop);
            next.sandbox_id = start.sandbox_id;
            assert_eq!(check(Some(&record), &next), Fence::Apply);
        }
    }
}
