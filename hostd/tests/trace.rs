//! The trace continues through hostd: a result carries a `traceparent` whose trace id is its
//! command's and whose parent id is hostd's own apply span (W3C Trace Context; see
//! `berth_schemas::trace`). Runs a `sim` hostd (no root needed) against the real NATS
//! JetStream, with a unique subject prefix whose streams are deleted afterwards, also when
//! the test fails.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use async_nats::HeaderMap;
use berth_hostd::runtime::sim::SIM;
use berth_hostd::HostdConfig;
use berth_schemas::trace::{TraceParent, TRACEPARENT};
use berth_schemas::wire::{self, Command, CommandResult, Resources, Runtime, SandboxSpec};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, OrgId, SandboxId, Subjects};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

/// How long a result may take to arrive.
const RESULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The parent id the test's "relay" span publishes with.
const RELAY_SPAN: [u8; 8] = [0xab; 8];

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

#[tokio::test]
async fn a_result_continues_its_commands_trace_with_hostds_span_as_parent() {
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let subjects = Subjects::new(&format!("t{tag}")).unwrap();
    let state_dir = PathBuf::from(format!("/var/tmp/berth-hostd-trace-{tag}"));
    let nats = async_nats::connect(nats_url()).await.unwrap();
    let js = jetstream::new(nats.clone());
    berth_hostd::ensure_streams(&js, &subjects).await.unwrap();
    let shutdown = CancellationToken::new();

    // The body runs in its own task so that cleanup below runs even when it panics.
    let body = tokio::spawn(exercise(
        js.clone(),
        subjects.clone(),
        state_dir.clone(),
        shutdown.clone(),
    ));
    let outcome = body.await;

    shutdown.cancel();
    let _ = js.delete_stream(subjects.cmd_stream()).await;
    let _ = js.delete_stream(subjects.result_stream()).await;
    let _ = std::fs::remove_dir_all(&state_dir);
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// Runs a sim hostd, sends a create with a `traceparent` and a delete without one, and checks
/// the trace each result carries.
async fn exercise(
    js: jetstream::Context,
    subjects: Subjects,
    state_dir: PathBuf,
    shutdown: CancellationToken,
) {
    let mut config = HostdConfig::new(nats_url(), subjects.clone(), &state_dir, "trace-host");
    config.runtimes = vec![SIM.to_owned()];
    let host_id = berth_hostd::host_id(&state_dir).unwrap();
    let mut results = js
        .get_stream(subjects.result_stream())
        .await
        .unwrap()
        .create_consumer(pull::Config {
            filter_subject: subjects.result(host_id),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap()
        .messages()
        .await
        .unwrap();
    let hostd = tokio::spawn(berth_hostd::run(config, shutdown.clone()));

    let sandbox = SandboxId::new();
    let create = command(sandbox, CommandKind::Create, Generation(1));
    let sent = TraceParent::for_command(create.id, RELAY_SPAN);
    publish(&js, &subjects, host_id, &create, Some(&sent)).await;
    let (result, trace) = next_result(&mut results).await;
    assert_eq!(result.command_id, create.id);
    let trace = trace.expect("the create's result carries a traceparent");
    assert_eq!(trace.trace_id, sent.trace_id, "same trace as the command");
    assert_ne!(trace.parent_id, RELAY_SPAN, "the parent is hostd's span");
    assert_ne!(trace.parent_id, [0; 8]);

    // Without a header the trace is still the command's (its id is the trace id).
    let delete = command(sandbox, CommandKind::Delete, Generation(2));
    publish(&js, &subjects, host_id, &delete, None).await;
    let (result, trace) = next_result(&mut results).await;
    assert_eq!(result.command_id, delete.id);
    let trace = trace.expect("the delete's result carries a traceparent");
    assert_eq!(trace.trace_id, *delete.id.as_uuid().as_bytes());

    shutdown.cancel();
    hostd.await.unwrap().unwrap();
}

fn command(sandbox: SandboxId, kind: CommandKind, generation: Generation) -> Command {
    Command {
        snapshot: None,
        id: CommandId::new(),
        sandbox_id: sandbox,
        generation,
        kind,
        spec: Some(SandboxSpec {
            org_id: OrgId::new(),
            template: "base".into(),
            resources: Resources {
                vcpus: 1,
                memory_mib: 256,
            },
            runtime: Runtime::Runc,
            disk_mib: 64,
            network: Default::default(),
            env: Vec::new(),
            entrypoint: Vec::new(),
            image: None,
        }),
    }
}

/// Publishes `cmd` on the host's command subject as the relay does, with `trace` as its
/// `traceparent` when given.
async fn publish(
    js: &jetstream::Context,
    subjects: &Subjects,
    host: HostId,
    cmd: &Command,
    trace: Option<&TraceParent>,
) {
    let mut headers = HeaderMap::new();
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        cmd.id.to_string().as_str(),
    );
    if let Some(trace) = trace {
        headers.insert(TRACEPARENT, trace.to_header().as_str());
    }
    js.publish_with_headers(subjects.cmd(host), headers, wire::encode(cmd).into())
        .await
        .unwrap()
        .await
        .unwrap();
}

/// The next result and the `traceparent` it carries.
async fn next_result(results: &mut pull::Stream) -> (CommandResult, Option<TraceParent>) {
    let message = tokio::time::timeout(RESULT_TIMEOUT, results.next())
        .await
        .expect("a result within the timeout")
        .expect("the result stream is open")
        .unwrap();
    message.ack().await.unwrap();
    let trace = message
        .headers
        .as_ref()
        .and_then(|h| h.get(TRACEPARENT))
        .and_then(|v| TraceParent::parse(v.as_str()));
    (wire::decode(&message.payload).unwrap(), trace)
}
