//! The floors `berth bench` measures in the same run as the stack's figures: raw `runc run`
//! (interleaved with raw `crun run` where crun is installed, [`crun`]), raw `runsc run`, and a
//! raw `runsc checkpoint` + `runsc restore` of one detached sandbox, all of a busybox bundle
//! made by `runc spec`; a raw Postgres commit; a raw JetStream publish.
//!
//! A floor that cannot be measured (runsc missing, say) is returned as an error the caller
//! prints and leaves empty: the table then says `n/a`, never a guessed figure.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use super::Samples;

pub mod crun;

pub use crun::CrunFloor;

/// How long one floor or peer command may take before the bench gives it up (killed).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// A busybox OCI bundle in its own directory under `/var/tmp`, removed on drop: `rootfs/bin`
/// holds `busybox` (busybox-static) and the applets the bench runs, `config.json` is
/// `runc spec`'s default with the given process.
pub struct Bundle {
    dir: PathBuf,
}

/// The busybox applets a bench bundle links.
const APPLETS: &[&str] = &["sh", "true", "sleep", "echo"];

impl Bundle {
    /// Makes the bundle `name` running `args`.
    ///
    /// Errors: `/bin/busybox` missing, `runc spec` failing, I/O.
    pub async fn new(name: &str, args: &[&str]) -> anyhow::Result<Self> {
        let dir = PathBuf::from(format!(
            "/var/tmp/berth-bench-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let bundle = Self { dir };
        let bin = bundle.rootfs().join("bin");
        std::fs::create_dir_all(&bin)?;
        std::fs::copy("/bin/busybox", bin.join("busybox"))
            .context("copy /bin/busybox (busybox-static)")?;
        for applet in APPLETS {
            std::os::unix::fs::symlink("busybox", bin.join(applet))?;
        }
        let spec = tokio::process::Command::new("runc")
            .arg("spec")
            .current_dir(&bundle.dir)
            .status()
            .await?;
        if !spec.success() {
            bail!("runc spec failed");
        }
        let config_path = bundle.dir.join("config.json");
        let mut config: Value = serde_json::from_slice(&std::fs::read(&config_path)?)?;
        config["process"]["terminal"] = json!(false);
        config["process"]["args"] = json!(args);
        std::fs::write(&config_path, serde_json::to_vec(&config)?)?;
        Ok(bundle)
    }

    /// The bundle directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The root filesystem.
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }
}

impl Drop for Bundle {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A file or directory removed when this is dropped.
pub struct RemoveOnDrop(pub PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `program args`, stdin and stdout closed, and returns how long it took. Its stderr
/// goes to a file, not a pipe: a detached container (`runsc restore --detach`) inherits it
/// and would hold a pipe open long after the command returned.
///
/// Errors: the program could not start or exited non-zero (its stderr in the message).
pub async fn timed(program: &str, args: &[&str]) -> anyhow::Result<Duration> {
    timed_with(program, args, |_| {}).await
}

/// [`timed`], with `prepare` applied to the command before it is spawned (a `pre_exec`, say).
///
/// Errors: as [`timed`].
pub async fn timed_with(
    program: &str,
    args: &[&str],
    prepare: impl FnOnce(&mut tokio::process::Command),
) -> anyhow::Result<Duration> {
    let err_path = std::env::temp_dir().join(format!(
        "berth-bench-{}-{}.stderr",
        std::process::id(),
        uuid::Uuid::now_v7().simple()
    ));
    let err_file = std::fs::File::create(&err_path)?;
    // Removed on drop too (an interrupted bench drops this future mid-command).
    let _remove = RemoveOnDrop(err_path.clone());
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err_file)
        .kill_on_drop(true);
    prepare(&mut command);
    let t = Instant::now();
    let run = command.status();
    let status = match tokio::time::timeout(COMMAND_TIMEOUT, run).await {
        Ok(status) => status.with_context(|| format!("start {program}")),
        Err(_) => Err(anyhow::anyhow!(
            "{program} {}: no end within {COMMAND_TIMEOUT:?}",
            args.join(" ")
        )),
    };
    let elapsed = t.elapsed();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let status = status?;
    if !status.success() {
        bail!("{program} {}: {status}: {}", args.join(" "), stderr.trim());
    }
    Ok(elapsed)
}

/// The raw `runc run` floor and, interleaved with it sample by sample so load weighs on both
/// alike, the raw `crun run` floor of the same bundle.
#[derive(Default)]
pub struct RuntimeFloors {
    /// `runc run` of `/bin/true`, start to exit.
    pub runc: Samples,
    /// `crun run` of the same bundle, in the mode it ran in, or why it did not run.
    pub crun: CrunFloor,
}

/// Measures [`RuntimeFloors`]: `samples` raw `runc run`s of a busybox `true`, each followed by
/// a raw `crun run` of the same bundle when crun is installed and runs here in some mode
/// ([`crun::probe`]; its probe run is not counted).
///
/// Errors: as [`runc_run`]; crun's own failures are its floor's [`CrunFloor::Refused`].
pub async fn runc_and_crun_run(samples: usize) -> anyhow::Result<RuntimeFloors> {
    let bundle = Bundle::new("runc", &["/bin/true"]).await?;
    let root = path_str(&bundle.dir().join("runc-root"));
    let dir = path_str(bundle.dir());
    let mut crun = crun::Runner::probe(&bundle).await;
    let mut out = RuntimeFloors::default();
    for i in 0..samples {
        let id = format!("floor{i}");
        out.runc
            .push(timed("runc", &["--root", &root, "run", "--bundle", &dir, &id]).await?);
        crun.sample(&bundle).await;
    }
    out.crun = crun.into_floor();
    Ok(out)
}

/// Raw `runc run` of a busybox container that runs `true`: the runtime's own cost.
pub async fn runc_run(samples: usize) -> anyhow::Result<Samples> {
    let bundle = Bundle::new("runc", &["/bin/true"]).await?;
    let root = bundle.dir().join("runc-root");
    let (root, dir) = (path_str(&root), path_str(bundle.dir()));
    let mut out = Samples::default();
    for i in 0..samples {
        let id = format!("floor{i}");
        out.push(timed("runc", &["--root", &root, "run", "--bundle", &dir, &id]).await?);
    }
    Ok(out)
}

/// The gVisor floors of one run: `runsc run` of `true` to its end, and of a detached
/// `sleep`, then a `runsc checkpoint` of that sandbox and a `runsc restore` of the image.
#[derive(Default)]
pub struct RunscFloors {
    /// `runsc run` of `/bin/true`, start to exit.
    pub run: Samples,
    /// `runsc run --detach` of `/bin/sleep`, until runsc returns.
    pub run_detached: Samples,
    /// `runsc checkpoint` of that running sandbox.
    pub checkpoint: Samples,
    /// `runsc restore --detach` of that checkpoint image.
    pub restore: Samples,
}

/// Measures [`RunscFloors`] `samples` times each, with hostd's platform
/// ([`berth_hostd::runtime::runsc::RUNSC_PLATFORM`]) and no network (`--network=none`: hostd's
/// sandboxes bring gVisor's netstack up in their own namespace, so the floor is a little
/// lower than what hostd can reach).
///
/// Errors: runsc missing or failing (every container it made is deleted first).
pub async fn runsc(samples: usize) -> anyhow::Result<RunscFloors> {
    let short = Bundle::new("runsc-true", &["/bin/true"]).await?;
    let long = Bundle::new("runsc-sleep", &["/bin/sleep", "3600"]).await?;
    let root = path_str(&long.dir().join("runsc-root"));
    let global = [
        "--root",
        root.as_str(),
        berth_hostd::runtime::runsc::RUNSC_PLATFORM,
        "--network=none",
    ];
    let runsc = |args: Vec<String>| {
        let mut all: Vec<String> = global.iter().map(|s| s.to_string()).collect();
        all.extend(args);
        async move {
            let refs: Vec<&str> = all.iter().map(String::as_str).collect();
            timed("runsc", &refs).await
        }
    };
    let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let (short_dir, long_dir) = (path_str(short.dir()), path_str(long.dir()));
    let mut floors = RunscFloors::default();
    let mut made = RunscMade {
        global: global.iter().map(|s| s.to_string()).collect(),
        ids: Vec::new(),
    };
    let outcome = async {
        for i in 0..samples {
            let id = format!("floor{i}");
            floors
                .run
                .push(runsc(s(&["run", "--bundle", &short_dir, &id])).await?);
            let id = format!("cycle{i}");
            made.ids.push(id.clone());
            let image = path_str(&long.dir().join(format!("image{i}")));
            floors
                .run_detached
                .push(runsc(s(&["run", "--detach", "--bundle", &long_dir, &id])).await?);
            floors
                .checkpoint
                .push(runsc(s(&["checkpoint", "--image-path", &image, &id])).await?);
            // The checkpointed sandbox's remains hold the id (hostd deletes them too).
            runsc(s(&["delete", "--force", &id])).await?;
            floors.restore.push(
                runsc(s(&[
                    "restore",
                    "--detach",
                    "--image-path",
                    &image,
                    "--bundle",
                    &long_dir,
                    &id,
                ]))
                .await?,
            );
            runsc(s(&["delete", "--force", &id])).await?;
            made.ids.pop();
        }
        anyhow::Ok(())
    }
    .await;
    for id in std::mem::take(&mut made.ids) {
        let _ = runsc(s(&["delete", "--force", &id])).await;
    }
    outcome.map(|()| floors)
}

/// The detached runsc sandboxes of a floor run not deleted yet: deleted on drop too, so an
/// interrupted bench (its future dropped) leaves no gVisor sandbox running.
struct RunscMade {
    /// runsc's global flags (`--root …`).
    global: Vec<String>,
    ids: Vec<String>,
}

impl Drop for RunscMade {
    fn drop(&mut self) {
        for id in &self.ids {
            let _ = std::process::Command::new("runsc")
                .args(&self.global)
                .args(["delete", "--force", id])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// A raw single-row insert and commit.
pub async fn pg_commit(url: &str, samples: usize) -> anyhow::Result<Samples> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await?;
    sqlx::query("CREATE TEMP TABLE bench_floor (id bigint, at timestamptz)")
        .execute(&mut conn)
        .await?;
    let mut out = Samples::default();
    for i in 0..samples {
        let t = Instant::now();
        let mut tx = conn.begin().await?;
        sqlx::query("INSERT INTO bench_floor VALUES ($1, now())")
            .bind(i as i64)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        out.push(t.elapsed());
    }
    Ok(out)
}

/// A raw JetStream publish awaiting its ack, on a file-backed stream of its own; with the
/// control plane's credentials file when the stack's NATS has auth on.
pub async fn js_publish(url: &str, creds: Option<&str>, samples: usize) -> anyhow::Result<Samples> {
    let spec = berth_schemas::nats_auth::NatsConnect {
        url: url.to_owned(),
        creds: creds
            .map(|path| berth::nats_access::load(std::path::Path::new(path)))
            .transpose()?,
        ca_file: None,
    };
    let client = crate::connect_with(&spec).await?;
    let js = async_nats::jetstream::new(client);
    let tag = uuid::Uuid::now_v7().simple().to_string();
    // Named by the process too, so a test can tell a run's stream from another's.
    let name = format!("BENCH_FLOOR_{}_{tag}", std::process::id());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("bench.floor.{tag}")],
        storage: async_nats::jetstream::stream::StorageType::File,
        ..Default::default()
    })
    .await?;
    // Deleted on drop too: an interrupted bench drops this future mid-publish.
    let _stream = FloorStream {
        js: js.clone(),
        name,
    };
    let mut out = Samples::default();
    for _ in 0..samples {
        let t = Instant::now();
        js.publish(format!("bench.floor.{tag}"), "x".into())
            .await?
            .await?;
        out.push(t.elapsed());
    }
    Ok(out)
}

/// The JetStream floor's own stream, deleted when this is dropped (the floor ended, failed or
/// was interrupted), waiting at most [`FLOOR_STREAM_DELETE`] for the server's answer.
struct FloorStream {
    js: async_nats::jetstream::Context,
    name: String,
}

/// How long dropping a [`FloorStream`] waits for its deletion.
const FLOOR_STREAM_DELETE: std::time::Duration = std::time::Duration::from_secs(5);

impl Drop for FloorStream {
    fn drop(&mut self) {
        let (js, name) = (self.js.clone(), std::mem::take(&mut self.name));
        let delete = async move {
            match tokio::time::timeout(FLOOR_STREAM_DELETE, js.delete_stream(&name)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => eprintln!("bench: the JetStream floor's stream {name}: {e}"),
                Err(_) => eprintln!(
                    "bench: the JetStream floor's stream {name} not deleted within {FLOOR_STREAM_DELETE:?}"
                ),
            }
        };
        let handle = tokio::runtime::Handle::current();
        match handle.runtime_flavor() {
            // Waits here, so a bench that exits right after the drop leaves no stream.
            tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| handle.block_on(delete))
            }
            _ => drop(handle.spawn(delete)),
        }
    }
}
