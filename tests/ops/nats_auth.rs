//! Only a host speaks for itself on NATS (DESIGN.md guarantee 8, the NATS half): each test
//! starts its own nats-server on a free loopback port with a generated config (auth and/or
//! TLS) and shows an attack failing next to the same thing done rightfully succeeding. The
//! shared NATS the other tests use stays open.
//!
//! Absence is shown without timing: a forbidden message is followed, on the same connection,
//! by an allowed one; NATS keeps one connection's order, so once the allowed one arrived the
//! forbidden one would have arrived before it.

use std::path::Path;
use std::sync::{Arc, Mutex};

use async_nats::jetstream::{self, consumer::pull};
use berth::nats_access::{self, ServerTls};
use berth_schemas::nats_auth::{server_auth_config, Creds, HostUser, NatsConnect, Role};
use berth_schemas::wire::{self, Heartbeat, Resources, RuntimeInfo};
use berth_schemas::{HostId, Subjects};
use futures::{FutureExt, StreamExt};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::support::nats_server::{write_pem, NatsServer};
use crate::support::stack::NatsTarget;
use crate::support::{eventually, nats_url, unique_subjects, Stack, SETTLE_TIMEOUT};

/// The next message of `sub`, or a panic naming `what` after [`SETTLE_TIMEOUT`]: a message the
/// server never delivers fails the test instead of hanging it. The panic carries `context()`
/// (the clients' connection events and the server's log), so a lost message says whether a
/// connection dropped on the way.
///
/// The cause of this test's hangs on a loaded machine (once for 20 minutes, once for 120 s in
/// CI) was a subscription the server had not taken yet: see [`processed`].
async fn next_within(
    sub: &mut async_nats::Subscriber,
    what: &str,
    context: impl Fn() -> String,
) -> async_nats::Message {
    match tokio::time::timeout(SETTLE_TIMEOUT, sub.next()).await {
        Ok(Some(message)) => message,
        Ok(None) => panic!("subscription closed: {what}\n{}", context()),
        Err(_) => panic!(
            "no message within {SETTLE_TIMEOUT:?}: {what}\n{}",
            context()
        ),
    }
}

/// Returns once the server has handled everything `client` sent before (its subscriptions
/// among it): a JetStream request answered on the same connection, since the server handles
/// one connection's protocol in order. async-nats's `flush` only writes the socket (no PING
/// round trip), so without this a message another connection publishes next can reach the
/// server before this connection's `SUB` does, and is never delivered to it.
async fn processed(client: &async_nats::Client, subjects: &Subjects) {
    client
        .request(
            format!("$JS.API.STREAM.INFO.{}", subjects.cmd_stream()),
            "".into(),
        )
        .await
        .expect("the server answers a stream info request");
}

fn connect_spec(server: &NatsServer, creds: Option<&Creds>) -> NatsConnect {
    NatsConnect {
        url: server.url(),
        creds: creds.cloned(),
        ca_file: None,
    }
}

fn host_user(creds: &Creds) -> HostUser {
    let Role::Host(host_id) = creds.role else {
        panic!("not a host's credentials")
    };
    HostUser {
        host_id,
        public_key: creds.public_key(),
    }
}

/// A connection with `creds` whose server errors (permission violations) are collected.
async fn watched(
    server: &NatsServer,
    creds: &Creds,
) -> (async_nats::Client, Arc<Mutex<Vec<String>>>) {
    let errors = Arc::new(Mutex::new(Vec::new()));
    let sink = errors.clone();
    let client = connect_spec(server, Some(creds))
        .options()
        .event_callback(move |event| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().push(event.to_string().to_lowercase());
            }
        })
        .connect(server.url())
        .await
        .expect("a registered host connects");
    (client, errors)
}

async fn reported(errors: &Arc<Mutex<Vec<String>>>, what: &str) {
    let what = what.to_lowercase();
    eventually(&format!("the server reports {what}"), || async {
        errors.lock().unwrap().iter().any(|e| e.contains(&what))
    })
    .await;
}

fn heartbeat(host: HostId) -> Heartbeat {
    Heartbeat {
        host_id: host,
        name: format!("hb-{host}"),
        seq: 1,
        capacity: Resources {
            vcpus: 2,
            memory_mib: 1024,
        },
        used: Resources::default(),
        runtimes: vec![RuntimeInfo {
            name: "runc".into(),
            memory_snapshot: false,
        }],
        inventory: Vec::new(),
        forwarder: None,
        sent_at_ms: 0,
        warm: Vec::new(),
    }
}

#[tokio::test]
async fn a_client_without_credentials_or_with_an_unknown_key_is_refused() {
    let subjects = unique_subjects();
    let control_plane = Creds::generate(Role::ControlPlane);
    let host = Creds::generate(Role::Host(HostId::new()));
    let auth = server_auth_config(&subjects, &control_plane.public_key(), &[host_user(&host)]);
    let server = NatsServer::start(Some(&auth), None).await;

    let anonymous = connect_spec(&server, None).connect().await;
    assert!(anonymous.is_err(), "an anonymous client got in");
    let stranger = Creds::generate(Role::Host(HostId::new()));
    let unknown = connect_spec(&server, Some(&stranger)).connect().await;
    assert!(unknown.is_err(), "a key the server does not list got in");

    // The listed keys get in.
    for creds in [&control_plane, &host] {
        let client = connect_spec(&server, Some(creds))
            .connect()
            .await
            .unwrap_or_else(|e| panic!("{:?} refused: {e}\n{}", creds.role, server.log()));
        client.flush().await.unwrap();
    }
}

#[tokio::test]
async fn a_hosts_credentials_cannot_speak_for_or_read_another_host() {
    let subjects = unique_subjects();
    let control_plane = Creds::generate(Role::ControlPlane);
    let (a, b) = (HostId::new(), HostId::new());
    let (creds_a, creds_b) = (
        Creds::generate(Role::Host(a)),
        Creds::generate(Role::Host(b)),
    );
    let auth = server_auth_config(
        &subjects,
        &control_plane.public_key(),
        &[host_user(&creds_a), host_user(&creds_b)],
    );
    let server = NatsServer::start(Some(&auth), None).await;
    let (cp, cp_events) = watched(&server, &control_plane).await;
    let cp_js = jetstream::new(cp.clone());
    berth_schemas::streams::ensure_streams(&cp_js, &subjects)
        .await
        .unwrap();
    let (host_a, errors) = watched(&server, &creds_a).await;
    let context = || {
        format!(
            "control plane's events: {:?}\nhost A's events: {:?}\nserver log:\n{}",
            cp_events.lock().unwrap(),
            errors.lock().unwrap(),
            server.log()
        )
    };

    // Publishing: host A forges B's result and heartbeat, sends agent requests (exec as root
    // in a sandbox) and commands to B and to itself, and an event; then its own result and
    // heartbeat. The control plane sees everything under the prefix.
    let mut everything = cp
        .subscribe(format!("{}.>", subjects.prefix()))
        .await
        .unwrap();
    processed(&cp, &subjects).await;
    let forged = [
        subjects.result(b),
        subjects.heartbeat(b),
        subjects.agent(b),
        subjects.cmd(b),
        subjects.agent(a),
        subjects.cmd(a),
        format!("{}.events.sandbox.x.y", subjects.prefix()),
    ];
    for subject in &forged {
        host_a
            .publish(subject.clone(), "forged".into())
            .await
            .unwrap();
    }
    for subject in [subjects.result(a), subjects.heartbeat(a)] {
        host_a.publish(subject, "mine".into()).await.unwrap();
    }
    host_a.flush().await.unwrap();
    for own in [subjects.result(a), subjects.heartbeat(a)] {
        let next = next_within(
            &mut everything,
            "host A's own result and heartbeat",
            context,
        )
        .await;
        assert_eq!(
            (next.subject.as_str(), &next.payload[..]),
            (own.as_str(), &b"mine"[..]),
            "host A's forged message was delivered"
        );
    }
    for subject in &forged {
        reported(
            &errors,
            &format!("permissions violation for publish to \"{subject}\""),
        )
        .await;
    }

    // Subscribing: to B's agent requests and commands, and to anyone's replies.
    let forbidden = [
        subjects.agent(b),
        subjects.cmd(b),
        "_INBOX.>".to_owned(),
        format!("{}.>", Role::Host(b).inbox_prefix()),
    ];
    let mut stolen = Vec::new();
    for subject in &forbidden {
        stolen.push(host_a.subscribe(subject.clone()).await.unwrap());
    }
    let mut own = host_a.subscribe(subjects.agent(a)).await.unwrap();
    processed(&host_a, &subjects).await;
    for subject in &forbidden {
        reported(
            &errors,
            &format!("permissions violation for subscription to \"{subject}\""),
        )
        .await;
    }
    for subject in [
        subjects.agent(b),
        subjects.cmd(b),
        "_INBOX.somebody.reply".to_owned(),
        format!("{}.exec.output", Role::Host(b).inbox_prefix()),
    ] {
        cp.publish(subject, "secret".into()).await.unwrap();
    }
    cp.publish(subjects.agent(a), "for A".into()).await.unwrap();
    cp.flush().await.unwrap();
    let mine = next_within(
        &mut own,
        "the control plane's message on A's agent subject",
        context,
    )
    .await;
    assert_eq!(&mine.payload[..], b"for A");
    for (subject, sub) in forbidden.iter().zip(&mut stolen) {
        assert!(
            !matches!(sub.next().now_or_never(), Some(Some(_))),
            "host A read {subject}"
        );
    }

    // JetStream: A cannot open a consumer on B's commands, neither under B's consumer name
    // nor under its own name with B's filter in the request body.
    let a_js = jetstream::new(host_a.clone());
    let stream = subjects.cmd_stream();
    let steal = a_js
        .create_consumer_on_stream(
            pull::Config {
                durable_name: Some(subjects.host_consumer(b)),
                filter_subject: subjects.cmd(b),
                ..Default::default()
            },
            stream.clone(),
        )
        .await;
    assert!(steal.is_err(), "host A made B's command consumer");
    let own_name = subjects.host_consumer(a);
    let body = serde_json::json!({
        "stream_name": stream,
        "config": {
            "durable_name": own_name,
            "filter_subject": subjects.cmd(b),
            "ack_policy": "explicit",
            "deliver_policy": "all",
        },
    });
    let reply = host_a
        .request(
            format!(
                "$JS.API.CONSUMER.CREATE.{stream}.{own_name}.{}",
                subjects.cmd(a)
            ),
            serde_json::to_vec(&body).unwrap().into(),
        )
        .await
        .expect("the server answers a request on A's own consumer subject");
    let reply: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    // JSConsumerCreateFilterSubjectMismatchErr: the server compares the body with the subject.
    assert_eq!(
        reply["error"]["err_code"], 10131,
        "a consumer named A's but filtering B's commands was made: {reply}"
    );
    let mut names = cp_js.get_stream(&stream).await.unwrap().consumer_names();
    while let Some(name) = names.next().await {
        let name = name.unwrap();
        let info = cp_js
            .get_stream(&stream)
            .await
            .unwrap()
            .consumer_info(&name)
            .await
            .unwrap();
        assert_ne!(info.config.filter_subject, subjects.cmd(b), "{name}");
    }

    // The rightful path still works: A's own consumer on its own commands.
    let mine = a_js
        .get_stream(&stream)
        .await
        .expect("A looks its command stream up")
        .create_consumer(pull::Config {
            durable_name: Some(own_name.clone()),
            filter_subject: subjects.cmd(a),
            ..Default::default()
        })
        .await;
    assert!(mine.is_ok(), "A's own consumer: {:?}", mine.err());
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn heartbeats_of_an_unregistered_host_or_on_another_hosts_subject_are_not_applied(
    db: PgPool,
) {
    let subjects = unique_subjects();
    let nats = async_nats::connect(nats_url()).await.unwrap();
    let stop = CancellationToken::new();
    let scheduler = tokio::spawn(berth_scheduler::run(
        berth_scheduler::SchedulerConfig {
            subjects: subjects.clone(),
        },
        db.clone(),
        nats.clone(),
        stop.clone(),
    ));
    let (a, b, stranger) = (HostId::new(), HostId::new(), HostId::new());
    for host in [a, b] {
        berth_store::hosts::register(&db, host, None).await.unwrap();
    }
    let row = |host: HostId| {
        let db = db.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT 1::int8 FROM hosts WHERE id = $1")
                .bind(host)
                .fetch_optional(&db)
                .await
                .unwrap()
                .is_some()
        }
    };
    // The subscription is up once a heartbeat gets through.
    let publish = |subject: String, hb: Heartbeat| {
        let nats = nats.clone();
        async move {
            nats.publish(subject, wire::encode(&hb).into())
                .await
                .unwrap();
        }
    };
    eventually(
        "the scheduler applies a registered host's heartbeat",
        || async {
            publish(subjects.heartbeat(a), heartbeat(a)).await;
            row(a).await
        },
    )
    .await;

    // B's heartbeat sent on A's subject, and a stranger's on its own; then B's own, rightly.
    publish(subjects.heartbeat(a), heartbeat(b)).await;
    publish(subjects.heartbeat(stranger), heartbeat(stranger)).await;
    let mut marker = heartbeat(a);
    marker.name = "after the forgeries".into();
    marker.seq = 2;
    publish(subjects.heartbeat(a), marker).await;
    eventually("the heartbeat after the forgeries is applied", || async {
        sqlx::query_scalar::<_, String>("SELECT name FROM hosts WHERE id = $1")
            .bind(a)
            .fetch_one(&db)
            .await
            .unwrap()
            == "after the forgeries"
    })
    .await;
    assert!(
        !row(b).await,
        "a heartbeat for B on A's subject made B's row"
    );
    assert!(
        !row(stranger).await,
        "an unregistered host's heartbeat made a row"
    );

    publish(subjects.heartbeat(b), heartbeat(b)).await;
    eventually("B's own heartbeat is applied", || row(b)).await;

    stop.cancel();
    scheduler.await.unwrap().unwrap();
}

/// The URL of the test's own database (`#[sqlx::test]` made it on `DATABASE_URL`'s server).
fn database_url(db: &PgPool) -> String {
    let base = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let name = db.connect_options().get_database().unwrap().to_owned();
    let (server, _) = base.rsplit_once('/').unwrap();
    format!("{server}/{name}")
}

fn berth_cli(db: &PgPool, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
        .args(args)
        .env("DATABASE_URL", database_url(db))
        .output()
        .expect("run berth");
    assert!(
        out.status.success(),
        "berth {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn with_auth_on_a_host_added_by_the_cli_runs_a_sandbox_end_to_end_until_it_is_removed(
    db: PgPool,
) {
    berth_store::MIGRATOR.run(&db).await.unwrap();
    let subjects = Subjects::new(&format!("t{}", crate::support::unique())).unwrap();
    let dir = crate::support::cleanup::fresh_dir("nats-auth");
    let cp_file = dir.join("control-plane.creds");
    let control_plane = nats_access::load_or_create(&cp_file, Role::ControlPlane).unwrap();
    // At first only the control plane is let in.
    let auth = nats_access::render_auth(&db, &subjects, &control_plane)
        .await
        .unwrap();
    let server = NatsServer::start(Some(&auth), None).await;
    let mut stack = Stack::start_full(
        db.clone(),
        NatsTarget {
            url: server.url(),
            control_plane: Some(control_plane.clone()),
        },
        subjects.clone(),
        0,
        berth_reconciler::pass::PassConfig::default(),
        |_| {},
    )
    .await;

    // The operator's steps: issue the host's credentials, re-render the users, reload.
    let host_file = dir.join("host.creds");
    let printed = berth_cli(
        &db,
        &[
            "admin",
            "add-host",
            "--creds-out",
            host_file.to_str().unwrap(),
        ],
    );
    let host: HostId = printed.trim().parse().expect("add-host prints the host id");
    let auth_file = dir.join("auth.conf");
    berth_cli(
        &db,
        &[
            "admin",
            "nats-config",
            "--control-plane-creds",
            cp_file.to_str().unwrap(),
            "--subject-prefix",
            subjects.prefix(),
            "--out",
            auth_file.to_str().unwrap(),
        ],
    );
    let host_creds = nats_access::load(&host_file).unwrap();
    assert_eq!(host_creds.role, Role::Host(host));
    assert!(connect_spec(&server, Some(&host_creds))
        .connect()
        .await
        .is_err());
    server.reload(Some(&std::fs::read_to_string(&auth_file).unwrap()));
    eventually("the reloaded server lets the new host in", || async {
        connect_spec(&server, Some(&host_creds))
            .connect()
            .await
            .is_ok()
    })
    .await;

    let index = stack
        .add_host_full((None, None), &[], Some(host_file.clone()))
        .await;
    assert_eq!(stack.hosts[index].host_id, host);
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let (status, body) = stack.exec(&id, &["echo", "hello"]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["stdout"], "hello\n", "{body}");
    let (status, _) = stack.delete(&id).await;
    assert_eq!(status, 202);
    stack.wait_state(&id, "deleted").await;
    stack.assert_no_capacity_drift().await;

    // Removing the host shuts its key out once the users are re-rendered and reloaded.
    berth_cli(&db, &["admin", "remove-host", &host.to_string()]);
    let render = [
        "admin",
        "nats-config",
        "--control-plane-creds",
        cp_file.to_str().unwrap(),
        "--subject-prefix",
        subjects.prefix(),
    ];
    let users = berth_cli(&db, &render);
    assert!(!users.contains(&host_creds.public_key()), "{users}");
    server.reload(Some(&users));
    eventually("the reloaded server refuses the removed host", || async {
        connect_spec(&server, Some(&host_creds))
            .connect()
            .await
            .is_err()
    })
    .await;
    stack.teardown().await;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A CA and a server certificate for `localhost` and 127.0.0.1 signed by it, as PEM files in
/// `dir`: (CA certificate, server TLS files).
fn test_ca(dir: &Path) -> (std::path::PathBuf, ServerTls) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "berth test CA");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let server_key = KeyPair::generate().unwrap();
    let server_cert = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    (
        write_pem(dir, "ca.pem", &ca_cert.pem()),
        ServerTls {
            cert_file: write_pem(dir, "server.pem", &server_cert.pem()),
            key_file: write_pem(dir, "server-key.pem", &server_key.serialize_pem()),
        },
    )
}

#[tokio::test]
async fn a_tls_connection_with_the_test_ca_works_and_a_client_without_it_is_refused() {
    let dir = crate::support::cleanup::fresh_dir("nats-tls");
    let (ca, tls) = test_ca(&dir);
    let subjects = unique_subjects();
    let control_plane = Creds::generate(Role::ControlPlane);
    let auth = server_auth_config(&subjects, &control_plane.public_key(), &[]);
    let server = NatsServer::start(Some(&auth), Some(tls)).await;

    let with_ca = NatsConnect {
        url: server.url(),
        creds: Some(control_plane.clone()),
        ca_file: Some(ca.clone()),
    };
    let client = with_ca
        .connect()
        .await
        .unwrap_or_else(|e| panic!("TLS with the test CA: {e}\n{}", server.log()));
    let mut sub = client.subscribe("tls.check").await.unwrap();
    client
        .publish("tls.check", "over tls".into())
        .await
        .unwrap();
    assert_eq!(
        &next_within(&mut sub, "the message over TLS", String::new)
            .await
            .payload[..],
        b"over tls"
    );

    let without_ca = NatsConnect {
        ca_file: None,
        ..with_ca
    };
    assert!(
        without_ca.connect().await.is_err(),
        "a client that does not trust the test CA connected"
    );
    drop(client);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
