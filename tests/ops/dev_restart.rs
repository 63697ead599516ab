//! `berth dev` restarted on its state dir: its in-process stack waits for its hosts by their
//! heartbeats since it started, whatever an operator made of them. A host cordoned or
//! draining before the restart heartbeats as such, and counts; only a `lost` one would not
//! (an attack run's restart once waited 60 s for hosts that were up, cordoned, and gave up).

use std::time::Duration;

use berth::stack::{Pools, Stack, StackConfig};
use berth_schemas::host_state::{HostEvent, HostState};
use berth_schemas::HostId;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::support::cleanup::{delete_streams_blocking, fresh_dir, remove_dir_unless_mounted};
use crate::support::{nats_url, unique_subjects};

/// Far longer than two sim hosts take to heartbeat (a few heartbeat intervals).
const HOSTS_TIMEOUT: Duration = Duration::from_secs(30);

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_restarted_stack_counts_its_cordoned_and_draining_hosts(db: PgPool) {
    let subjects = unique_subjects();
    let dirs = [fresh_dir("restart-a"), fresh_dir("restart-b")];
    let config = || {
        let mut config =
            StackConfig::new(nats_url(), subjects.clone(), "127.0.0.1:0".parse().unwrap());
        for (i, dir) in dirs.iter().enumerate() {
            let mut host =
                berth_hostd::HostdConfig::new(nats_url(), subjects.clone(), dir, format!("r{i}"));
            host.runtimes = vec![berth_hostd::runtime::sim::SIM.to_owned()];
            host.heartbeat_interval = Duration::from_millis(200);
            config.hosts.push(host);
        }
        config
    };
    let shutdown = CancellationToken::new();
    let mut stack = Stack::start(config(), Pools::shared(db.clone()), &shutdown)
        .await
        .unwrap();
    stack
        .wait_for_hosts(2, HOSTS_TIMEOUT, &shutdown)
        .await
        .unwrap();
    let ids: Vec<HostId> = dirs
        .iter()
        .map(|d| berth_hostd::host_id(d).unwrap())
        .collect();
    let mut conn = db.acquire().await.unwrap();
    for (id, event) in ids.iter().zip([HostEvent::Cordon, HostEvent::Drain]) {
        berth_store::hosts::apply_event(&mut conn, *id, event)
            .await
            .unwrap()
            .unwrap();
    }
    drop(conn);
    stack.stop().await;

    // The same state dirs, so the same hosts: both are heard from again, as they were left.
    let mut again = Stack::start(config(), Pools::shared(db.clone()), &shutdown)
        .await
        .unwrap();
    let waited = again.wait_for_hosts(2, HOSTS_TIMEOUT, &shutdown).await;
    let mut states = Vec::new();
    for id in &ids {
        states.push(
            berth_store::hosts::get(&db, *id)
                .await
                .unwrap()
                .unwrap()
                .state,
        );
    }
    again.stop().await;
    delete_streams_blocking(&subjects);
    for dir in &dirs {
        remove_dir_unless_mounted(dir);
    }
    waited.unwrap();
    assert_eq!(
        states,
        [HostState::Cordoned, HostState::Draining],
        "a restart keeps what the operator made of its hosts"
    );
}
