//! `berth-hostd`: the host daemon. It owns everything sandbox-shaped on one machine: it
//! consumes the host's commands from JetStream, runs sandboxes in an OCI runtime (runc, or
//! runsc = gVisor whose stop keeps memory) with an overlay root filesystem and a network
//! namespace each, isolates them with nftables, answers exec and file requests through the
//! in-sandbox agent, and publishes heartbeats.
//!
//! Entry points: [`run`] (the daemon), [`host_id`], [`ensure_streams`], [`agent::main`] (the
//! in-sandbox agent, `berth agent`), [`template::build_cached`] and [`template::import_rootfs`]
//! (`berth template build|import`).
//!
//! # Layout: by use case
//! - [`nats`]: the NATS faces. [`nats::commands`] consumes commands (ordering per sandbox,
//!   publish-then-ack, `traceparent` continued onto results); [`nats::agent`] answers exec
//!   and file requests; [`nats::heartbeat`] publishes heartbeats.
//! - [`apply`]: one file per use case, applying a command at most once (with [`fence`]):
//!   [`apply::up`] (create and start), [`apply::stop`], [`apply::delete`].
//! - [`host`]: what this hostd holds (records, addresses, runtimes, agent gates) and the
//!   [`host::Backend`] trait: everything a real host and a sim host do differently.
//! - [`backend`]: its implementations, [`backend::oci`] (runc/runsc, netns, overlay,
//!   nftables, cgroups, the agent) and [`backend::sim`] (control-plane load only).
//! - [`fault`]: crash points for the crash tests (compiled in only with the
//!   `fault-injection` feature).
//! - [`adopt`]: at start, adopts what a previous run left and sweeps strays (OCI only).
//! - [`runtime`]: the runtime driver trait, runc, runsc and the sim driver.
//! - [`netns`], [`firewall`], [`overlay`], [`disk`], [`template`], [`bundle`], [`oci`],
//!   [`seccomp`], [`isolation`] (the user namespace of runc sandboxes),
//!   [`address`], [`cgroup`], [`gate`], [`cleanup`], [`record`], [`layout`]: the pieces.
//! - [`agent`]: the in-sandbox agent and hostd's client of it.
//!
//! # Guarantees
//! See DESIGN.md guarantees 2 (at most once per command id + generation), 5 (no container
//! that no record accounts for) and 6 (a memory restore keeps processes and open files; a
//! disk-only stop keeps files only); each module's docs say how it keeps them.
//!
//! # Assumptions
//! hostd runs as root in the root network namespace with runc (and runsc, optionally), `cp`,
//! iproute2, nftables, util-linux's `unshare` and a static busybox at `/bin/busybox`. Several
//! hostd may share one machine if their state dirs and address pools differ.

pub mod address;
pub mod adopt;
pub mod agent;
pub mod apply;
pub mod backend;
pub mod bundle;
pub mod cgroup;
pub mod cleanup;
pub mod console;
pub mod disk;
pub mod error;
pub mod fault;
pub mod fence;
pub mod firewall;
pub mod forwarder;
pub mod gate;
pub mod host;
pub mod image;
pub mod isolation;
pub mod keeper;
pub mod layout;
pub mod metrics;
pub mod nats;
pub mod netns;
pub mod oci;
pub mod overlay;
pub mod record;
pub mod runtime;
pub mod seccomp;
pub mod template;
pub mod tool;
pub mod volume;
pub mod warm;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use berth_schemas::wire::Resources;
use berth_schemas::{HostId, Subjects};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use error::HostdError;
pub use nats::heartbeat::DEFAULT_HEARTBEAT_INTERVAL;

use crate::backend::oci::OciBackend;
use crate::backend::sim::SimBackend;
use crate::host::{Backend, Host};
use crate::layout::StateLayout;
use crate::nats::{commands, heartbeat};
use crate::runtime::runc::{Runc, RUNC};
use crate::runtime::runsc::{Runsc, RUNSC};
use crate::runtime::sim::{Sim, SIM};
use crate::runtime::{RuntimeDriver, Runtimes};

/// The default address pool: sandboxes get /30s out of 10.200.0.0/16.
pub const DEFAULT_ADDRESS_POOL: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 0);

/// The default runtime.
pub const DEFAULT_RUNTIME: &str = RUNC;

/// The runtimes a host offers by default: runc, and runsc when it is installed.
pub fn default_runtimes() -> Vec<String> {
    let mut runtimes = vec![RUNC.to_owned()];
    if Runsc::available() {
        runtimes.push(RUNSC.to_owned());
    }
    runtimes
}

/// Where the host's memory size is read from.
const MEMINFO: &str = "/proc/meminfo";

/// Configuration of one hostd.
#[derive(Debug, Clone)]
pub struct HostdConfig {
    /// NATS server URL (`nats://127.0.0.1:4222`, `tls://…`).
    pub nats_url: String,
    /// This host's NATS credentials (`berth admin add-host`); `None` connects anonymously
    /// (an open NATS). With credentials, the host id is the one they were issued for (see
    /// [`run`]) and hostd only looks the streams up (its permissions cannot create them).
    pub nats_creds: Option<berth_schemas::nats_auth::Creds>,
    /// The CA file that signed the NATS server's certificate; set, TLS is required.
    pub nats_ca: Option<PathBuf>,
    /// Subject and stream names (carries the prefix).
    pub subjects: Subjects,
    /// Everything this hostd owns lives below it (see [`layout`]).
    pub state_dir: PathBuf,
    /// Human-readable name for heartbeats.
    pub name: String,
    /// What the host offers to sandboxes (whole vCPUs, MiB).
    pub capacity: Resources,
    /// Interval between heartbeats; default [`DEFAULT_HEARTBEAT_INTERVAL`].
    pub heartbeat_interval: Duration,
    /// Base of a /16; each sandbox gets a /30 from it. Default [`DEFAULT_ADDRESS_POOL`].
    /// Two hostd on one machine need disjoint pools.
    pub address_pool: Ipv4Addr,
    /// The `berth` binary containing `berth agent`, copied into every sandbox, and `berth
    /// console-log`, which writes each container's console beside it. Default: the running
    /// executable.
    pub agent_binary: PathBuf,
    /// The cap of one console log file of a sandbox, in bytes (one rotated file is kept);
    /// default [`console::DEFAULT_CONSOLE_LOG_MAX_BYTES`].
    pub console_log_max_bytes: u64,
    /// The OCI runtimes this host offers (`runc`, `runsc`); default [`default_runtimes`].
    /// Each template names the runtime its sandboxes need.
    pub runtimes: Vec<String>,
    /// Where expensive templates (`python`) are built once for every hostd of the machine.
    /// Default [`template::DEFAULT_TEMPLATE_CACHE`].
    pub template_cache: PathBuf,
    /// How long a `sim` runtime's container takes to "boot" (only read when `runtimes`
    /// holds `sim`); default [`runtime::sim::DEFAULT_SIM_BOOT`].
    pub sim_boot: Duration,
    /// IPv4 networks every sandbox with public egress may reach although they lie in a
    /// range public egress refuses (`berth_schemas::network::BLOCKED_V4`): the resolver of
    /// a cloud network at a private address, say. Default: none.
    pub sandbox_egress_allow: Vec<berth_schemas::network::Ipv4Net>,
    /// The preview port forwarder (see [`forwarder`]); `None`: this host runs none, and its
    /// sandboxes have no preview URLs. Default: none.
    pub forwarder: Option<forwarder::ForwarderConfig>,
    /// Where snapshots are stored (`berth_storage`): `BERTH_OBJECT_STORE`, else a local store
    /// at `<state dir>/objects`. Hosts that clone each other's snapshots share one store.
    pub object_store: berth_storage::StoreSettings,
    /// The bound of this host's cache of snapshot chunks, bytes (`<state dir>/chunk-cache`).
    pub chunk_cache_bytes: u64,
    /// How many sandboxes to keep booted ahead per template ([`warm`]). Default: none.
    pub warm_pool: warm::WarmConfig,
}

impl HostdConfig {
    /// A config with defaults for everything but the four arguments; capacity is the
    /// machine's CPU count and memory size.
    pub fn new(
        nats_url: impl Into<String>,
        subjects: Subjects,
        state_dir: impl Into<PathBuf>,
        name: impl Into<String>,
    ) -> Self {
        let state_dir: PathBuf = state_dir.into();
        Self {
            nats_url: nats_url.into(),
            nats_creds: None,
            nats_ca: None,
            subjects,
            state_dir: state_dir.clone(),
            name: name.into(),
            capacity: machine_capacity(),
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            address_pool: DEFAULT_ADDRESS_POOL,
            agent_binary: std::env::current_exe()
                .unwrap_or_else(|_| PathBuf::from("/proc/self/exe")),
            console_log_max_bytes: console::DEFAULT_CONSOLE_LOG_MAX_BYTES,
            runtimes: default_runtimes(),
            template_cache: PathBuf::from(template::DEFAULT_TEMPLATE_CACHE),
            sim_boot: runtime::sim::DEFAULT_SIM_BOOT,
            sandbox_egress_allow: Vec::new(),
            forwarder: None,
            object_store: berth_storage::StoreSettings::new(
                berth_storage::Location::default_under(&state_dir),
            ),
            chunk_cache_bytes: berth_storage::cache::DEFAULT_CACHE_BYTES,
            warm_pool: warm::WarmConfig::default(),
        }
    }
}

/// Runs hostd until `shutdown` is cancelled: stable host id, streams, adoption of what a
/// previous run left, then the command consumer, the agent request server and heartbeats.
///
/// With host credentials (`config.nats_creds`), the host id is theirs: a state dir without a
/// `host-id` takes it, one with another id is refused ([`HostdError::HostIdMismatch`]).
///
/// Sandboxes keep running when hostd stops; the next run adopts them.
///
/// Errors: [`HostdError::UnsupportedRuntime`]; [`HostdError::Nats`] when NATS is unreachable,
/// refuses the credentials, or the streams cannot be made; [`HostdError::Io`] for the state
/// dir; [`HostdError::HostIdMismatch`].
pub async fn run(config: HostdConfig, shutdown: CancellationToken) -> Result<(), HostdError> {
    let host_id = match config.nats_creds.as_ref().map(|c| c.role) {
        Some(berth_schemas::nats_auth::Role::Host(id)) => adopt_host_id(&config.state_dir, id)?,
        _ => host_id(&config.state_dir)?,
    };
    if config.runtimes.iter().any(|r| r == RUNC) {
        isolation::check_searchable(&config.state_dir)?;
    }
    let span = tracing::info_span!("hostd", %host_id, name = %config.name);
    run_as(host_id, config, shutdown).instrument(span).await
}

async fn run_as(
    host_id: HostId,
    config: HostdConfig,
    shutdown: CancellationToken,
) -> Result<(), HostdError> {
    let (runtimes, backend) = backend_for(host_id, &config)?;
    let connect = berth_schemas::nats_auth::NatsConnect {
        url: config.nats_url.clone(),
        creds: config.nats_creds.clone(),
        ca_file: config.nats_ca.clone(),
    };
    let nats = connect
        .connect()
        .await
        .map_err(HostdError::nats("connect"))?;
    let js = async_nats::jetstream::new(nats.clone());
    if config.nats_creds.is_some() {
        // A host's permissions only let it look its command stream up; the control plane
        // makes the streams.
        wait_for_command_stream(&js, &config.subjects, &shutdown).await?;
    } else {
        ensure_streams(&js, &config.subjects).await?;
    }

    let host = Arc::new(Host::open(host_id, &config, runtimes, backend)?);
    host.backend.adopt(&host).await?;
    let records = host.snapshot();
    if records.iter().any(|r| r.warm) {
        let containers = host.containers().await?;
        host.warm.adopt(&records, |record| {
            containers.get(&host.names(record.sandbox_id).container_id)
                == Some(&runtime::ContainerStatus::Running)
        });
    }
    tracing::info!(%host_id, name = %config.name, state_dir = %config.state_dir.display(), "hostd started");

    // Stop the siblings when one part fails for good.
    let stop = shutdown.child_token();
    let (forwarding, forwarder_address) = match &config.forwarder {
        Some(f) => {
            let (listener, advertise) = forwarder::bind(f).await?;
            let task = tokio::spawn(forwarder::serve(
                host.clone(),
                listener,
                f.key,
                stop.clone(),
            ));
            (Some(task), Some(advertise.to_string()))
        }
        None => (None, None),
    };
    let heartbeats = tokio::spawn(heartbeat::run(
        host.clone(),
        nats.clone(),
        heartbeat::HeartbeatConfig {
            subject: config.subjects.heartbeat(host_id),
            name: config.name.clone(),
            capacity: config.capacity,
            interval: config.heartbeat_interval,
            forwarder: forwarder_address,
        },
        stop.clone(),
    ));
    let agent_ops = tokio::spawn(nats::agent::serve(
        host.clone(),
        nats.clone(),
        config.subjects.clone(),
        stop.clone(),
    ));
    let sweeper = tokio::spawn(host::sweep_cache_every(
        host.clone(),
        host::CACHE_SWEEP_INTERVAL,
        stop.clone(),
    ));
    let pool_filler = tokio::spawn(warm::fill(host.clone(), stop.clone()));
    let holder = host.clone();
    let consumed = commands::consume(host, js, config.subjects.clone(), stop.clone()).await;
    stop.cancel();
    let agent_ops = agent_ops.await.map_err(|e| HostdError::Io {
        context: "agent request task".into(),
        source: std::io::Error::other(e),
    })?;
    let _ = heartbeats.await;
    let _ = sweeper.await;
    let _ = pool_filler.await;
    warm::empty(&holder).await;
    if let Some(task) = forwarding {
        let _ = task.await;
    }
    // A server that no longer lets this host in (its key removed) never answers a flush.
    match tokio::time::timeout(SHUTDOWN_FLUSH_TIMEOUT, nats.flush()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "flush at shutdown failed"),
        Err(_) => tracing::warn!(timeout = ?SHUTDOWN_FLUSH_TIMEOUT, "NATS not flushed at shutdown"),
    }
    holder.backend.shut_down(&holder).await;
    tracing::info!(%host_id, "hostd stopped");
    consumed.and(agent_ops)
}

/// The runtimes and backend `config` asks for: `sim` is chosen explicitly and then is the
/// only runtime, on the sim backend (control-plane load tests); otherwise the OCI backend
/// with each named OCI runtime.
///
/// Errors: [`HostdError::UnsupportedRuntime`]; a runtime's own when its root can't be made.
fn backend_for(
    host_id: HostId,
    config: &HostdConfig,
) -> Result<(Runtimes, Arc<dyn Backend>), HostdError> {
    if config.runtimes.iter().any(|r| r == SIM) {
        let sim: Arc<dyn RuntimeDriver> = Arc::new(Sim::new(config.sim_boot));
        return Ok((Runtimes::catch_all(sim), Arc::new(SimBackend)));
    }
    let layout = StateLayout::new(&config.state_dir);
    let console = runtime::cli::ConsoleConfig {
        berth: config.agent_binary.clone(),
        max_bytes: config.console_log_max_bytes,
    };
    let mut drivers: Vec<Arc<dyn RuntimeDriver>> = Vec::new();
    for name in &config.runtimes {
        drivers.push(match name.as_str() {
            RUNC => Arc::new(Runc::new(layout.runc_root(), console.clone())?),
            RUNSC => Arc::new(Runsc::new(layout.runsc_root(), true, console.clone())?),
            other => {
                return Err(HostdError::UnsupportedRuntime {
                    name: other.to_owned(),
                    offered: format!("{RUNC}, {RUNSC}, {SIM}"),
                })
            }
        });
    }
    Ok((
        Runtimes::new(drivers),
        Arc::new(OciBackend::new(host_id, config)),
    ))
}

/// How long hostd waits at shutdown for NATS to take what it still buffers.
const SHUTDOWN_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// How often hostd looks for the command stream the control plane has not made yet.
const STREAM_LOOKUP_INTERVAL: Duration = Duration::from_secs(1);

/// Waits until the command stream exists (the control plane creates it), or `shutdown`.
///
/// Errors: [`HostdError::Nats`] when cancelled before it exists.
async fn wait_for_command_stream(
    js: &async_nats::jetstream::Context,
    subjects: &Subjects,
    shutdown: &CancellationToken,
) -> Result<(), HostdError> {
    loop {
        match js.get_stream(subjects.cmd_stream()).await {
            Ok(_) => return Ok(()),
            Err(e) => {
                tracing::info!(error = %e, stream = %subjects.cmd_stream(), "waiting for the control plane's command stream");
                tokio::select! {
                    _ = shutdown.cancelled() => {
                        return Err(HostdError::nats("look up the command stream")(e));
                    }
                    _ = tokio::time::sleep(STREAM_LOOKUP_INTERVAL) => {}
                }
            }
        }
    }
}

/// The host id of a hostd whose NATS credentials were issued for `id`: writes it to
/// `<state_dir>/host-id` when there is none yet, and returns it.
///
/// Errors: [`HostdError::HostIdMismatch`] when the file names another host (the credentials
/// belong to another machine, or the state dir does); [`HostdError::Io`],
/// [`HostdError::HostIdFile`].
pub fn adopt_host_id(state_dir: &Path, id: HostId) -> Result<HostId, HostdError> {
    let found = create_host_id(state_dir, id)?;
    if found != id {
        return Err(HostdError::HostIdMismatch {
            path: StateLayout::new(state_dir).host_id_file(),
            state: found,
            creds: id,
        });
    }
    Ok(id)
}

/// The host's stable id: read from `<state_dir>/host-id`, or created there once.
///
/// Errors: [`HostdError::Io`]; [`HostdError::HostIdFile`] when the file holds something else.
pub fn host_id(state_dir: &Path) -> Result<HostId, HostdError> {
    create_host_id(state_dir, HostId::new())
}

/// The id in `<state_dir>/host-id`, or `new` written there when there is none.
fn create_host_id(state_dir: &Path, new: HostId) -> Result<HostId, HostdError> {
    let path = StateLayout::new(state_dir).host_id_file();
    let read = |path: &Path| -> Result<Option<HostId>, HostdError> {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                text.trim()
                    .parse::<HostId>()
                    .map(Some)
                    .map_err(|_| HostdError::HostIdFile {
                        path: path.to_path_buf(),
                        content: text.clone(),
                    })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(HostdError::io(format!("read {}", path.display()))(e)),
        }
    };
    if let Some(id) = read(&path)? {
        return Ok(id);
    }
    std::fs::create_dir_all(state_dir)
        .map_err(HostdError::io(format!("create {}", state_dir.display())))?;
    // Write a temporary file, then hard-link it into place: the link fails if another process
    // won the race, and the file is never seen half-written.
    let tmp = state_dir.join(format!(".host-id.{}", uuid::Uuid::new_v4().simple()));
    let id = new;
    std::fs::write(&tmp, format!("{id}\n"))
        .map_err(HostdError::io(format!("write {}", tmp.display())))?;
    let linked = std::fs::hard_link(&tmp, &path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(id),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            read(&path)?.ok_or_else(|| HostdError::HostIdFile {
                path: path.clone(),
                content: String::new(),
            })
        }
        Err(e) => Err(HostdError::io(format!("create {}", path.display()))(e)),
    }
}

/// Makes sure the command and result streams exist (idempotent; the api and reconciler call
/// the same definitions). The configs live in `berth_schemas::streams` so every component
/// creates them identically: file storage, work-queue retention, a duplicate window so a
/// re-published command (same `Nats-Msg-Id`) is dropped.
///
/// Errors: [`HostdError::Nats`].
pub async fn ensure_streams(
    js: &async_nats::jetstream::Context,
    subjects: &Subjects,
) -> Result<(), HostdError> {
    berth_schemas::streams::ensure_streams(js, subjects)
        .await
        .map_err(HostdError::nats("ensure streams"))
}

/// The machine's CPU count and memory size (MiB).
fn machine_capacity() -> Resources {
    let vcpus = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1);
    let memory_mib = std::fs::read_to_string(MEMINFO)
        .ok()
        .and_then(|t| meminfo_total_mib(&t))
        .unwrap_or(0);
    Resources { vcpus, memory_mib }
}

/// `MemTotal` of a `/proc/meminfo` text, in MiB.
fn meminfo_total_mib(meminfo: &str) -> Option<u32> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    u32::try_from(kib / 1024).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_total_is_read_in_mib() {
        let text = "MemTotal:       24683652 kB\nMemFree:        21987000 kB\n";
        assert_eq!(meminfo_total_mib(text), Some(24105));
        assert_eq!(meminfo_total_mib("nothing"), None);
    }

    #[test]
    fn the_host_id_is_created_once_and_read_afterwards() {
        let dir = std::env::temp_dir().join(format!("berth-hostid-{}", uuid::Uuid::new_v4()));
        let first = host_id(&dir).unwrap();
        assert_eq!(host_id(&dir).unwrap(), first);
        std::fs::write(dir.join("host-id"), "garbage").unwrap();
        assert!(matches!(host_id(&dir), Err(HostdError::HostIdFile { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_state_dir_takes_the_credentials_host_id_once_and_refuses_another() {
        let dir = std::env::temp_dir().join(format!("berth-hostid-{}", uuid::Uuid::new_v4()));
        let (a, b) = (HostId::new(), HostId::new());
        assert_eq!(adopt_host_id(&dir, a).unwrap(), a);
        assert_eq!(host_id(&dir).unwrap(), a);
        assert!(matches!(
            adopt_host_id(&dir, b),
            Err(HostdError::HostIdMismatch { state, creds, .. }) if state == a && creds == b
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn defaults_fill_everything_but_the_arguments() {
        let c = HostdConfig::new("nats://x", Subjects::default(), "/tmp/s", "h");
        assert_eq!(c.heartbeat_interval, DEFAULT_HEARTBEAT_INTERVAL);
        assert_eq!(c.runtimes[0], "runc");
        assert!(c.capacity.vcpus >= 1);
    }
}
