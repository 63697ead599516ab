//! The peer column of `berth bench`: Podman (Debian's `podman`), what a user would pick to run
//! a local container sandbox instead, timed on the same busybox rootfs in the same run.
//!
//! One Podman cycle is `podman run -d` (a `sleep`), `podman exec` (`echo hi`, answered) and
//! `podman rm -f -t 0` (kill at once, as Berth's delete does), with
//! `--runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1024:1024`: Podman's default
//! rlimits exceed this machine's hard limits, and runc refuses to raise them. Podman's default
//! bridge network is kept (Berth's sandboxes get a network too). The image comes from
//! `podman import` of the bench's busybox rootfs ([`super::floors::Bundle`]) and is removed at
//! the end.

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::floors::{timed, Bundle};

/// The flags every `podman run` of the bench takes (see the module docs).
const RUN_FLAGS: &[&str] = &[
    "--runtime",
    "runc",
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
];

/// An imported busybox image, removed (with any container of this run left) on [`Podman::remove`].
pub struct Podman {
    image: String,
    tag: String,
    _bundle: Bundle,
    /// Set by [`Podman::remove`]; else `Drop` removes the run's containers and image (an
    /// interrupted bench drops this mid-cycle).
    removed: bool,
}

impl Drop for Podman {
    fn drop(&mut self) {
        if self.removed {
            return;
        }
        let quiet = |args: &[&str]| {
            std::process::Command::new("podman")
                .args(args)
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .output()
        };
        let filter = format!("name=berth-bench-{}-", self.tag);
        if let Ok(out) = quiet(&["ps", "-aq", "--filter", &filter]) {
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = quiet(&["rm", "-f", "-t", "0", id]);
            }
        }
        let _ = quiet(&["rmi", "-f", &self.image]);
    }
}

/// The times of one Podman cycle.
pub struct Cycle {
    /// `podman run -d` until it returned.
    pub run: Duration,
    /// `podman exec … echo hi`, answered.
    pub exec: Duration,
    /// `podman rm -f -t 0` until it returned.
    pub rm: Duration,
}

impl Cycle {
    /// The whole cycle.
    pub fn total(&self) -> Duration {
        self.run + self.exec + self.rm
    }
}

impl Podman {
    /// Imports the busybox rootfs as an image of this run.
    ///
    /// Errors: no `podman` (apt-get install podman), the import failing.
    pub async fn prepare() -> anyhow::Result<Self> {
        let version = tokio::process::Command::new("podman")
            .arg("--version")
            .output()
            .await
            .context("podman not found (apt-get install podman)")?;
        if !version.status.success() {
            bail!("podman --version failed");
        }
        let bundle = Bundle::new("podman", &["/bin/sleep", "3600"]).await?;
        let tar = bundle.dir().join("rootfs.tar");
        let rootfs = bundle.rootfs();
        let tar_str = tar.to_string_lossy().into_owned();
        timed(
            "tar",
            &["-C", &rootfs.to_string_lossy(), "-cf", &tar_str, "."],
        )
        .await?;
        let tag = format!("{}-{}", std::process::id(), chrono::Utc::now().timestamp());
        let image = format!("localhost/berth-bench-busybox:{tag}");
        timed("podman", &["import", "-q", &tar_str, &image]).await?;
        Ok(Self {
            image,
            tag,
            _bundle: bundle,
            removed: false,
        })
    }

    /// One cycle: run, exec, remove.
    ///
    /// Errors: any step failing, or the exec not answering `hi` (the container is removed).
    pub async fn cycle(&self, i: usize) -> anyhow::Result<Cycle> {
        let name = format!("berth-bench-{}-{i}", self.tag);
        let mut run_args = vec!["run", "-d", "--name", &name];
        run_args.extend_from_slice(RUN_FLAGS);
        run_args.extend_from_slice(&[&self.image, "/bin/sleep", "3600"]);
        let outcome = async {
            let run = timed("podman", &run_args).await?;
            let t = Instant::now();
            let out = tokio::process::Command::new("podman")
                .args(["exec", &name, "/bin/echo", "hi"])
                .stdin(Stdio::null())
                .output()
                .await?;
            let exec = t.elapsed();
            if !out.status.success() || out.stdout != b"hi\n" {
                bail!(
                    "podman exec: {}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            let rm = timed("podman", &["rm", "-f", "-t", "0", &name]).await?;
            Ok(Cycle { run, exec, rm })
        }
        .await;
        if outcome.is_err() {
            let _ = timed("podman", &["rm", "-f", "-t", "0", &name]).await;
        }
        outcome
    }

    /// Removes the image.
    pub async fn remove(mut self) {
        if let Err(e) = timed("podman", &["rmi", "-f", &self.image]).await {
            eprintln!("bench: podman image {} not removed: {e:#}", self.image);
        }
        self.removed = true;
    }
}
