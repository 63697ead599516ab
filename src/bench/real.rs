//! The bench of a running stack on real runtimes: the lifecycle on runc and on gVisor, time to
//! interactive, a burst for throughput (with the stack's CPU per create), Berth beside Podman
//! cycle by cycle, and the floors of the same run; printed as tables, then every target of
//! issue 16 beside its figure ([`super::targets`]).

use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::{json, Value};

use super::floors::{self, CrunFloor, RunscFloors};
use super::podman::Podman;
use super::targets::{in_ms, ratio, Goal, Target};
use super::warm::{served, WarmClaims};
use super::{ms, BenchArgs, Client, Samples, CHEAP_FLOOR_SAMPLES, FLOOR_SAMPLES, MAX_WAIT_SECS};

/// `/proc/<pid>/stat` counts CPU time in clock ticks of this many per second (`USER_HZ`,
/// fixed at 100 by Linux's ABI on the platforms Berth runs on).
const USER_HZ: f64 = 100.0;

/// The lifecycle figures of one template.
#[derive(Default)]
struct Lifecycle {
    create: Samples,
    exec: Samples,
    stop: Samples,
    start: Samples,
    delete: Samples,
    /// Stops that kept only the disk (`last_stop` not `memory`): on gVisor each such stop is
    /// not the memory stop the targets are about.
    disk_stops: usize,
}

/// Takes `n` sandboxes of `body`'s template one after another through create, exec, stop,
/// start and delete.
async fn lifecycle(client: &Client, body: &Value, n: usize) -> anyhow::Result<Lifecycle> {
    let post = reqwest::Method::POST;
    let mut l = Lifecycle::default();
    for _ in 0..n {
        let (d, id) = client
            .transition(
                post.clone(),
                "/v1/sandboxes",
                Some(body.clone()),
                None,
                "running",
            )
            .await?;
        l.create.push(d);
        l.exec.push(exec_hi(client, &id).await?);
        let stop_path = format!("/v1/sandboxes/{id}/stop");
        let stop = client.transition(post.clone(), &stop_path, None, Some(&id), "stopped");
        l.stop.push(stop.await?.0);
        let (_, row) = client
            .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await?;
        if row["last_stop"] != "memory" {
            l.disk_stops += 1;
        }
        let start_path = format!("/v1/sandboxes/{id}/start");
        let start = client.transition(post.clone(), &start_path, None, Some(&id), "running");
        l.start.push(start.await?.0);
        l.delete.push(client_delete(client, &id).await?);
    }
    Ok(l)
}

/// `echo hi` in sandbox `id`, answered; returns the round trip.
async fn exec_hi(client: &Client, id: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let (status, out) = client
        .send(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": ["echo", "hi"]})),
        )
        .await?;
    if status != 200 || out["stdout"] != "hi\n" {
        bail!("exec failed: {status} {out}");
    }
    Ok(t.elapsed())
}

/// Deletes sandbox `id` and waits for `deleted`; returns the time.
async fn client_delete(client: &Client, id: &str) -> anyhow::Result<Duration> {
    let path = format!("/v1/sandboxes/{id}");
    let done = client.transition(reqwest::Method::DELETE, &path, None, Some(id), "deleted");
    Ok(done.await?.0)
}

/// CPU seconds `pid` used, its own and its waited-for children's (runc, ip, nft, …).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime, stime, cutime, cstime are fields 14–17 of the line; 12–15 after the name.
    let ticks: f64 = fields
        .get(11..15)?
        .iter()
        .map(|f| f.parse::<f64>().unwrap_or(0.0))
        .sum();
    Some(ticks / USER_HZ)
}

/// Berth's create→running→exec→delete→deleted beside Podman's run→exec→rm, pair by pair.
#[derive(Default)]
struct Versus {
    berth: Samples,
    podman: Samples,
    podman_run: Samples,
    podman_exec: Samples,
    podman_rm: Samples,
    /// Berth's cycle over Podman's, per pair.
    ratios: Vec<f64>,
}

async fn versus_podman(client: &Client, body: &Value, pairs: usize) -> anyhow::Result<Versus> {
    let podman = Podman::prepare().await?;
    let mut v = Versus::default();
    let outcome = async {
        for i in 0..pairs {
            let t = Instant::now();
            let post = reqwest::Method::POST;
            let create =
                client.transition(post, "/v1/sandboxes", Some(body.clone()), None, "running");
            let (_, id) = create.await?;
            exec_hi(client, &id).await?;
            client_delete(client, &id).await?;
            let berth = t.elapsed();
            let cycle = podman.cycle(i).await?;
            v.berth.push(berth);
            v.podman.push(cycle.total());
            v.podman_run.push(cycle.run);
            v.podman_exec.push(cycle.exec);
            v.podman_rm.push(cycle.rm);
            v.ratios
                .push(berth.as_secs_f64() / cycle.total().as_secs_f64());
        }
        anyhow::Ok(())
    }
    .await;
    podman.remove().await;
    outcome.map(|()| v)
}

fn median(v: &[f64]) -> Option<f64> {
    Samples(v.to_vec()).quantile(0.5)
}

/// Prints a warning for a phase that could not run, and gives its default (empty) figures.
fn or_missing<T: Default>(what: &str, r: anyhow::Result<T>) -> T {
    r.unwrap_or_else(|e| {
        eprintln!("bench: {what} not measured: {e:#}");
        T::default()
    })
}

/// The lifecycle, time-to-interactive, throughput, Podman, floor and preview figures of a
/// running stack, and the targets, printed as tables.
pub async fn measure(
    args: &BenchArgs,
    client: &Client,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<()> {
    // The floors first, on a stack at rest: measured after the Berth phases they ran beside
    // the refills of the stack's warm pools.
    eprintln!("bench: the floors…");
    let floors::RuntimeFloors {
        runc: runc_floor,
        crun: crun_floor,
    } = or_missing(
        "the runc floor",
        floors::runc_and_crun_run(FLOOR_SAMPLES).await,
    );
    let runsc = or_missing::<RunscFloors>(
        "the runsc floors",
        floors::runsc(args.runsc_floor_samples).await,
    );
    let pg_floor = match args.database_url.clone().or_else(|| lookup("DATABASE_URL")) {
        Some(url) => or_missing(
            "the Postgres floor",
            floors::pg_commit(&url, CHEAP_FLOOR_SAMPLES).await,
        ),
        None => Samples::default(),
    };
    let creds = std::env::var("BERTH_NATS_CREDS")
        .ok()
        .or_else(|| lookup("BERTH_NATS_CREDS"));
    let js_floor = match args.nats_url.clone().or_else(|| lookup("NATS_URL")) {
        Some(url) => or_missing(
            "the JetStream floor",
            floors::js_publish(&url, creds.as_deref(), CHEAP_FLOOR_SAMPLES).await,
        ),
        None => Samples::default(),
    };

    let sandbox = json!({"template": args.template, "vcpus": 1, "memory_mib": 128});
    let claims = WarmClaims::new(lookup);
    let mut warm_served = Vec::new();
    eprintln!("bench: the runc lifecycle…");
    let before = claims.read().await;
    let runc = lifecycle(client, &sandbox, args.sandboxes()).await?;
    warm_served.push(("runc lifecycle", served(before, claims.read().await)));

    eprintln!("bench: time to interactive…");
    // Time to interactive: create (waited on, no polling) → first exec answered.
    let mut waited_create = Samples::default();
    let mut interactive = Samples::default();
    let before = claims.read().await;
    for _ in 0..args.sandboxes() {
        let (running, first_exec, id) = client.interactive(&sandbox).await?;
        waited_create.push(running);
        interactive.push(first_exec);
        let path = format!("/v1/sandboxes/{id}?wait=deleted&timeout={MAX_WAIT_SECS}s");
        let (status, gone) = client.send(reqwest::Method::DELETE, &path, None).await?;
        if status != 200 {
            bail!("delete with wait: {status} {gone}");
        }
    }

    warm_served.push(("time to interactive", served(before, claims.read().await)));

    eprintln!("bench: the burst…");
    // Throughput: a burst of creates, then deletes, all in flight at once; the stack's CPU.
    let stack_pid = args
        .stack_pid
        .or_else(|| lookup("BERTH_DEV_PID").and_then(|p| p.parse().ok()));
    let cpu_before = stack_pid.and_then(cpu_seconds);
    let before = claims.read().await;
    let burst_started = Instant::now();
    let created = futures::future::try_join_all((0..args.burst).map(|_| {
        let post = reqwest::Method::POST;
        client.transition(
            post,
            "/v1/sandboxes",
            Some(sandbox.clone()),
            None,
            "running",
        )
    }))
    .await?;
    futures::future::try_join_all(created.iter().map(|(_, id)| client_delete(client, id))).await?;
    let burst_elapsed = burst_started.elapsed();
    let cpu_per_create = stack_pid
        .and_then(cpu_seconds)
        .zip(cpu_before)
        .map(|(after, before)| (after - before) / args.burst.max(1) as f64);
    let throughput = (2 * args.burst) as f64 / burst_elapsed.as_secs_f64();
    warm_served.push(("burst", served(before, claims.read().await)));

    eprintln!("bench: the gVisor lifecycle…");
    let gvisor = match args.gvisor_template.as_str() {
        "" => Lifecycle::default(),
        template => {
            let body = json!({"template": template, "vcpus": 1, "memory_mib": 256});
            let before = claims.read().await;
            let measured = or_missing(
                "the gVisor lifecycle",
                lifecycle(client, &body, args.gvisor_sandboxes).await,
            );
            warm_served.push(("gVisor lifecycle", served(before, claims.read().await)));
            measured
        }
    };
    eprintln!("bench: Berth vs Podman…");
    let versus = match args.podman_pairs {
        0 => Versus::default(),
        pairs => or_missing(
            "the Podman column",
            versus_podman(client, &sandbox, pairs).await,
        ),
    };

    println!("| operation | n | p50 ms | p95 ms | p99 ms | floor | floor p50 ms | overhead p50 ms | ratio p50 |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let none = Samples::default();
    let row = |name: &str, s: &Samples, floor_name: &str, floor: &Samples| {
        let (p50, f50) = (s.quantile(0.5), floor.quantile(0.5));
        let overhead = p50.zip(f50).map(|(a, b)| a - b);
        let ratio = ratio(p50, f50)
            .map(|r| format!("{r:.1}x"))
            .unwrap_or_else(|| "n/a".into());
        println!(
            "| {name} | {} | {} | {} | {} | {floor_name} | {} | {} | {ratio} |",
            s.0.len(),
            ms(p50),
            ms(s.quantile(0.95)),
            ms(s.quantile(0.99)),
            ms(f50),
            ms(overhead)
        );
    };
    row("create→running", &runc.create, "runc run", &runc_floor);
    row("exec round trip", &runc.exec, "—", &none);
    row(
        "create→running (?wait=running)",
        &waited_create,
        "runc run",
        &runc_floor,
    );
    row(
        "time to interactive (create→first exec answered)",
        &interactive,
        "runc run",
        &runc_floor,
    );
    row("stop→stopped", &runc.stop, "—", &none);
    row("start→running", &runc.start, "runc run", &runc_floor);
    row("delete→deleted", &runc.delete, "—", &none);
    row(
        "gVisor create→running",
        &gvisor.create,
        "runsc run -d",
        &runsc.run_detached,
    );
    row("gVisor exec round trip", &gvisor.exec, "—", &none);
    row(
        "gVisor stop→stopped (memory)",
        &gvisor.stop,
        "runsc checkpoint",
        &runsc.checkpoint,
    );
    row(
        "gVisor start→running (restore)",
        &gvisor.start,
        "runsc restore",
        &runsc.restore,
    );
    row("gVisor delete→deleted", &gvisor.delete, "—", &none);
    row("raw runc run (busybox true)", &runc_floor, "—", &none);
    match &crun_floor {
        CrunFloor::Missing => {}
        CrunFloor::Refused(said) => row(
            &format!("raw crun run (busybox true): refused: {said}"),
            &none,
            "—",
            &none,
        ),
        CrunFloor::Ran { mode, samples } => row(
            &format!("raw crun run (busybox true; {})", mode.describe()),
            samples,
            "—",
            &none,
        ),
    }
    row("raw runsc run (busybox true)", &runsc.run, "—", &none);
    row(
        "raw runsc run -d (busybox sleep)",
        &runsc.run_detached,
        "—",
        &none,
    );
    row(
        "raw runsc checkpoint (that sandbox)",
        &runsc.checkpoint,
        "—",
        &none,
    );
    row(
        "raw runsc restore -d (that image)",
        &runsc.restore,
        "—",
        &none,
    );
    row("raw Postgres commit", &pg_floor, "—", &none);
    row("raw JetStream publish+ack", &js_floor, "—", &none);
    println!();
    if gvisor.disk_stops > 0 {
        println!(
            "{} of {} gVisor stops kept only the disk (not memory stops)\n",
            gvisor.disk_stops,
            gvisor.stop.0.len()
        );
    }
    let warm_note: Vec<String> = warm_served
        .iter()
        .map(|(phase, served)| format!("{phase} {served}"))
        .collect();
    println!(
        "creates served by a warm pool (`berth_warm_claims_total`): {}\n",
        warm_note.join(", ")
    );
    let cpu_note = match cpu_per_create {
        Some(cpu) => format!("{:.1} ms CPU per create (+ its delete)", cpu * 1000.0),
        None => {
            "CPU per create not measured (no --stack-pid, no BERTH_DEV_PID in stack.env)".into()
        }
    };
    println!(
        "throughput: {} creates + {} deletes in flight at once took {:.2} s: {:.1} lifecycle commands/s; \
         {cpu_note} (the `berth dev` process and the runc/ip/nft processes it waited for; Postgres and NATS not counted)",
        args.burst, args.burst, burst_elapsed.as_secs_f64(), throughput
    );

    let versus_ratio = median(&versus.ratios);
    if !versus.ratios.is_empty() {
        println!();
        println!(
            "| Berth vs Podman, pair by pair (runc, same busybox rootfs) | n | p50 ms | p95 ms |"
        );
        println!("|---|---|---|---|");
        for (name, s) in [
            (
                "Berth create→running + exec + delete→deleted",
                &versus.berth,
            ),
            ("Podman run -d + exec + rm -f (whole cycle)", &versus.podman),
            ("Podman run -d", &versus.podman_run),
            ("Podman exec", &versus.podman_exec),
            ("Podman rm -f -t 0", &versus.podman_rm),
        ] {
            println!(
                "| {name} | {} | {} | {} |",
                s.0.len(),
                ms(s.quantile(0.5)),
                ms(s.quantile(0.95))
            );
        }
        println!(
            "| ratio Berth / Podman (median of the pairs) | {} | {:.2}× | — |",
            versus.ratios.len(),
            versus_ratio.unwrap_or(f64::NAN)
        );
    }

    let floor_note = |name: &str, s: &Samples| match s.quantile(0.5) {
        Some(f) => format!("{name} {:.1} ms in this run", f * 1000.0),
        None => format!("{name} not measured"),
    };
    let p50 = |s: &Samples| in_ms(s.quantile(0.5));
    let spread = |s: &Samples| ratio(s.quantile(0.99), s.quantile(0.5));
    let sim = "measured by `berth bench --runtime sim` (a separate run)";
    let targets = [
        Target::new(
            "create→running p50, runc",
            Goal::MaxMs(25.0),
            p50(&runc.create),
            floor_note("runc run", &runc_floor),
        ),
        Target::new(
            "create→running p99 / p50, runc",
            Goal::MaxRatio(3.0),
            spread(&runc.create),
            "",
        ),
        Target::new(
            "create→running p50, gVisor",
            Goal::MaxMs(100.0),
            p50(&gvisor.create),
            floor_note("runsc run -d", &runsc.run_detached),
        ),
        Target::new(
            "create→running p99 / p50, gVisor",
            Goal::MaxRatio(3.0),
            spread(&gvisor.create),
            "",
        ),
        Target::new(
            "time to interactive p50, runc",
            Goal::MaxMs(35.0),
            p50(&interactive),
            "create?wait=running, then the first exec",
        ),
        Target::new(
            "exec round trip p50, runc",
            Goal::MaxMs(5.0),
            p50(&runc.exec),
            "",
        ),
        Target::new(
            "exec round trip p50, gVisor",
            Goal::MaxMs(15.0),
            p50(&gvisor.exec),
            "",
        ),
        Target::new(
            "delete→deleted p50, runc",
            Goal::MaxMs(50.0),
            p50(&runc.delete),
            "",
        ),
        Target::new(
            "delete→deleted p50, gVisor",
            Goal::MaxMs(200.0),
            p50(&gvisor.delete),
            "",
        ),
        Target::new(
            "gVisor stop with memory p50",
            Goal::MaxMs(400.0),
            p50(&gvisor.stop),
            floor_note("runsc checkpoint", &runsc.checkpoint),
        ),
        Target::new(
            "gVisor stop / raw runsc checkpoint",
            Goal::MaxRatio(1.5),
            ratio(gvisor.stop.quantile(0.5), runsc.checkpoint.quantile(0.5)),
            "",
        ),
        Target::new(
            "gVisor start from memory p50",
            Goal::MaxMs(250.0),
            p50(&gvisor.start),
            floor_note("runsc restore", &runsc.restore),
        ),
        Target::new(
            "gVisor start / raw runsc restore",
            Goal::MaxRatio(1.5),
            ratio(gvisor.start.quantile(0.5), runsc.restore.quantile(0.5)),
            "",
        ),
        Target::new(
            "real lifecycle commands/s, runc",
            Goal::MinPerSec(50.0),
            Some(throughput),
            cpu_note,
        ),
        Target::new(
            "Berth cycle / Podman cycle (median of pairs)",
            Goal::MaxRatio(0.25),
            versus_ratio,
            "create→running→exec→delete→deleted vs run -d + exec + rm -f",
        ),
        Target::new(
            "sim: lifecycle commands/s sustained",
            Goal::MinPerSec(1000.0),
            None,
            sim,
        ),
        Target::new(
            "sim: reconciler pass p50 at 100k × 1000 hosts",
            Goal::MaxMs(500.0),
            None,
            sim,
        ),
        Target::new("sim: GET ?state=running p50", Goal::MaxMs(10.0), None, sim),
    ];
    super::targets::print("target (issue 16)", &targets);
    println!("\nThe machine is shared: read each figure against the floors of the same run.");

    // The preview figures, when the stack runs a proxy (`berth dev` writes where).
    if let (Some(url), Some(domain)) = (lookup("BERTH_PROXY"), lookup("BERTH_PREVIEW_DOMAIN")) {
        super::preview::run(client, &super::preview::ProxyTarget { url, domain }).await?;
    }
    let throttled = client.throttled.load(std::sync::atomic::Ordering::Relaxed);
    if throttled > 0 {
        println!(
            "\nthe API's rate limits answered 429 to {throttled} requests (retried after Retry-After): \
             the figures of those requests include that wait; raise `--rate-per-key` on the stack to measure without it"
        );
    }
    Ok(())
}
