//! The outbox relay (`berth_api::relay::drain`) against the real Postgres and the real NATS
//! JetStream: a command is published at least once, marked only after JetStream's ack, kept
//! once in the stream however often it is re-published, and claimed by one relay when several
//! drain at once (guarantee 2, the control-plane half).
//!
//! Each test uses its own subject prefix and deletes its streams at the end.

use std::collections::HashSet;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use async_nats::jetstream::{self, message::StreamMessage};
use berth_api::relay::{self, RelayError};
use berth_schemas::wire::{self, Command, Resources, Runtime, SandboxSpec};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, OrgId, SandboxId, Subjects};
use berth_store::commands::insert as insert_command;
use futures::{FutureExt, StreamExt};
use sqlx::PgPool;

use crate::support::inproc;

/// Guards the wait for the watcher's end markers; the test hangs without it if one is lost.
const WATCH_TIMEOUT: Duration = Duration::from_secs(60);

/// One test's outbox: its database, a host row, and its own subjects on the real NATS.
struct Outbox {
    db: PgPool,
    subjects: Subjects,
    nats: async_nats::Client,
    js: jetstream::Context,
    host: HostId,
}

impl Outbox {
    /// Registers a host; creates no stream yet.
    async fn start(db: PgPool) -> Outbox {
        let host = HostId::new();
        inproc::heartbeat(
            &db,
            host,
            Resources {
                vcpus: 16,
                memory_mib: 16_384,
            },
        )
        .await;
        let nats = async_nats::connect(inproc::nats_url())
            .await
            .expect("connect to NATS");
        Outbox {
            db,
            subjects: inproc::unique_subjects(),
            js: jetstream::new(nats.clone()),
            nats,
            host,
        }
    }

    async fn ensure_streams(&self) {
        berth_schemas::streams::ensure_streams(&self.js, &self.subjects)
            .await
            .expect("create the streams");
    }

    /// Commits `n` commands of `kind` for the host in one transaction; returns their ids.
    async fn insert(&self, n: usize, kind: CommandKind) -> Vec<CommandId> {
        let mut tx = self.db.begin().await.unwrap();
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let command = Command {
                snapshot: None,
                id: CommandId::new(),
                sandbox_id: SandboxId::new(),
                generation: Generation::INITIAL,
                kind,
                spec: Some(SandboxSpec {
                    org_id: OrgId::new(),
                    template: "base".into(),
                    resources: Resources {
                        vcpus: 1,
                        memory_mib: 256,
                    },
                    runtime: Runtime::Runc,
                    disk_mib: 256,
                    network: Default::default(),
                    env: Vec::new(),
                    entrypoint: Vec::new(),
                    image: None,
                }),
            };
            insert_command(&mut tx, self.host, &command).await.unwrap();
            ids.push(command.id);
        }
        tx.commit().await.unwrap();
        ids
    }

    async fn drain(&self) -> Result<usize, RelayError> {
        drain(&self.db, &self.js, &self.subjects).await
    }

    /// Every message the command stream holds, in sequence order.
    async fn stored(&self) -> Vec<StreamMessage> {
        let mut stream = self
            .js
            .get_stream(self.subjects.cmd_stream())
            .await
            .expect("the command stream");
        let state = stream.info().await.expect("stream info").state.clone();
        let mut messages = Vec::new();
        if state.messages > 0 {
            for seq in state.first_sequence..=state.last_sequence {
                messages.push(stream.get_raw_message(seq).await.expect("a stored message"));
            }
        }
        assert_eq!(messages.len() as u64, state.messages);
        messages
    }
}

/// One relay batch loop, unbounded, with the default per-host cap on creates and starts in
/// flight.
async fn drain(
    db: &PgPool,
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<usize, RelayError> {
    relay::drain(
        db,
        js,
        subjects,
        relay::DEFAULT_MAX_CONCURRENT_STARTS,
        usize::MAX,
    )
    .await
    .map(|drained| drained.published)
}

/// Runs `test` on a fresh outbox and deletes its streams afterwards, also when it fails.
async fn with_outbox<F, Fut>(db: PgPool, test: F)
where
    F: FnOnce(Outbox) -> Fut,
    Fut: Future<Output = ()>,
{
    let outbox = Outbox::start(db).await;
    let (js, subjects) = (outbox.js.clone(), outbox.subjects.clone());
    let outcome = AssertUnwindSafe(test(outbox)).catch_unwind().await;
    berth_schemas::streams::delete_streams(&js, &subjects).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// `(published, publish_attempts)` of one command row.
async fn publish_state(db: &PgPool, id: CommandId) -> (bool, i32) {
    sqlx::query_as("SELECT published_at IS NOT NULL, publish_attempts FROM commands WHERE id = $1")
        .bind(id)
        .fetch_one(db)
        .await
        .expect("read the command row")
}

/// The `Nats-Msg-Id` a message was published with.
fn msg_id(headers: Option<&async_nats::HeaderMap>) -> String {
    headers
        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_command_committed_while_no_relay_runs_is_published_once_a_relay_drains(db: PgPool) {
    with_outbox(db.clone(), |outbox| async move {
        let api = inproc::Api::new(db.clone(), outbox.nats.clone(), outbox.subjects.clone());
        let org = inproc::org(&db).await;
        let id = api
            .create(&org.key, r#"{"vcpus":1,"memory_mib":256}"#)
            .await;
        let command = inproc::commands_of(&db, id).await.remove(0);
        assert_eq!(command.kind, CommandKind::Create);
        assert_eq!(publish_state(&db, command.id).await, (false, 0));

        // No stream takes the subject yet, so JetStream never acks: the command stays unmarked.
        match outbox.drain().await {
            Err(RelayError::Publish { command_id, .. }) => assert_eq!(command_id, command.id),
            other => panic!("a publish nobody acked must fail the batch, got {other:?}"),
        }
        assert_eq!(publish_state(&db, command.id).await, (false, 1));

        outbox.ensure_streams().await;
        assert_eq!(outbox.drain().await.unwrap(), 1);
        assert_eq!(publish_state(&db, command.id).await, (true, 1));
        assert_eq!(
            outbox.drain().await.unwrap(),
            0,
            "nothing is left to publish"
        );

        let stored = outbox.stored().await;
        assert_eq!(stored.len(), 1);
        assert_eq!(stored[0].subject.as_str(), outbox.subjects.cmd(outbox.host));
        assert_eq!(msg_id(Some(&stored[0].headers)), command.id.to_string());
        assert_eq!(
            wire::decode::<Command>(&stored[0].payload).unwrap(),
            command.command,
            "the stream holds the payload the API committed"
        );
    })
    .await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_relay_that_dies_between_the_ack_and_the_mark_leaves_one_copy_in_the_stream(db: PgPool) {
    with_outbox(db.clone(), |outbox| async move {
        outbox.ensure_streams().await;
        let id = outbox.insert(1, CommandKind::Create).await[0];
        assert_eq!(outbox.drain().await.unwrap(), 1);
        assert_eq!(publish_state(&db, id).await, (true, 0));

        // The crash: JetStream acked, but the mark never committed.
        sqlx::query("UPDATE commands SET published_at = NULL WHERE id = $1")
            .bind(id)
            .execute(&db)
            .await
            .unwrap();
        assert_eq!(
            outbox.drain().await.unwrap(),
            1,
            "the next relay publishes the command again"
        );
        assert!(publish_state(&db, id).await.0);

        let stored = outbox.stored().await;
        assert_eq!(
            stored.len(),
            1,
            "JetStream dropped the second publish by its Nats-Msg-Id"
        );
        assert_eq!(msg_id(Some(&stored[0].headers)), id.to_string());
    })
    .await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn two_relays_draining_at_once_publish_each_command_exactly_once(db: PgPool) {
    // More than two batches, so the relays overlap on the table. Stops: the per-host cap on
    // boots in flight does not hold them back.
    const COMMANDS: usize = 3 * relay::BATCH_SIZE as usize;
    with_outbox(db.clone(), |outbox| async move {
        outbox.ensure_streams().await;
        let ids: HashSet<String> = outbox
            .insert(COMMANDS, CommandKind::Stop)
            .await
            .iter()
            .map(ToString::to_string)
            .collect();

        // A plain subscriber sees every publish on the wire, even one JetStream would deduplicate.
        let watcher = async_nats::connect(inproc::nats_url()).await.unwrap();
        let mut wire_msgs = watcher
            .subscribe(format!("{}.>", outbox.subjects.prefix()))
            .await
            .unwrap();
        watcher.flush().await.unwrap();

        let a = async_nats::connect(inproc::nats_url()).await.unwrap();
        let b = async_nats::connect(inproc::nats_url()).await.unwrap();
        let (ja, jb) = (jetstream::new(a.clone()), jetstream::new(b.clone()));
        let (na, nb) = tokio::join!(
            drain(&db, &ja, &outbox.subjects),
            drain(&db, &jb, &outbox.subjects)
        );
        let (na, nb) = (na.unwrap(), nb.unwrap());
        assert_eq!(na + nb, COMMANDS, "each command claimed once ({na} + {nb})");
        let unpublished: i64 =
            sqlx::query_scalar("SELECT count(*) FROM commands WHERE published_at IS NULL")
                .fetch_one(&db)
                .await
                .unwrap();
        assert_eq!(unpublished, 0);

        // An end marker from each relay's connection: NATS keeps one publisher's order, so when
        // both markers are in, every publish of both relays is too.
        for (client, name) in [(&a, "a"), (&b, "b")] {
            client
                .publish(
                    format!("{}.done.{name}", outbox.subjects.prefix()),
                    "".into(),
                )
                .await
                .unwrap();
            client.flush().await.unwrap();
        }
        let cmd_prefix = format!("{}.cmd.", outbox.subjects.prefix());
        let mut published = Vec::new();
        let mut markers = 0;
        tokio::time::timeout(WATCH_TIMEOUT, async {
            while markers < 2 {
                let msg = wire_msgs.next().await.expect("the subscription is open");
                if msg.subject.starts_with(&cmd_prefix) {
                    published.push(msg_id(msg.headers.as_ref()));
                } else {
                    markers += 1;
                }
            }
        })
        .await
        .expect("both end markers arrive");
        assert_eq!(published.len(), COMMANDS, "publishes on the wire");
        assert_eq!(published.into_iter().collect::<HashSet<_>>(), ids);

        let stored: HashSet<String> = outbox
            .stored()
            .await
            .iter()
            .map(|m| msg_id(Some(&m.headers)))
            .collect();
        assert_eq!(stored, ids, "the stream holds each command once");
    })
    .await;
}

/// Unpublished events the backlog test starts with: far more than one relay round publishes
/// (`ROUND_BATCHES` × the event batch), so a relay that drained every event before its next
/// command would still be draining when the command is committed.
const EVENT_BACKLOG: i64 = 50_000;

/// How many events are still unpublished.
async fn events_pending(db: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM events WHERE published_at IS NULL")
        .fetch_one(db)
        .await
        .expect("count unpublished events")
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_backlog_of_events_never_holds_a_command_back_past_one_round(db: PgPool) {
    with_outbox(db.clone(), |outbox| async move {
        outbox.ensure_streams().await;
        let api = inproc::Api::new(db.clone(), outbox.nats.clone(), outbox.subjects.clone());
        let org = inproc::org(&db).await;
        let first = api.create(&org.key, inproc::SANDBOX).await;
        // The first sandbox's event, copied into a backlog the size a lagging fleet builds.
        sqlx::query(
            "INSERT INTO events (id, sandbox_id, org_id, type, from_state, to_state, reason,
                                 generation)
             SELECT gen_random_uuid(), e.sandbox_id, e.org_id, e.type, e.from_state, e.to_state,
                    e.reason, e.generation
               FROM events e, generate_series(1, $2)
              WHERE e.sandbox_id = $1",
        )
        .bind(first)
        .bind(EVENT_BACKLOG)
        .execute(&db)
        .await
        .unwrap();
        let backlog = events_pending(&db).await;
        assert!(backlog > EVENT_BACKLOG, "{backlog}");

        let shutdown = tokio_util::sync::CancellationToken::new();
        let relay = tokio::spawn(berth_api::outbox::run(
            db.clone(),
            outbox.nats.clone(),
            outbox.subjects.clone(),
            relay::DEFAULT_MAX_CONCURRENT_STARTS,
            shutdown.clone(),
        ));
        crate::support::eventually("the relay is publishing the event backlog", || async {
            events_pending(&db).await < backlog
        })
        .await;

        // A command committed while the backlog drains goes out within a round.
        let second = api.create(&org.key, inproc::SANDBOX).await;
        let command = inproc::commands_of(&db, second).await.remove(0);
        crate::support::eventually("the second create is published", || async {
            publish_state(&db, command.id).await.0
        })
        .await;
        let left = events_pending(&db).await;
        assert!(
            left > 0,
            "the command waited for all {backlog} events to be published first"
        );

        // And the events go on draining after the command (the rounds alternate; draining
        // all of them takes minutes on a loaded machine, so the test stops at progress).
        crate::support::eventually("more events are published after the command", || async {
            events_pending(&db).await < left
        })
        .await;
        shutdown.cancel();
        relay.await.unwrap();
    })
    .await;
}

/// The relay has connections of its own: while requests hold every connection of the API's
/// pool (here its only one), a committed command is still published. On the API's pool the
/// relay waited behind the requests, and in the 1,000-host sim the outbox grew without bound.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_relay_publishes_while_requests_hold_every_connection_of_the_apis_pool(db: PgPool) {
    with_outbox(db.clone(), |outbox| async move {
        outbox.ensure_streams().await;
        let api_pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with((*db.connect_options()).clone())
            .await
            .unwrap();
        let held = api_pool.acquire().await.unwrap();
        let config =
            berth_api::ApiConfig::new("127.0.0.1:0".parse().unwrap(), outbox.subjects.clone());
        let state = berth_api::AppState::new(
            api_pool.clone(),
            outbox.nats.clone(),
            outbox.subjects.clone(),
            config,
            berth_api::metrics::handle(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(berth_api::serve(listener, state, shutdown.clone()));

        let ids = outbox.insert(3, CommandKind::Stop).await;
        berth_api::outbox::wake();
        // The relay polls every second besides; a relay without a connection never publishes.
        let deadline = tokio::time::Instant::now() + WATCH_TIMEOUT;
        loop {
            let mut published = 0;
            for id in &ids {
                published += publish_state(&db, *id).await.0 as usize;
            }
            if published == ids.len() {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the relay published {published} of {} commands while the API's pool was held",
                ids.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(held);
        shutdown.cancel();
        server.await.unwrap().unwrap();
        api_pool.close().await;
    })
    .await;
}
