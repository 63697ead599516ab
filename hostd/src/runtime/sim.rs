//! The `sim` runtime: a timed no-op standing in for the OCI runtime, the network namespace and
//! the overlay disk, so one machine can run hundreds of hostd and load the control plane as
//! a fleet would (DESIGN.md, "Real parts, not mocks": only for control-plane load, never the
//! default, never in a correctness test).
//!
//! Everything above the runtime stays the real hostd code path: the command consumer, the
//! fence, the record store, results published through JetStream, heartbeats with an inventory,
//! exec over NATS. What is replaced:
//! - bring-up ([`bring_up`]): no template, agent bundle, netns, veth, nftables rule, overlay
//!   mount or container; an address is still reserved from the host's pool (in memory) and the
//!   record is written as usual, then the "container" runs after the configured boot delay;
//! - delete ([`delete`]): drops the sim container, the address and the sandbox dir only;
//! - heartbeats count a sim container that runs as answering (no agent ping);
//! - exec ([`exec`]) answers with a canned echo of argv, marked as sim on stderr.
//!
//! Stop uses the ordinary path: `status` and `destroy` come from this driver, and the unmount
//! there only reads the mount table (nothing was mounted).
//!
//! # Selection
//! Only explicitly: a hostd whose runtimes include [`SIM`] offers nothing else, and
//! [`super::Runtimes::get`] hands the sim driver out for every template's runtime name.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use berth_schemas::wire::{AgentFailure, AgentOp, AgentReply, Command, ExecReply, ExecRequest};
use futures::future::BoxFuture;
use futures::FutureExt;

use super::{ContainerStatus, RunRequest, RuntimeDriver};
use crate::error::HostdError;
use crate::host::Host;
use crate::record::{Phase, SandboxRecord};

/// The runtime's name.
pub const SIM: &str = "sim";

/// The default simulated boot time (what `run` waits before the container "runs").
pub const DEFAULT_SIM_BOOT: Duration = Duration::from_millis(0);

/// What every sim exec writes on stderr, so nobody mistakes its output for a real process's.
pub const SIM_EXEC_STDERR: &str = "berth sim runtime: nothing was executed\n";

/// The sim driver: containers are entries in a table.
#[derive(Debug, Default)]
pub struct Sim {
    boot: Duration,
    containers: Mutex<HashMap<String, ContainerStatus>>,
}

impl Sim {
    /// A driver whose `run` takes `boot`.
    pub fn new(boot: Duration) -> Self {
        Self {
            boot,
            containers: Mutex::new(HashMap::new()),
        }
    }

    fn table(&self) -> MutexGuard<'_, HashMap<String, ContainerStatus>> {
        // Entries are replaced whole, so a poisoned table is still consistent.
        self.containers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl RuntimeDriver for Sim {
    fn name(&self) -> &'static str {
        SIM
    }

    fn memory_snapshot(&self) -> bool {
        false
    }

    fn simulated(&self) -> bool {
        true
    }

    fn run<'a>(&'a self, req: RunRequest<'a>) -> BoxFuture<'a, Result<(), HostdError>> {
        async move {
            if !self.boot.is_zero() {
                tokio::time::sleep(self.boot).await;
            }
            self.table()
                .insert(req.container_id.to_owned(), ContainerStatus::Running);
            Ok(())
        }
        .boxed()
    }

    fn status<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<ContainerStatus>, HostdError>> {
        let status = self.table().get(container_id).copied();
        async move { Ok(status) }.boxed()
    }

    fn pid<'a>(&'a self, _container_id: &'a str) -> BoxFuture<'a, Result<Option<i64>, HostdError>> {
        async move { Ok(None) }.boxed()
    }

    fn list(&self) -> BoxFuture<'_, Result<HashMap<String, ContainerStatus>, HostdError>> {
        let all = self.table().clone();
        async move { Ok(all) }.boxed()
    }

    fn destroy<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>> {
        self.table().remove(container_id);
        async move { Ok(()) }.boxed()
    }
}

/// Bring-up on a sim host: reserve an address, write the record, "run" the container.
///
/// Errors: [`HostdError::AddressPoolExhausted`]; [`HostdError::Io`] from the record store.
pub(crate) async fn bring_up(
    host: &Arc<Host>,
    record: &mut SandboxRecord,
    runtime: &dyn RuntimeDriver,
) -> Result<Ipv4Addr, HostdError> {
    let id = record.sandbox_id;
    record.runtime = SIM.to_owned();
    let link = match record.link {
        Some(link) => {
            host.allocator.restore(id, link);
            link
        }
        None => host.allocator.reserve(id, &Default::default())?,
    };
    record.link = Some(link);
    host.put(record)?;
    host.store.unbury(id)?;
    let container_id = host.names(id).container_id;
    if runtime.status(&container_id).await? != Some(ContainerStatus::Running) {
        let paths = host.layout.sandbox(id);
        let console_log = paths.console_log();
        runtime
            .run(RunRequest {
                container_id: &container_id,
                bundle: paths.dir(),
                console_log: &console_log,
            })
            .await?;
    }
    Ok(link.sandbox)
}

/// Delete on a sim host: drop the container, the address and the sandbox dir; a tombstone.
///
/// Errors: [`HostdError::Io`] when the sandbox dir cannot be removed.
pub(crate) async fn delete(
    host: &Host,
    cmd: &Command,
    record: Option<SandboxRecord>,
) -> Result<SandboxRecord, HostdError> {
    let id = cmd.sandbox_id;
    let container_id = host.names(id).container_id;
    for runtime in host.runtimes.all() {
        runtime.destroy(&container_id).await?;
    }
    host.allocator.release(id);
    let paths = host.layout.sandbox(id);
    match tokio::fs::remove_dir_all(paths.dir()).await {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(HostdError::io(format!("remove {}", paths.dir().display()))(
                e,
            ));
        }
        _ => {}
    }
    let mut tombstone =
        record.unwrap_or_else(|| SandboxRecord::new(id, cmd.spec.clone(), SIM, cmd.generation));
    tombstone.phase = Phase::Deleted;
    tombstone.link = None;
    Ok(tombstone)
}

/// The canned stdout of a sim exec: argv after the program, joined by spaces, plus a newline
/// (what `echo` would print for `["echo", …]`).
fn echo(argv: &[String]) -> Vec<u8> {
    format!("{}\n", argv.get(1..).unwrap_or_default().join(" ")).into_bytes()
}

/// A sim exec (`{p}.exec`): exit 0, stdout [`echo`] of argv, stderr [`SIM_EXEC_STDERR`].
pub fn exec(request: &ExecRequest) -> ExecReply {
    ExecReply::Finished {
        exit_code: 0,
        stdout: echo(&request.argv),
        stderr: SIM_EXEC_STDERR.as_bytes().to_vec(),
        timed_out: false,
    }
}

/// A sim agent operation (`{p}.agent`): exec as [`exec`]; file operations fail, since a sim
/// sandbox has no filesystem.
pub fn agent(op: &AgentOp) -> AgentReply {
    match op {
        AgentOp::Exec(spec) | AgentOp::ExecStream(spec) => AgentReply::Exec {
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
    use berth_schemas::SandboxId;

    #[tokio::test]
    async fn a_sim_container_runs_after_its_boot_delay_and_is_gone_after_destroy() {
        let sim = Sim::new(Duration::from_millis(20));
        let dir = std::path::Path::new("/nonexistent");
        sim.run(RunRequest {
            container_id: "c1",
            bundle: dir,
            console_log: dir,
        })
        .await
        .unwrap();
        assert_eq!(
            sim.status("c1").await.unwrap(),
            Some(ContainerStatus::Running)
        );
        assert_eq!(sim.list().await.unwrap().len(), 1);
        sim.destroy("c1").await.unwrap();
        sim.destroy("c1").await.unwrap();
        assert_eq!(sim.status("c1").await.unwrap(), None);
    }

    #[test]
    fn sim_exec_echoes_its_arguments_and_says_it_is_sim() {
        let reply = exec(&ExecRequest {
            sandbox_id: SandboxId::new(),
            argv: vec!["echo".into(), "hi".into(), "there".into()],
            timeout_ms: 1000,
        });
        let ExecReply::Finished { stdout, stderr, .. } = reply else {
            panic!("sim exec always finishes");
        };
        assert_eq!(stdout, b"hi there\n");
        assert_eq!(stderr, SIM_EXEC_STDERR.as_bytes());
    }

    #[test]
    fn every_runtime_name_resolves_to_the_sim_driver_on_a_sim_host() {
        let runtimes = super::super::Runtimes::new(vec![Arc::new(Sim::default())]);
        assert!(runtimes.simulated());
        assert_eq!(runtimes.get("runc").unwrap().name(), SIM);
        assert_eq!(runtimes.get("runsc").unwrap().name(), SIM);
    }
}
