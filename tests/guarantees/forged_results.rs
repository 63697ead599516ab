//! Only a sandbox's own host speaks for it (issue 11, item 1): a result is applied only when the
//! outbox issued its command to the reporting host, for that sandbox, generation and kind, the
//! sandbox is placed on that host, and it arrived on that host's own result subject. Everything
//! else is rejected and changes nothing. Results are synthesized (no hostd), through
//! `berth_reconciler::results::{apply, consume}` on the real Postgres and NATS.

use async_nats::jetstream;
use berth_reconciler::results::{self, Applied, Rejection};
use berth_schemas::wire::{Command, CommandResult};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, SandboxState};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::support::env::{eventually, nats_url, unique_subjects};
use crate::support::inproc::{self, Plane};

async fn apply(db: &PgPool, result: &CommandResult) -> Applied {
    results::apply(db, result).await.expect("apply a result")
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_result_that_does_not_match_the_issued_command_changes_nothing(db: PgPool) {
    let plane = Plane::start(db).await;
    let (id, stop) = plane.stopping().await;
    let before = inproc::row(&plane.db, id).await;
    assert_eq!(before.state, "stopping");
    let genuine = inproc::result_for(&stop, inproc::failed());

    let forgeries = [
        (
            "a command id the outbox never issued",
            CommandResult {
                command_id: CommandId::new(),
                ..genuine.clone()
            },
            Rejection::UnknownCommand,
        ),
        (
            "another host reporting the sandbox's command",
            CommandResult {
                host_id: HostId::new(),
                ..genuine.clone()
            },
            Rejection::WrongHost,
        ),
        (
            "the command id under another kind",
            CommandResult {
                kind: CommandKind::Start,
                ..genuine.clone()
            },
            Rejection::Mismatch,
        ),
        (
            "the command id at a newer generation",
            CommandResult {
                generation: Generation(stop.generation.0 + 1),
                ..genuine.clone()
            },
            Rejection::Mismatch,
        ),
        (
            "the command id for another sandbox",
            CommandResult {
                sandbox_id: plane.create().await,
                ..genuine.clone()
            },
            Rejection::Mismatch,
        ),
    ];
    for (what, forged, why) in forgeries {
        assert_eq!(
            apply(&plane.db, &forged).await,
            Applied::Rejected(why),
            "{what}"
        );
        assert_eq!(inproc::row(&plane.db, id).await, before, "{what}");
        assert!(
            !plane.latest(id).await.completed,
            "{what}: the stop command stays open"
        );
    }

    // The genuine report still applies: the stop failed, the sandbox runs again.
    assert_eq!(
        apply(&plane.db, &genuine).await,
        Applied::Transitioned {
            to: SandboxState::Running
        }
    );
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_forged_stop_failure_cannot_bring_a_stopped_sandbox_back(db: PgPool) {
    let plane = Plane::start(db).await;
    let (id, stop) = plane.stopping().await;
    plane
        .deliver(&stop, inproc::succeeded(CommandKind::Stop))
        .await;
    let stopped = inproc::row(&plane.db, id).await;
    assert_eq!(stopped.state, "stopped");
    // What the attack of the issue sent: "stop failed" for the sandbox at its generation, from
    // its host, with a made-up command id.
    let forged = CommandResult {
        command_id: CommandId::new(),
        ..inproc::result_for(&stop, inproc::failed())
    };
    assert_eq!(
        apply(&plane.db, &forged).await,
        Applied::Rejected(Rejection::UnknownCommand)
    );
    assert_eq!(inproc::row(&plane.db, id).await, stopped);
    plane.assert_capacity_released().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_command_of_another_host_completes_without_touching_the_row(db: PgPool) {
    let plane = Plane::start(db).await;
    let id = plane.create().await;
    let create = plane.latest(id).await;
    plane
        .deliver(&create, inproc::succeeded(CommandKind::Create))
        .await;
    let running = inproc::row(&plane.db, id).await;
    // A delete the control plane sent to another host (an orphan of the sandbox there), at the
    // row's generation: that host's success must not delete the sandbox placed here.
    let other = HostId::new();
    inproc::heartbeat(&plane.db, other, inproc::HOST_CAPACITY).await;
    let command = Command {
        snapshot: None,
        id: CommandId::new(),
        sandbox_id: id,
        generation: create.generation,
        kind: CommandKind::Delete,
        spec: Some(create.command.spec.clone().expect("a create has a spec")),
    };
    let mut conn = plane.db.acquire().await.unwrap();
    berth_store::commands::insert(&mut conn, other, &command)
        .await
        .unwrap();
    drop(conn);
    let orphan = inproc::commands_of(&plane.db, id)
        .await
        .into_iter()
        .find(|c| c.id == command.id)
        .unwrap();
    assert_eq!(
        apply(
            &plane.db,
            &inproc::result_for(&orphan, inproc::succeeded(CommandKind::Delete))
        )
        .await,
        Applied::Rejected(Rejection::NotPlacement)
    );
    assert_eq!(inproc::row(&plane.db, id).await, running);
    let after = inproc::commands_of(&plane.db, id).await;
    assert!(
        after.iter().find(|c| c.id == command.id).unwrap().completed,
        "the other host's own command is complete"
    );
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_result_published_on_another_hosts_subject_is_not_applied(db: PgPool) {
    let plane = Plane::start(db).await;
    let (id, stop) = plane.stopping().await;
    let subjects = unique_subjects();
    let nats = async_nats::connect(nats_url()).await.unwrap();
    let js = jetstream::new(nats.clone());
    berth_schemas::streams::ensure_streams(&js, &subjects)
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let consumer = inproc::spawn_result_consumer(&subjects, &plane.db, nats, &shutdown);

    // Another (real, registered) host publishes on its own result subject, as its credentials
    // allow, a success that names the sandbox's host: forged.
    let intruder = HostId::new();
    inproc::heartbeat(&plane.db, intruder, inproc::HOST_CAPACITY).await;
    let forged = inproc::result_for(&stop, inproc::succeeded(CommandKind::Stop));
    inproc::publish_result(&js, &subjects, intruder, &forged).await;
    // Then the sandbox's host reports, on its own subject, that the stop failed.
    let genuine = inproc::result_for(&stop, inproc::failed());
    inproc::publish_result(&js, &subjects, plane.host, &genuine).await;

    // Had the forged success applied, the sandbox would be stopped and the failure a duplicate.
    eventually("the genuine stop failure is applied", || async {
        inproc::row(&plane.db, id).await.state == "running"
    })
    .await;
    assert_eq!(
        inproc::event_states(&plane.db, id).await,
        ["provisioning", "running", "stopping", "running"]
    );
    inproc::stop_result_consumer(&shutdown, consumer, &js, &subjects).await;
}
