//! Issue 12 item 1: a command is never timed out because its result waits in the control
//! plane's own backlog. The pass counts a published command's time to the results watermark
//! (`berth_reconciler::watermark`), which stays behind while the result consumer has results
//! to apply; on the real results stream and consumer, the real sampler and the real pass.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use berth_reconciler::pass::{run_pass, Action, PassConfig};
use berth_reconciler::{results, watermark};
use berth_schemas::CommandKind;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::support::env::{eventually, nats_url, unique_subjects};
use crate::support::inproc::{self, Plane};

/// The watermark as the database holds it, if any sample reached one.
async fn applied_through(db: &PgPool) -> Option<chrono::DateTime<chrono::Utc>> {
    sqlx::query_scalar("SELECT applied_through FROM results_watermark")
        .fetch_optional(db)
        .await
        .unwrap()
}

/// Two creates, both published: the host answered one (its result is in the results stream,
/// behind a consumer that is not running) and never the other. With a zero create timeout and
/// no inventory to vouch for either, the pass fails neither while the result waits: the
/// watermark stays before their publish. Once the consumer runs, the answered one runs, the
/// watermark passes their deadline, and the pass fails the other one only.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_command_is_not_timed_out_while_its_result_waits_in_the_consumers_backlog(db: PgPool) {
    let plane = Plane::start(db).await;
    let lease = inproc::lease(&plane.db).await;
    let subjects = unique_subjects();
    let nats = async_nats::connect(nats_url()).await.unwrap();
    let js = jetstream::new(nats.clone());
    berth_schemas::streams::ensure_streams(&js, &subjects)
        .await
        .unwrap();
    // The reconcilers' durable consumer exists (as after any earlier run) but nobody pulls.
    js.get_stream(subjects.result_stream())
        .await
        .unwrap()
        .get_or_create_consumer(
            &subjects.reconciler_consumer(),
            consumer::pull::Config {
                durable_name: Some(subjects.reconciler_consumer()),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: results::ACK_WAIT,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let shutdown = CancellationToken::new();
    let sampler = tokio::spawn(watermark::run(
        plane.db.clone(),
        nats.clone(),
        subjects.clone(),
        shutdown.clone(),
    ));
    eventually("a first watermark (nothing queued yet)", || async {
        applied_through(&plane.db).await.is_some()
    })
    .await;

    let (answered, unanswered) = (plane.create().await, plane.create().await);
    let answer = inproc::result_for(
        &plane.latest(answered).await,
        inproc::succeeded(CommandKind::Create),
    );
    inproc::publish_result(&js, &subjects, plane.host, &answer).await;
    // Published (by the relay, as far as the pass can tell) after the host's answer was
    // queued: every sample from now on sees the result pending.
    let published: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "UPDATE commands SET published_at = clock_timestamp()
          WHERE sandbox_id = ANY($1) RETURNING published_at",
    )
    .bind(vec![answered.0, unanswered.0])
    .fetch_all(&plane.db)
    .await
    .unwrap()[0];
    let eager = PassConfig {
        create_timeout: Duration::ZERO,
        health: inproc::lifecycle_only_health(),
        ..PassConfig::default()
    };
    // Several samples pass while the result waits; none moves the watermark past the publish.
    tokio::time::sleep(watermark::SAMPLE_INTERVAL * 3).await;
    let report = run_pass(&plane.db, &eager, &lease).await.unwrap();
    assert_eq!(report.count(Action::CommandTimeout), 0, "{report:?}");
    assert!(applied_through(&plane.db).await.unwrap() < published);
    for id in [answered, unanswered] {
        assert_eq!(inproc::row(&plane.db, id).await.state, "provisioning");
    }

    // The consumer applies the backlog; the watermark then passes both deadlines.
    let consumer = inproc::spawn_result_consumer(&subjects, &plane.db, nats, &shutdown);
    eventually("the queued result is applied", || async {
        inproc::row(&plane.db, answered).await.state == "running"
    })
    .await;
    eventually("the watermark passes the publish", || async {
        applied_through(&plane.db).await.unwrap() > published
    })
    .await;
    let report = run_pass(&plane.db, &eager, &lease).await.unwrap();
    assert_eq!(report.count(Action::CommandTimeout), 1, "{report:?}");
    assert_eq!(inproc::row(&plane.db, answered).await.state, "running");
    assert_eq!(
        inproc::row(&plane.db, unanswered).await.state,
        "failed-start"
    );

    shutdown.cancel();
    sampler.await.unwrap();
    inproc::stop_result_consumer(&shutdown, consumer, &js, &subjects).await;
}

/// The result consumer outlives the JetStream consumer it pulls from. A JetStream node that
/// deletes or stops it (nats-server 2.9 also sends waiting pulls `409 Consumer Deleted` when a
/// node merely stops the consumer; the client's message stream then ends) once ended
/// `results::consume` and with it the reconciler process: results then waited until an
/// operator restarted it. Now it subscribes again, the consumer is made anew, and a result
/// published after the deletion is applied.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_result_consumer_subscribes_again_when_its_jetstream_consumer_is_deleted(db: PgPool) {
    let plane = Plane::start(db).await;
    let subjects = unique_subjects();
    let nats = async_nats::connect(nats_url()).await.unwrap();
    let js = jetstream::new(nats.clone());
    let shutdown = CancellationToken::new();
    let consumer = inproc::spawn_result_consumer(&subjects, &plane.db, nats, &shutdown);
    let answer = |row| inproc::result_for(&row, inproc::succeeded(CommandKind::Create));
    let first = plane.create().await;
    let result = answer(plane.latest(first).await);
    inproc::publish_result(&js, &subjects, plane.host, &result).await;
    eventually("the first result is applied", || async {
        inproc::row(&plane.db, first).await.state == "running"
    })
    .await;

    let stream = js.get_stream(subjects.result_stream()).await.unwrap();
    stream
        .delete_consumer(&subjects.reconciler_consumer())
        .await
        .unwrap();
    let second = plane.create().await;
    let result = answer(plane.latest(second).await);
    inproc::publish_result(&js, &subjects, plane.host, &result).await;
    eventually(
        "a result published after the deletion is applied",
        || async { inproc::row(&plane.db, second).await.state == "running" },
    )
    .await;
    assert!(!consumer.is_finished(), "the result consumer ended");

    inproc::stop_result_consumer(&shutdown, consumer, &js, &subjects).await;
}
