//! Agent requests: core-NATS request/reply on `{p}.agent.<host_id>` ([`AgentRequest`] →
//! [`AgentReply`]), each in its own task: exec with env, cwd and stdin (and OOM reporting),
//! and files (stat, read, write, list, rename), each carried out by the host's backend. A
//! streamed exec ([`AgentOp::ExecStream`]) answers with several messages on the reply
//! subject: its output as it arrives, then the exit; they are published in order from one
//! connection.
//!
//! The API never reaches a sandbox address: it asks the host, which holds the sandbox's
//! agent gate permit for the call's length (see `gate`).

use std::sync::Arc;

use async_nats::{Client, Message, Subject};
use berth_schemas::wire::{self, AgentFailure, AgentOp, AgentReply, AgentRequest};
use berth_schemas::Subjects;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::error::HostdError;
use crate::host::{Host, OutputSender};

/// Serves agent requests until `shutdown`, each in its own task; a message without a reply
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
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            next = requests.next() => match next {
                Some(message) => match message.reply.clone() {
                    Some(reply_to) => {
                        tokio::spawn(answer(host.clone(), nats.clone(), message, reply_to));
                    }
                    None => tracing::warn!("agent request without a reply subject; dropped"),
                },
                None => break,
            },
        }
    }
    let _ = requests.unsubscribe().await;
    Ok(())
}

/// Answers one request on `reply_to`.
async fn answer(host: Arc<Host>, nats: Client, message: Message, reply_to: Subject) {
    let reply = match wire::decode::<AgentRequest>(&message.payload) {
        Ok(request) => {
            let span = tracing::info_span!(
                "agent_op",
                host_id = %host.host_id,
                sandbox_id = %request.sandbox_id,
            );
            let output = match request.op {
                AgentOp::ExecStream(_) => Some(forward_output(nats.clone(), reply_to.clone())),
                _ => None,
            };
            match output {
                Some((sender, forwarder)) => {
                    let reply = run(&host, request, Some(sender)).instrument(span).await;
                    // Every chunk is out before the final message.
                    let _ = forwarder.await;
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

/// Carries out one request: the sandbox must run (its gate permit is held for the call's
/// length), then the backend answers it.
pub async fn run(host: &Host, request: AgentRequest, output: Option<OutputSender>) -> AgentReply {
    let sandbox = request.sandbox_id;
    let (address, _permit) = match host.exec_target(sandbox) {
        Ok(target) => target,
        Err(failure) => return AgentReply::Failed(failure),
    };
    host.backend
        .agent(host, sandbox, address, request.op, output)
        .await
}

/// A channel whose chunks a task publishes, in order, as [`AgentReply::Output`] to
/// `reply_to`; the task ends when every sender is dropped.
fn forward_output(nats: Client, reply_to: Subject) -> (OutputSender, tokio::task::JoinHandle<()>) {
    let (sender, mut chunks) = tokio::sync::mpsc::unbounded_channel::<(u8, Vec<u8>)>();
    let task = tokio::spawn(async move {
        while let Some((fd, data)) = chunks.recv().await {
            let message = wire::encode(&AgentReply::Output { fd, data });
            if let Err(e) = nats.publish(reply_to.clone(), message.into()).await {
                tracing::warn!(error = %e, "streamed output not sent");
            }
        }
    });
    (sender, task)
}
