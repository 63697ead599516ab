//! Agent requests: core-NATS request/reply on `{p}.agent.<host_id>` ([`AgentRequest`] →
//! [`AgentReply`]), each in its own task: exec with env, cwd and stdin (and OOM reporting),
//! and files (stat, read, write, list, rename), each carried out by the host's backend. A
//! streamed exec ([`AgentOp::ExecStream`]) answers with several messages on the reply
//! subject: its output as it arrives, then the exit; they are published in order from one
//! connection.
//!
//! # Flow control
//! A windowed stream ([`AgentOp::ExecStreamWindowed`]) publishes at most `window` output
//! messages beyond the credits its requester sent back ([`AgentOp::StreamCredit`], on the
//! same subject without a reply subject, naming the stream by its reply subject). Without
//! credit the forwarder waits, the bounded output channel fills, hostd stops reading the
//! agent, and the process blocks on its full pipe: memory stays bounded on both sides. A
//! stream that gets no credit for [`STREAM_STALL_TIMEOUT`], or whose requester cancels it
//! ([`AgentOp::StreamCancel`]), stops forwarding; its process runs on to its own timeout.
//!
//! # Terminal sessions
//! An [`AgentOp::Tty`] is a windowed stream whose process runs on a pseudo-terminal; while it
//! runs, its input arrives as [`AgentOp::TtyInput`] requests naming the session by its reply
//! subject. Each is queued on the session's channel of [`TTY_INPUT_QUEUE`] inputs and
//! answered [`AgentReply::Done`] only once queued, so a requester that waits for each answer
//! before sending the next (the API does) holds at most one input in flight: the queue is the
//! bound, and a terminal that takes no input stops the requester, not a buffer.
//!
//! The API never reaches a sandbox address: it asks the host, which holds the sandbox's
//! agent gate permit for the call's length (see `gate`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::{Client, Message, Subject};
use berth_schemas::wire::{self, AgentFailure, AgentOp, AgentReply, AgentRequest, TtyInput};
use berth_schemas::{SandboxId, Subjects};
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::error::HostdError;
use crate::host::{Host, OutputSender};

/// Output chunks hostd holds for one stream between the agent and NATS; while they are all
/// waiting, it stops reading the agent.
pub const OUTPUT_CHANNEL_CHUNKS: usize = 16;

/// How long a windowed stream's forwarder waits for credit before it gives the stream up.
pub const STREAM_STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the final reply of a stream waits for its forwarder to flush (it only waits for
/// credit or NATS); past that the forwarder is dropped and the final reply goes out.
pub const FORWARDER_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Inputs queued for one terminal session before hostd stops answering its requester.
pub const TTY_INPUT_QUEUE: usize = 4;

/// A terminal session's sandbox and input queue.
type TtyEntry = (SandboxId, mpsc::Sender<TtyInput>);

/// The terminal sessions in flight, by reply subject.
#[derive(Clone, Default)]
struct Ttys(Arc<Mutex<HashMap<String, TtyEntry>>>);

impl Ttys {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, TtyEntry>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The flow of one windowed stream: its credit and a way to end it.
#[derive(Clone)]
struct Flow {
    credit: Arc<Semaphore>,
    cancel: CancellationToken,
}

/// The windowed streams in flight, by reply subject.
#[derive(Clone, Default)]
struct Flows(Arc<Mutex<HashMap<String, Flow>>>);

impl Flows {
    fn open(&self, reply_to: &str, window: u32) -> Flow {
        let flow = Flow {
            credit: Arc::new(Semaphore::new(window.max(1) as usize)),
            cancel: CancellationToken::new(),
        };
        self.lock().insert(reply_to.to_owned(), flow.clone());
        flow
    }

    fn close(&self, reply_to: &str) {
        self.lock().remove(reply_to);
    }

    fn get(&self, reply_to: &str) -> Option<Flow> {
        self.lock().get(reply_to).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Flow>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Serves agent requests until `shutdown`, each in its own task; flow-control messages
/// (without a reply subject) are applied to their stream; any other message without a reply
/// subject is dropped with a warning.
///
/// Errors: [`HostdError::Nats`] when the subscription cannot be made.
pub async fn serve(
    host: Arc<Host>,
    nats: Client,
    subjects: Subjects,
    shutdown: CancellationToken,
) -> Result<(), HostdError> {
    let subject = subjects.agent(host.host_id);
    let mut requests = nats
        .subscribe(subject.clone())
        .await
        .map_err(HostdError::nats("subscribe to agent requests"))?;
    tracing::info!(%subject, "serving agent requests");
    let flows = Flows::default();
    let ttys = Ttys::default();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            next = requests.next() => match next {
                Some(message) => match message.reply.clone() {
                    Some(reply_to) => {
                        // A session's input queue exists before any later message on this
                        // subject is looked at: its first input may come right behind it.
                        let inputs = open_tty(&ttys, &message, &reply_to);
                        tokio::spawn(answer(
                            host.clone(),
                            nats.clone(),
                            (flows.clone(), ttys.clone()),
                            message,
                            (reply_to, inputs),
                        ));
                    }
                    None => control(&flows, &ttys, &message),
                },
                None => break,
            },
        }
    }
    let _ = requests.unsubscribe().await;
    Ok(())
}

/// For an [`AgentOp::Tty`] request, registers its session's input queue under its reply
/// subject and returns the queue's receiving end; `None` for any other message.
fn open_tty(
    ttys: &Ttys,
    message: &Message,
    reply_to: &Subject,
) -> Option<mpsc::Receiver<TtyInput>> {
    let request = wire::decode::<AgentRequest>(&message.payload).ok()?;
    if !matches!(request.op, AgentOp::Tty { .. }) {
        return None;
    }
    let (input, inputs) = mpsc::channel(TTY_INPUT_QUEUE);
    ttys.lock()
        .insert(reply_to.to_string(), (request.sandbox_id, input));
    Some(inputs)
}

/// Applies a flow-control message to its stream. A cancelled terminal session also loses its
/// input queue, which closes the agent connection's input side: the terminal is hung up.
fn control(flows: &Flows, ttys: &Ttys, message: &Message) {
    match wire::decode::<AgentRequest>(&message.payload).map(|r| r.op) {
        Ok(AgentOp::StreamCredit { reply_to, chunks }) => {
            if let Some(flow) = flows.get(&reply_to) {
                flow.credit.add_permits(chunks as usize);
            }
        }
        Ok(AgentOp::StreamCancel { reply_to }) => {
            if let Some(flow) = flows.get(&reply_to) {
                flow.cancel.cancel();
            }
            ttys.lock().remove(&reply_to);
        }
        _ => tracing::warn!("agent request without a reply subject; dropped"),
    }
}

/// Answers one request on `reply_to`.
async fn answer(
    host: Arc<Host>,
    nats: Client,
    (flows, ttys): (Flows, Ttys),
    message: Message,
    (reply_to, tty_inputs): (Subject, Option<mpsc::Receiver<TtyInput>>),
) {
    let reply = match wire::decode::<AgentRequest>(&message.payload) {
        Ok(AgentRequest {
            sandbox_id,
            op: AgentOp::TtyInput { reply_to, input },
        }) => tty_input(&ttys, sandbox_id, &reply_to, input).await,
        Ok(AgentRequest {
            sandbox_id,
            op: AgentOp::Tty { spec, size, window },
        }) => {
            let span = tracing::info_span!(
                "tty",
                host_id = %host.host_id,
                sandbox_id = %sandbox_id,
            );
            let flow = flows.open(reply_to.as_str(), window);
            let (sender, mut forwarder) =
                forward_output(nats.clone(), reply_to.clone(), Some(flow));
            let reply = async {
                let Some(inputs) = tty_inputs else {
                    return AgentReply::Failed(AgentFailure::Agent(
                        "the session's input queue is missing".into(),
                    ));
                };
                let (address, _permit) = match host.exec_target(sandbox_id) {
                    Ok(target) => target,
                    Err(failure) => return AgentReply::Failed(failure),
                };
                host.backend
                    .tty(&host, sandbox_id, address, spec, size, sender, inputs)
                    .await
            }
            .instrument(span)
            .await;
            ttys.lock().remove(reply_to.as_str());
            if tokio::time::timeout(FORWARDER_DRAIN_TIMEOUT, &mut forwarder)
                .await
                .is_err()
            {
                forwarder.abort();
            }
            flows.close(reply_to.as_str());
            reply
        }
        Ok(request) => {
            let span = tracing::info_span!(
                "agent_op",
                host_id = %host.host_id,
                sandbox_id = %request.sandbox_id,
            );
            let output = match &request.op {
                AgentOp::ExecStream(_) => {
                    Some(forward_output(nats.clone(), reply_to.clone(), None))
                }
                AgentOp::ExecStreamWindowed { window, .. } => {
                    let flow = flows.open(reply_to.as_str(), *window);
                    Some(forward_output(nats.clone(), reply_to.clone(), Some(flow)))
                }
                _ => None,
            };
            match output {
                Some((sender, mut forwarder)) => {
                    let reply = run(&host, request, Some(sender)).instrument(span).await;
                    // Every chunk is out before the final message, unless the forwarder is
                    // stuck waiting for credit that does not come.
                    if tokio::time::timeout(FORWARDER_DRAIN_TIMEOUT, &mut forwarder)
                        .await
                        .is_err()
                    {
                        forwarder.abort();
                    }
                    flows.close(reply_to.as_str());
                    reply
                }
                None => run(&host, request, None).instrument(span).await,
            }
        }
        Err(e) => AgentReply::Failed(AgentFailure::Agent(format!("malformed agent request: {e}"))),
    };
    if let Err(e) = nats.publish(reply_to, wire::encode(&reply).into()).await {
        tracing::warn!(error = %e, "agent reply not sent");
    }
}

/// Queues `input` for the terminal session `session` of `sandbox`: [`AgentReply::Done`] once
/// queued (waiting while the queue is full), `NotFound` when no such session runs there,
/// `TooLarge` for keystrokes over the agent's frame limit.
async fn tty_input(ttys: &Ttys, sandbox: SandboxId, session: &str, input: TtyInput) -> AgentReply {
    let limit = crate::agent::protocol::MAX_TTY_INPUT;
    if matches!(&input, TtyInput::Data(data) if data.len() > limit) {
        return AgentReply::Failed(AgentFailure::TooLarge {
            limit: limit as u64,
        });
    }
    let queue = match ttys.lock().get(session) {
        Some((owner, queue)) if *owner == sandbox => queue.clone(),
        _ => return AgentReply::Failed(AgentFailure::NotFound),
    };
    match queue.send(input).await {
        Ok(()) => AgentReply::Done,
        Err(_) => AgentReply::Failed(AgentFailure::NotFound),
    }
}

/// Carries out one request: the sandbox must run (its gate permit is held for the call's
/// length), then the backend answers it.
pub async fn run(host: &Host, request: AgentRequest, output: Option<OutputSender>) -> AgentReply {
    let sandbox = request.sandbox_id;
    let _busy = host.warm.busy();
    let (address, _permit) = match host.exec_target(sandbox) {
        Ok(target) => target,
        Err(failure) => return AgentReply::Failed(failure),
    };
    host.backend
        .agent(host, sandbox, address, request.op, output)
        .await
}

/// A bounded channel whose chunks a task publishes, in order, as [`AgentReply::Output`] to
/// `reply_to`, each after taking one credit of `flow` when there is one. The task ends when
/// every sender is dropped, when the flow is cancelled, or when it waited
/// [`STREAM_STALL_TIMEOUT`] for credit; it then drops the receiver, so the exec stops
/// reading the agent.
fn forward_output(
    nats: Client,
    reply_to: Subject,
    flow: Option<Flow>,
) -> (OutputSender, tokio::task::JoinHandle<()>) {
    let (sender, mut chunks) = tokio::sync::mpsc::channel::<(u8, Vec<u8>)>(OUTPUT_CHANNEL_CHUNKS);
    let task = tokio::spawn(async move {
        let cancelled = flow.as_ref().map(|f| f.cancel.clone()).unwrap_or_default();
        loop {
            let next = tokio::select! {
                _ = cancelled.cancelled() => {
                    tracing::info!("the requester cancelled the stream");
                    return;
                }
                next = chunks.recv() => next,
            };
            let Some((fd, data)) = next else { return };
            if let Some(flow) = &flow {
                let credit = tokio::select! {
                    _ = flow.cancel.cancelled() => return,
                    credit = tokio::time::timeout(STREAM_STALL_TIMEOUT, flow.credit.acquire()) => credit,
                };
                match credit {
                    Ok(Ok(permit)) => permit.forget(),
                    _ => {
                        tracing::warn!(
                            waited = ?STREAM_STALL_TIMEOUT,
                            "the requester stopped reading the stream; ended"
                        );
                        return;
                    }
                }
            }
            let message = wire::encode(&AgentReply::Output { fd, data });
            if let Err(e) = nats.publish(reply_to.clone(), message.into()).await {
                tracing::warn!(error = %e, "streamed output not sent");
            }
        }
    });
    (sender, task)
}
