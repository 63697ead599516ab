//! `berth`: the one binary. Parses flags and calls each component's `run`; nothing else lives
//! here but `berth dev` (see [`dev`]).

mod dev;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context;
use berth_schemas::Subjects;
use clap::{Args, Parser, Subcommand, ValueEnum};
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

/// Default NATS server.
const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
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
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the HTTP API and run the outbox relay.
    Api {
        #[command(flatten)]
        conn: Conn,
        /// Listen address.
        #[arg(long, env = "BERTH_API_ADDR", default_value = berth_api::DEFAULT_LISTEN)]
        listen: SocketAddr,
    },
    /// Consume heartbeats and keep host rows current.
    Scheduler {
        #[command(flatten)]
        conn: Conn,
    },
    /// Apply host results to sandbox rows.
    Reconciler {
        #[command(flatten)]
        conn: Conn,
    },
    /// Run the host daemon.
    Hostd {
        #[command(flatten)]
        nats: NatsArgs,
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
    },
    /// The in-sandbox agent (runs as PID 1 inside each sandbox).
    Agent {
        #[arg(long, default_value = "0.0.0.0:18047")]
        listen: SocketAddr,
    },
    /// API, scheduler, reconciler and N hostd in one process.
    Dev(dev::DevArgs),
    /// Apply database migrations.
    Migrate {
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
    },
    /// Administrative tasks.
    Admin {
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
        #[command(subcommand)]
        command: AdminCmd,
    },
}

#[derive(Subcommand)]
enum AdminCmd {
    /// Create an org and print its first API key (shown once).
    CreateOrg { name: String },
}

#[derive(Args, Clone)]
struct NatsArgs {
    #[arg(long, env = "NATS_URL", default_value = DEFAULT_NATS_URL)]
    nats_url: String,
    /// Prefix of every NATS subject.
    #[arg(long, env = "BERTH_SUBJECT_PREFIX", default_value = berth_schemas::subjects::DEFAULT_PREFIX)]
    subject_prefix: String,
}

#[derive(Args, Clone)]
struct Conn {
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    #[command(flatten)]
    nats: NatsArgs,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Cmd::Agent { listen } = cli.command {
        // The agent is std-only and forks first: no tokio runtime may exist yet.
        berth_hostd::agent::main(listen).context("agent")?;
        return Ok(());
    }
    init_tracing(cli.log_format);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(cli.command))
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        t.cancel();
    });
    token
}

pub(crate) async fn connect_db(url: &str) -> anyhow::Result<sqlx::PgPool> {
    PgPoolOptions::new()
        .max_connections(DB_POOL_SIZE)
        .connect(url)
        .await
        .with_context(|| format!("connect to Postgres at {}", redact(url)))
}

pub(crate) async fn connect_nats(url: &str) -> anyhow::Result<async_nats::Client> {
    async_nats::connect(url)
        .await
        .with_context(|| format!("connect to NATS at {url}"))
}

fn redact(url: &str) -> String {
    match url.split_once('@') {
        Some((_, host)) => format!("postgres://…@{host}"),
        None => url.to_owned(),
    }
}

fn subjects(prefix: &str) -> anyhow::Result<Subjects> {
    Ok(Subjects::new(prefix)?)
}

async fn run(command: Cmd) -> anyhow::Result<()> {
    match command {
        Cmd::Api { conn, listen } => {
            let db = connect_db(&conn.database_url).await?;
            let nats = connect_nats(&conn.nats.nats_url).await?;
            let subjects = subjects(&conn.nats.subject_prefix)?;
            let state = berth_api::AppState {
                db,
                nats,
                subjects: subjects.clone(),
                config: berth_api::ApiConfig::new(listen, subjects),
                prometheus: berth_api::metrics::handle(),
            };
            berth_api::run(state, shutdown_on_signal()).await?;
        }
        Cmd::Scheduler { conn } => {
            let db = connect_db(&conn.database_url).await?;
            let nats = connect_nats(&conn.nats.nats_url).await?;
            let config = berth_scheduler::SchedulerConfig {
                subjects: subjects(&conn.nats.subject_prefix)?,
            };
            berth_scheduler::run(config, db, nats, shutdown_on_signal()).await?;
        }
        Cmd::Reconciler { conn } => {
            let db = connect_db(&conn.database_url).await?;
            let nats = connect_nats(&conn.nats.nats_url).await?;
            let config =
                berth_reconciler::ReconcilerConfig::new(subjects(&conn.nats.subject_prefix)?);
            berth_reconciler::run(config, db, nats, shutdown_on_signal()).await?;
        }
        Cmd::Hostd {
            nats,
            state_dir,
            name,
            address_pool,
        } => {
            let name = name.unwrap_or_else(dev::hostname);
            let mut config = berth_hostd::HostdConfig::new(
                nats.nats_url,
                subjects(&nats.subject_prefix)?,
                state_dir,
                name,
            );
            config.address_pool = address_pool;
            berth_hostd::run(config, shutdown_on_signal()).await?;
        }
        Cmd::Agent { .. } => unreachable!("handled before the runtime starts"),
        Cmd::Dev(args) => dev::run(args).await?,
        Cmd::Migrate { database_url } => {
            let db = connect_db(&database_url).await?;
            berth_schemas::db::MIGRATOR.run(&db).await?;
            println!("migrations applied");
        }
        Cmd::Admin {
            database_url,
            command: AdminCmd::CreateOrg { name },
        } => {
            let db = connect_db(&database_url).await?;
            berth_schemas::db::MIGRATOR.run(&db).await?;
            let (org, key) = berth_api::auth::create_org(&db, &name).await?;
            eprintln!("created org {name} ({org}); the key is shown only now");
            println!("{key}");
        }
    }
    Ok(())
}
