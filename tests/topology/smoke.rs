//! The topology comes up as `deploy/topology` says, and runs sandboxes.

use sqlx::PgPool;

use super::kit::Topology;
use super::load::{assert_converged, Load};
use super::{NO_RATE_LIMITS, SERIAL};

/// Sandboxes the smoke test runs through their lifecycle (4 requests each).
const SMOKE_SANDBOXES: usize = 12;
/// How long a connection attempt from a host's namespace may take before it counts as refused.
const PROBE_TIMEOUT: &str = "3";
/// How long a replicated stream may stay between leaders before the test fails.
const STREAM_LEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Whether a TCP connection from host `n`'s namespace to `addr:port` opens.
fn host_reaches(topo: &Topology, n: usize, addr: &str, port: u16) -> bool {
    std::process::Command::new("ip")
        .args(["netns", "exec", &topo.netns(n), "timeout", PROBE_TIMEOUT])
        .args(["bash", "-c", &format!("exec 3<>/dev/tcp/{addr}/{port}")])
        .status()
        .unwrap()
        .success()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_topology_runs_sandboxes_over_a_nats_cluster_with_replicated_streams_and_fenced_hosts(
    db: PgPool,
) {
    let _serial = SERIAL.lock().await;
    let topo = Topology::up(db, 3, &NO_RATE_LIMITS).await;

    // Every stream has three replicas, one per node, and the client took the URL list.
    let vars = std::fs::read_to_string(topo.dir.join("topology.env")).unwrap();
    let get = |k: &str| {
        vars.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap()
            .to_owned()
    };
    let connect = berth_schemas::nats_auth::NatsConnect {
        url: get("TOPOLOGY_NATS_URLS"),
        creds: Some(
            berth::nats_access::load(std::path::Path::new(&get("TOPOLOGY_CONTROL_PLANE_CREDS")))
                .unwrap(),
        ),
        ca_file: None,
    };
    assert_eq!(connect.servers().len(), 3);
    let nats = connect.connect().await.unwrap();
    let js = async_nats::jetstream::new(nats);
    let subjects = berth_schemas::Subjects::new(&get("TOPOLOGY_SUBJECT_PREFIX")).unwrap();
    for name in [
        subjects.cmd_stream(),
        subjects.result_stream(),
        subjects.events_stream(),
    ] {
        let mut stream = js.get_stream(&name).await.unwrap();
        // A stream between leaders (just created, or its leader moved) lists all three peers
        // as replicas and no leader: wait, bounded, for the election to end.
        let deadline = tokio::time::Instant::now() + STREAM_LEADER_TIMEOUT;
        let (info, cluster) = loop {
            let info = stream.info().await.unwrap().clone();
            let cluster = info.cluster.clone().expect("a clustered stream");
            if cluster.leader.is_some() || tokio::time::Instant::now() >= deadline {
                break (info, cluster);
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        };
        assert_eq!(info.config.num_replicas, 3, "{name}");
        let leader = cluster
            .leader
            .clone()
            .unwrap_or_else(|| panic!("{name}: no leader"));
        let mut peers: Vec<_> = cluster.replicas.iter().map(|p| p.name.clone()).collect();
        assert!(!peers.contains(&leader), "{name}: {cluster:?}");
        peers.push(leader);
        peers.sort();
        peers.dedup();
        assert_eq!(peers.len(), 3, "{name}: {cluster:?}");
    }

    // A host reaches the NATS servers over the bridge, and nothing else of this machine: not
    // a listener on every address, not another port of the bridge address.
    let bridge = get("TOPOLOGY_NATS_URLS")
        .split(',')
        .next()
        .unwrap()
        .trim_start_matches("nats://")
        .to_owned();
    let (nats_ip, nats_port) = bridge.split_once(':').unwrap();
    let other = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let other_port = other.local_addr().unwrap().port();
    for n in 1..=topo.hosts {
        assert!(host_reaches(&topo, n, nats_ip, nats_port.parse().unwrap()));
        assert!(!host_reaches(&topo, n, nats_ip, other_port), "host {n}");
    }
    drop(other);

    // Sandboxes run on every host, through both APIs.
    let load = Load::start(&topo, SMOKE_SANDBOXES, 4);
    let tally = load.finish().await;
    assert!(tally.refused.is_empty(), "{:?}", tally.refused);
    let hosts_used: i64 = sqlx::query_scalar("SELECT count(DISTINCT host_id) FROM sandboxes")
        .fetch_one(&topo.db)
        .await
        .unwrap();
    assert!(hosts_used >= 2, "sandboxes ran on {hosts_used} host(s)");
    assert_converged(&topo, &tally).await;
}
