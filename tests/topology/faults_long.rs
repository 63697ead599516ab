//! The long faults, `#[ignore]`d: `deploy/test-faults` runs them (`--ignored`), outside the
//! per-push run (tests/README.md). A host's link cut for 30 s and past the lost and failover
//! thresholds, a slow and lossy link, and a Postgres restart; each under the same load and
//! ending with the same checks as `faults.rs`.

use std::time::{Duration, Instant};

use sqlx::PgPool;

use super::faults::{
    converged, in_transit, progress, since, CONCURRENCY, LOAD_SANDBOXES, PROGRESS,
};
use super::impair::{nats_round_trips, SlowLink};
use super::kit::Topology;
use super::load::{assert_converged, containers, report, Load};
use super::{NO_RATE_LIMITS, SERIAL};

/// How long the short cut lasts: under every threshold (a host is lost after 5 min).
const SHORT_CUT: Duration = Duration::from_secs(30);
/// The reconciler's thresholds in the long-cut test, and how long that cut lasts: past
/// lost + failover + two passes.
const LOST_AFTER: &str = "10s";
const FAILOVER_AFTER: &str = "10s";
const PASS_INTERVAL: &str = "2s";
const LONG_CUT: Duration = Duration::from_secs(40);
/// How many NATS round trips the slow-link test measures from each of two hosts.
const RTT_SAMPLES: usize = 9;
/// The environment variable naming the Postgres cluster the restart test may restart
/// (`<version> <name>`, e.g. `15 topo`): never guessed, and checked against `DATABASE_URL`'s
/// port, so the test cannot restart a Postgres others use.
const PG_CLUSTER_ENV: &str = "BERTH_TOPOLOGY_PG_CLUSTER";

/// Cuts host `n`'s link (`ip link set down` on its bridge side) until `heal`.
fn cut(topo: &Topology, n: usize) {
    topo.sh("ip", &["link", "set", &topo.veth(n), "down"]);
}

fn heal(topo: &Topology, n: usize) {
    topo.sh("ip", &["link", "set", &topo.veth(n), "up"]);
}

/// Which 1-based host holds the most sandboxes now (the one worth cutting).
async fn busiest_host(topo: &Topology) -> usize {
    let mut best = (1, -1i64);
    for n in 1..=topo.hosts {
        let count: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sandboxes WHERE host_id = $1 AND state <> 'deleted'",
        )
        .bind(topo.host_id(n))
        .fetch_one(&topo.db)
        .await
        .unwrap();
        if count > best.1 {
            best = (n, count);
        }
    }
    best.0
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
#[ignore = "long: deploy/test-faults"]
async fn a_host_cut_off_for_thirty_seconds_catches_up_when_healed(db: PgPool) {
    let _serial = SERIAL.lock().await;
    let topo = Topology::up(db, 3, &NO_RATE_LIMITS).await;
    let load = Load::start(&topo, LOAD_SANDBOXES, CONCURRENCY);
    progress(&topo, &load, PROGRESS).await;
    let host = busiest_host(&topo).await;
    let before = load.tally();
    cut(&topo, host);
    let t0 = Instant::now();
    let watched = in_transit(&topo.db).await;
    // The fault is the duration itself: the link stays down this long, load or not.
    tokio::time::sleep_until((t0 + SHORT_CUT).into()).await;
    heal(&topo, host);
    let healed = Instant::now();
    let took = converged(&topo, healed, watched).await;
    let after = load.tally();
    let tally = load.finish().await;
    assert_converged(&topo, &tally).await;
    assert_eq!(tally.failed_start, 0, "no sandbox failed for a 30 s cut");
    report(
        "host link down 30 s, healed (time after the heal)",
        took,
        &since(&before, &after),
    );
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
#[ignore = "long: deploy/test-faults"]
async fn a_host_cut_off_past_lost_and_failover_has_its_stale_containers_destroyed(db: PgPool) {
    let _serial = SERIAL.lock().await;
    let mut env = NO_RATE_LIMITS.to_vec();
    env.extend([
        ("BERTH_HOST_LOST_AFTER", LOST_AFTER),
        ("BERTH_FAILOVER_AFTER", FAILOVER_AFTER),
        ("BERTH_RECONCILE_INTERVAL", PASS_INTERVAL),
    ]);
    let topo = Topology::up(db, 3, &env).await;
    let load = Load::start(&topo, LOAD_SANDBOXES, CONCURRENCY);
    progress(&topo, &load, PROGRESS).await;
    let host = busiest_host(&topo).await;
    let id = topo.host_id(host);
    let before = load.tally();
    cut(&topo, host);
    let t0 = Instant::now();
    let watched = in_transit(&topo.db).await;
    crate::support::eventually("the cut host is lost", || async {
        let state: String = sqlx::query_scalar("SELECT state FROM hosts WHERE id = $1")
            .bind(id)
            .fetch_one(&topo.db)
            .await
            .unwrap();
        state == "lost"
    })
    .await;
    tokio::time::sleep_until((t0 + LONG_CUT).into()).await;
    // Nothing of the cut host runs anywhere else.
    let stranded: Vec<String> = sqlx::query_scalar(
        "SELECT id::text FROM sandboxes WHERE host_id = $1 AND state = 'running'",
    )
    .bind(id)
    .fetch_all(&topo.db)
    .await
    .unwrap();
    assert!(stranded.is_empty(), "running on a lost host: {stranded:?}");
    heal(&topo, host);
    let healed = Instant::now();
    let took = converged(&topo, healed, watched).await;
    crate::support::eventually("the healed host is ready", || async {
        let state: String = sqlx::query_scalar("SELECT state FROM hosts WHERE id = $1")
            .bind(id)
            .fetch_one(&topo.db)
            .await
            .unwrap();
        state == "ready"
    })
    .await;
    let after = load.tally();
    let tally = load.finish().await;
    assert_converged(&topo, &tally).await;
    assert!(containers(&topo.runc_root(host)).is_empty());
    report(
        &format!(
            "host link down {} s, past lost ({LOST_AFTER}) and failover ({FAILOVER_AFTER}), healed (time after the heal; {} failed-start)",
            LONG_CUT.as_secs(),
            tally.failed_start
        ),
        took,
        &since(&before, &after),
    );
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
#[ignore = "long: deploy/test-faults"]
async fn a_slow_lossy_host_link_still_converges(db: PgPool) {
    let _serial = SERIAL.lock().await;
    let topo = Topology::up(db, 3, &NO_RATE_LIMITS).await;
    let host = 1;
    // Dropped before the topology (declared after it): also when the test fails.
    let link = SlowLink::apply(&topo, host).await;
    let t0 = Instant::now();
    let load = Load::start(&topo, LOAD_SANDBOXES, CONCURRENCY);
    let tally = load.finish().await;
    let took = t0.elapsed();
    assert_converged(&topo, &tally).await;
    let on_slow: i64 = sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE host_id = $1")
        .bind(topo.host_id(host))
        .fetch_one(&topo.db)
        .await
        .unwrap();
    assert!(on_slow > 0, "no sandbox ran on the slow host");
    link.assert_applied();
    let applied = link.describe();
    // The delay as the host's NATS client sees it, next to an unimpaired host's.
    let median = |rtts: Vec<Duration>| {
        rtts.get(rtts.len() / 2).map_or("none".to_owned(), |d| {
            format!("{:.1} ms", d.as_secs_f64() * 1e3)
        })
    };
    let slow_rtt = median(nats_round_trips(&topo, host, RTT_SAMPLES).await);
    let other_rtt = median(nats_round_trips(&topo, host + 1, RTT_SAMPLES).await);
    report(
        &format!(
            "slow lossy link on a host ({applied}; NATS round trip, median of {RTT_SAMPLES}: {slow_rtt} from it, {other_rtt} from another host; {on_slow} sandboxes there; whole load)"
        ),
        took,
        &tally,
    );
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
#[ignore = "long: deploy/test-faults"]
async fn a_postgres_restart_under_load_loses_nothing(db: PgPool) {
    let cluster = std::env::var(PG_CLUSTER_ENV).unwrap_or_else(|_| {
        panic!("set {PG_CLUSTER_ENV} to the Postgres cluster of DATABASE_URL (`15 NAME`)")
    });
    let (version, name) = cluster.split_once(' ').expect("`<version> <name>`");
    let listed = std::process::Command::new("pg_lsclusters")
        .args(["-h", version, name])
        .output()
        .unwrap();
    let port = String::from_utf8_lossy(&listed.stdout)
        .split_whitespace()
        .nth(2)
        .unwrap_or_default()
        .to_owned();
    let url: reqwest::Url = std::env::var("DATABASE_URL").unwrap().parse().unwrap();
    assert_eq!(
        url.port().map(|p| p.to_string()),
        Some(port.clone()),
        "{PG_CLUSTER_ENV} names a cluster on port {port}, not DATABASE_URL's"
    );
    let _serial = SERIAL.lock().await;
    let topo = Topology::up(db, 3, &NO_RATE_LIMITS).await;
    let load = Load::start(&topo, LOAD_SANDBOXES, CONCURRENCY);
    progress(&topo, &load, PROGRESS).await;
    let before = load.tally();
    let (t0, watched) = (Instant::now(), in_transit(&topo.db).await);
    topo.sh("pg_ctlcluster", &[version, name, "restart"]);
    let took = converged(&topo, t0, watched).await;
    let after = load.tally();
    let tally = load.finish().await;
    assert_converged(&topo, &tally).await;
    report("Postgres restart", took, &since(&before, &after));
}
