//! `berth`: the one binary. Parses flags and calls each component's `run`; nothing else lives
//! here but `berth dev` (see [`dev`]).

mod admin_args;
mod bench;
mod cli;
mod config_doc;
mod dev;
mod limits_args;
mod nats_args;
mod preview_args;
use admin_args::AdminCmd;
pub(crate) use limits_args::DiskArgs;
use nats_args::{Conn, NatsArgs};

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context;
use berth_schemas::nats_auth::{NatsConnect, Role};
use berth_schemas::Subjects;
use clap::{Parser, Subcommand, ValueEnum};
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

/// Database connections per process.
const DB_POOL_SIZE: u32 = 16;

#[derive(Parser)]
#[command(
    name = "berth",
    version,
    about = "Berth: an open sandbox control plane"
)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, env = "BERTH_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    /// Log each span's duration when it closes (`time.busy`, `time.idle`): the profile of a
    /// path such as a create's API transaction, relay publish, hostd apply and result apply.
    #[arg(long, env = "BERTH_LOG_SPANS", global = true)]
    log_spans: bool,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

// Parsed once at start and consumed: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Serve the HTTP API and run the outbox relay.
    Api {
        #[command(flatten)]
        conn: Conn,
        /// Listen address.
        #[arg(long, env = "BERTH_API_ADDR", default_value = berth_api::DEFAULT_LISTEN)]
        listen: SocketAddr,
        /// Let webhooks deliver to loopback, private and link-local addresses (an on-premise
        /// receiver); refused by default.
        #[arg(long, env = "BERTH_WEBHOOK_ALLOW_PRIVATE_TARGETS")]
        webhook_allow_private_targets: bool,
        #[command(flatten)]
        disk: DiskArgs,
        #[command(flatten)]
        limits: limits_args::ApiLimitArgs,
        /// Serve Prometheus metrics (`GET /metrics`) on this address (keep it inside the
        /// operator's network); unset: not served there.
        #[arg(long, env = "BERTH_METRICS_ADDR")]
        metrics_addr: Option<SocketAddr>,
        /// Also answer `GET /metrics` on the API's own (public) listener; off by default, when
        /// it answers 404 like any unknown path.
        #[arg(long, env = "BERTH_METRICS_ON_API")]
        metrics_on_api: bool,
        /// Placement chooses only hosts heard from within this window.
        #[arg(long, env = "BERTH_HEARTBEAT_FRESHNESS",
              default_value_t = berth_scheduler::DEFAULT_HEARTBEAT_FRESHNESS.into())]
        heartbeat_freshness: humantime::Duration,
        #[command(flatten)]
        preview: preview_args::PreviewArgs,
        /// The template cache of this machine (hostd's `template_cache`): `POST /v1/templates`
        /// pulls images into its `oci/` dir, where this machine's hostd find them.
        #[arg(long, env = "BERTH_TEMPLATE_CACHE",
              default_value = berth_hostd::template::DEFAULT_TEMPLATE_CACHE)]
        template_cache: PathBuf,
        /// How often the collector tries the store-wide sweep of the object store's orphans
        /// (one API process runs it at a time).
        #[arg(long, env = "BERTH_OBJECT_SWEEP_EVERY",
              default_value_t = berth_api::sweep::DEFAULT_SWEEP_EVERY.into())]
        object_sweep_every: humantime::Duration,
        /// The sweep removes only manifests and chunks older than this that nothing names;
        /// keep it far above the longest an upload takes until its report is applied.
        #[arg(long, env = "BERTH_OBJECT_SWEEP_GRACE",
              default_value_t = berth_api::sweep::DEFAULT_SWEEP_GRACE.into())]
        object_sweep_grace: humantime::Duration,
    },
    /// Serve preview URLs: forward HTTP, WebSocket and SSE to a port inside a sandbox,
    /// through its host's forwarder, waking stopped sandboxes.
    Proxy {
        #[command(flatten)]
        conn: Conn,
        /// Listen address.
        #[arg(long, env = "BERTH_PROXY_ADDR", default_value = berth_api::preview::DEFAULT_PROXY_LISTEN)]
        listen: SocketAddr,
        #[command(flatten)]
        preview: preview_args::PreviewArgs,
        /// Connection caps and timeouts (the API's flags; the proxy applies the connection
        /// caps, the header-read timeout, which is also its idle timeout, and the key lookup
        /// rates).
        #[command(flatten)]
        limits: limits_args::ApiLimitArgs,
        /// Serve Prometheus metrics (`GET /metrics`) on this address; unset: not served.
        #[arg(long, env = "BERTH_METRICS_ADDR")]
        metrics_addr: Option<SocketAddr>,
    },
    /// Consume heartbeats and keep host rows current.
    Scheduler {
        #[command(flatten)]
        conn: Conn,
        /// Serve Prometheus metrics (`GET /metrics`) on this address; unset: not served.
        #[arg(long, env = "BERTH_METRICS_ADDR")]
        metrics_addr: Option<SocketAddr>,
    },
    /// Apply host results to sandbox rows.
    Reconciler {
        #[command(flatten)]
        conn: Conn,
        /// Serve Prometheus metrics (`GET /metrics`) on this address; unset: not served.
        #[arg(long, env = "BERTH_METRICS_ADDR")]
        metrics_addr: Option<SocketAddr>,
        #[command(flatten)]
        timing: berth::timing_args::ReconcilerTimingArgs,
    },
    /// Run the host daemon.
    Hostd {
        #[command(flatten)]
        nats: NatsArgs,
        /// Serve Prometheus metrics (`GET /metrics`) on this address; unset: not served.
        #[arg(long, env = "BERTH_METRICS_ADDR")]
        metrics_addr: Option<SocketAddr>,
        /// Everything this host owns lives below this directory.
        #[arg(
            long,
            env = "BERTH_HOSTD_STATE_DIR",
            default_value = "/var/lib/berth/hostd"
        )]
        state_dir: PathBuf,
        /// Human-readable host name.
        #[arg(long, env = "BERTH_HOST_NAME")]
        name: Option<String>,
        /// Base of the /16 sandbox addresses are taken from.
        #[arg(long, env = "BERTH_ADDRESS_POOL", default_value = "10.200.0.0")]
        address_pool: Ipv4Addr,
        /// IPv4 networks (CIDRs, comma-separated) that every sandbox with public egress may
        /// reach although they are private, link-local or otherwise refused: the resolver
        /// of a cloud network, say (`10.0.0.2/32`).
        #[arg(long, env = "BERTH_SANDBOX_EGRESS_ALLOW", value_delimiter = ',')]
        sandbox_egress_allow: Vec<berth_schemas::network::Ipv4Net>,
        /// Sandboxes to keep booted ahead per template, handed to creates of the same shape
        /// (`base=2,base-gvisor=1`; the shape is the newest create's). Default: none.
        #[arg(long, env = "BERTH_WARM_POOL", default_value = "")]
        warm_pool: berth_hostd::warm::WarmConfig,
        /// vCPUs offered to sandboxes (default: the machine's CPUs).
        #[arg(long, env = "BERTH_HOST_VCPUS")]
        vcpus: Option<u32>,
        /// Memory offered to sandboxes, in MiB (default: the machine's memory).
        #[arg(long, env = "BERTH_HOST_MEMORY_MIB")]
        memory_mib: Option<u32>,
        /// Runtimes to offer instead of the defaults (runc, and runsc when installed). `sim`
        /// is for control-plane load tests only: no containers, and it replaces every
        /// template's runtime.
        #[arg(long = "runtime", env = "BERTH_HOSTD_RUNTIMES", value_delimiter = ',')]
        runtimes: Vec<String>,
        /// How long a `sim` container takes to "boot", in milliseconds.
        #[arg(long, env = "BERTH_SIM_BOOT_MS", default_value_t = 0)]
        sim_boot_ms: u64,
        /// Time between two heartbeats (the API's `--heartbeat-freshness` and the
        /// reconciler's `--host-lost-after` must be comfortably longer).
        #[arg(long, env = "BERTH_HEARTBEAT_INTERVAL",
              default_value_t = berth_hostd::DEFAULT_HEARTBEAT_INTERVAL.into())]
        heartbeat_interval: humantime::Duration,
        #[command(flatten)]
        forwarder: preview_args::ForwarderArgs,
    },
    /// The in-sandbox agent (runs as PID 1 inside each sandbox).
    Agent {
        /// Where the agent listens inside the sandbox's network namespace.
        #[arg(long, default_value = "0.0.0.0:18047")]
        listen: SocketAddr,
    },
    /// Writes a sandbox's console (this process's stdin) to a log file capped at `max_bytes`,
    /// keeping one rotated file; hostd starts one beside each container.
    #[command(hide = true)]
    ConsoleLog {
        /// The log file; the rotated one is `<path>.1`.
        #[arg(long)]
        path: PathBuf,
        /// The cap of one file, in bytes.
        #[arg(long)]
        max_bytes: u64,
    },
    /// Runs a detached OCI runtime command and stays the parent of the container's processes,
    /// reaping them as they exit; hostd starts one per container run or restore.
    #[command(hide = true)]
    RuntimeKeeper {
        /// The runtime's argv.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        argv: Vec<std::ffi::OsString>,
    },
    /// API, scheduler, reconciler and N hostd in one process.
    Dev(dev::DevArgs),
    /// Measure lifecycle latency and throughput of a running stack against raw floors.
    Bench(bench::BenchArgs),
    /// Apply database migrations.
    Migrate {
        /// Postgres URL (`postgres://user:password@host:port/db`).
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
    },
    /// Sandboxes through the API, as a user (key from BERTH_API_KEY or `berth login`).
    Sandbox(cli::SandboxArgs),
    /// Save an API URL and key for the user commands (in a mode-0600 config file).
    Login(cli::LoginArgs),
    /// Print a shell completion script (`berth completions bash > /etc/bash_completion.d/berth`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Templates: `ls` and `pull` through the API (a user's); `build` and `import` on this machine (an
    /// operator's).
    Template {
        #[command(subcommand)]
        command: TemplateCmd,
    },
    /// Print reference documentation rendered from this binary (`docs config`: every flag and
    /// environment variable, the content of deploy/CONFIG.md).
    Docs {
        #[command(subcommand)]
        what: config_doc::DocsCmd,
    },
    /// Administrative tasks.
    Admin {
        /// Postgres URL (`postgres://user:password@host:port/db`).
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
        #[command(subcommand)]
        command: AdminCmd,
    },
}

#[derive(Subcommand)]
enum TemplateCmd {
    /// List the templates sandboxes can be created from (through the API, with a user's key).
    #[command(alias = "list")]
    Ls(cli::ApiArgs),
    /// Pull an OCI image into a template (through the API) and wait until it is ready.
    Pull(cli::TemplatePullArgs),
    /// Build a template into the machine-wide cache every hostd reads (idempotent).
    Build {
        /// The template (`python`).
        name: String,
        /// The cache dir (hostd's `template_cache`).
        #[arg(long, default_value = berth_hostd::template::DEFAULT_TEMPLATE_CACHE)]
        cache_dir: PathBuf,
    },
    /// Import a root filesystem tarball (`.tar` or `.tar.gz`) as a template into this
    /// machine's cache, and register it in the database when one is given. Run it on every
    /// host machine that should offer the template.
    Import {
        /// The template's name (a-z, 0-9, '-').
        name: String,
        /// The tarball of the root filesystem.
        tarball: PathBuf,
        /// The runtime its sandboxes run in: `runc` or `runsc`.
        #[arg(long, default_value = "runc")]
        runtime: String,
        /// What the template is, as `GET /v1/templates` shows it.
        #[arg(long, default_value = "")]
        description: String,
        /// The cache dir (hostd's `template_cache`).
        #[arg(long, default_value = berth_hostd::template::DEFAULT_TEMPLATE_CACHE)]
        cache_dir: PathBuf,
        /// Postgres to register the template in (unset: import on this machine only).
        #[arg(long, env = "DATABASE_URL")]
        database_url: Option<String>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The user's commands: their own errors and exit codes, no logs.
    let user = match cli.command {
        Cmd::Sandbox(args) => cli::UserCmd::Sandbox(args),
        Cmd::Login(args) => cli::UserCmd::Login(args),
        Cmd::Template {
            command: TemplateCmd::Ls(args),
        } => cli::UserCmd::TemplateLs(args),
        Cmd::Template {
            command: TemplateCmd::Pull(args),
        } => cli::UserCmd::TemplatePull(args),
        Cmd::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "berth", &mut std::io::stdout());
            return Ok(());
        }
        Cmd::Docs {
            what: config_doc::DocsCmd::Config,
        } => {
            use clap::CommandFactory;
            print!("{}", config_doc::render(&Cli::command()));
            return Ok(());
        }
        command => return run_component(Cli { command, ..cli }),
    };
    std::process::exit(cli::run(user));
}

/// Runs a component or an operator's command.
fn run_component(cli: Cli) -> anyhow::Result<()> {
    if let Cmd::Agent { listen } = cli.command {
        // The agent is std-only and forks first: no tokio runtime may exist yet.
        berth_hostd::agent::main(listen).context("agent")?;
        return Ok(());
    }
    if let Cmd::ConsoleLog { path, max_bytes } = &cli.command {
        // One per sandbox for its life: std only, no runtime, no threads.
        berth_hostd::console::copy_capped(&mut std::io::stdin().lock(), path, *max_bytes)
            .context("console log")?;
        return Ok(());
    }
    if let Cmd::RuntimeKeeper { argv } = &cli.command {
        // Forks: std only, no runtime, no threads.
        let code = berth_hostd::keeper::run(argv).context("runtime keeper")?;
        std::process::exit(code);
    }
    init_tracing(cli.log_format, cli.log_spans);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(cli.command))
}

fn init_tracing(format: LogFormat, spans: bool) {
    use tracing_subscriber::fmt::format::FmtSpan;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(if spans { FmtSpan::CLOSE } else { FmtSpan::NONE })
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Cancels the returned token on SIGINT or SIGTERM.
pub(crate) fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        // Said in the log: a part that ends without an error line ended on one of these (or
        // on SIGKILL).
        let signal = tokio::select! {
            _ = tokio::signal::ctrl_c() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        };
        tracing::info!(signal, "shutting down on a signal");
        t.cancel();
    });
    token
}

pub(crate) async fn connect_db(url: &str) -> anyhow::Result<sqlx::PgPool> {
    connect_db_with(url, DB_POOL_SIZE).await
}

/// [`connect_db`] with a pool of `size` connections. Every connection runs with `jit = off`:
/// the control plane's queries are short lookups and writes, and the pass's few large ones
/// spent longer compiling than running (0.4–0.7 s at 100,000 sandboxes, `tests/bench/RESULTS.md`).
pub(crate) async fn connect_db_with(url: &str, size: u32) -> anyhow::Result<sqlx::PgPool> {
    let options: sqlx::postgres::PgConnectOptions = url
        .parse()
        .with_context(|| format!("parse the Postgres URL {}", redact(url)))?;
    PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options.options([("jit", "off")]))
        .await
        .with_context(|| format!("connect to Postgres at {}", redact(url)))
}

/// The reconciler's pool: the usual size, or more when more results are applied at once than
/// would leave 8 connections to the pass, the watermark and the gauges.
pub(crate) fn reconciler_pool(timing: &berth::timing_args::ReconcilerTimingArgs) -> u32 {
    DB_POOL_SIZE.max(u32::try_from(timing.result_concurrency).unwrap_or(u32::MAX) + 8)
}

pub(crate) async fn connect_nats(url: &str) -> anyhow::Result<async_nats::Client> {
    connect_with(&NatsConnect::open(url)).await
}

pub(crate) async fn connect_with(spec: &NatsConnect) -> anyhow::Result<async_nats::Client> {
    spec.connect()
        .await
        .with_context(|| format!("connect to NATS at {}", spec.url))
}

fn redact(url: &str) -> String {
    match url.split_once('@') {
        Some((_, host)) => format!("postgres://…@{host}"),
        None => url.to_owned(),
    }
}

/// Installs the metrics recorder and, when `addr` is set, serves `/metrics` on it until
/// `shutdown`. Binding happens here, so a taken address fails the command at once.
async fn serve_metrics(
    addr: Option<SocketAddr>,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    berth_api::metrics::handle();
    let Some(addr) = addr else {
        return Ok(());
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("bind the metrics address {addr}"))?;
    tokio::spawn(berth_api::metrics::serve_on(listener, shutdown.clone()));
    Ok(())
}

fn subjects(prefix: &str) -> anyhow::Result<Subjects> {
    Ok(Subjects::new(prefix)?)
}

async fn run(command: Cmd) -> anyhow::Result<()> {
    match command {
        Cmd::Api {
            conn,
            listen,
            webhook_allow_private_targets,
            limits,
            metrics_addr,
            metrics_on_api,
            disk,
            heartbeat_freshness,
            preview,
            template_cache,
            object_sweep_every,
            object_sweep_grace,
        } => {
            let disk_args_private = disk.sandbox_egress_allow_private;
            let disk = disk.limits()?;
            let shutdown = shutdown_on_signal();
            serve_metrics(metrics_addr, &shutdown).await?;
            let db = connect_db(&conn.database_url).await?;
            let nats = conn.nats.connect().await?;
            let subjects = conn.nats.subjects()?;
            let mut config = berth_api::ApiConfig::new(listen, subjects.clone());
            config.webhooks.allow_private_targets = webhook_allow_private_targets;
            config.limits = limits.config();
            config.disk = disk;
            config.sandbox_egress_private = disk_args_private;
            config.metrics_on_api = metrics_on_api;
            config.heartbeat_freshness = heartbeat_freshness.into();
            config.preview = preview.config()?;
            // The hosts' object store, so a snapshot's delete removes its content.
            config.object_store = match std::env::var(berth_storage::store::OBJECT_STORE_ENV) {
                Ok(v) if !v.is_empty() => Some(berth_storage::StoreSettings::new(
                    berth_storage::Location::parse(&v)?,
                )),
                _ => None,
            };
            anyhow::ensure!(
                !object_sweep_every.is_zero(),
                "--object-sweep-every must be more than zero"
            );
            config.sweep.every = object_sweep_every.into();
            config.sweep.grace = object_sweep_grace.into();
            let state =
                berth_api::AppState::new(db, nats, subjects, config, berth_api::metrics::handle())
                    .with_images(std::sync::Arc::new(berth::image_puller::CachePuller::new(
                        &template_cache,
                    )));
            berth_api::run(state, shutdown).await?;
        }
        Cmd::Proxy {
            conn,
            listen,
            preview,
            limits,
            metrics_addr,
        } => {
            let config = preview.config()?;
            anyhow::ensure!(
                config.secret.is_some(),
                "berth proxy needs --preview-secret (BERTH_PREVIEW_SECRET)"
            );
            let shutdown = shutdown_on_signal();
            serve_metrics(metrics_addr, &shutdown).await?;
            let db = connect_db(&conn.database_url).await?;
            let nats = conn.nats.connect().await?;
            let subjects = conn.nats.subjects()?;
            let guards = berth_api::limits::Guards::new(limits.config());
            let proxy = berth_api::preview::Preview::new(db, guards, config, Default::default());
            // A preview that wakes a sandbox commits its start here: the API's relays hear of it.
            tokio::spawn(berth_api::outbox::forward_wakes(
                nats.clone(),
                subjects.clone(),
                shutdown.clone(),
            ));
            tokio::spawn(berth_api::preview::routes::evict_on_events(
                proxy.clone(),
                nats,
                subjects,
                shutdown.clone(),
            ));
            berth_api::preview::server::run(listen, proxy, shutdown).await?;
        }
        Cmd::Scheduler { conn, metrics_addr } => {
            let shutdown = shutdown_on_signal();
            serve_metrics(metrics_addr, &shutdown).await?;
            let db = connect_db(&conn.database_url).await?;
            let nats = conn.nats.connect().await?;
            let config = berth_scheduler::SchedulerConfig {
                subjects: conn.nats.subjects()?,
            };
            berth_scheduler::run(config, db, nats, shutdown).await?;
        }
        Cmd::Reconciler {
            conn,
            metrics_addr,
            timing,
        } => {
            let shutdown = shutdown_on_signal();
            serve_metrics(metrics_addr, &shutdown).await?;
            let db = connect_db_with(&conn.database_url, reconciler_pool(&timing)).await?;
            let nats = conn.nats.connect().await?;
            let mut config = berth_reconciler::ReconcilerConfig::new(conn.nats.subjects()?);
            timing.apply(&mut config);
            berth_reconciler::run(config, db, nats, shutdown).await?;
        }
        Cmd::Hostd {
            nats,
            metrics_addr,
            state_dir,
            name,
            address_pool,
            sandbox_egress_allow,
            warm_pool,
            vcpus,
            memory_mib,
            runtimes,
            sim_boot_ms,
            heartbeat_interval,
            forwarder,
        } => {
            let name = name.unwrap_or_else(dev::hostname);
            let spec = nats.connect_spec()?;
            if let Some(creds) = &spec.creds {
                anyhow::ensure!(
                    matches!(creds.role, Role::Host(_)),
                    "--nats-creds of a hostd must be host credentials (berth admin add-host)"
                );
            }
            // BERTH_OBJECT_STORE (s3://bucket/prefix, or a directory), else <state dir>/objects.
            let object_store = berth_storage::Location::from_env_or_default(&state_dir)?;
            let subjects = nats.subjects()?;
            let mut config =
                berth_hostd::HostdConfig::new(nats.nats_url, subjects, state_dir, name);
            config.object_store = berth_storage::StoreSettings::new(object_store);
            config.nats_creds = spec.creds;
            config.nats_ca = spec.ca_file;
            config.address_pool = address_pool;
            config.sandbox_egress_allow = sandbox_egress_allow.iter().map(|n| n.trunc()).collect();
            config.warm_pool = warm_pool;
            if let Some(v) = vcpus {
                config.capacity.vcpus = v;
            }
            if let Some(m) = memory_mib {
                config.capacity.memory_mib = m;
            }
            if !runtimes.is_empty() {
                config.runtimes = runtimes;
            }
            config.sim_boot = std::time::Duration::from_millis(sim_boot_ms);
            config.heartbeat_interval = heartbeat_interval.into();
            config.forwarder = forwarder.config()?;
            let shutdown = shutdown_on_signal();
            serve_metrics(metrics_addr, &shutdown).await?;
            berth_hostd::run(config, shutdown).await?;
        }
        Cmd::Agent { .. }
        | Cmd::ConsoleLog { .. }
        | Cmd::RuntimeKeeper { .. }
        | Cmd::Sandbox(_)
        | Cmd::Login(_)
        | Cmd::Completions { .. }
        | Cmd::Docs { .. }
        | Cmd::Template {
            command: TemplateCmd::Ls(_) | TemplateCmd::Pull(_),
        } => {
            unreachable!("handled before the runtime starts")
        }
        Cmd::Dev(args) => dev::run(args).await?,
        Cmd::Bench(args) => {
            if let Err(e) = bench::run(args).await {
                // A signal is the user's choice, not a failure to explain with a backtrace.
                if e.chain().any(|c| c.is::<bench::Interrupted>()) {
                    eprintln!("berth bench: {e}");
                    std::process::exit(bench::INTERRUPTED_EXIT);
                }
                return Err(e);
            }
        }
        Cmd::Template {
            command: TemplateCmd::Build { name, cache_dir },
        } => {
            let rootfs = berth_hostd::template::build_cached(&name, &cache_dir)
                .await
                .map_err(|e| anyhow::anyhow!(e.report()))?;
            println!("template {name}: {}", rootfs.display());
        }
        Cmd::Template {
            command:
                TemplateCmd::Import {
                    name,
                    tarball,
                    runtime,
                    description,
                    cache_dir,
                    database_url,
                },
        } => {
            let rootfs = {
                let (name, runtime, description) =
                    (name.clone(), runtime.clone(), description.clone());
                tokio::task::spawn_blocking(move || {
                    berth_hostd::template::import_rootfs(
                        &name,
                        &tarball,
                        &runtime,
                        &description,
                        &cache_dir,
                    )
                })
                .await?
                .map_err(|e| anyhow::anyhow!(e.report()))?
            };
            println!("template {name}: {}", rootfs.display());
            if let Some(url) = database_url {
                let db = connect_db(&url).await?;
                berth_store::MIGRATOR.run(&db).await?;
                berth_api::templates::register(&db, &name, &description, &runtime).await?;
                println!("template {name} registered ({runtime})");
            }
        }
        Cmd::Migrate { database_url } => {
            let db = connect_db(&database_url).await?;
            berth_store::MIGRATOR.run(&db).await?;
            println!("migrations applied");
        }
        Cmd::Admin {
            database_url,
            command,
        } => {
            let db = connect_db(&database_url).await?;
            berth_store::MIGRATOR.run(&db).await?;
            match command {
                AdminCmd::CreateOrg { name, quota } => {
                    let (org, key) =
                        berth_api::auth::create_org_with_quota(&db, &name, quota.quota()).await?;
                    eprintln!("created org {name} ({org}); the key is shown only now");
                    println!("{key}");
                }
                AdminCmd::Orgs(cmd) => print!("{}", berth::org_admin::run(&db, cmd).await?),
                AdminCmd::CreateAdminKey => {
                    let key = berth_api::auth::create_admin_key(&db).await?;
                    eprintln!("created an operator key; it is shown only now");
                    println!("{key}");
                }
                AdminCmd::SetQuota {
                    org,
                    max_running,
                    max_vcpus,
                    max_memory_mib,
                } => {
                    if !berth_api::quota::set(&db, &org, max_running, max_vcpus, max_memory_mib)
                        .await?
                    {
                        anyhow::bail!("no org named {org:?}");
                    }
                    eprintln!("quotas of {org} set");
                }
                AdminCmd::AddHost { host_id, creds_out } => {
                    anyhow::ensure!(
                        !creds_out.exists(),
                        "{} exists; credentials are never overwritten",
                        creds_out.display()
                    );
                    let host = host_id.unwrap_or_default();
                    let creds = berth::nats_access::issue_host(&db, host).await?;
                    berth::nats_access::write_new(&creds_out, &creds)?;
                    eprintln!(
                        "registered host {host}; its NATS credentials are in {} \
                         (berth hostd --nats-creds); now re-render the server's users \
                         (berth admin nats-config) and reload nats-server",
                        creds_out.display()
                    );
                    println!("{host}");
                }
                AdminCmd::ForwarderKey {
                    host_id,
                    preview_secret,
                } => {
                    println!(
                        "{}",
                        preview_args::forwarder_key_hex(&preview_secret, host_id)
                    );
                }
                AdminCmd::RemoveHost { host_id } => {
                    if !berth_store::hosts::unregister(&db, host_id).await? {
                        anyhow::bail!("host {host_id} is not registered");
                    }
                    eprintln!(
                        "host {host_id} unregistered; now re-render the server's users \
                         (berth admin nats-config) and reload nats-server"
                    );
                }
                AdminCmd::BreakerList => print!("{}", berth::breaker_admin::list(&db).await?),
                AdminCmd::BreakerRelease { host, fleet: _ } => {
                    berth::breaker_admin::release(&db, host).await?;
                    eprintln!("released; the next reconciler pass acts on it");
                }
                AdminCmd::NatsConfig {
                    control_plane_creds,
                    subject_prefix,
                    out,
                } => {
                    let creds = berth::nats_access::load_or_create(
                        &control_plane_creds,
                        Role::ControlPlane,
                    )?;
                    let block =
                        berth::nats_access::render_auth(&db, &subjects(&subject_prefix)?, &creds)
                            .await?;
                    match out {
                        Some(path) => {
                            let tmp = path.with_extension("tmp");
                            std::fs::write(&tmp, &block)
                                .with_context(|| format!("write {}", tmp.display()))?;
                            std::fs::rename(&tmp, &path)
                                .with_context(|| format!("replace {}", path.display()))?;
                            eprintln!("wrote {}; reload nats-server to apply it", path.display());
                        }
                        None => print!("{block}"),
                    }
                }
            }
        }
    }
    Ok(())
}
