//! Fault injection for crash tests: hostd kills itself (SIGKILL, as `kill -9` would) at a
//! named step of applying a command, so a test can restart it and check that the redelivered
//! command converges.
//!
//! Compiled in only with the crate's `fault-injection` feature, which is off by default (the
//! root package's tests turn it on through a dev-dependency, so `cargo build` of the `berth`
//! binary never contains it). With the feature, [`CRASH_AT_ENV`] names the crash point as
//! `<command>:<step>` (`create:network`, `stop:checkpointed`; see [`Step`]); without it
//! [`crash_point`] is an empty inline function and the variable is never read.
//!
//! The command kind comes from a task-local that [`scope`] sets around one apply, so the
//! shared bring-up of a create and a start can tell them apart.

use berth_schemas::CommandKind;

/// The environment variable naming the crash point (read only with the `fault-injection`
/// feature): `<command>:<step>`, with the command as its wire name (`create`, `start`,
/// `stop`, `delete`) and the step as [`Step::as_str`].
pub const CRASH_AT_ENV: &str = "BERTH_HOSTD_CRASH_AT";

/// A step of applying a command after which a crash can be injected. Bring-up (create and
/// start) passes `Address`, `Network`, `Mounted`, `Container`, `Agent`; a stop passes
/// `Stopping`, `Checkpointed` (only on a runtime with memory snapshots), `Destroyed`,
/// `Unmounted`, and then, in its background upload, `Uploading`; a snapshot passes
/// `Captured`; a restore, clone, unarchive or migrate passes `Fetched` while it seeds the disk
/// and `Seeded` before its bring-up; an archive passes
/// `Uploading` and `Captured` (its copy confirmed whole and recorded, the disk kept); a delete
/// (also the one that frees an archived sandbox's disk) passes `TornDown`; every command passes `Recorded` once its record is written,
/// before its result is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Bring-up: the address is reserved and the record written with it.
    Address,
    /// Bring-up: the network (netns, veth, firewall) and the disk exist.
    Network,
    /// Bring-up: the overlay is mounted and the OCI spec written.
    Mounted,
    /// Bring-up: the container was started or restored (the agent may not answer yet).
    Container,
    /// Bring-up: the agent answered; the record still says what it said before.
    Agent,
    /// Stop: the container's state was read (and its agent calls drained), nothing changed.
    Stopping,
    /// Stop: the memory snapshot was taken; the checkpointed container is still there.
    Checkpointed,
    /// Stop: the container is destroyed; the overlay and the disk are still mounted.
    Destroyed,
    /// Stop: the overlay and the disk are unmounted; the record still says running.
    Unmounted,
    /// Any command: its record is written, its result not yet published.
    Recorded,
    /// Snapshot: the capture is staged and the sandbox thawed; nothing is uploaded yet.
    Captured,
    /// Restore or clone: the disk (and memory image) is seeded from the snapshot; nothing is
    /// booted yet.
    Seeded,
    /// A stop's background upload or an archive's: the first chunk is stored, the manifest
    /// not yet.
    Uploading,
    /// Restore, clone, unarchive or migrate, mid-download: the disk tree is fetched beside its
    /// place (a partial tree), not renamed into place yet.
    Fetched,
    /// Delete (also the one freeing an archived sandbox's disk): the container, network and
    /// address are gone;
    /// the sandbox dir (its disk image and record) is not removed yet.
    TornDown,
}

impl Step {
    /// Every step, in the order a create, a stop and then any command pass them.
    pub const ALL: [Step; 15] = [
        Step::Address,
        Step::Network,
        Step::Mounted,
        Step::Container,
        Step::Agent,
        Step::Stopping,
        Step::Checkpointed,
        Step::Destroyed,
        Step::Unmounted,
        Step::Recorded,
        Step::Captured,
        Step::Seeded,
        Step::Uploading,
        Step::Fetched,
        Step::TornDown,
    ];

    /// The step's name in [`CRASH_AT_ENV`].
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Address => "address",
            Step::Network => "network",
            Step::Mounted => "mounted",
            Step::Container => "container",
            Step::Agent => "agent",
            Step::Stopping => "stopping",
            Step::Checkpointed => "checkpointed",
            Step::Destroyed => "destroyed",
            Step::Unmounted => "unmounted",
            Step::Recorded => "recorded",
            Step::Captured => "captured",
            Step::Seeded => "seeded",
            Step::Uploading => "uploading",
            Step::Fetched => "fetched",
            Step::TornDown => "torn-down",
        }
    }

    /// The step named `name`, if any.
    pub fn parse(name: &str) -> Option<Step> {
        Self::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

/// The value of [`CRASH_AT_ENV`] that crashes a `kind` command at `step`.
pub fn crash_at(kind: CommandKind, step: Step) -> String {
    format!("{}:{}", kind_name(kind), step.as_str())
}

/// A command kind's name in [`CRASH_AT_ENV`]: its wire name without `sandbox.`.
fn kind_name(kind: CommandKind) -> &'static str {
    let name = kind.as_str();
    name.strip_prefix("sandbox.").unwrap_or(name)
}

#[cfg(feature = "fault-injection")]
mod enabled {
    use std::sync::OnceLock;

    use berth_schemas::CommandKind;

    use super::{kind_name, Step, CRASH_AT_ENV};

    tokio::task_local! {
        static COMMAND: CommandKind;
    }

    /// The crash point read once from the environment: (command kind name, step).
    fn armed() -> Option<&'static (String, Step)> {
        static ARMED: OnceLock<Option<(String, Step)>> = OnceLock::new();
        ARMED
            .get_or_init(|| {
                let value = std::env::var(CRASH_AT_ENV).ok()?;
                let (kind, step) = value.split_once(':')?;
                let parsed = Step::parse(step);
                if parsed.is_none() {
                    tracing::error!(%value, "unknown crash step; no crash will happen");
                }
                Some((kind.to_owned(), parsed?))
            })
            .as_ref()
    }

    pub async fn scope<F: std::future::Future>(kind: CommandKind, work: F) -> F::Output {
        COMMAND.scope(kind, work).await
    }

    pub fn crash_point(step: Step) {
        let Some((kind, armed)) = armed() else {
            return;
        };
        let current = COMMAND.try_with(|k| kind_name(*k)).ok();
        if *armed == step && current == Some(kind.as_str()) {
            tracing::error!(command = %kind, step = step.as_str(), "fault injection: killing hostd");
            // SIGKILL, not abort(): nothing runs after it, no core file is written.
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
            std::process::abort();
        }
    }
}

/// Runs one apply of a `kind` command, so [`crash_point`] knows which command passes.
#[cfg(feature = "fault-injection")]
pub async fn scope<F: std::future::Future>(kind: CommandKind, work: F) -> F::Output {
    enabled::scope(kind, work).await
}

/// Runs one apply of a `kind` command (without the feature: just runs it).
#[cfg(not(feature = "fault-injection"))]
pub async fn scope<F: std::future::Future>(kind: CommandKind, work: F) -> F::Output {
    let _ = kind;
    work.await
}

/// Kills this process when [`CRASH_AT_ENV`] names `step` of the command being applied.
#[cfg(feature = "fault-injection")]
pub fn crash_point(step: Step) {
    enabled::crash_point(step)
}

/// Does nothing: fault injection is not compiled in.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn crash_point(step: Step) {
    let _ = step;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_step_name_parses_back_and_names_are_unique() {
        for step in Step::ALL {
            assert_eq!(Step::parse(step.as_str()), Some(step));
        }
        assert_eq!(Step::parse("nowhere"), None);
        assert_eq!(
            crash_at(CommandKind::Stop, Step::Checkpointed),
            "stop:checkpointed"
        );
    }
}
