//! Guarantees 2 and 3 under races, duplicates and late results: hostd applies a command at
//! most once, and a late completion cannot bring a deleted sandbox back. Against the real
//! Postgres, NATS and `berth hostd` processes; a host is made slow or silent by freezing its
//! process (SIGSTOP) or killing it, never by a mock.

use std::time::Duration;

use berth_reconciler::pass::PassConfig;
use berth_schemas::wire::{Command, SandboxSpec};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, SandboxId};
use berth_store::commands::insert as insert_command;
use sqlx::PgPool;

use crate::support::http::{running_sandbox, stopped_sandbox};
use crate::support::{eventually, Stack};

/// A pass every 100 ms; command timeouts as given; hosts are never judged lost here.
fn fast_pass(create: Duration, start: Duration) -> PassConfig {
    PassConfig {
        interval: Duration::from_millis(100),
        create_timeout: create,
        start_timeout: start,
        ..PassConfig::default()
    }
}

async fn events_of(stack: &Stack, id: &str) -> Vec<(String, String)> {
    sqlx::query_as("SELECT to_state, reason FROM events WHERE sandbox_id = $1::uuid ORDER BY id")
        .bind(id)
        .fetch_all(&stack.db)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_late_running_after_delete_leaves_the_row_deleted_and_no_container(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stopped_sandbox(&stack).await;

    stack.hosts[0].freeze();
    assert_eq!(stack.request(&id, "start").await.0, 202);
    let (status, body) = stack.delete(&id).await;
    assert_eq!(status, 202, "delete is accepted while starting: {body}");
    stack.hosts[0].thaw();

    stack.wait_state(&id, "deleted").await;
    eventually("the container is destroyed", || async {
        stack.leftovers(&id).is_empty()
    })
    .await;
    let events = events_of(&stack, &id).await;
    let after_delete: Vec<_> = events
        .iter()
        .skip_while(|(to, _)| to != "starting")
        .skip(1)
        .collect();
    assert_eq!(
        after_delete,
        [
            &("stopping".to_owned(), "user_request".to_owned()),
            &("deleted".to_owned(), "host_report".to_owned())
        ],
        "the late start's success never reached the row"
    );
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_create_that_times_out_and_then_succeeds_is_destroyed_and_stays_failed(db: PgPool) {
    let stack = Stack::start_with(
        db,
        1,
        fast_pass(Duration::from_secs(1), PassConfig::default().start_timeout),
    )
    .await;
    stack.hosts[0].freeze();
    let id = stack.create().await;
    let failed = stack.wait_state(&id, "failed-start").await;
    assert!(
        failed["state_reason"].as_str().unwrap().contains("timeout"),
        "the reason says why: {failed}"
    );
    let reserved: i32 = sqlx::query_scalar("SELECT reserved_vcpus FROM hosts")
        .fetch_one(&stack.db)
        .await
        .unwrap();
    assert_eq!(reserved, 0, "capacity released when the create timed out");

    stack.hosts[0].thaw();
    // The host now runs the stale create, reports success, then applies the compensating
    // destroy queued at the timeout.
    eventually("the compensating destroy ran", || async {
        let done: Option<String> = sqlx::query_scalar(
            "SELECT outcome FROM commands WHERE sandbox_id = $1::uuid AND kind = 'sandbox.delete'",
        )
        .bind(&id)
        .fetch_optional(&stack.db)
        .await
        .unwrap()
        .flatten();
        done.is_some()
    })
    .await;
    stack.nothing_left(&id).await;
    assert_eq!(stack.state_of(&id).await, "failed-start");
    let events = events_of(&stack, &id).await;
    assert_eq!(
        events,
        [
            ("provisioning".to_owned(), "user_request".to_owned()),
            ("failed-start".to_owned(), "timeout".to_owned())
        ]
    );
    let reserved: i32 = sqlx::query_scalar("SELECT reserved_vcpus FROM hosts")
        .fetch_one(&stack.db)
        .await
        .unwrap();
    assert_eq!(reserved, 0, "released exactly once");
    stack.assert_no_capacity_drift().await;
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_start_with_an_old_generation_that_arrives_after_a_newer_stop_is_refused(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stopped_sandbox(&stack).await; // generation 2
    assert_eq!(stack.request(&id, "start").await.0, 202); // 3
    stack.wait_state(&id, "running").await;
    assert_eq!(stack.request(&id, "stop").await.0, 202); // 4
    let stopped = stack.wait_state(&id, "stopped").await;
    assert_eq!(stopped["generation"], 4);

    // The start of generation 3 reaches the host again, after the stop of generation 4.
    let sandbox: SandboxId = id.parse().unwrap();
    let host: HostId = stack.hosts[0].host_id;
    let late = Command {
        snapshot: None,
        id: CommandId::new(),
        sandbox_id: sandbox,
        generation: Generation(3),
        kind: CommandKind::Start,
        spec: Some(SandboxSpec {
            org_id: sqlx::query_scalar("SELECT org_id FROM sandboxes WHERE id = $1")
                .bind(sandbox)
                .fetch_one(&stack.db)
                .await
                .unwrap(),
            template: "base".into(),
            resources: berth_schemas::wire::Resources {
                vcpus: 1,
                memory_mib: 256,
            },
            runtime: berth_schemas::wire::Runtime::Runc,
            disk_mib: 256,
            network: Default::default(),
            env: Vec::new(),
            entrypoint: Vec::new(),
            image: None,
        }),
    };
    let mut tx = stack.db.begin().await.unwrap();
    insert_command(&mut tx, host, &late).await.unwrap();
    tx.commit().await.unwrap();

    eventually("the host answered the stale start", || async {
        let outcome: Option<String> =
            sqlx::query_scalar("SELECT outcome FROM commands WHERE id = $1")
                .bind(late.id)
                .fetch_one(&stack.db)
                .await
                .unwrap();
        outcome.is_some()
    })
    .await;
    let outcome: String = sqlx::query_scalar("SELECT outcome FROM commands WHERE id = $1")
        .bind(late.id)
        .fetch_one(&stack.db)
        .await
        .unwrap();
    assert_eq!(outcome, "refused_stale");
    assert!(
        !stack.container_exists(&id),
        "the refused start ran nothing"
    );
    assert_eq!(stack.state_of(&id).await, "stopped");
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn stop_and_start_sent_ten_ms_apart_accept_exactly_one_fifty_times(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = running_sandbox(&stack).await;
    let mut conflicts = 0;
    for round in 0..50 {
        let running = stack.state_of(&id).await == "running";
        let (first, second, first_target, second_target) = if running {
            ("stop", "start", "stopped", "running")
        } else {
            ("start", "stop", "running", "stopped")
        };
        let a = stack.request(&id, first);
        let b = async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            stack.request(&id, second).await
        };
        let ((sa, ba), (sb, bb)) = tokio::join!(a, b);
        let accepted: Vec<_> = [(sa, first_target), (sb, second_target)]
            .into_iter()
            .filter(|(s, _)| *s == 202)
            .collect();
        assert_eq!(
            accepted.len(),
            1,
            "round {round}: {first}→{sa} {ba}, {second}→{sb} {bb}"
        );
        // The loser is a 409, or — if it happened to be decided first — a same-target no-op.
        let loser = if sa == 202 { sb } else { sa };
        assert!(loser == 409 || loser == 200, "round {round}: {loser}");
        if loser == 409 {
            conflicts += 1;
            let body = if sa == 202 { &bb } else { &ba };
            assert_eq!(body["error"]["code"], "conflict");
            assert!(body["error"]["state"].is_string());
        }
        stack.wait_state(&id, accepted[0].1).await;
    }
    assert!(conflicts > 0, "the 10 ms race produced conflicts");
    stack.assert_no_capacity_drift().await;
    assert_eq!(stack.delete(&id).await.0, 202);
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_start_the_host_never_answers_times_out_and_delete_is_accepted_from_starting_and_failed_start(
    db: PgPool,
) {
    let stack = Stack::start_with(
        db,
        1,
        fast_pass(PassConfig::default().create_timeout, Duration::from_secs(1)),
    )
    .await;
    let a = stopped_sandbox(&stack).await;
    let b = stopped_sandbox(&stack).await;
    stack.hosts[0].freeze();
    assert_eq!(stack.request(&a, "start").await.0, 202);
    assert_eq!(stack.request(&b, "start").await.0, 202);
    let (status, body) = stack.delete(&b).await;
    assert_eq!(status, 202, "delete from starting: {body}");

    let failed = stack.wait_state(&a, "failed-start").await;
    assert!(
        failed["state_reason"]
            .as_str()
            .unwrap()
            .contains("sandbox.start"),
        "{failed}"
    );
    let (status, body) = stack.delete(&a).await;
    assert_eq!(status, 202, "delete from failed-start: {body}");
    assert_eq!(
        stack.delete(&a).await.0,
        200,
        "a repeated delete changes nothing"
    );

    stack.hosts[0].thaw();
    stack.wait_state(&a, "deleted").await;
    stack.wait_state(&b, "deleted").await;
    eventually("nothing is left of either", || async {
        stack.leftovers(&a).is_empty() && stack.leftovers(&b).is_empty()
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_delete_published_while_its_host_is_down_is_applied_when_it_returns(db: PgPool) {
    let mut stack = Stack::start(db, 1).await;
    let id = running_sandbox(&stack).await;
    stack.hosts[0].stop(true).await; // kill -9: the container keeps running without its hostd
    let (status, body) = stack.delete(&id).await;
    assert_eq!(status, 202, "{body}");
    // Published and waiting in the host's durable consumer.
    eventually("the delete is published", || async {
        let published: Option<bool> = sqlx::query_scalar(
            "SELECT published_at IS NOT NULL FROM commands WHERE sandbox_id = $1::uuid AND kind = 'sandbox.delete'",
        )
        .bind(&id)
        .fetch_optional(&stack.db)
        .await
        .unwrap();
        published == Some(true)
    })
    .await;
    assert_eq!(stack.state_of(&id).await, "stopping");

    stack.restart_host(0).await;
    stack.wait_state(&id, "deleted").await;
    eventually("nothing is left", || async {
        stack.leftovers(&id).is_empty()
    })
    .await;
    stack.assert_no_capacity_drift().await;
    stack.teardown().await;
}
