//! `berth bench --snapshots`: snapshot, fork and clone figures of a running stack (issue 13),
//! each against a raw floor measured in the same run:
//!
//! - snapshot frozen time (`paused_ms`) p50 and snapshot → `ready` p50, per runtime: against a
//!   raw `runsc checkpoint` followed by a raw `runsc restore` of its image (gVisor: what hostd
//!   does, since Debian's runsc never returns from `checkpoint --leave-running`) and a raw copy
//!   of an upper dir of the same size (runc);
//! - fork → running p50 (a fork of one, until the clone runs), per runtime: against a raw
//!   `runsc restore` (gVisor) and a raw `runc run` (runc); targets gVisor ≤ 250 ms, runc ≤ 150 ms;
//! - a clone of a 100 MiB sandbox from the object store on another host: against a raw copy of
//!   100 MiB.
//!
//! The raw runsc floors run a busybox container with `--network=none` in a scratch dir.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use super::{ms, ratio_p50, Client, Samples, MAX_WAIT_SECS};

/// How often a `creating` snapshot is looked at.
const POLL: Duration = Duration::from_millis(5);
/// How long one snapshot may take before the bench gives up.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(300);
/// The size of the clone-from-the-store sandbox's data, MiB.
const CLONE_MIB: u64 = 100;
/// Clones tried until one lands on another host than its source.
const CLONE_TRIES: usize = 4;

/// Runs the snapshot section with `samples` samples per figure.
pub(super) async fn run(client: &Client, samples: usize) -> anyhow::Result<()> {
    println!("| operation | n | p50 ms | p95 ms | floor | floor p50 ms | ratio p50 | target |");
    println!("|---|---|---|---|---|---|---|---|");
    let row = |name: &str, s: &Samples, floor_name: &str, floor: &Samples, target: &str| {
        let ratio = ratio_p50(s, floor);
        println!(
            "| {name} | {} | {} | {} | {floor_name} | {} | {ratio} | {target} |",
            s.0.len(),
            ms(s.quantile(0.5)),
            ms(s.quantile(0.95)),
            ms(floor.quantile(0.5)),
        );
    };
    let scratch = PathBuf::from(format!("/var/tmp/berth-bench-snap-{}", std::process::id()));
    let floors = {
        // Removed also when an interrupted bench drops this future.
        let _scratch = super::floors::RemoveOnDrop(scratch.clone());
        Floors::measure(&scratch, samples).await
    };
    let floors = floors?;
    for (template, runtime) in [("base", "runc"), ("base-gvisor", "gVisor")] {
        let figures = per_runtime(client, template, samples).await?;
        let (frozen_floor, frozen_name, fork_floor, fork_name, target) = if runtime == "runc" {
            (
                &floors.copy_small,
                "cp -a of the upper dir",
                &floors.runc_run,
                "runc run",
                "≤ 150 ms",
            )
        } else {
            (
                &floors.in_place,
                "runsc checkpoint + restore",
                &floors.restore,
                "runsc restore",
                "≤ 250 ms",
            )
        };
        row(
            &format!("{runtime}: snapshot frozen (paused_ms)"),
            &figures.frozen,
            frozen_name,
            frozen_floor,
            "",
        );
        row(
            &format!("{runtime}: snapshot → ready"),
            &figures.ready,
            frozen_name,
            frozen_floor,
            "",
        );
        row(
            &format!("{runtime}: fork → running"),
            &figures.fork,
            fork_name,
            fork_floor,
            target,
        );
    }
    let (clone, other_host) = clone_from_store(client).await?;
    row(
        &format!(
            "runc: clone of a {CLONE_MIB} MiB sandbox → running ({})",
            if other_host {
                "other host, from the object store"
            } else {
                "same host: no other host took it"
            }
        ),
        &clone,
        &format!("cp -a of {CLONE_MIB} MiB"),
        &floors.copy_big,
        "",
    );
    row(
        "raw runsc checkpoint",
        &floors.checkpoint,
        "—",
        &Samples::default(),
        "",
    );
    row(
        "raw runsc restore",
        &floors.restore,
        "—",
        &Samples::default(),
        "",
    );
    row(
        "raw runc run",
        &floors.runc_run,
        "—",
        &Samples::default(),
        "",
    );
    Ok(())
}

/// One runtime's figures.
struct Figures {
    frozen: Samples,
    ready: Samples,
    fork: Samples,
}

async fn per_runtime(client: &Client, template: &str, n: usize) -> anyhow::Result<Figures> {
    let body = json!({"template": template, "vcpus": 1, "memory_mib": 256});
    let (_, id) = client
        .transition(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(body),
            None,
            "running",
        )
        .await?;
    exec(client, &id, "head -c 1048576 /dev/urandom > /root/seed").await?;
    let mut figures = Figures {
        frozen: Samples::default(),
        ready: Samples::default(),
        fork: Samples::default(),
    };
    for i in 0..n {
        exec(client, &id, &format!("echo {i} > /root/step")).await?;
        let started = Instant::now();
        let snapshot = snapshot(client, &id).await?;
        figures.ready.push(started.elapsed());
        let paused = snapshot["paused_ms"].as_u64().unwrap_or_default();
        figures.frozen.push(Duration::from_millis(paused));
    }
    for _ in 0..n {
        let started = Instant::now();
        let (status, fork) = client
            .send(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/fork"),
                Some(json!({"count": 1})),
            )
            .await?;
        if status != 202 {
            bail!("fork: {status} {fork}");
        }
        let clone = fork["sandboxes"][0]["id"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        client.wait(&clone, "running").await?;
        figures.fork.push(started.elapsed());
        client.delete(&clone).await?;
    }
    client.delete(&id).await?;
    Ok(figures)
}

/// A clone of a 100 MiB runc sandbox's snapshot placed on another host than its source when
/// one takes it (tried [`CLONE_TRIES`] times); (clone → running, whether on another host).
async fn clone_from_store(client: &Client) -> anyhow::Result<(Samples, bool)> {
    let body = json!({"template": "base", "vcpus": 1, "memory_mib": 256});
    let (_, id) = client
        .transition(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(body),
            None,
            "running",
        )
        .await?;
    exec(
        client,
        &id,
        &format!("head -c {} /dev/urandom > /root/data", CLONE_MIB << 20),
    )
    .await?;
    let snapshot = snapshot(client, &id).await?;
    let source_host = host_of(client, &id).await?;
    let mut samples = Samples::default();
    let mut other = false;
    for _ in 0..CLONE_TRIES {
        let (d, clone) = client
            .transition(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/clone"),
                Some(json!({"snapshot_id": snapshot["id"]})),
                None,
                "running",
            )
            .await?;
        let on_other = host_of(client, &clone).await? != source_host;
        client.delete(&clone).await?;
        if on_other {
            samples.push(d);
            other = true;
            break;
        }
        if samples.0.is_empty() {
            samples.push(d);
        }
    }
    client.delete(&id).await?;
    Ok((samples, other))
}

pub(super) async fn host_of(client: &Client, id: &str) -> anyhow::Result<Value> {
    let (_, sandbox) = client
        .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await?;
    Ok(sandbox["host_id"].clone())
}

/// Runs `sh -c script` in `id` (for as long as the API lets a wait last); returns its stdout.
///
/// Errors: the exec refused, or the script exited non-zero.
pub(super) async fn exec(client: &Client, id: &str, script: &str) -> anyhow::Result<String> {
    let (status, out) = client
        .send(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": ["sh", "-c", script], "timeout_ms": MAX_WAIT_SECS * 1000})),
        )
        .await?;
    if status != 200 || out["exit_code"] != 0 {
        bail!("exec {script}: {status} {out}");
    }
    Ok(out["stdout"].as_str().unwrap_or_default().to_owned())
}

/// Takes a snapshot of `id` and polls it until ready; returns it.
async fn snapshot(client: &Client, id: &str) -> anyhow::Result<Value> {
    take(client, id, "snapshot").await
}

/// `POST /v1/sandboxes/{id}/{route}` (`snapshot` or `backup`), then polls the snapshot it
/// answered every [`POLL`] until it is `ready`; returns it.
///
/// Errors: the request refused, or the snapshot `failed` or still `creating` after
/// [`SNAPSHOT_TIMEOUT`].
pub(super) async fn take(client: &Client, id: &str, route: &str) -> anyhow::Result<Value> {
    let (status, taken) = client
        .send(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/{route}"),
            None,
        )
        .await?;
    if status != 202 {
        bail!("{route}: {status} {taken}");
    }
    let snapshot_id = taken["id"].as_str().unwrap_or_default().to_owned();
    let deadline = Instant::now() + SNAPSHOT_TIMEOUT;
    loop {
        let (_, s) = client
            .send(
                reqwest::Method::GET,
                &format!("/v1/snapshots/{snapshot_id}"),
                None,
            )
            .await?;
        match s["state"].as_str() {
            Some("ready") => return Ok(s),
            Some("creating") if Instant::now() < deadline => tokio::time::sleep(POLL).await,
            _ => bail!("snapshot {snapshot_id} did not become ready: {s}"),
        }
    }
}

/// The raw floors, measured in a scratch dir.
struct Floors {
    checkpoint: Samples,
    /// A checkpoint and the restore of its image, one after the other.
    in_place: Samples,
    restore: Samples,
    runc_run: Samples,
    copy_small: Samples,
    copy_big: Samples,
}

impl Floors {
    async fn measure(dir: &Path, n: usize) -> anyhow::Result<Floors> {
        std::fs::create_dir_all(dir)?;
        let bundle = busybox_bundle(dir, &["/bin/sleep", "100000"])?;
        let root = dir.join("runsc-root");
        let mut checkpoint = Samples::default();
        let mut restore = Samples::default();
        let mut in_place = Samples::default();
        let runsc = |args: Vec<String>| {
            let root = root.clone();
            async move {
                let status = tokio::process::Command::new("runsc")
                    .arg("--root")
                    .arg(&root)
                    .args(["--platform=ptrace", "--network=none"])
                    .args(&args)
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status()
                    .await?;
                if !status.success() {
                    bail!("runsc {args:?} failed");
                }
                anyhow::Ok(())
            }
        };
        let b = bundle.display().to_string();
        for i in 0..n {
            let (c, r) = (format!("bench-c{i}"), format!("bench-r{i}"));
            let image = dir.join(format!("image{i}")).display().to_string();
            runsc(vec![
                "run".into(),
                "--detach".into(),
                "--bundle".into(),
                b.clone(),
                c.clone(),
            ])
            .await?;
            // A plain checkpoint (it ends the container), then the restore of its image into
            // a new container: `checkpoint --leave-running` of this runsc never returns.
            let t = Instant::now();
            runsc(vec![
                "checkpoint".into(),
                "--image-path".into(),
                image.clone(),
                c.clone(),
            ])
            .await?;
            let checkpointed = t.elapsed();
            checkpoint.push(checkpointed);
            let t = Instant::now();
            runsc(vec![
                "restore".into(),
                "--detach".into(),
                "--image-path".into(),
                image,
                "--bundle".into(),
                b.clone(),
                r.clone(),
            ])
            .await?;
            let restored = t.elapsed();
            restore.push(restored);
            in_place.push(checkpointed + restored);
            for id in [c, r] {
                let _ = runsc(vec!["delete".into(), "--force".into(), id]).await;
            }
        }
        let runc_run = super::floors::runc_run(super::FLOOR_SAMPLES).await?;
        let copy_small = copy_floor(dir, 1, n).await?;
        let copy_big = copy_floor(dir, CLONE_MIB, n.min(5)).await?;
        Ok(Floors {
            checkpoint,
            in_place,
            restore,
            runc_run,
            copy_small,
            copy_big,
        })
    }
}

/// `cp -a` of a directory holding `mib` MiB of random bytes, `n` times.
async fn copy_floor(dir: &Path, mib: u64, n: usize) -> anyhow::Result<Samples> {
    let from = dir.join(format!("upper-{mib}"));
    std::fs::create_dir_all(&from)?;
    let mut data = vec![0u8; (mib << 20) as usize];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut data);
    std::fs::write(from.join("data"), &data)?;
    let mut samples = Samples::default();
    for i in 0..n {
        let to = dir.join(format!("copy-{mib}-{i}"));
        let t = Instant::now();
        let status = tokio::process::Command::new("cp")
            .arg("-a")
            .arg(&from)
            .arg(&to)
            .status()
            .await?;
        let sync = tokio::process::Command::new("sync")
            .arg("-f")
            .arg(&to)
            .status()
            .await?;
        samples.push(t.elapsed());
        if !status.success() || !sync.success() {
            bail!("cp -a failed");
        }
        let _ = std::fs::remove_dir_all(&to);
    }
    Ok(samples)
}

/// A runtime bundle of a busybox root running `args`.
fn busybox_bundle(dir: &Path, args: &[&str]) -> anyhow::Result<PathBuf> {
    let bundle = dir.join("bundle");
    let rootfs = bundle.join("rootfs");
    std::fs::create_dir_all(rootfs.join("bin"))?;
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox"))
        .context("copy /bin/busybox (busybox-static)")?;
    for tool in ["sleep", "sh"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(tool)).ok();
    }
    let spec = std::process::Command::new("runc")
        .arg("spec")
        .current_dir(&bundle)
        .status()?;
    if !spec.success() {
        bail!("runc spec failed");
    }
    let path = bundle.join("config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    config["process"]["terminal"] = json!(false);
    config["process"]["args"] = json!(args);
    std::fs::write(&path, serde_json::to_vec(&config)?)?;
    Ok(bundle)
}
