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
//! [`FAIL_AT_ENV`] names a failure point the same way: the command fails there with an
//! injected error every time it passes it, and is retried as any failed apply is (nak'd and
//! redelivered), which holds one kind of command back while later ones go through.
//!
//! The command kind comes from a task-local that [`scope`] sets around one apply, so the
//! shared bring-up of a create and a start can tell them apart.

use berth_schemas::CommandKind;

/// The environment variable naming the crash point (read only with the `fault-injection`
/// feature): `<command>:<step>`, with the command as its wire name (`create`, `start`,
/// `stop`, `delete`) and the step as [`Step::as_str`].
pub const CRASH_AT_ENV: &str = "BERTH_HOSTD_CRASH_AT";

/// The environment variable naming a failure point (read only with the `fault-injection`
/// feature), `<command>:<step>` as in [`CRASH_AT_ENV`]: every apply of such a command that
/// reaches that step fails there ([`fail_point`]) and is retried later, as a failing disk or
/// runtime would make it. `delete:fenced` holds every delete back before it touches anything,
/// until its fence refuses it as stale (a later command of the sandbox was applied).
pub const FAIL_AT_ENV: &str = "BERTH_HOSTD_FAIL_AT";

/// A step of applying a command after which a crash can be injected. Bring-up (create and
/// start) passes `Address`, `Network`, `Mounted`, `Container`, `Agent`; a stop passes
/// `Stopping`, `ImageWritten` and `Checkpointed` (only on a runtime with memory snapshots), `Destroyed`,
/// `Unmounted`, and then, in its background upload, `Uploading`; a snapshot passes
/// `Captured`; a restore, clone, unarchive or migrate passes `Fetched` while it seeds the disk
/// and `Seeded` before its bring-up; an archive passes
/// `Uploading` and `Captured` (its copy confirmed whole and recorded, the disk kept); a delete
/// (also the one that frees an archived sandbox's disk) passes `TornDown`; every command passes
/// `Fenced` once its fence let it through, before it touches anything, and `Recorded` once its
/// record is written, before its result is published.
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
    /// Stop: the checkpoint's image is written beside its place (a partial image), not renamed
    /// into place; the checkpointed container is still there.
    ImageWritten,
    /// Stop: the memory snapshot was taken; the checkpointed container is still there.
    Checkpointed,
    /// Stop: the container is destroyed; the overlay and the disk are still mounted.
    Destroyed,
    /// Stop: the overlay and the disk are unmounted; the record still says running.
    Unmounted,
    /// Any command: its record is written, its result not yet published.
    Recorded,
    /// Any command: its fence let it through (not a replay, not stale); nothing is applied yet.
    Fenced,
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
    pub const ALL: [Step; 17] = [
        Step::Address,
        Step::Network,
        Step::Mounted,
        Step::Container,
        Step::Agent,
        Step::Stopping,
        Step::ImageWritten,
        Step::Checkpointed,
        Step::Destroyed,
        Step::Unmounted,
        Step::Recorded,
        Step::Fenced,
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
            Step::ImageWritten => "image-written",
            Step::Checkpointed => "checkpointed",
            Step::Destroyed => "destroyed",
            Step::Unmounted => "unmounted",
            Step::Recorded => "recorded",
            Step::Fenced => "fenced",
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

    use super::{kind_name, Step, CRASH_AT_ENV, FAIL_AT_ENV};

    tokio::task_local! {
        static COMMAND: CommandKind;
    }

    /// The point `<command>:<step>` named by the environment variable `var`, if any.
    fn point_of(var: &str) -> Option<(String, Step)> {
        let value = std::env::var(var).ok()?;
        let (kind, step) = value.split_once(':')?;
        let parsed = Step::parse(step);
        if parsed.is_none() {
            tracing::error!(%var, %value, "unknown fault step; no fault will happen");
        }
        Some((kind.to_owned(), parsed?))
    }

    /// The crash point read once from the environment: (command kind name, step).
    fn armed() -> Option<&'static (String, Step)> {
        static ARMED: OnceLock<Option<(String, Step)>> = OnceLock::new();
        ARMED.get_or_init(|| point_of(CRASH_AT_ENV)).as_ref()
    }

    /// The failure point read once from the environment: (command kind name, step).
    fn failing() -> Option<&'static (String, Step)> {
        static FAILING: OnceLock<Option<(String, Step)>> = OnceLock::new();
        FAILING.get_or_init(|| point_of(FAIL_AT_ENV)).as_ref()
    }

    /// Whether `point` names `step` of the command being applied.
    fn here(point: Option<&'static (String, Step)>, step: Step) -> Option<&'static str> {
        let (kind, at) = point?;
        let current = COMMAND.try_with(|k| kind_name(*k)).ok();
        (*at == step && current == Some(kind.as_str())).then_some(kind.as_str())
    }

    pub fn fail_point(step: Step) -> std::io::Result<()> {
        match here(failing(), step) {
            Some(kind) => {
                tracing::warn!(command = %kind, step = step.as_str(), "fault injection: failing the command");
                Err(std::io::Error::other(format!(
                    "injected failure at {kind}:{}",
                    step.as_str()
                )))
            }
            None => Ok(()),
        }
    }

    pub async fn scope<F: std::future::Future>(kind: CommandKind, work: F) -> F::Output {
        COMMAND.scope(kind, work).await
    }

    pub fn crash_point(step: Step) {
        if let Some(kind) = here(armed(), step) {
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

/// Fails (an injected I/O error) when [`FAIL_AT_ENV`] names `step` of the command being
/// applied; the caller returns it as the apply's error, so the command is retried later.
///
/// Errors: the injected error, `injected failure at <command>:<step>`.
#[cfg(feature = "fault-injection")]
pub fn fail_point(step: Step) -> std::io::Result<()> {
    enabled::fail_point(step)
}

/// Never fails: fault injection is not compiled in.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn fail_point(step: Step) -> std::io::Result<()> {
    let _ = step;
    Ok(())
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
