//! Exec: core-NATS request/reply on `{p}.exec.<host_id>`, each request in its own task,
//! forwarded to the sandbox's agent.

use std::sync::Arc;

use async_nats::Client;
use berth_schemas::wire::{self, ExecError, ExecReply, ExecRequest};
use berth_schemas::Subjects;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::agent::client::{self, ExecResult};
use crate::error::HostdError;
use crate::host::Host;

/// Serves exec requests until `shutdown`.
///
/// Errors: [`HostdError::Nats`] when the subscription cannot be made.
pub async fn serve(
    host: Arc<Host>,
    nats: Client,
    subjects: Subjects,
    shutdown: CancellationToken,
) -> Result<(), HostdError> {
    let subject = subjects.exec(host.host_id);
    let client = nats.clone();
    crate::requests::serve(
        &nats,
        subject,
        "subscribe to exec requests",
        shutdown,
        |message, reply_to| answer(host.clone(), client.clone(), message, reply_to),
    )
    .await
}

async fn answer(
    host: Arc<Host>,
    nats: Client,
    message: async_nats::Message,
    reply_to: async_nats::Subject,
) {
    let reply = match wire::decode::<ExecRequest>(&message.payload) {
        Ok(request) => {
            let span = tracing::info_span!(
                "exec",
                host_id = %host.host_id,
                sandbox_id = %request.sandbox_id,
            );
            run(&host, request).instrument(span).await
        }
        Err(e) => ExecReply::Failed(ExecError::Agent(format!("malformed exec request: {e}"))),
    };
    if let Err(e) = nats.publish(reply_to, wire::encode(&reply).into()).await {
        tracing::warn!(error = %e, "exec reply not sent");
    }
}

/// Runs one request against the sandbox's agent.
pub async fn run(host: &Host, request: ExecRequest) -> ExecReply {
    let (address, _permit) = match host.exec_target(request.sandbox_id) {
        Ok(a) => a,
        Err(e) => return ExecReply::Failed(e),
    };
    if host.runtimes.simulated() {
        return crate::runtime::sim::exec(&request);
    }
    match client::exec(address, request.argv, request.timeout_ms).await {
        Ok(ExecResult::Finished(out)) => {
            tracing::debug!(
                exit_code = out.exit_code,
                timed_out = out.timed_out,
                "exec finished"
            );
            ExecReply::Finished {
                exit_code: out.exit_code,
                stdout: out.stdout,
                stderr: out.stderr,
                timed_out: out.timed_out,
            }
        }
        Ok(ExecResult::Refused(reason)) => ExecReply::Failed(ExecError::Agent(reason)),
        Err(e) => ExecReply::Failed(ExecError::Agent(e.report())),
    }
}
