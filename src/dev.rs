//! `berth dev`: the whole system in one process — API (with the relay), scheduler, reconciler
//! and N hostd, each hostd with its own state dir, host id and address pool.
//!
//! Against `DATABASE_URL` / `NATS_URL` when set; otherwise against a private Postgres (initdb
//! in the state dir) and a private `nats-server -js`, both on free loopback ports, started here
//! and stopped (by the PIDs started here) when `berth dev` exits.
//!
//! The private nats-server runs with authentication on (unless `--nats-open`): `berth dev`
//! keeps the control plane's and each host's credentials in `<state>/nats-auth/` (mode 0600,
//! reused across restarts), registers the hosts with their keys, renders the server's config
//! with each principal's permissions (`berth_schemas::nats_auth`) into `<state>/nats/nats.conf`,
//! and writes `BERTH_NATS_CREDS` (the control plane's file) to `stack.env`.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use berth::stack::{Pools, Reconciler, Stack, StackConfig};
use clap::Args;
use sqlx::Row;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How long `berth dev` waits for its hosts' first heartbeats before giving up.
const HOSTS_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a private service gets to start answering.
const SERVICE_START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a private service gets to exit after SIGTERM before SIGKILL.
const SERVICE_STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// The name of the org `berth dev` creates.
const DEV_ORG: &str = "dev";

/// Flags of `berth dev`.
#[derive(Args, Debug)]
pub struct DevArgs {
    /// API listen address.
    #[arg(long, env = "BERTH_API_ADDR", default_value = berth_api::DEFAULT_LISTEN)]
    api_addr: SocketAddr,
    /// State directory (hostd state, private Postgres and NATS data, the API key).
    #[arg(long, env = "BERTH_STATE_DIR", default_value = ".berth")]
    state_dir: PathBuf,
    /// Prefix of every NATS subject.
    #[arg(long, env = "BERTH_SUBJECT_PREFIX", default_value = berth_schemas::subjects::DEFAULT_PREFIX)]
    subject_prefix: String,
    /// How many hostd to run.
    #[arg(long, env = "BERTH_DEV_HOSTS", default_value_t = 2)]
    hosts: u8,
    /// Host i takes sandbox addresses from this /16 with its second octet plus i.
    #[arg(long, env = "BERTH_ADDRESS_POOL", default_value = "10.200.0.0")]
    address_pool: Ipv4Addr,
    /// Postgres to use; unset → a private one in the state dir.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// NATS to use; unset → a private `nats-server -js`.
    #[arg(long, env = "NATS_URL")]
    nats_url: Option<String>,
    /// Run the private nats-server without authentication (anyone reaching its port may speak
    /// for any host); by default each component has its own credentials and permissions.
    #[arg(long, env = "BERTH_DEV_NATS_OPEN")]
    nats_open: bool,
    /// Let webhooks deliver to loopback, private and link-local addresses (a receiver on this
    /// machine); refused by default.
    #[arg(long, env = "BERTH_WEBHOOK_ALLOW_PRIVATE_TARGETS")]
    webhook_allow_private_targets: bool,
    #[command(flatten)]
    disk: crate::DiskArgs,
    #[command(flatten)]
    limits: crate::limits_args::ApiLimitArgs,
    #[command(flatten)]
    timing: berth::timing_args::ReconcilerTimingArgs,
    /// Sandboxes each hostd keeps booted ahead per template, handed to creates of the same
    /// shape (`base=2,base-gvisor=1`; the shape is the newest create's). Default: none.
    #[arg(long, env = "BERTH_WARM_POOL", default_value = "")]
    warm_pool: berth_hostd::warm::WarmConfig,
    /// Where the preview proxy listens.
    #[arg(long, env = "BERTH_PROXY_ADDR", default_value = berth_api::preview::DEFAULT_PROXY_LISTEN)]
    proxy_addr: SocketAddr,
    #[command(flatten)]
    preview: crate::preview_args::PreviewArgs,
    /// Serve Prometheus metrics (`GET /metrics`) on this address (`deploy/up`:
    /// `127.0.0.1:9464`); unset: not served. The API's listener never serves them.
    #[arg(long, env = "BERTH_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
}

/// The preview settings of the dev stack: the flags', with a fresh random secret when none
/// is given, and the proxy's port in the domain (so handed-out URLs open as they are).
fn dev_preview(args: &DevArgs) -> anyhow::Result<berth_api::preview::PreviewConfig> {
    let mut preview = args.preview.config()?;
    if preview.secret.is_none() {
        let secret: [u8; 32] = rand::random();
        preview.secret = Some(std::sync::Arc::new(secret.to_vec()));
    }
    preview.domain = config_domain(args);
    Ok(preview)
}

/// The preview domain with the proxy's port, unless it names one or the port is 80.
fn config_domain(args: &DevArgs) -> String {
    let domain = &args.preview.preview_domain;
    match args.proxy_addr.port() {
        80 => domain.clone(),
        _ if domain.contains(':') => domain.clone(),
        port => format!("{domain}:{port}"),
    }
}

/// The machine's host name, for host names in heartbeats.
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// A child process started by `berth dev`; stopped by its PID on exit.
pub(crate) struct PrivateService {
    name: &'static str,
    child: Child,
}

impl PrivateService {
    pub(crate) async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let pid = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            if tokio::time::timeout(SERVICE_STOP_TIMEOUT, self.child.wait())
                .await
                .is_err()
            {
                warn!(service = self.name, "did not stop on SIGTERM; killing");
                let _ = self.child.kill().await;
            }
        }
        info!(service = self.name, "stopped");
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn postgres_bin_dir() -> anyhow::Result<PathBuf> {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(root)
        .with_context(|| {
            format!(
                "no Postgres under {} (apt-get install postgresql)",
                root.display()
            )
        })?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .context("no Postgres server binaries found (apt-get install postgresql)")
}

/// Runs `program` as the `postgres` user when we are root (Postgres refuses to run as root).
/// A command for a private service: when `berth dev` dies, even by SIGKILL, the kernel sends
/// the service SIGTERM (`PR_SET_PDEATHSIG`), so no orphan holds its port or data dir.
fn service_command(program: &Path) -> Command {
    let mut c = Command::new(program);
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        c.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
                .map_err(std::io::Error::from)
        });
    }
    c
}

/// Runs `program` as the `postgres` user when we are root (Postgres refuses to run as root).
fn as_postgres_user(program: &Path) -> anyhow::Result<Command> {
    let mut c = service_command(program);
    // The postgres user may not be able to enter our working directory.
    c.current_dir("/");
    if nix::unistd::geteuid().is_root() {
        let user = nix::unistd::User::from_name("postgres")?
            .context("no postgres user (apt-get install postgresql)")?;
        c.uid(user.uid.as_raw()).gid(user.gid.as_raw());
    }
    Ok(c)
}

/// Stops a private service left running by a `berth dev` that died without stopping it: the
/// process named in `pid_file` (first line), if it still runs `expected` on `state_dir`.
async fn stop_stale(pid_file: &Path, expected: &str, state_dir: &Path) {
    let Some(pid) = std::fs::read_to_string(pid_file)
        .ok()
        .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<i32>().ok()))
    else {
        return;
    };
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    if !cmdline.contains(expected) || !cmdline.contains(&*state_dir.to_string_lossy()) {
        return;
    }
    warn!(
        pid,
        service = expected,
        "stopping a private service a previous berth dev left running"
    );
    let pid = nix::unistd::Pid::from_raw(pid);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = tokio::time::Instant::now() + SERVICE_STOP_TIMEOUT;
    while nix::sys::signal::kill(pid, None).is_ok() {
        if tokio::time::Instant::now() > deadline {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) async fn start_private_postgres(
    state_dir: &Path,
    shutdown: &CancellationToken,
) -> anyhow::Result<(String, PrivateService)> {
    let bin = postgres_bin_dir()?;
    let data = state_dir.join("postgres");
    let data = std::path::absolute(&data)?;
    let root = nix::unistd::geteuid().is_root();
    if !data.join("PG_VERSION").exists() {
        std::fs::create_dir_all(&data)?;
        if root {
            chown_postgres(&data).await?;
        }
        let status = as_postgres_user(&bin.join("initdb"))?
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "--encoding=UTF8"])
            .stdout(Stdio::null())
            .status()
            .await
            .context("run initdb")?;
        if !status.success() {
            bail!("initdb failed for {}", data.display());
        }
    } else if root {
        chown_postgres(&data).await?;
    }
    let port = free_port()?;
    let log = std::fs::File::create(state_dir.join("postgres.log"))?;
    stop_stale(&data.join("postmaster.pid"), "postgres", state_dir).await;
    let child = as_postgres_user(&bin.join("postgres"))?
        .arg("-D")
        .arg(&data)
        .arg("-k")
        .arg(&data)
        .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1"])
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("start postgres")?;
    let service = PrivateService {
        name: "postgres",
        child,
    };
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let deadline = tokio::time::Instant::now() + SERVICE_START_TIMEOUT;
    loop {
        match sqlx::postgres::PgConnectOptions::new()
            .host("127.0.0.1")
            .port(port)
            .username("postgres")
            .database("postgres")
            .connect_opts()
            .await
        {
            Ok(_) => break,
            Err(e) if tokio::time::Instant::now() > deadline => {
                service.stop().await;
                bail!(
                    "private Postgres did not start (see {}/postgres.log): {e}",
                    state_dir.display()
                );
            }
            Err(_) => {}
        }
        if shutdown.is_cancelled() {
            service.stop().await;
            bail!("interrupted while Postgres was starting");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    info!(%port, "private Postgres running");
    Ok((url, service))
}

trait ConnectOpts {
    async fn connect_opts(self) -> Result<sqlx::PgConnection, sqlx::Error>;
}

impl ConnectOpts for sqlx::postgres::PgConnectOptions {
    async fn connect_opts(self) -> Result<sqlx::PgConnection, sqlx::Error> {
        use sqlx::ConnectOptions;
        self.connect().await
    }
}

async fn chown_postgres(dir: &Path) -> anyhow::Result<()> {
    let status = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(dir)
        .status()
        .await?;
    if !status.success() {
        bail!(
            "chown postgres {} failed (is there a postgres user?)",
            dir.display()
        );
    }
    Ok(())
}

/// Starts a private `nats-server` with JetStream on a free loopback port. With `auth` (the
/// server's `authorization` block and the control plane's credentials, which the readiness
/// check connects with) only the listed principals get in; without, it is open.
pub(crate) async fn start_private_nats(
    state_dir: &Path,
    auth: Option<(&str, &berth_schemas::nats_auth::Creds)>,
    shutdown: &CancellationToken,
) -> anyhow::Result<(String, PrivateService)> {
    let port = free_port()?;
    let dir = std::path::absolute(state_dir.join("nats"))?;
    std::fs::create_dir_all(&dir)?;
    let config_file = dir.join("nats.conf");
    std::fs::write(
        &config_file,
        berth::nats_access::server_config(port, &dir, auth.map(|(block, _)| block), None),
    )
    .with_context(|| format!("write {}", config_file.display()))?;
    let log = std::fs::File::create(state_dir.join("nats.log"))?;
    let pid_file = state_dir.join("nats.pid");
    stop_stale(&pid_file, "nats-server", state_dir).await;
    let connect = berth_schemas::nats_auth::NatsConnect {
        url: format!("nats://127.0.0.1:{port}"),
        creds: auth.map(|(_, creds)| creds.clone()),
        ca_file: None,
    };
    let child = service_command(Path::new("nats-server"))
        .arg("-c")
        .arg(&config_file)
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("start nats-server (apt-get install nats-server)")?;
    if let Some(pid) = child.id() {
        std::fs::write(&pid_file, format!("{pid}\n"))?;
    }
    let service = PrivateService {
        name: "nats",
        child,
    };
    let url = connect.url.clone();
    let deadline = tokio::time::Instant::now() + SERVICE_START_TIMEOUT;
    loop {
        let error = match connect.connect().await {
            Ok(c) => match c.flush().await {
                Ok(()) => break,
                Err(e) => e.to_string(),
            },
            Err(e) => e.to_string(),
        };
        if tokio::time::Instant::now() > deadline {
            service.stop().await;
            bail!(
                "private nats-server did not start (see {}/nats.log): {error}",
                state_dir.display()
            );
        }
        if shutdown.is_cancelled() {
            service.stop().await;
            bail!("interrupted while nats-server was starting");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    info!(%port, "private NATS running");
    Ok((url, service))
}

/// Reuses `<state>/api-key` when it still authenticates; otherwise makes a key for the dev
/// org (creating the org if needed) and writes it there (mode 0600).
async fn dev_api_key(db: &sqlx::PgPool, state_dir: &Path) -> anyhow::Result<String> {
    let path = state_dir.join("api-key");
    if let Ok(key) = std::fs::read_to_string(&path) {
        let key = key.trim().to_owned();
        if berth_api::auth::authenticate(db, &key).await?.is_some() {
            return Ok(key);
        }
    }
    let key = match berth_api::auth::create_org(db, DEV_ORG).await {
        Ok((_, key)) => key,
        Err(berth_api::auth::CreateOrgError::Exists(_)) => {
            let org = sqlx::query("SELECT id FROM orgs WHERE name = $1")
                .bind(DEV_ORG)
                .fetch_one(db)
                .await?
                .get("id");
            berth_api::auth::create_key(db, org).await?
        }
        Err(e) => return Err(e.into()),
    };
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)?;
    std::io::Write::write_all(&mut f, format!("{key}\n").as_bytes())?;
    Ok(key)
}

fn pool_for(base: Ipv4Addr, index: u8) -> anyhow::Result<Ipv4Addr> {
    let [a, b, _, _] = base.octets();
    let b = b
        .checked_add(index)
        .context("address pool second octet overflows")?;
    Ok(Ipv4Addr::new(a, b, 0, 0))
}

fn control_plane_creds_path(state_dir: &Path) -> PathBuf {
    state_dir.join("nats-auth").join("control-plane.creds")
}

/// The control plane's credentials and each host's (reused from `<state>/nats-auth/` when
/// they are still for the host whose state dir is there; issued otherwise), every host
/// registered with its key.
async fn dev_credentials(
    db: &sqlx::PgPool,
    state_dir: &Path,
    host_dirs: &[PathBuf],
) -> anyhow::Result<(
    berth_schemas::nats_auth::Creds,
    Vec<berth_schemas::nats_auth::Creds>,
)> {
    use berth_schemas::nats_auth::Role;
    let control_plane = berth::nats_access::load_or_create(
        &control_plane_creds_path(state_dir),
        Role::ControlPlane,
    )?;
    let mut hosts = Vec::new();
    for (i, dir) in host_dirs.iter().enumerate() {
        let id = berth_hostd::host_id(dir)?;
        let path = state_dir.join("nats-auth").join(format!("host-{i}.creds"));
        let creds = match berth::nats_access::load(&path) {
            Ok(creds) if creds.role == Role::Host(id) => creds,
            _ => {
                let _ = std::fs::remove_file(&path);
                let creds = berth_schemas::nats_auth::Creds::generate(Role::Host(id));
                berth::nats_access::write_new(&path, &creds)?;
                creds
            }
        };
        berth::nats_access::register_host(db, &creds).await?;
        hosts.push(creds);
    }
    Ok((control_plane, hosts))
}

/// Runs the whole stack until SIGINT/SIGTERM.
pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.state_dir)
        .with_context(|| format!("create {}", args.state_dir.display()))?;
    let state_dir = std::path::absolute(&args.state_dir)?;
    let mut services = Vec::new();
    let result = run_stack(&args, &state_dir, &mut services).await;
    for service in services.into_iter().rev() {
        service.stop().await;
    }
    result
}

async fn run_stack(
    args: &DevArgs,
    state_dir: &Path,
    services: &mut Vec<PrivateService>,
) -> anyhow::Result<()> {
    let shutdown = crate::shutdown_on_signal();
    crate::serve_metrics(args.metrics_addr, &shutdown).await?;
    let database_url = match &args.database_url {
        Some(url) => url.clone(),
        None => {
            let (url, svc) = start_private_postgres(state_dir, &shutdown).await?;
            services.push(svc);
            url
        }
    };
    // One pool for every component: room for the result consumer's applies and 8 more.
    let db = crate::connect_db_with(&database_url, crate::reconciler_pool(&args.timing)).await?;
    let subjects = berth_schemas::Subjects::new(&args.subject_prefix)?;
    let host_dirs: Vec<PathBuf> = (0..args.hosts)
        .map(|i| state_dir.join("hosts").join(i.to_string()))
        .collect();
    // Credentials when dev runs its own NATS with auth on: (control plane, one per host).
    let auth = if args.nats_url.is_none() && !args.nats_open {
        berth_store::MIGRATOR.run(&db).await.context("migrate")?;
        Some(dev_credentials(&db, state_dir, &host_dirs).await?)
    } else {
        None
    };
    let nats_url = match &args.nats_url {
        Some(url) => url.clone(),
        None => {
            let block = match &auth {
                Some((control_plane, _)) => Some((
                    berth::nats_access::render_auth(&db, &subjects, control_plane).await?,
                    control_plane,
                )),
                None => None,
            };
            let (url, svc) = start_private_nats(
                state_dir,
                block.as_ref().map(|(b, c)| (b.as_str(), *c)),
                &shutdown,
            )
            .await?;
            services.push(svc);
            url
        }
    };
    let mut config = StackConfig::new(nats_url.clone(), subjects, args.api_addr);
    config.api.webhooks.allow_private_targets = args.webhook_allow_private_targets;
    config.api.disk = args.disk.limits()?;
    config.api.sandbox_egress_private = args.disk.sandbox_egress_allow_private;
    config.api.limits = args.limits.config();
    // One window for placement and for a failed create's retry.
    config.api.heartbeat_freshness = args.timing.heartbeat_freshness.into();
    config.api.preview = dev_preview(args)?;
    config.proxy_listen = Some(args.proxy_addr);
    if let Reconciler::Leader(reconciler) = &mut config.reconciler {
        args.timing.apply(reconciler);
    }
    config.nats_creds = auth.as_ref().map(|(cp, _)| cp.clone());
    // One object store for every host of the stack (a clone may boot on another host) and the
    // API (a snapshot's delete removes its content): BERTH_OBJECT_STORE, else <state dir>/objects.
    let object_store =
        berth_storage::StoreSettings::new(berth_storage::Location::from_env_or_default(state_dir)?);
    config.api.object_store = Some(object_store.clone());
    let host_name = hostname();
    for (i, dir) in host_dirs.iter().enumerate() {
        let mut host = berth_hostd::HostdConfig::new(
            nats_url.clone(),
            config.subjects.clone(),
            dir.clone(),
            format!("{host_name}-{i}"),
        );
        host.address_pool = pool_for(args.address_pool, i as u8)?;
        host.object_store = object_store.clone();
        host.nats_creds = auth.as_ref().map(|(_, hosts)| hosts[i].clone());
        host.warm_pool = args.warm_pool.clone();
        // The stack derives each host's key from the preview secret.
        host.forwarder = Some(berth_hostd::forwarder::ForwarderConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            key: [0; 32],
        });
        config.hosts.push(host);
    }
    let mut stack = Stack::start(config, Pools::shared(db.clone()), &shutdown).await?;
    let api_addr = stack.api_addr;
    let ready = async {
        let key = dev_api_key(&db, state_dir).await?;
        stack
            .wait_for_hosts(usize::from(args.hosts), HOSTS_READY_TIMEOUT, &shutdown)
            .await?;
        anyhow::Ok(key)
    }
    .await;
    let key = match ready {
        Ok(key) => key,
        Err(e) => {
            stack.stop().await;
            return Err(e);
        }
    };
    // What clients and `berth bench` need to find this stack.
    std::fs::write(
        state_dir.join("stack.env"),
        format!(
            "BERTH_API=http://{api_addr}\nDATABASE_URL={database_url}\nNATS_URL={nats_url}\n\
             BERTH_SUBJECT_PREFIX={}\nBERTH_HOSTS_DIR={}\nBERTH_DEV_PID={}\n{}{}{}",
            args.subject_prefix,
            state_dir.join("hosts").display(),
            std::process::id(),
            match &auth {
                Some(_) => format!(
                    "BERTH_NATS_CREDS={}\n",
                    control_plane_creds_path(state_dir).display()
                ),
                None => String::new(),
            },
            match args.metrics_addr {
                Some(metrics) => format!("BERTH_METRICS=http://{metrics}\n"),
                None => String::new(),
            },
            match stack.proxy_addr {
                Some(proxy) => format!(
                    "BERTH_PROXY=http://{proxy}\nBERTH_PREVIEW_DOMAIN={}\n",
                    config_domain(args)
                ),
                None => String::new(),
            }
        ),
    )?;
    println!("api: http://{api_addr}");
    if let Some(proxy) = stack.proxy_addr {
        println!(
            "preview: http://{{port}}-{{sandbox_id}}.{} (proxy on {proxy})",
            config_domain(args)
        );
    }
    println!("api key: {key}");
    println!("ready: {} hosts", args.hosts);

    let outcome = tokio::select! {
        _ = shutdown.cancelled() => Ok(()),
        exited = stack.exited() => exited,
    };
    stack.stop().await;
    outcome
}
