//! What hostd's heartbeat costs with running sandboxes, listing containers from the runtimes'
//! state files against running `runc list` and `runsc list` (issue 16): a measurement, not a
//! check, so ignored by default. Run it as
//!
//! ```text
//! BERTH_OLD_BERTH=/path/to/berth-built-before cargo test -p berth --test hostd \
//!     heartbeat_cost -- --ignored --nocapture
//! ```
//!
//! It prints (1) one list of both roots, by state files and by the two processes: wall time
//! and CPU (this process plus its reaped children, and the whole machine's, which includes what
//! each `runsc list` makes every gVisor sandbox do), and (2) a `berth hostd` process over a
//! window of heartbeats: its CPU with its children's and the machine's, this build and, when
//! `BERTH_OLD_BERTH` names one, an older build on the same sandboxes.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use berth_hostd::runtime::cli::{ConsoleConfig, OciCli};
use berth_hostd::runtime::{runsc, statefile};
use berth_schemas::wire::{self, GuestStatus, Heartbeat};
use berth_schemas::{CommandKind, SandboxId};
use futures::StreamExt;

use crate::harness::*;

/// Sandboxes of each runtime kept running while measuring.
const PER_RUNTIME: usize = 5;

/// Lists timed per way of listing.
const LISTS: u32 = 40;

/// How long hostd's heartbeats are watched per build.
const WINDOW: Duration = Duration::from_secs(30);

/// Clock ticks per second of `/proc`'s CPU times (`sysconf(_SC_CLK_TCK)`, 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn heartbeat_cost() -> anyhow::Result<()> {
    crate::support::env::init_tracing("warn");
    let mut h = Harness::new().await?;
    let outcome = measure(&mut h).await;
    h.teardown().await;
    outcome
}

/// utime + stime (+ cutime + cstime with `children`) of `/proc/<pid>/stat`, in ticks.
fn process_ticks(pid: &str, children: bool) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = &stat[stat.rfind(')').context("stat")? + 1..];
    let fields: Vec<u64> = rest
        .split_ascii_whitespace()
        .skip(11) // fields 3..=13
        .take(4)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    let own = fields[0] + fields[1];
    Ok(if children {
        own + fields[2] + fields[3]
    } else {
        own
    })
}

/// The machine's busy ticks (every CPU's time but idle and iowait), from `/proc/stat`.
fn machine_ticks() -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let cpu = stat.lines().next().context("/proc/stat")?;
    let f: Vec<u64> = cpu
        .split_ascii_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    Ok(f.iter().sum::<u64>() - f[3] - f[4])
}

fn ms(ticks: u64, per: u32) -> f64 {
    ticks as f64 * 1000.0 / TICKS_PER_SECOND / f64::from(per)
}

async fn measure(h: &mut Harness) -> anyhow::Result<()> {
    h.spawn_hostd_process(None)?;
    let mut sandboxes = Vec::new();
    for template in ["base", "base-gvisor"] {
        for _ in 0..PER_RUNTIME {
            let sandbox = SandboxId::new();
            let create = h.command_with_template(sandbox, 1, CommandKind::Create, template);
            succeeded_address(&h.send(&create).await?)?;
            sandboxes.push(sandbox);
        }
    }
    for sandbox in &sandboxes {
        h.heartbeat_with(*sandbox, GuestStatus::Running).await?;
    }
    println!(
        "{} sandboxes running ({PER_RUNTIME} runc, {PER_RUNTIME} runsc)",
        sandboxes.len()
    );

    // (1) One list of both roots.
    let console = ConsoleConfig {
        berth: PathBuf::from(env!("CARGO_BIN_EXE_berth")),
        max_bytes: 1 << 20,
    };
    let runc = OciCli::new("runc", "runc", h.runc_root(), Vec::new(), console.clone())?;
    let runsc = OciCli::new(
        "runsc",
        "runsc",
        h.runsc_root(),
        vec![runsc::RUNSC_PLATFORM.to_owned()],
        console,
    )?;
    let me = std::process::id().to_string();
    let (t0, p0, m0) = (Instant::now(), process_ticks(&me, true)?, machine_ticks()?);
    for _ in 0..LISTS {
        let listed = runc.list().await?.len() + runsc.list().await?.len();
        anyhow::ensure!(listed == sandboxes.len(), "listed {listed}");
    }
    let (cli_wall, cli_cpu, cli_machine) = (
        t0.elapsed() / LISTS,
        process_ticks(&me, true)? - p0,
        machine_ticks()? - m0,
    );
    let (t0, p0, m0) = (Instant::now(), process_ticks(&me, true)?, machine_ticks()?);
    for _ in 0..LISTS {
        let listed = statefile::runc::list(&h.runc_root())?.len()
            + statefile::runsc::list(&h.runsc_root())?.len();
        anyhow::ensure!(listed == sandboxes.len(), "listed {listed}");
    }
    let (file_wall, file_cpu, file_machine) = (
        t0.elapsed() / LISTS,
        process_ticks(&me, true)? - p0,
        machine_ticks()? - m0,
    );
    println!("\none list of both roots ({LISTS} each; CPU ms per list)");
    println!("| way | wall ms | CPU ms (test + children) | machine CPU ms |");
    println!("|---|---|---|---|");
    for (way, wall, cpu, machine) in [
        ("runc list + runsc list", cli_wall, cli_cpu, cli_machine),
        ("state files", file_wall, file_cpu, file_machine),
    ] {
        println!(
            "| {way} | {:.2} | {:.2} | {:.2} |",
            wall.as_secs_f64() * 1000.0,
            ms(cpu, LISTS),
            ms(machine, LISTS)
        );
    }

    // (2) hostd over a window of heartbeats, this build, then the older one.
    println!("\nberth hostd over {WINDOW:?} of heartbeats (interval {TEST_HEARTBEAT_INTERVAL:?}; CPU ms per heartbeat)");
    println!("| build | heartbeats | hostd CPU ms (+ children) | machine CPU ms |");
    println!("|---|---|---|---|");
    window(h, "this", &sandboxes).await?;
    if let Some(old) = std::env::var_os("BERTH_OLD_BERTH") {
        h.stop_hostd_process().await?;
        h.spawn_hostd_binary(std::path::Path::new(&old), None)?;
        window(h, "old", &sandboxes).await?;
    }
    // Dropping the harness removes the sandboxes' containers, networks and mounts.
    h.stop_hostd_process().await
}

/// Watches the running hostd process for [`WINDOW`] once every sandbox is in its
/// heartbeats as running, and prints one row.
async fn window(h: &mut Harness, build: &str, sandboxes: &[SandboxId]) -> anyhow::Result<()> {
    for sandbox in sandboxes {
        h.heartbeat_with(*sandbox, GuestStatus::Running).await?;
    }
    let pid = h
        .process
        .as_ref()
        .and_then(|c| c.id())
        .context("no hostd process")?
        .to_string();
    let (p0, m0) = (process_ticks(&pid, true)?, machine_ticks()?);
    let deadline = tokio::time::Instant::now() + WINDOW;
    let mut beats = 0u32;
    while let Ok(Some(msg)) = tokio::time::timeout_at(deadline, h.heartbeats.next()).await {
        let hb: Heartbeat = wire::decode(&msg.payload)?;
        anyhow::ensure!(hb.inventory.len() == sandboxes.len(), "inventory");
        beats += 1;
    }
    let (cpu, machine) = (process_ticks(&pid, true)? - p0, machine_ticks()? - m0);
    println!(
        "| {build} | {beats} | {:.2} | {:.2} |",
        ms(cpu, beats.max(1)),
        ms(machine, beats.max(1))
    );
    Ok(())
}
