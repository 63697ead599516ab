//! `berth bench --storage`: what archiving, unarchiving, backing up and moving a sandbox between
//! hosts cost on a running stack (issue 14), each against a raw floor measured in the same run:
//!
//! - archive → `archived` of a stopped runc sandbox that wrote `--storage-mib` MiB of random
//!   bytes. The archive is sent as soon as the stop answered, so the figure holds the upload of
//!   the stop snapshot (which hostd began in the background at the stop). Floor: a raw upload of
//!   as many fresh random bytes to the same object store, through the `object_store` crate, in
//!   chunks of the artifact format's size with hostd's upload concurrency
//!   ([`CHUNK_BYTES`], [`UPLOAD_CONCURRENCY`]), uncompressed;
//! - start → `running` of that archived sandbox with its old host cordoned, so it unarchives on
//!   another host and fetches its stop snapshot from the store. Floor: a raw download of the
//!   floor's bytes;
//! - backup (`POST …/backup` → the snapshot `ready`) on runc and on gVisor, each after the
//!   sandbox wrote `--storage-mib` MiB of fresh random bytes. Floor: the raw upload;
//! - restore from that backup (`POST …/restore-from-backup` → `running`) with the sandbox's host
//!   cordoned, so it is placed on another host and fetches the backup from the store: the boot
//!   a failover makes once a lost host's sandboxes are restored elsewhere. Floor: the raw
//!   download;
//! - the migration of a running gVisor sandbox: its host cordoned, stop, wait until the stop is
//!   durable, start → `running` on another host. Two downtimes: the sandbox's own (the longest
//!   gap between the wall-clock ticks a process inside writes, a process that runs on across
//!   the move) and the API's (stop request → `running`), with the API's three steps. Floor: a
//!   raw `runsc checkpoint` + `runsc restore` ([`super::floors::runsc`]).
//!
//! Every figure is taken `--sandboxes` times: p50, and p90 once there are 10 samples. Cordoning
//! needs an operator key (`--admin-key`, else one made in the stack's database); every host the
//! bench cordons is uncordoned before it goes on, also when a step failed.
//!
//! Not measured here: a whole failover (a host silenced past the lost and failover thresholds
//! until its sandboxes run elsewhere): `berth dev`'s hosts are tasks of one process, which
//! cannot be silenced one at a time. `berth bench --failover` ([`super::failover`]) measures it
//! on a private stack of its own with two `berth hostd` child processes; the restore row here
//! is the boot that failover makes.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use berth_storage::manifest::CHUNK_BYTES;
use berth_storage::upload::UPLOAD_CONCURRENCY;
use berth_storage::{Location, Objects, StoreSettings};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Value};

use super::snapshots::{exec, host_of, take};
use super::{floors, BenchArgs, Client, Row, Samples, TRANSITION_TIMEOUT};

/// How often a stopped sandbox is looked at until its stop is durable.
const DURABLE_POLL: Duration = Duration::from_millis(20);
/// Memory of the bench's sandboxes, MiB (a gVisor one keeps its written bytes in memory too).
const SANDBOX_MIB: u64 = 512;
/// The key prefix of the raw floor's objects in the store (removed after each sample).
const FLOOR_PREFIX: &str = "berth-bench";
/// A process that appends the wall clock (a file's mtime, in ns: busybox `date` has no `%N`)
/// to `/root/ticks` about every 10 ms, forever; its PID in `/root/pid`.
const TICKER: &str = "(while :; do touch /root/tick; stat -c %y /root/tick >> /root/ticks; \
     sleep 0.01; done) </dev/null >/dev/null 2>&1 & echo $! > /root/pid";
/// Prints the longest gap between consecutive lines of `/root/ticks`, in whole milliseconds
/// (`YYYY-MM-DD HH:MM:SS.nnnnnnnnn +0000`; a gap across midnight is not counted). The sleep lets
/// the ticker write after a resume first.
const GAP: &str = "sleep 0.3; awk '{split($2, t, \":\"); s = t[1] * 3600 + t[2] * 60 + t[3]; \
     if (NR > 1 && s - p > m) m = s - p; p = s} END {printf \"%d\\n\", m * 1000}' /root/ticks";

/// Runs the storage section with `--sandboxes` samples per figure and prints its table.
pub(super) async fn run(
    client: &Client,
    args: &BenchArgs,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<()> {
    let n = args.sandboxes().max(1);
    let mib = args.storage_mib;
    let operator = operator(client, args, lookup).await?;
    let objects = open_store(&args.state_dir)?;
    eprintln!("bench: raw upload and download of {mib} MiB, {n} times");
    let store = StoreFloors::measure(&objects, mib << 20, n, &client.run_tag).await?;
    eprintln!("bench: raw runsc checkpoint + restore, {n} times");
    let runsc = match floors::runsc(n).await {
        Ok(f) => f
            .checkpoint
            .0
            .iter()
            .zip(&f.restore.0)
            .map(|(c, r)| c + r)
            .collect(),
        Err(e) => {
            eprintln!("bench: no runsc floor: {e:#}");
            Vec::new()
        }
    };
    let runsc = Samples(runsc);
    eprintln!("bench: archive and unarchive on another host, {n} sandboxes");
    let archive = archive_cycles(client, &operator, mib, n).await?;
    eprintln!("bench: backups, {n} of each runtime");
    let runc_backup = backups(client, &operator, "base", mib, n).await?;
    let gvisor = if args.gvisor_template.is_empty() {
        None
    } else {
        let backup = backups(client, &operator, &args.gvisor_template, mib, n).await?;
        eprintln!("bench: migrations of a running gVisor sandbox, {n}");
        let moves = migrations(client, &operator, &args.gvisor_template, n).await?;
        Some((backup, moves))
    };

    let upload = format!("raw upload of {mib} MiB");
    let download = format!("raw download of {mib} MiB");
    let checkpoint = "raw runsc checkpoint + restore";
    let none = Samples::default();
    let mut rows = vec![
        Row::new(
            format!(
                "runc: archive → archived ({mib} MiB written{})",
                archive.failures()
            ),
            &archive.archive,
            &upload,
            &store.upload,
        ),
        Row::new(
            format!(
                "runc: unarchive + start → running ({} of {} on another host)",
                archive.elsewhere,
                archive.unarchive.0.len()
            ),
            &archive.unarchive,
            &download,
            &store.download,
        ),
    ];
    rows.extend(runc_backup.rows("runc", mib, (&upload, &download), &store));
    if let Some((backup, moves)) = &gvisor {
        rows.extend(backup.rows("gVisor", mib, (&upload, &download), &store));
        rows.extend([
            Row::new(
                "gVisor: migration downtime, the sandbox's clock (longest tick gap)".into(),
                &moves.gap,
                checkpoint,
                &runsc,
            ),
            Row::new(
                "gVisor: migration downtime, API (stop request → running elsewhere)".into(),
                &moves.api,
                checkpoint,
                &runsc,
            ),
            Row::new(
                "gVisor: migration step: stop → stopped".into(),
                &moves.stop,
                "—",
                &none,
            ),
            Row::new(
                "gVisor: migration step: stopped → durable".into(),
                &moves.durable,
                "—",
                &none,
            ),
            Row::new(
                "gVisor: migration step: start → running (migrating)".into(),
                &moves.start,
                "—",
                &none,
            ),
        ]);
    }
    rows.extend([
        Row::new(upload.clone(), &store.upload, "—", &none),
        Row::new(download.clone(), &store.download, "—", &none),
        Row::new(checkpoint.into(), &runsc, "—", &none),
    ]);
    Row::print(&rows);
    Ok(())
}

/// A client of the same API with an operator key: `--admin-key`, else a new one made in the
/// stack's database (`--database-url`, else `DATABASE_URL` of `stack.env`).
async fn operator(
    client: &Client,
    args: &BenchArgs,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Client> {
    let key = match &args.admin_key {
        Some(key) => key.clone(),
        None => {
            let url = args
                .database_url
                .clone()
                .or_else(|| lookup("DATABASE_URL"))
                .context("no --admin-key, and no database to make one in (DATABASE_URL)")?;
            let db = sqlx::PgPool::connect(&url).await?;
            let key = berth_api::auth::create_admin_key(&db).await?;
            db.close().await;
            key
        }
    };
    Ok(client.with_key(key))
}

/// The stack's object store: `BERTH_OBJECT_STORE`, else `<state dir>/objects` (`berth dev`'s),
/// which must exist already (a store the stack does not use would measure nothing of it).
fn open_store(state_dir: &Path) -> anyhow::Result<Objects> {
    let location = Location::from_env_or_default(&std::path::absolute(state_dir)?)?;
    if let Location::Local(dir) = &location {
        if !dir.is_dir() {
            bail!(
                "no object store at {}: give the stack's state dir (--state-dir) or its \
                 BERTH_OBJECT_STORE",
                dir.display()
            );
        }
    }
    Ok(Objects::open(&StoreSettings::new(location))?)
}

/// The object store floors: fresh random bytes put in [`CHUNK_BYTES`] objects,
/// [`UPLOAD_CONCURRENCY`] at once, then got back the same way.
#[derive(Default)]
struct StoreFloors {
    upload: Samples,
    download: Samples,
}

impl StoreFloors {
    async fn measure(objects: &Objects, bytes: u64, n: usize, tag: &str) -> anyhow::Result<Self> {
        let mut floors = StoreFloors::default();
        for i in 0..n {
            let prefix = format!("{FLOOR_PREFIX}/{tag}/{i}");
            let outcome = floors.sample(objects, bytes, &prefix).await;
            for (key, _) in objects.list(&prefix).await.unwrap_or_default() {
                let _ = objects.delete(&key.as_str().into()).await;
            }
            outcome?;
        }
        Ok(floors)
    }

    async fn sample(&mut self, objects: &Objects, bytes: u64, prefix: &str) -> anyhow::Result<()> {
        let mut data = vec![0u8; bytes as usize];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut data);
        let data = Bytes::from(data);
        let parts: Vec<_> = (0..data.len())
            .step_by(CHUNK_BYTES)
            .enumerate()
            .map(|(j, at)| {
                let key = object_store::path::Path::from(format!("{prefix}/{j}"));
                (key, data.slice(at..(at + CHUNK_BYTES).min(data.len())))
            })
            .collect();
        let started = Instant::now();
        futures::stream::iter(
            parts
                .iter()
                .map(|(key, part)| objects.put(key, part.clone())),
        )
        .buffer_unordered(UPLOAD_CONCURRENCY)
        .try_collect::<Vec<()>>()
        .await?;
        self.upload.push(started.elapsed());
        let started = Instant::now();
        let got: Vec<Option<Bytes>> =
            futures::stream::iter(parts.iter().map(|(k, _)| objects.get(k)))
                .buffered(UPLOAD_CONCURRENCY)
                .try_collect()
                .await?;
        self.download.push(started.elapsed());
        let back: usize = got.iter().flatten().map(Bytes::len).sum();
        if back != data.len() {
            bail!("the raw download read {back} bytes of {}", data.len());
        }
        Ok(())
    }
}

/// Runs `step` with `host` cordoned, and uncordons it afterwards whatever `step` did (an
/// interrupted step's host is uncordoned by the run's clean-up, [`Client::clean_up`]).
pub(super) async fn cordoned<T>(
    operator: &Client,
    host: &str,
    step: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    operator.cordon_action(host, "cordon").await?;
    let outcome = step.await;
    let uncordoned = operator.cordon_action(host, "uncordon").await;
    let value = outcome?;
    uncordoned?;
    Ok(value)
}

/// Creates a running sandbox of `template`; returns its id.
pub(super) async fn running(client: &Client, template: &str) -> anyhow::Result<String> {
    let body = json!({"template": template, "vcpus": 1, "memory_mib": SANDBOX_MIB});
    let post = reqwest::Method::POST;
    let (_, id) = client
        .transition(post, "/v1/sandboxes", Some(body), None, "running")
        .await?;
    Ok(id)
}

/// Writes `mib` MiB of fresh random bytes to `/root/data` in `id`.
async fn write(client: &Client, id: &str, mib: u64) -> anyhow::Result<()> {
    exec(
        client,
        id,
        &format!("head -c {} /dev/urandom > /root/data", mib << 20),
    )
    .await?;
    Ok(())
}

/// `POST /v1/sandboxes/{id}/{action}`, then waits for `state`; returns how long that took.
async fn act(client: &Client, id: &str, action: &str, state: &str) -> anyhow::Result<Duration> {
    let path = format!("/v1/sandboxes/{id}/{action}");
    let post = reqwest::Method::POST;
    Ok(client
        .transition(post, &path, None, Some(id), state)
        .await?
        .0)
}

/// The state of `id`.
async fn state(client: &Client, id: &str) -> anyhow::Result<String> {
    let path = format!("/v1/sandboxes/{id}");
    let (_, sandbox) = client.send(reqwest::Method::GET, &path, None).await?;
    Ok(sandbox["state"].as_str().unwrap_or_default().to_owned())
}

/// The host `id` is on (an error when it has none).
async fn host(client: &Client, id: &str) -> anyhow::Result<String> {
    let host = host_of(client, id).await?;
    host.as_str()
        .map(str::to_owned)
        .with_context(|| format!("sandbox {id} has no host: {host}"))
}

/// The archive figures: archive → archived, and start of the archived sandbox → running.
#[derive(Default)]
struct Archive {
    archive: Samples,
    unarchive: Samples,
    /// Unarchives that landed on another host than the sandbox's last.
    elsewhere: usize,
    /// Archives that failed and left their sandbox `stopped` (the documented failure: its
    /// upload failed), each followed by another sandbox in its place.
    failed: usize,
}

impl Archive {
    /// `; k of m failed and stayed stopped` when some did, else nothing.
    fn failures(&self) -> String {
        match self.failed {
            0 => String::new(),
            k => format!(
                "; {k} of {} failed and stayed stopped",
                k + self.archive.0.len()
            ),
        }
    }
}

/// Runc sandboxes, one after another until `n` were archived: write `mib` MiB, stop, archive,
/// then start with the old host cordoned (so it unarchives elsewhere), delete. An archive that
/// fails back to `stopped` is counted and its sandbox deleted (at most `n` of them).
async fn archive_cycles(
    client: &Client,
    operator: &Client,
    mib: u64,
    n: usize,
) -> anyhow::Result<Archive> {
    let mut figures = Archive::default();
    while figures.archive.0.len() < n {
        let id = running(client, "base").await?;
        write(client, &id, mib).await?;
        let home = host(client, &id).await?;
        act(client, &id, "stop", "stopped").await?;
        match act(client, &id, "archive", "archived").await {
            Ok(took) => figures.archive.push(took),
            Err(error) if figures.failed < n && state(client, &id).await? == "stopped" => {
                eprintln!("bench: the archive of {id} failed back to stopped: {error:#}");
                figures.failed += 1;
                client.delete(&id).await?;
                continue;
            }
            Err(error) => return Err(error),
        }
        let start = act(client, &id, "start", "running");
        figures
            .unarchive
            .push(cordoned(operator, &home, start).await?);
        if host(client, &id).await? != home {
            figures.elsewhere += 1;
        }
        client.delete(&id).await?;
    }
    Ok(figures)
}

/// `n` backups of one running sandbox of `template`, each after it wrote `mib` MiB anew:
/// `POST …/backup` → the backup `ready`.
/// Then `POST …/restore-from-backup` of that backup with the sandbox's host cordoned (so it is
/// placed on another host, which fetches the backup from the store) → `running`: the boot a
/// failover makes after a host is lost.
async fn backups(
    client: &Client,
    operator: &Client,
    template: &str,
    mib: u64,
    n: usize,
) -> anyhow::Result<Backups> {
    let id = running(client, template).await?;
    let mut figures = Backups::default();
    for _ in 0..n {
        write(client, &id, mib).await?;
        let started = Instant::now();
        let backup = take(client, &id, "backup").await?;
        figures.backup.push(started.elapsed());
        let home = host(client, &id).await?;
        let path = format!("/v1/sandboxes/{id}/restore-from-backup");
        let body = json!({"backup_id": backup["id"]});
        let restore = client.transition(
            reqwest::Method::POST,
            &path,
            Some(body),
            Some(&id),
            "running",
        );
        figures
            .restore
            .push(cordoned(operator, &home, restore).await?.0);
        if host(client, &id).await? != home {
            figures.elsewhere += 1;
        }
    }
    client.delete(&id).await?;
    Ok(figures)
}

/// The backup figures of one runtime.
#[derive(Default)]
struct Backups {
    /// `POST …/backup` → the backup `ready`.
    backup: Samples,
    /// `POST …/restore-from-backup` → `running`.
    restore: Samples,
    /// Restores that landed on another host than the sandbox's.
    elsewhere: usize,
}

impl Backups {
    /// The backup row (against the raw upload) and the restore row (against the raw download)
    /// of `runtime`; `names` are those floors' names.
    fn rows<'a>(
        &'a self,
        runtime: &str,
        mib: u64,
        names: (&'a str, &'a str),
        store: &'a StoreFloors,
    ) -> [Row<'a>; 2] {
        let restored = format!(
            "{runtime}: restore-from-backup → running ({} of {} on another host)",
            self.elsewhere,
            self.restore.0.len()
        );
        [
            Row::new(
                format!("{runtime}: backup → ready ({mib} MiB new)"),
                &self.backup,
                names.0,
                &store.upload,
            ),
            Row::new(restored, &self.restore, names.1, &store.download),
        ]
    }
}

/// The migration figures of a running gVisor sandbox.
#[derive(Default)]
struct Moves {
    /// The longest gap between the ticks of the process inside.
    gap: Samples,
    /// Stop request → `running` on the other host.
    api: Samples,
    stop: Samples,
    durable: Samples,
    start: Samples,
}

/// Moves one running sandbox of `template` with a [`TICKER`] inside to another host `n` times
/// (each from the host it is on then): cordon that host, stop, wait until the stop is durable,
/// start → `running`, uncordon. Each move must keep the ticker's process.
async fn migrations(
    client: &Client,
    operator: &Client,
    template: &str,
    n: usize,
) -> anyhow::Result<Moves> {
    let id = running(client, template).await?;
    exec(client, &id, TICKER).await?;
    let pid = exec(client, &id, "cat /root/pid").await?.trim().to_owned();
    let mut moves = Moves::default();
    for _ in 0..n {
        let home = host(client, &id).await?;
        // Only this move's ticks count.
        exec(client, &id, "sleep 0.2; : > /root/ticks; sleep 0.2").await?;
        let step = async {
            let started = Instant::now();
            let stopped = act(client, &id, "stop", "stopped").await?;
            durable(client, &id).await?;
            let durable = started.elapsed();
            let start = act(client, &id, "start", "running").await?;
            anyhow::Ok((stopped, durable - stopped, start, started.elapsed()))
        };
        let (stop, durable, start, api) = cordoned(operator, &home, step).await?;
        if host(client, &id).await? == home {
            bail!("sandbox {id} started on its cordoned host {home} again");
        }
        exec(client, &id, &format!("kill -0 {pid}"))
            .await
            .context("the ticker did not survive the move (not a memory stop?)")?;
        let gap: u64 = exec(client, &id, GAP).await?.trim().parse()?;
        moves.gap.push(Duration::from_millis(gap));
        moves.api.push(api);
        moves.stop.push(stop);
        moves.durable.push(durable);
        moves.start.push(start);
    }
    client.delete(&id).await?;
    Ok(moves)
}

/// Polls `id` every [`DURABLE_POLL`] until its stop is durable (`durable_at` set).
async fn durable(client: &Client, id: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + TRANSITION_TIMEOUT;
    loop {
        let (status, sandbox): (u16, Value) = client
            .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await?;
        if status == 200 && !sandbox["durable_at"].is_null() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the stop of {id} never became durable: {status} {sandbox}");
        }
        tokio::time::sleep(DURABLE_POLL).await;
    }
}
