//! Host results delivered the ways JetStream and hosts can deliver them — twice, in reverse
//! order, late after a timeout, contradicting an earlier report — through the real API and
//! `berth_reconciler::results::apply` on the real Postgres. No hostd: results are synthesized
//! from the commands the outbox holds.

use berth_reconciler::pass;
use berth_reconciler::results::Applied;
use berth_schemas::{CommandKind, SandboxId, SandboxState};
use sqlx::PgPool;

use crate::support::inproc::{self, OutboxCommand, Plane, RowView};

/// One step of a history: a request, or the host's report on the newest command.
#[derive(Debug, Clone, Copy)]
enum Step {
    Request(&'static str),
    Report(bool),
}

use Step::{Report, Request};

/// Runs `history` on a new sandbox, delivering every report `deliveries` times. Returns the
/// sandbox and its row after every step.
async fn run(plane: &Plane, history: &[Step], deliveries: usize) -> (SandboxId, Vec<RowView>) {
    let id = plane.create().await;
    let mut trace = vec![inproc::row(&plane.db, id).await];
    for step in history {
        match *step {
            Request(verb) => plane.request(id, verb).await,
            Report(ok) => {
                let command = plane.latest(id).await;
                let outcome = if ok {
                    inproc::succeeded(command.kind)
                } else {
                    inproc::failed()
                };
                let first = plane.deliver(&command, outcome.clone()).await;
                assert!(
                    matches!(first, Applied::Transitioned { .. }),
                    "{step:?} on {command:?}: {first:?}"
                );
                for _ in 1..deliveries {
                    assert_eq!(
                        plane.deliver(&command, outcome.clone()).await,
                        Applied::Duplicate,
                        "a repeated {step:?} on {command:?}"
                    );
                }
            }
        }
        trace.push(inproc::row(&plane.db, id).await);
    }
    (id, trace)
}

/// `(kind, generation)` of every command of a sandbox.
async fn command_shapes(db: &PgPool, id: SandboxId) -> Vec<(CommandKind, i64)> {
    inproc::commands_of(db, id)
        .await
        .iter()
        .map(|c| (c.kind, c.generation.0))
        .collect()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn every_result_delivered_twice_leaves_the_same_states_as_delivered_once(db: PgPool) {
    let plane = Plane::start(db).await;
    let histories: [&[Step]; 2] = [
        &[
            Report(true),
            Request("stop"),
            Report(true),
            Request("start"),
            Report(true),
            Request("delete"),
            Report(true),
        ],
        &[
            Report(false),
            Request("start"),
            Report(true),
            Request("stop"),
            Report(false),
            Request("stop"),
            Report(true),
            Request("start"),
            Report(false),
            Request("delete"),
            Report(true),
        ],
    ];
    for history in histories {
        let (once, once_trace) = run(&plane, history, 1).await;
        let (twice, twice_trace) = run(&plane, history, 2).await;
        assert_eq!(once_trace, twice_trace, "{history:?}");
        assert_eq!(once_trace.last().unwrap().state, "deleted");
        assert_eq!(
            inproc::event_states(&plane.db, once).await,
            inproc::event_states(&plane.db, twice).await
        );
        assert_eq!(
            command_shapes(&plane.db, once).await,
            command_shapes(&plane.db, twice).await
        );
    }
    plane.assert_capacity_released().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn results_delivered_in_reverse_order_leave_the_same_states_as_in_order(db: PgPool) {
    let plane = Plane::start(db).await;
    // create → stop → start → delete. The create's and the stop's results are needed before
    // the next request is allowed; the start's and the delete's are held back (a delete is
    // accepted while starting), so two results are in flight at once. Then the held results
    // arrive, and afterwards the whole log is redelivered: in order for one sandbox, in reverse
    // for the other.
    let mut finals = Vec::new();
    for reverse in [false, true] {
        let id = plane.create().await;
        let mut log = Vec::new();
        let create = plane.latest(id).await;
        plane.deliver(&create, inproc::succeeded(create.kind)).await;
        log.push(create);
        plane.request(id, "stop").await;
        let stop = plane.latest(id).await;
        plane.deliver(&stop, inproc::succeeded(stop.kind)).await;
        log.push(stop);
        plane.request(id, "start").await;
        log.push(plane.latest(id).await);
        plane.request(id, "delete").await;
        log.push(plane.latest(id).await);
        assert_eq!(inproc::row(&plane.db, id).await.state, "stopping");

        let mut held = log[2..].to_vec();
        let mut all = log.clone();
        if reverse {
            held.reverse();
            all.reverse();
        }
        for command in held.iter().chain(all.iter()) {
            plane
                .deliver(command, inproc::succeeded(command.kind))
                .await;
        }
        finals.push((
            inproc::row(&plane.db, id).await,
            inproc::event_states(&plane.db, id).await,
            command_shapes(&plane.db, id).await,
        ));
    }
    assert_eq!(finals[0], finals[1]);
    let (row, events, _) = &finals[0];
    assert_eq!(row.state, "deleted");
    assert!(row.deleting && !row.holds_capacity);
    assert_eq!(
        events,
        &[
            "provisioning",
            "running",
            "stopping",
            "stopped",
            "starting",
            "stopping",
            "deleted"
        ]
    );
    plane.assert_capacity_released().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_late_create_success_after_a_timeout_leaves_failed_start_and_destroys_the_container(
    db: PgPool,
) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let id = plane.create().await;
    let create = plane.latest(id).await;
    assert_eq!(inproc::reserved(&plane.db, plane.host).await, (1, 256));

    inproc::relay_all(&plane.db).await;
    let report = pass::run_pass(&plane.db, &inproc::eager_timeouts(), &lease)
        .await
        .unwrap();
    assert_eq!(report.count(pass::Action::CommandTimeout), 1);
    let failed = inproc::row(&plane.db, id).await;
    assert_eq!(failed.state, "failed-start");
    assert!(!failed.holds_capacity);
    plane.assert_capacity_released().await;

    // The host finally answers the create: too late, the row stays failed.
    let late = plane
        .deliver(&create, inproc::succeeded(CommandKind::Create))
        .await;
    assert_eq!(late, Applied::Stale);
    assert_eq!(inproc::row(&plane.db, id).await, failed);

    // The container the late create built is destroyed: exactly one sandbox.delete is queued,
    // at a generation newer than the create's, so the host's fence lets it through after it.
    let deletes: Vec<OutboxCommand> = inproc::commands_of(&plane.db, id)
        .await
        .into_iter()
        .filter(|c| c.kind == CommandKind::Delete)
        .collect();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    assert!(deletes[0].generation > create.generation);
    assert!(!deletes[0].completed);
    assert_eq!(deletes[0].host_id, plane.host);

    // Capacity was released exactly once: another pass and a redelivery change nothing.
    inproc::relay_all(&plane.db).await;
    pass::run_pass(&plane.db, &inproc::eager_timeouts(), &lease)
        .await
        .unwrap();
    plane
        .deliver(&create, inproc::succeeded(CommandKind::Create))
        .await;
    assert_eq!(inproc::row(&plane.db, id).await, failed);
    assert_eq!(inproc::commands_of(&plane.db, id).await.len(), 2);
    assert_eq!(
        inproc::event_states(&plane.db, id).await,
        ["provisioning", "failed-start"]
    );
    plane.assert_capacity_released().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_create_success_contradicting_its_reported_failure_queues_one_delete(db: PgPool) {
    let plane = Plane::start(db).await;
    let id = plane.create().await;
    let create = plane.latest(id).await;
    assert_eq!(
        plane.deliver(&create, inproc::failed()).await,
        Applied::Transitioned {
            to: SandboxState::FailedStart
        }
    );
    let failed = inproc::row(&plane.db, id).await;
    for delivery in 0..2 {
        let applied = plane
            .deliver(&create, inproc::succeeded(CommandKind::Create))
            .await;
        let expected = if delivery == 0 {
            Applied::Compensated
        } else {
            Applied::Duplicate
        };
        assert_eq!(applied, expected, "delivery {}", delivery + 1);
    }
    assert_eq!(inproc::row(&plane.db, id).await, failed);
    assert_eq!(
        command_shapes(&plane.db, id).await,
        [(CommandKind::Create, 1), (CommandKind::Delete, 1)],
        "one compensating delete, however often the success is delivered"
    );
    plane.assert_capacity_released().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_second_pass_after_a_start_timeout_changes_nothing(db: PgPool) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let (id, _) = run(&plane, &[Report(true), Request("stop"), Report(true)], 1).await;
    plane.request(id, "start").await;
    let config = inproc::eager_timeouts();
    inproc::relay_all(&plane.db).await;
    let first = pass::run_pass(&plane.db, &config, &lease).await.unwrap();
    assert_eq!(first.count(pass::Action::CommandTimeout), 1);
    let after_first = (
        inproc::row(&plane.db, id).await,
        command_shapes(&plane.db, id).await,
        inproc::event_states(&plane.db, id).await,
    );
    assert_eq!(after_first.0.state, "failed-start");
    assert_eq!(after_first.1.last(), Some(&(CommandKind::Stop, 4)));

    // The compensating stop is not a command the sandbox waits on: it never times out.
    let second = pass::run_pass(&plane.db, &config, &lease).await.unwrap();
    assert_eq!(second.count(pass::Action::CommandTimeout), 0);
    assert_eq!(
        (
            inproc::row(&plane.db, id).await,
            command_shapes(&plane.db, id).await,
            inproc::event_states(&plane.db, id).await,
        ),
        after_first
    );
    plane.assert_capacity_released().await;
}
