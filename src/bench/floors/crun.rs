//! The raw `crun run` floor (issue 16 lever 5): the same busybox bundle as the raw `runc run`
//! floor, run by crun, sample by sample beside runc ([`super::runc_and_crun_run`]).
//!
//! crun 1.8 decides the cgroup layout from its own mount namespace (a `statfs` of
//! `/sys/fs/cgroup` and of `/sys/fs/cgroup/unified`) and refuses a hybrid layout whose cgroup2
//! hierarchy lists any controller, before it looks at `--cgroup-manager` ("cgroups in hybrid
//! mode not supported, drop all controllers from cgroupv2"; source: `libcrun_cgroup_enter` in
//! crun's `src/libcrun/cgroup.c`). Without a cgroup2 mount at `/sys/fs/cgroup/unified` it runs
//! in its cgroup v1 ("legacy") mode, limits written to the v1 controllers. So the floor tries
//! crun as the host mounts cgroups, then in a mount namespace of its own without that mount
//! ([`CrunMode::LegacyView`]), both with the `cgroupfs` manager, and says which ran, or what
//! crun said to each.
//!
//! Assumptions: crun is `crun` on `PATH`; the bench runs as root (unshare of a mount
//! namespace needs `CAP_SYS_ADMIN`, as `runc run` needs root).

use std::ffi::CStr;
use std::process::Stdio;

use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;

use super::{path_str, timed_with, Bundle, Samples};

/// The crun binary, looked up on `PATH`.
const CRUN: &str = "crun";

/// The cgroup manager every crun floor run uses: the one Berth would (no systemd on the host
/// is assumed; the `systemd` manager needs its D-Bus).
const CGROUP_MANAGER: &str = "--cgroup-manager=cgroupfs";

/// Where a hybrid layout mounts its cgroup2 hierarchy (what crun `statfs`es).
const UNIFIED_MOUNT: &CStr = c"/sys/fs/cgroup/unified";

/// How crun was run for its floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrunMode {
    /// In the bench's own mount namespace: the host's cgroup layout as it is.
    HostView,
    /// In a mount namespace of its own (host mounts still propagate in) without the cgroup2
    /// mount at `/sys/fs/cgroup/unified`: crun's cgroup v1 mode.
    LegacyView,
}

impl CrunMode {
    /// The words the bench prints for the mode.
    pub fn describe(self) -> &'static str {
        match self {
            Self::HostView => "cgroupfs, cgroups as the host mounts them",
            Self::LegacyView => {
                "cgroupfs, cgroup v1: own mount namespace without /sys/fs/cgroup/unified"
            }
        }
    }
}

/// The raw `crun run` floor of one bench run.
#[derive(Default)]
pub enum CrunFloor {
    /// `crun` is not on `PATH`: nothing is printed.
    #[default]
    Missing,
    /// crun did not run the bundle in any mode tried: what it said to each.
    Refused(String),
    /// Measured: `run` of `/bin/true`, start to exit, in `mode`.
    Ran {
        /// The mode every sample ran in.
        mode: CrunMode,
        /// The samples.
        samples: Samples,
    },
}

/// The crun half of the interleaved floor: its state root, the floor so far, the next id.
pub struct Runner {
    root: String,
    floor: CrunFloor,
    next: usize,
}

impl Runner {
    /// Finds how crun runs `bundle` here: one uncounted run as the host mounts cgroups, then,
    /// if that failed, one in [`CrunMode::LegacyView`]. Never fails: a crun that does not run
    /// is a [`CrunFloor::Refused`] floor.
    pub async fn probe(bundle: &Bundle) -> Self {
        let mut runner = Self {
            root: path_str(&bundle.dir().join("crun-root")),
            floor: CrunFloor::Missing,
            next: 0,
        };
        let installed = tokio::process::Command::new(CRUN)
            .arg("--version")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await;
        if installed.is_err() {
            return runner;
        }
        let as_mounted = match runner.run(bundle, CrunMode::HostView).await {
            Ok(_) => return runner.ran(CrunMode::HostView),
            Err(e) => crun_said(&e),
        };
        runner.floor = match runner.run(bundle, CrunMode::LegacyView).await {
            Ok(_) => return runner.ran(CrunMode::LegacyView),
            Err(e) => CrunFloor::Refused(format!(
                "as mounted: {as_mounted}; without /sys/fs/cgroup/unified: {}",
                crun_said(&e)
            )),
        };
        runner
    }

    /// One more sample when crun runs here; a failure ends the floor as refused, saying after
    /// how many samples.
    pub async fn sample(&mut self, bundle: &Bundle) {
        let CrunFloor::Ran { mode, .. } = self.floor else {
            return;
        };
        let outcome = self.run(bundle, mode).await;
        let CrunFloor::Ran { samples, .. } = &mut self.floor else {
            return;
        };
        match outcome {
            Ok(took) => samples.push(took),
            Err(e) => {
                let after = samples.0.len();
                self.floor = CrunFloor::Refused(format!(
                    "failed after {after} samples ({}): {}",
                    mode.describe(),
                    crun_said(&e)
                ));
            }
        }
    }

    /// The floor measured.
    pub fn into_floor(self) -> CrunFloor {
        self.floor
    }

    fn ran(mut self, mode: CrunMode) -> Self {
        self.floor = CrunFloor::Ran {
            mode,
            samples: Samples::default(),
        };
        self
    }

    /// One `crun run` of the bundle in `mode`, under an id of its own that is deleted if the
    /// run did not end well (or was interrupted).
    async fn run(
        &mut self,
        bundle: &Bundle,
        mode: CrunMode,
    ) -> anyhow::Result<std::time::Duration> {
        let id = format!("crun{}", self.next);
        self.next += 1;
        let dir = path_str(bundle.dir());
        let mut in_flight = InFlight {
            root: self.root.clone(),
            id: Some(id.clone()),
        };
        let args = [
            "--root",
            self.root.as_str(),
            CGROUP_MANAGER,
            "run",
            "--bundle",
            &dir,
            &id,
        ];
        let took = match mode {
            CrunMode::HostView => timed_with(CRUN, &args, |_| {}).await?,
            CrunMode::LegacyView => timed_with(CRUN, &args, legacy_view).await?,
        };
        // `run` deleted the container when it exited.
        in_flight.id = None;
        Ok(took)
    }
}

/// Makes `command` start in a mount namespace of its own, a slave of the bench's (mounts made
/// later on the host still appear in it), without the cgroup2 mount at
/// `/sys/fs/cgroup/unified`: crun sees a cgroup v1 layout.
fn legacy_view(command: &mut tokio::process::Command) {
    // SAFETY: the closure runs in the forked child before exec and makes only three system
    // calls on static C strings: no allocation, no lock, as `pre_exec` requires.
    unsafe {
        command.pre_exec(|| {
            nix::sched::unshare(CloneFlags::CLONE_NEWNS)?;
            nix::mount::mount(
                None::<&CStr>,
                c"/",
                None::<&CStr>,
                MsFlags::MS_REC | MsFlags::MS_SLAVE,
                None::<&CStr>,
            )?;
            nix::mount::umount2(UNIFIED_MOUNT, MntFlags::MNT_DETACH)?;
            Ok(())
        });
    }
}

/// What crun printed, from a [`super::timed`] error (`<program> <args>: <status>: <stderr>`),
/// on one line and without `|` (it is printed in a markdown table).
fn crun_said(e: &anyhow::Error) -> String {
    let text = format!("{e:#}");
    let said = text
        .split_once("exit status: ")
        .and_then(|(_, rest)| rest.split_once(": "))
        .map_or(text.as_str(), |(_, stderr)| stderr);
    said.replace(['\n', '|'], " ").trim().to_owned()
}

/// A crun container id of a run that has not ended well yet: deleted (`delete --force`) on
/// drop, so a failed or interrupted floor leaves no container or cgroup of its.
struct InFlight {
    root: String,
    id: Option<String>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(id) = &self.id {
            let _ = std::process::Command::new(CRUN)
                .args(["--root", &self.root, "delete", "--force", id])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_crun_said_is_its_stderr_on_one_line() {
        let e = anyhow::anyhow!(
            "crun --root /r run --bundle /b crun0: exit status: 1: cgroups in hybrid mode not \
             supported, drop all controllers from cgroupv2\n"
        );
        assert_eq!(
            crun_said(&e),
            "cgroups in hybrid mode not supported, drop all controllers from cgroupv2"
        );
        let e = anyhow::anyhow!("crun --root /r run x: exit status: 1: cannot open sd-bus: a|b");
        assert_eq!(crun_said(&e), "cannot open sd-bus: a b");
        let e = anyhow::anyhow!("start crun");
        assert_eq!(crun_said(&e), "start crun");
    }
}
