//! The one in-process control plane: the API (with its command and event relays and the
//! webhook worker), the scheduler's heartbeat consumer, the reconciler (its result consumer,
//! and the leader's pass unless the caller runs passes itself) and N hostd, each a task of
//! this process. `berth dev`, `berth bench --runtime sim` and the end-to-end tests assemble
//! the control plane through [`Stack::start`] and nowhere else.
//!
//! # Guarantees
//! - [`Stack::start`] returns once the database is migrated, the JetStream streams of the
//!   subject prefix exist and the API listens; every component then runs until
//!   [`Stack::stop`], or until one of them exits (see [`Stack::exited`]).
//! - Dropping a `Stack` without [`Stack::stop`] (a panicking test) cancels and aborts every
//!   task, so nothing of it outlives its owner.
//!
//! # Assumptions
//! Postgres and NATS are reachable; starting a private Postgres or nats-server when they are
//! not is `berth dev`'s business (`src/dev.rs`), not the stack's.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use berth_schemas::Subjects;
use futures::FutureExt;
use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// How long [`Stack::stop`] waits for a component to finish after cancelling it.
pub const COMPONENT_STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How often [`Stack::wait_for_hosts`] looks at the `hosts` table.
const HOSTS_POLL: Duration = Duration::from_millis(200);

/// Which parts of the reconciler run.
#[derive(Debug, Clone)]
pub enum Reconciler {
    /// The result consumer, the leader loop (the periodic pass) and the fleet gauges.
    Leader(Box<berth_reconciler::ReconcilerConfig>),
    /// Only the result consumer, applying at most this many results at once (and the results
    /// watermark its progress gives): the caller runs passes itself, e.g. to time them.
    ResultsOnly(usize),
}

/// One database pool per component, as when each runs as its own process; or one shared.
#[derive(Debug, Clone)]
pub struct Pools {
    /// The API's pool: handlers, relays, the webhook worker.
    pub api: PgPool,
    /// The scheduler's heartbeat consumer.
    pub scheduler: PgPool,
    /// The reconciler's result consumer and pass.
    pub reconciler: PgPool,
}

impl Pools {
    /// Every component on the same pool.
    pub fn shared(db: PgPool) -> Self {
        Self {
            api: db.clone(),
            scheduler: db.clone(),
            reconciler: db,
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct StackConfig {
    /// NATS server URL; the hostd of the stack connect to it on their own.
    pub nats_url: String,
    /// The control plane's NATS credentials (`None`: an open NATS).
    pub nats_creds: Option<berth_schemas::nats_auth::Creds>,
    /// The CA file of a TLS NATS server (`None`: plain).
    pub nats_ca: Option<std::path::PathBuf>,
    /// Subject and stream names (their prefix isolates this stack on a shared NATS).
    pub subjects: Subjects,
    /// The API's configuration. `api.listen` is bound by [`Stack::start`] (port 0 takes a free
    /// port) and then holds the bound address.
    pub api: berth_api::ApiConfig,
    /// Which reconciler parts run.
    pub reconciler: Reconciler,
    /// One in-process hostd per entry (each with its own state dir and address pool). A host
    /// with a forwarder gets its key derived from `api.preview.secret` here.
    pub hosts: Vec<berth_hostd::HostdConfig>,
    /// Where the preview proxy listens (port 0 takes a free port; `None`: no proxy). It uses
    /// `api.preview`.
    pub proxy_listen: Option<SocketAddr>,
    /// Run the scheduler's heartbeat consumer (default). A test that stands in a consumer of
    /// its own (a delayed one) turns it off.
    pub heartbeat_consumer: bool,
}

impl StackConfig {
    /// Defaults for everything: the API on `listen`, the leader reconciler, no hostd.
    pub fn new(nats_url: impl Into<String>, subjects: Subjects, listen: SocketAddr) -> Self {
        Self {
            nats_url: nats_url.into(),
            nats_creds: None,
            nats_ca: None,
            api: berth_api::ApiConfig::new(listen, subjects.clone()),
            reconciler: Reconciler::Leader(Box::new(berth_reconciler::ReconcilerConfig::new(
                subjects.clone(),
            ))),
            subjects,
            hosts: Vec::new(),
            proxy_listen: None,
            heartbeat_consumer: true,
        }
    }
}

/// A running control plane. Stop it with [`Stack::stop`]; dropping it aborts every task.
pub struct Stack {
    /// Where the API listens.
    pub api_addr: SocketAddr,
    /// Where the preview proxy listens, when it runs.
    pub proxy_addr: Option<SocketAddr>,
    /// The API's pool.
    pub db: PgPool,
    /// The stack's NATS connection.
    pub nats: async_nats::Client,
    /// The stack's subjects.
    pub subjects: Subjects,
    /// Cancelled by [`Stack::stop`]; a child of the token given to [`Stack::start`].
    pub shutdown: CancellationToken,
    /// When the stack started, by the database's clock.
    started_at: chrono::DateTime<chrono::Utc>,
    tasks: JoinSet<anyhow::Result<()>>,
}

impl Stack {
    /// Migrates the database, registers the in-process hosts (their ids from their state dirs,
    /// or their credentials), makes the streams, binds the API and starts every component as a
    /// task. `shutdown` stops them all (so does [`Stack::stop`]).
    ///
    /// Errors: migration, registration, NATS connection, stream creation or binding
    /// `config.api.listen`.
    pub async fn start(
        mut config: StackConfig,
        pools: Pools,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Stack> {
        berth_store::MIGRATOR
            .run(&pools.api)
            .await
            .context("migrate")?;
        let started_at = sqlx::query_scalar("SELECT now()")
            .fetch_one(&pools.api)
            .await?;
        for host in &mut config.hosts {
            let id = match host.nats_creds.as_ref().map(|c| c.role) {
                Some(berth_schemas::nats_auth::Role::Host(id)) => {
                    berth_hostd::adopt_host_id(&host.state_dir, id)?
                }
                _ => berth_hostd::host_id(&host.state_dir)?,
            };
            if let (Some(secret), Some(forwarder)) =
                (&config.api.preview.secret, host.forwarder.as_mut())
            {
                forwarder.key = berth_schemas::preview::forwarder_key(secret, id);
            }
            let key = host.nats_creds.as_ref().map(|c| c.public_key());
            berth_store::hosts::register(&pools.api, id, key.as_deref())
                .await
                .with_context(|| format!("register host {id}"))?;
        }
        let connect = berth_schemas::nats_auth::NatsConnect {
            url: config.nats_url.clone(),
            creds: config.nats_creds.clone(),
            ca_file: config.nats_ca.clone(),
        };
        let nats = connect
            .connect()
            .await
            .with_context(|| format!("connect to NATS at {}", config.nats_url))?;
        let js = async_nats::jetstream::new(nats.clone());
        berth_schemas::streams::ensure_streams(&js, &config.subjects)
            .await
            .context("create JetStream streams")?;
        let listener = tokio::net::TcpListener::bind(config.api.listen)
            .await
            .with_context(|| format!("bind the API to {}", config.api.listen))?;
        let api_addr = listener.local_addr()?;
        config.api.listen = api_addr;

        let stop = shutdown.child_token();
        let subjects = config.subjects.clone();
        let mut tasks = JoinSet::new();
        let scheduler = berth_scheduler::SchedulerConfig {
            subjects: subjects.clone(),
        };
        let (db, bus, halt) = (pools.scheduler.clone(), nats.clone(), stop.clone());
        if config.heartbeat_consumer {
            tasks.spawn(async move {
                berth_scheduler::run(scheduler, db, bus, halt)
                    .await
                    .context("scheduler")
            });
        }
        let (db, bus, halt) = (pools.reconciler.clone(), nats.clone(), stop.clone());
        let (reconciler, result_subjects) = (config.reconciler, subjects.clone());
        // A create retried elsewhere is placed within the API's heartbeat window.
        let freshness = config.api.heartbeat_freshness;
        tasks.spawn(async move {
            match reconciler {
                Reconciler::Leader(mut config) => {
                    config.pass.health.heartbeat_freshness = freshness;
                    berth_reconciler::run(*config, db, bus, halt)
                        .await
                        .context("reconciler")
                }
                Reconciler::ResultsOnly(concurrency) => {
                    let health = berth_reconciler::health::HealthConfig {
                        heartbeat_freshness: freshness,
                        ..Default::default()
                    };
                    // The caller's passes count command timeouts to the results watermark.
                    let sampling = halt.child_token();
                    let watermark = tokio::spawn(berth_reconciler::watermark::run(
                        db.clone(),
                        bus.clone(),
                        result_subjects.clone(),
                        sampling.clone(),
                    ));
                    let consumed = berth_reconciler::results::consume(
                        &result_subjects,
                        &db,
                        bus,
                        health,
                        concurrency,
                        halt,
                    )
                    .await;
                    sampling.cancel();
                    let _ = watermark.await;
                    consumed.context("result consumer")
                }
            }
        });
        // The API pulls template images into the first hostd's template cache (every hostd of
        // a stack shares the machine; others pull by digest on first use).
        let template_cache = config
            .hosts
            .first()
            .map(|h| h.template_cache.clone())
            .unwrap_or_else(|| berth_hostd::template::DEFAULT_TEMPLATE_CACHE.into());
        for host in config.hosts {
            let stop = stop.clone();
            tasks.spawn(async move { berth_hostd::run(host, stop).await.context("hostd") });
        }
        let proxy_addr = match config.proxy_listen {
            Some(addr) => {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("bind the preview proxy to {addr}"))?;
                let bound = listener.local_addr()?;
                let proxy = berth_api::preview::Preview::new(
                    pools.api.clone(),
                    berth_api::limits::Guards::new(config.api.limits.clone()),
                    config.api.preview.clone(),
                    config.api.overcommit,
                );
                tasks.spawn(
                    berth_api::preview::routes::evict_on_events(
                        proxy.clone(),
                        nats.clone(),
                        subjects.clone(),
                        stop.clone(),
                    )
                    .map(Ok),
                );
                let halt = stop.clone();
                tasks.spawn(async move {
                    berth_api::preview::server::serve(listener, proxy, halt)
                        .await
                        .context("preview proxy")
                });
                Some(bound)
            }
            None => None,
        };
        let state = berth_api::AppState::new(
            pools.api.clone(),
            nats.clone(),
            subjects.clone(),
            config.api,
            berth_api::metrics::handle(),
        )
        .with_images(std::sync::Arc::new(crate::image_puller::CachePuller::new(
            &template_cache,
        )));
        tasks.spawn({
            let stop = stop.clone();
            async move { berth_api::serve(listener, state, stop).await.context("api") }
        });
        Ok(Stack {
            api_addr,
            proxy_addr,
            db: pools.api,
            nats,
            subjects,
            shutdown: stop,
            started_at,
            tasks,
        })
    }

    /// `http://<api address>`.
    pub fn api_url(&self) -> String {
        format!("http://{}", self.api_addr)
    }

    /// Waits until `n` hosts are heard from since this stack started (in service or cordoned,
    /// draining: not `lost`).
    ///
    /// Errors: after `timeout`, when `shutdown` fires, or when a component exits first.
    pub async fn wait_for_hosts(
        &mut self,
        n: usize,
        timeout: Duration,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let fresh: i64 = sqlx::query_scalar(
                // Up, whatever the operator made of it: a host cordoned or draining before a
                // restart heartbeats as such (an attack run's restart waited 60 s and gave up).
                "SELECT count(*) FROM hosts WHERE state <> 'lost' AND last_seen >= $1",
            )
            .bind(self.started_at)
            .fetch_one(&self.db)
            .await?;
            if fresh >= n as i64 {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!("only {fresh} of {n} hosts sent a heartbeat within {timeout:?}");
            }
            tokio::select! {
                _ = shutdown.cancelled() => bail!("interrupted while waiting for hosts"),
                exited = self.exited() => {
                    exited?;
                    bail!("a component exited during start-up");
                }
                _ = tokio::time::sleep(HOSTS_POLL) => {}
            }
        }
    }

    /// Waits until the first component stops; its error, if it failed. Never returns while
    /// every component runs.
    pub async fn exited(&mut self) -> anyhow::Result<()> {
        match self.tasks.join_next().await {
            Some(Ok(outcome)) => outcome,
            Some(Err(e)) => Err(e.into()),
            None => std::future::pending().await,
        }
    }

    /// Cancels every component and waits (at most [`COMPONENT_STOP_TIMEOUT`] in all) for them
    /// to finish; logs those that failed, aborts those that did not stop.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        let deadline = tokio::time::Instant::now() + COMPONENT_STOP_TIMEOUT;
        while let Ok(Some(joined)) = tokio::time::timeout_at(deadline, self.tasks.join_next()).await
        {
            match joined {
                Ok(Err(e)) => warn!(error = %format!("{e:#}"), "component stopped with an error"),
                Err(e) if e.is_panic() => warn!(error = %e, "component panicked"),
                _ => {}
            }
        }
        self.tasks.abort_all();
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.shutdown.cancel();
        // The JoinSet aborts what is left when it drops.
    }
}
