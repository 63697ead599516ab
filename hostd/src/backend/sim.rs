//! The sim backend: a timed no-op standing in for the OCI runtime, the network namespace and
//! the overlay disk, so one machine can run hundreds of hostd and load the control plane as
//! a fleet would (DESIGN.md, "Real parts, not mocks": only for control-plane load, never the
//! default, never in a correctness test). Its runtime driver is [`crate::runtime::sim`].
//!
//! Everything above the backend stays the real hostd code path: the command consumer, the
//! fence, the record store, results published through JetStream, heartbeats with an inventory,
//! agent requests over NATS. What is replaced:
//! - adoption: nothing on the machine to adopt or sweep;
//! - bring-up: no template, agent bundle, netns, veth, nftables rule, overlay mount or
//!   container; an address is still reserved from the host's pool (in memory) and the record
//!   is written as usual, then the "container" runs after the configured boot delay;
//! - delete: no network or mount to tear down (the container, address and dir go as usual);
//! - heartbeats count a sim container that runs as answering (no agent ping);
//! - agent requests ([`agent`]): exec answers with a canned echo of argv, marked as sim on
//!   stderr; file operations fail.
//!
//! Stop uses the ordinary path: `status` and `destroy` come from the driver, and the unmount
//! there only reads the mount table (nothing was mounted).

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use berth_schemas::wire::{AgentFailure, AgentOp, AgentReply};
use berth_schemas::SandboxId;
use futures::future::BoxFuture;
use futures::FutureExt;

use crate::address::LinkAddresses;
use crate::cleanup::CleanupStack;
use crate::error::HostdError;
use crate::host::{Backend, Host, OutputSender};
use crate::record::SandboxRecord;
use crate::runtime::{ContainerStatus, RunRequest};

/// What every sim exec writes on stderr, so nobody mistakes its output for a real process's.
pub const SIM_EXEC_STDERR: &str = "berth sim runtime: nothing was executed\n";

/// The sim backend (stateless: its containers live in the sim driver).
#[derive(Debug, Default, Clone, Copy)]
pub struct SimBackend;

impl Backend for SimBackend {
    fn adopt<'a>(&'a self, _host: &'a Host) -> BoxFuture<'a, Result<(), HostdError>> {
        async { Ok(()) }.boxed()
    }

    /// Reserves an address, writes the record, "runs" the container.
    fn bring_up<'a>(
        &'a self,
        host: &'a Arc<Host>,
        record: &'a mut SandboxRecord,
        _fresh: bool,
        _cleanup: &'a mut CleanupStack,
    ) -> BoxFuture<'a, Result<Ipv4Addr, HostdError>> {
        async move {
            let id = record.sandbox_id;
            let runtime = host.runtime_of(record)?;
            let link = host
                .claim_address(record, async { Ok(BTreeSet::new()) })
                .await?;
            let container_id = host.names(id).container_id;
            if runtime.status(&container_id).await? != Some(ContainerStatus::Running) {
                let paths = host.layout.sandbox(id);
                let console_log = paths.console_log();
                runtime
                    .run(RunRequest {
                        container_id: &container_id,
                        bundle: paths.dir(),
                        console_log: &console_log,
                        pid_file: &paths.init_pid(),
                    })
                    .await?;
            }
            Ok(link.sandbox)
        }
        .boxed()
    }

    fn tear_down<'a>(
        &'a self,
        _host: &'a Host,
        _sandbox: SandboxId,
        _record: Option<&'a SandboxRecord>,
    ) -> BoxFuture<'a, Result<(), HostdError>> {
        async { Ok(()) }.boxed()
    }

    /// A sim sandbox has no agent; running is answering.
    fn answers<'a>(
        &'a self,
        _host: &'a Host,
        _sandbox: SandboxId,
        _link: LinkAddresses,
    ) -> BoxFuture<'a, bool> {
        async { true }.boxed()
    }

    fn agent<'a>(
        &'a self,
        _host: &'a Host,
        _sandbox: SandboxId,
        _address: SocketAddr,
        op: AgentOp,
        _output: Option<OutputSender>,
    ) -> BoxFuture<'a, AgentReply> {
        let reply = agent(&op);
        async move { reply }.boxed()
    }

    fn shut_down<'a>(&'a self, _host: &'a Host) -> BoxFuture<'a, ()> {
        async {}.boxed()
    }
}

/// The canned stdout of a sim exec: argv after the program, joined by spaces, plus a newline
/// (what `echo` would print for `["echo", …]`).
fn echo(argv: &[String]) -> Vec<u8> {
    format!("{}\n", argv.get(1..).unwrap_or_default().join(" ")).into_bytes()
}

/// A sim agent operation: an exec exits 0 with stdout `echo` of argv and stderr
/// [`SIM_EXEC_STDERR`]; file operations fail, since a sim sandbox has no filesystem.
pub fn agent(op: &AgentOp) -> AgentReply {
    match op {
        AgentOp::Exec(spec)
        | AgentOp::ExecStream(spec)
        | AgentOp::ExecStreamWindowed { spec, .. } => AgentReply::Exec {
            exit_code: 0,
            stdout: echo(&spec.argv),
            stderr: SIM_EXEC_STDERR.as_bytes().to_vec(),
            timed_out: false,
            oom_killed: false,
        },
        _ => AgentReply::Failed(AgentFailure::Agent(
            "berth sim runtime: a sim sandbox has no files".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sim_exec_echoes_its_arguments_and_says_it_is_sim() {
        let reply = agent(&AgentOp::Exec(berth_schemas::wire::ExecSpec {
            argv: vec!["echo".into(), "hi".into(), "there".into()],
            env: vec![],
            cwd: None,
            stdin: vec![],
            timeout_ms: 1000,
        }));
        let AgentReply::Exec { stdout, stderr, .. } = reply else {
            panic!("sim exec always finishes");
        };
        assert_eq!(stdout, b"hi there\n");
        assert_eq!(stderr, SIM_EXEC_STDERR.as_bytes());
    }
}
