//! Faults under load: each test runs [`LOAD_SANDBOXES`] lifecycles (≥ 200 requests) across both
//! APIs, breaks a part of the topology while they run, heals it, and ends with
//! [`assert_converged`]: every accepted request converged, no sandbox lost, no container
//! without a row, no command applied twice, capacity drift 0. Each prints its figures
//! ([`report`]): time to converge, requests refused meanwhile and their codes.
//!
//! Time to converge: from the fault until every sandbox that was in transit (provisioning,
//! starting, stopping) when it struck or when it healed has settled.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::PgPool;

use super::kit::Topology;
use super::load::{assert_converged, report, Load, Tally};
use super::{NO_RATE_LIMITS, SERIAL};
use crate::support::env::SETTLE_TIMEOUT;

/// Lifecycles of the load (4 requests each: create, stop, start, delete).
pub const LOAD_SANDBOXES: usize = 50;
/// Lifecycles in flight at once.
pub const CONCURRENCY: usize = 6;
/// Sandboxes the load must create between two steps of a fault: it makes progress meanwhile.
pub const PROGRESS: usize = 3;
/// Poll of the database while waiting.
const POLL: Duration = Duration::from_millis(200);
/// The reconcilers' lease in the takeover test (the default is 30 s).
const SHORT_LEASE: Duration = Duration::from_secs(10);
/// What a loaded machine may add to a takeover beyond the lease and one renewal tick.
const TAKEOVER_SLACK: Duration = Duration::from_secs(5);

/// Sandboxes in a transitional state now.
pub async fn in_transit(db: &PgPool) -> HashSet<String> {
    sqlx::query_scalar(
        "SELECT id::text FROM sandboxes WHERE state IN ('provisioning', 'starting', 'stopping')",
    )
    .fetch_all(db)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// Waits until the load created `more` sandboxes beyond what it had; panics after
/// [`SETTLE_TIMEOUT`] with what the load saw, what is in transit and each part's state.
pub async fn progress(topo: &Topology, load: &Load, more: usize) {
    let target = load.created() + more;
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    while load.created() < target {
        if Instant::now() >= deadline {
            panic!(
                "the load made no progress: {:?}\nin transit: {:?}\n{}",
                load.tally(),
                in_transit(&topo.db).await,
                topo.diagnosis(8)
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until none of `watched` (plus what is in transit now, at the heal) is in transit;
/// returns the time since `since`.
pub async fn converged(topo: &Topology, since: Instant, mut watched: HashSet<String>) -> Duration {
    watched.extend(in_transit(&topo.db).await);
    let deadline = Instant::now() + 2 * SETTLE_TIMEOUT;
    loop {
        let now = in_transit(&topo.db).await;
        if watched.is_disjoint(&now) {
            return since.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "never settled: {:?}",
            watched.intersection(&now).collect::<Vec<_>>()
        );
        tokio::time::sleep(POLL).await;
    }
}

/// The refusals of `now` that `before` did not have.
pub fn since(before: &Tally, now: &Tally) -> Tally {
    let mut diff = now.clone();
    for (what, n) in &before.refused {
        if let Some(m) = diff.refused.get_mut(what) {
            *m -= n;
        }
    }
    diff.refused.retain(|_, n| *n > 0);
    diff
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_nats_node_and_then_the_jetstream_meta_leader_killed_under_load_lose_nothing(db: PgPool) {
    let _serial = SERIAL.lock().await;
    let topo = Topology::up(db, 3, &NO_RATE_LIMITS).await;
    let load = Load::start(&topo, LOAD_SANDBOXES, CONCURRENCY);
    progress(&topo, &load, PROGRESS).await;

    // The node leading the reconcilers' result consumer when it is not the meta leader (its
    // pulls die with it, and only a new pull gets results again), else another one; when the
    // meta leader leads that consumer, the second fault kills it.
    let leader = topo.meta_leader().await;
    let node = match topo.consumer_leader("_RESULT", "reconciler").await {
        Some(n) if n != leader => n,
        _ => {
            if leader == 1 {
                2
            } else {
                1
            }
        }
    };
    let node = format!("nats{node}");
    let before = load.tally();
    let (t0, watched) = (Instant::now(), in_transit(&topo.db).await);
    topo.part("kill", &node);
    progress(&topo, &load, PROGRESS).await;
    topo.part("start", &node);
    let node_converged = converged(&topo, t0, watched).await;
    let after_node = load.tally();

    let leader = format!("nats{}", topo.meta_leader().await);
    let (t1, watched) = (Instant::now(), in_transit(&topo.db).await);
    topo.part("kill", &leader);
    progress(&topo, &load, PROGRESS).await;
    topo.part("start", &leader);
    let leader_converged = converged(&topo, t1, watched).await;
    let after_leader = load.tally();

    let tally = load.finish().await;
    assert_converged(&topo, &tally).await;
    report(
        &format!(
            "kill -9 {node} (not the meta leader; the result consumer's if it leads it), restart"
        ),
        node_converged,
        &since(&before, &after_node),
    );
    report(
        "kill -9 the JetStream meta leader, restart",
        leader_converged,
        &since(&after_node, &after_leader),
    );
    report("(whole load of the NATS test)", leader_converged, &tally);
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn an_api_killed_mid_request_is_retried_on_the_other_with_the_same_answer_and_one_command(
    db: PgPool,
) {
    let _serial = SERIAL.lock().await;
    let topo = Topology::up(db, 3, &NO_RATE_LIMITS).await;
    let load = Load::start(&topo, LOAD_SANDBOXES, CONCURRENCY);
    progress(&topo, &load, PROGRESS).await;

    // A create that waits for `running` on api1, so the API holds it open after its commit.
    let key = format!("held-{}", crate::support::unique());
    let body =
        json!({"template": "base", "vcpus": 1, "memory_mib": 128, "metadata": {"held": key}});
    let path = "/v1/sandboxes?wait=running";
    let send = |api: usize| {
        topo.http
            .post(format!("{}{path}", topo.api_urls[api]))
            .bearer_auth(&topo.key)
            .header("Idempotency-Key", &key)
            .json(&body)
            .send()
    };
    let held = tokio::spawn(send(0));
    let mut id = String::new();
    crate::support::eventually("the held create committed", || async {
        let found: Option<String> =
            sqlx::query_scalar("SELECT id::text FROM sandboxes WHERE metadata->>'held' = $1")
                .bind(&key)
                .fetch_optional(&topo.db)
                .await
                .unwrap();
        found.is_some()
    })
    .await;
    let before = load.tally();
    let (t0, watched) = (Instant::now(), in_transit(&topo.db).await);
    topo.part("kill", "api1");
    assert!(
        held.await.unwrap().is_err(),
        "the request to the killed API got an answer"
    );
    // The client's retry with the same key on api2: the same sandbox, whatever it waited for.
    for _ in 0..2 {
        let resp = send(1).await.unwrap();
        let status = resp.status().as_u16();
        let answer: serde_json::Value = resp.json().await.unwrap();
        assert!(matches!(status, 200 | 202), "{status} {answer}");
        let answered = answer["id"].as_str().unwrap().to_owned();
        if id.is_empty() {
            id = answered;
        } else {
            assert_eq!(answered, id, "a replay answers the same sandbox");
        }
    }
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE metadata->>'held' = $1")
            .bind(&key)
            .fetch_one(&topo.db)
            .await
            .unwrap();
    assert_eq!(rows, 1, "one sandbox for one key");
    topo.part("start", "api1");
    // The restarted API answers before its last request below (a start is asynchronous).
    let ready = format!("{}/readyz", topo.api_urls[0]);
    crate::support::eventually("the restarted api1 answers /readyz", || async {
        topo.http
            .get(&ready)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;
    let api_converged = converged(&topo, t0, watched).await;
    let after = load.tally();

    // Its one create command, published (once: the hosts' count below shows none applied
    // twice, and JetStream drops a re-publish of the same command id).
    let (commands, published): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(published_at) FROM commands
          WHERE sandbox_id = $1::uuid AND kind = 'sandbox.create'",
    )
    .bind(&id)
    .fetch_one(&topo.db)
    .await
    .unwrap();
    assert_eq!(
        (commands, published),
        (1, 1),
        "one create command, published"
    );
    let status = topo
        .http
        .delete(format!(
            "{}/v1/sandboxes/{id}?wait=deleted",
            topo.api_urls[0]
        ))
        .bearer_auth(&topo.key)
        .send()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "DELETE on the restarted api1: {e}\n{}",
                topo.part_state("api1", 40)
            )
        })
        .status();
    assert!(status.is_success(), "{status}");

    let mut tally = load.finish().await;
    tally.ids.push(id);
    assert_converged(&topo, &tally).await;
    report(
        "kill -9 an API mid-request, retry on the other",
        api_converged,
        &since(&before, &after),
    );
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_leader_reconciler_killed_under_load_is_replaced_within_its_lease(db: PgPool) {
    let _serial = SERIAL.lock().await;
    let lease = format!("{}s", SHORT_LEASE.as_secs());
    let mut env = NO_RATE_LIMITS.to_vec();
    env.push(("BERTH_LEADER_LEASE", &lease));
    let topo = Topology::up(db, 3, &env).await;
    let load = Load::start(&topo, LOAD_SANDBOXES, CONCURRENCY);
    progress(&topo, &load, PROGRESS).await;

    let leader = topo.leader_reconciler().await;
    let before = load.tally();
    let (t0, watched) = (Instant::now(), in_transit(&topo.db).await);
    topo.part("kill", &format!("reconciler{leader}"));
    let successor = topo.leader_reconciler().await;
    let took = t0.elapsed();
    assert_ne!(successor, leader);
    assert!(
        took <= SHORT_LEASE + SHORT_LEASE / 3 + TAKEOVER_SLACK,
        "the standby took over after {took:?} (lease {SHORT_LEASE:?})"
    );
    println!(
        "TOPOLOGY takeover after {:.1} s (lease {lease})",
        took.as_secs_f64()
    );
    topo.part("start", &format!("reconciler{leader}"));
    let reconciler_converged = converged(&topo, t0, watched).await;
    let after = load.tally();

    let tally = load.finish().await;
    assert_converged(&topo, &tally).await;
    report(
        &format!(
            "kill -9 the leader reconciler (takeover {:.1} s)",
            took.as_secs_f64()
        ),
        reconciler_converged,
        &since(&before, &after),
    );
}
