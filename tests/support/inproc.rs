//! An in-process control plane for tests that need no hostd: the real API router (driven
//! request by request with `tower::ServiceExt::oneshot`), host rows written through the real
//! heartbeat apply, and host results synthesized from the commands the API wrote to the
//! outbox.
//!
//! Everything here runs against the real Postgres (the test's fresh database) and, where a
//! part needs it, the real NATS.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Method, Request};
use berth_schemas::wire::{
    self, Command, CommandResult, Heartbeat, Resources, ResultOutcome, RuntimeInfo,
};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, OrgId, SandboxId, Subjects};
use serde_json::Value;
use sqlx::{PgPool, Row};
use tower::ServiceExt;

#[allow(unused_imports)]
pub use super::env::{nats_url, unique, unique_subjects};

/// Placement and starts only consider hosts heard from within this window; long, so a host
/// registered at the start of a test stays placeable for all of it.
pub const TEST_HEARTBEAT_FRESHNESS: Duration = Duration::from_secs(3600);

/// Registers (or refreshes) a `ready` host through the scheduler's real heartbeat apply.
pub async fn heartbeat(db: &PgPool, host: HostId, capacity: Resources) {
    berth_scheduler::heartbeat::apply(
        db,
        &Heartbeat {
            host_id: host,
            name: format!("test-{host}"),
            seq: 1,
            capacity,
            used: Resources::default(),
            runtimes: vec![RuntimeInfo {
                name: "runc".into(),
                memory_snapshot: false,
            }],
            inventory: Vec::new(),
            forwarder: None,
            sent_at_ms: now_ms(),
            warm: Vec::new(),
        },
    )
    .await
    .expect("heartbeat apply");
}

/// An org and its API key.
#[derive(Debug, Clone)]
pub struct Org {
    pub id: OrgId,
    pub key: String,
}

/// Creates an org with a unique name through the API's own org creation.
pub async fn org(db: &PgPool) -> Org {
    let (id, key) = berth_api::auth::create_org(db, &format!("org-{}", unique()))
        .await
        .expect("create org");
    Org { id, key }
}

/// The API's real router over the test database.
#[derive(Clone)]
pub struct Api {
    router: axum::Router,
}

/// One HTTP answer: status and JSON body (`Value::Null` when the body is empty).
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Reply {
    /// `error.code` of an error body.
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("")
    }
}

impl Api {
    /// The router with a real NATS client (used only by exec) and a long heartbeat freshness.
    pub fn new(db: PgPool, nats: async_nats::Client, subjects: Subjects) -> Self {
        Self::configured(db, nats, subjects, |_| {})
    }

    /// [`Api::new`] with `adjust` applied to its configuration last.
    pub fn configured(
        db: PgPool,
        nats: async_nats::Client,
        subjects: Subjects,
        adjust: impl FnOnce(&mut berth_api::ApiConfig),
    ) -> Self {
        Self::with_state(db, nats, subjects, adjust, |state| state)
    }

    /// [`Api::configured`], with `state` applied to the router's state last (an image puller,
    /// say).
    pub fn with_state(
        db: PgPool,
        nats: async_nats::Client,
        subjects: Subjects,
        adjust: impl FnOnce(&mut berth_api::ApiConfig),
        state: impl FnOnce(berth_api::AppState) -> berth_api::AppState,
    ) -> Self {
        let addr = "127.0.0.1:0".parse().expect("a socket address");
        let mut config = berth_api::ApiConfig::new(addr, subjects.clone());
        config.heartbeat_freshness = TEST_HEARTBEAT_FRESHNESS;
        // The tests' webhook receivers listen on loopback.
        config.webhooks.allow_private_targets = true;
        // Scenarios drive one key much faster than a client should.
        config.limits = berth_api::limits::LimitsConfig::without_rate_limits();
        // The tests' egress targets are private networks they make.
        config.sandbox_egress_private = true;
        adjust(&mut config);
        let built =
            berth_api::AppState::new(db, nats, subjects, config, berth_api::metrics::handle());
        Self {
            router: berth_api::router(state(built)),
        }
    }

    /// Sends one request as the holder of `key`, with an `Idempotency-Key` when given.
    pub async fn call(
        &self,
        key: &str,
        method: Method,
        path: &str,
        idempotency_key: Option<&str>,
        body: Option<&str>,
    ) -> Reply {
        self.call_full(key, method, path, idempotency_key, body)
            .await
            .0
    }

    /// [`Api::call`] with a JSON `body` and no `Idempotency-Key`; also the answer's
    /// `Retry-After` header, if any.
    pub async fn call_with_retry_after(
        &self,
        key: &str,
        method: Method,
        path: &str,
        body: &str,
    ) -> (Reply, Option<String>) {
        let (reply, headers) = self.call_full(key, method, path, None, Some(body)).await;
        let retry_after = headers
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        (reply, retry_after)
    }

    async fn call_full(
        &self,
        key: &str,
        method: Method,
        path: &str,
        idempotency_key: Option<&str>,
        body: Option<&str>,
    ) -> (Reply, axum::http::HeaderMap) {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(header::AUTHORIZATION, format!("Bearer {key}"));
        if let Some(k) = idempotency_key {
            req = req.header("idempotency-key", k);
        }
        let req = match body {
            Some(b) => req
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(b.to_owned())),
            None => req.body(Body::empty()),
        }
        .expect("a well-formed request");
        self.send_full(req).await
    }

    /// Sends `req` as it is (headers the caller set, any body).
    pub async fn send(&self, req: Request<Body>) -> Reply {
        self.send_full(req).await.0
    }

    /// [`Api::send`], with the answer's headers.
    async fn send_full(&self, req: Request<Body>) -> (Reply, axum::http::HeaderMap) {
        let resp = self
            .router
            .clone()
            .oneshot(req)
            .await
            .expect("the router is infallible");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .expect("read the response body");
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        (Reply { status, body }, headers)
    }

    /// `POST /v1/sandboxes` with `body`; panics unless it is accepted. Returns the sandbox id.
    pub async fn create(&self, key: &str, body: &str) -> SandboxId {
        let reply = self
            .call(key, Method::POST, "/v1/sandboxes", None, Some(body))
            .await;
        assert_eq!(reply.status, 202, "create: {}", reply.body);
        reply.body["id"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .expect("the created sandbox's id")
    }

    /// `POST /v1/sandboxes/{id}/{verb}` (or `DELETE` for `delete`), without an idempotency key.
    pub async fn lifecycle(&self, key: &str, id: SandboxId, verb: &str) -> Reply {
        if verb == "delete" {
            self.call(
                key,
                Method::DELETE,
                &format!("/v1/sandboxes/{id}"),
                None,
                None,
            )
            .await
        } else {
            self.call(
                key,
                Method::POST,
                &format!("/v1/sandboxes/{id}/{verb}"),
                None,
                None,
            )
            .await
        }
    }
}

/// A command as the outbox holds it, its payload decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxCommand {
    pub id: CommandId,
    pub sandbox_id: SandboxId,
    pub host_id: HostId,
    pub kind: CommandKind,
    pub generation: Generation,
    pub completed: bool,
    pub published: bool,
    /// The decoded payload.
    pub command: Command,
}

/// Reads commands matching `filter` (a condition on the alias `c`), oldest first; checks that
/// every payload decodes to the command its columns describe.
pub async fn commands_where(db: &PgPool, filter: &str, bind: uuid::Uuid) -> Vec<OutboxCommand> {
    let rows = sqlx::query(&format!(
        "SELECT c.id, c.sandbox_id, c.host_id, c.kind, c.generation, c.payload,
                c.completed_at IS NOT NULL AS completed, c.published_at IS NOT NULL AS published
           FROM commands c
          WHERE {filter}
          ORDER BY c.created_at, c.id"
    ))
    .bind(bind)
    .fetch_all(db)
    .await
    .expect("read commands");
    rows.iter()
        .map(|r| {
            let payload: Vec<u8> = r.get("payload");
            let command: Command = wire::decode(&payload).expect("a command payload decodes");
            let kind: String = r.get("kind");
            assert_eq!(command.kind.as_str(), kind, "payload kind = column kind");
            assert_eq!(
                command.id,
                r.get::<CommandId, _>("id"),
                "payload id = row id"
            );
            assert_eq!(command.sandbox_id, r.get::<SandboxId, _>("sandbox_id"));
            assert_eq!(command.generation, r.get::<Generation, _>("generation"));
            OutboxCommand {
                id: command.id,
                sandbox_id: command.sandbox_id,
                host_id: r.get("host_id"),
                kind: command.kind,
                generation: command.generation,
                completed: r.get("completed"),
                published: r.get("published"),
                command,
            }
        })
        .collect()
}

/// Every command of one sandbox, oldest first.
pub async fn commands_of(db: &PgPool, sandbox: SandboxId) -> Vec<OutboxCommand> {
    commands_where(db, "c.sandbox_id = $1", sandbox.as_uuid()).await
}

/// What a host would report for `command`.
pub fn result_for(command: &OutboxCommand, outcome: ResultOutcome) -> CommandResult {
    CommandResult {
        command_id: command.id,
        sandbox_id: command.sandbox_id,
        host_id: command.host_id,
        generation: command.generation,
        kind: command.kind,
        outcome,
        heartbeat_seq: 0,
        apply_ms: 0,
    }
}

/// A success as hostd reports it (an address when the sandbox runs).
pub fn succeeded(kind: CommandKind) -> ResultOutcome {
    ResultOutcome::Succeeded {
        address: matches!(kind, CommandKind::Create | CommandKind::Start)
            .then(|| "10.99.0.2".to_owned()),
        last_stop: (kind == CommandKind::Stop).then_some(wire::StopMode::Disk),
    }
}

/// A runtime failure.
pub fn failed() -> ResultOutcome {
    ResultOutcome::Failed {
        reason: "runtime failed (synthesized by the test)".into(),
    }
}

/// One sandbox row as the lifecycle guarantees look at it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowView {
    pub state: String,
    pub generation: i64,
    pub holds_capacity: bool,
    pub deleting: bool,
}

/// Reads one sandbox row.
pub async fn row(db: &PgPool, id: SandboxId) -> RowView {
    let r = sqlx::query(
        "SELECT state, generation, holds_capacity, deleted_at IS NOT NULL AS deleting
           FROM sandboxes WHERE id = $1",
    )
    .bind(id)
    .fetch_one(db)
    .await
    .expect("read the sandbox row");
    RowView {
        state: r.get("state"),
        generation: r.get("generation"),
        holds_capacity: r.get("holds_capacity"),
        deleting: r.get("deleting"),
    }
}

/// `(reserved_vcpus, reserved_memory_mib)` of one host.
pub async fn reserved(db: &PgPool, host: HostId) -> (i64, i64) {
    sqlx::query_as("SELECT reserved_vcpus::int8, reserved_memory_mib FROM hosts WHERE id = $1")
        .bind(host)
        .fetch_one(db)
        .await
        .expect("read the host's reservation")
}

/// The `to_state` of every event of one sandbox, in commit order.
pub async fn event_states(db: &PgPool, id: SandboxId) -> Vec<String> {
    sqlx::query_scalar("SELECT to_state FROM events WHERE sandbox_id = $1 ORDER BY at, id")
        .bind(id)
        .fetch_all(db)
        .await
        .expect("read events")
}

/// `berth_reconciler::results::consume` on a task of its own, with the default health
/// config and concurrency, until `shutdown`; `nats` is its connection.
pub fn spawn_result_consumer(
    subjects: &Subjects,
    db: &PgPool,
    nats: async_nats::Client,
    shutdown: &tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<Result<(), berth_reconciler::ReconcilerError>> {
    let (subjects, db, shutdown) = (subjects.clone(), db.clone(), shutdown.clone());
    tokio::spawn(async move {
        berth_reconciler::results::consume(
            &subjects,
            &db,
            nats,
            Default::default(),
            berth_reconciler::results::APPLY_CONCURRENCY,
            shutdown,
        )
        .await
    })
}

/// Stops a consumer of [`spawn_result_consumer`] through its `shutdown`, waits (at most 60 s)
/// for it to end without error, then deletes the test's streams.
pub async fn stop_result_consumer(
    shutdown: &tokio_util::sync::CancellationToken,
    consumer: tokio::task::JoinHandle<Result<(), berth_reconciler::ReconcilerError>>,
    js: &async_nats::jetstream::Context,
    subjects: &Subjects,
) {
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(60), consumer)
        .await
        .expect("the consumer stops")
        .unwrap()
        .unwrap();
    berth_schemas::streams::delete_streams(js, subjects).await;
}

/// Publishes `result` on `host`'s result subject, as that host would, and awaits the stream's
/// ack.
pub async fn publish_result(
    js: &async_nats::jetstream::Context,
    subjects: &Subjects,
    host: HostId,
    result: &CommandResult,
) {
    js.publish(
        subjects.result(host),
        berth_schemas::wire::encode(result).into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

/// Host health for scenarios that synthesize host failures to test the sandbox lifecycle: a
/// host is never degraded (the third failure in a row would otherwise take the scenario's one
/// host out of placement, and its next create would be `503 unavailable`). Host health has
/// its own tests (`ops::host_health`); everything else is the default.
pub fn lifecycle_only_health() -> berth_reconciler::health::HealthConfig {
    let mut health = berth_reconciler::health::HealthConfig::default();
    health.policy.degrade_after = u32::MAX;
    health
}

/// A pass configuration whose command timeouts fire at once, and nothing else ever does.
pub fn eager_timeouts() -> berth_reconciler::pass::PassConfig {
    berth_reconciler::pass::PassConfig {
        health: lifecycle_only_health(),
        create_timeout: Duration::ZERO,
        start_timeout: Duration::ZERO,
        stop_timeout: Duration::ZERO,
        // The test's heartbeats carry no inventory; never judge a guest by it.
        inventory_grace: Duration::from_secs(365 * 24 * 3600),
        ..Default::default()
    }
}

/// What the relay would have done by now: marks every unpublished command published. This
/// plane runs no relay, and a command still in the outbox of a healthy host never times out.
pub async fn relay_all(db: &PgPool) {
    sqlx::query("UPDATE commands SET published_at = now() WHERE published_at IS NULL")
        .execute(db)
        .await
        .expect("mark the outbox published");
}

/// Takes the reconciler lease for the whole test.
pub async fn lease(db: &PgPool) -> berth_store::leases::Lease {
    berth_store::leases::acquire(
        db,
        berth_reconciler::LEASE_NAME,
        uuid::Uuid::now_v7(),
        Duration::from_secs(3600),
    )
    .await
    .expect("acquire the lease")
    .expect("nobody else holds the lease in a fresh database")
}

/// What the host of a [`Plane`] offers.
pub const HOST_CAPACITY: Resources = Resources {
    vcpus: 16,
    memory_mib: 16_384,
};
/// The create body of [`Plane::create`].
pub const SANDBOX: &str = r#"{"vcpus":1,"memory_mib":256}"#;

/// A host, an org and the router on the test's database: results are delivered by hand.
pub struct Plane {
    pub db: PgPool,
    pub api: Api,
    pub org: Org,
    pub host: HostId,
}

impl Plane {
    /// Registers a host of [`HOST_CAPACITY`] and an org on `db`.
    pub async fn start(db: PgPool) -> Plane {
        let host = HostId::new();
        heartbeat(&db, host, HOST_CAPACITY).await;
        let nats = async_nats::connect(nats_url())
            .await
            .expect("connect to NATS");
        Plane {
            api: Api::new(db.clone(), nats, unique_subjects()),
            org: org(&db).await,
            db,
            host,
        }
    }

    /// Creates a sandbox of [`SANDBOX`]'s size; panics unless accepted.
    pub async fn create(&self) -> SandboxId {
        self.api.create(&self.org.key, SANDBOX).await
    }

    /// Creates a sandbox and delivers its create's success: `running` on the plane's host.
    pub async fn running(&self) -> SandboxId {
        let id = self.create().await;
        let create = self.latest(id).await;
        self.deliver(&create, succeeded(CommandKind::Create)).await;
        id
    }

    /// A [`Plane::running`] sandbox with its stop requested: its open stop command.
    pub async fn stopping(&self) -> (SandboxId, OutboxCommand) {
        let id = self.running().await;
        self.request(id, "stop").await;
        (id, self.latest(id).await)
    }

    /// A [`Plane::stopping`] sandbox whose stop's first result was delivered: `stopped`; its
    /// stop command.
    pub async fn stopped(&self) -> (SandboxId, OutboxCommand) {
        let (id, stop) = self.stopping().await;
        self.deliver(&stop, succeeded(CommandKind::Stop)).await;
        (id, stop)
    }

    /// The sandbox as `GET /v1/sandboxes/{id}` shows it, after checking that the list
    /// (`GET /v1/sandboxes{list_query}`) holds it with the same `host_id`.
    pub async fn shown(&self, id: SandboxId, list_query: &str) -> Value {
        let key = &self.org.key;
        let path = format!("/v1/sandboxes/{id}");
        let one = self.api.call(key, Method::GET, &path, None, None).await;
        assert_eq!(one.status, 200, "{}", one.body);
        let path = format!("/v1/sandboxes{list_query}");
        let list = self.api.call(key, Method::GET, &path, None, None).await;
        let listed = list.body["sandboxes"]
            .as_array()
            .and_then(|all| all.iter().find(|s| s["id"] == id.to_string()))
            .unwrap_or_else(|| panic!("{id} not listed: {}", list.body));
        assert_eq!(listed["host_id"], one.body["host_id"], "{listed}");
        one.body
    }

    /// A lifecycle request that must be accepted.
    pub async fn request(&self, id: SandboxId, verb: &str) {
        let reply = self.api.lifecycle(&self.org.key, id, verb).await;
        assert_eq!(reply.status, 202, "{verb} {id}: {}", reply.body);
    }

    /// The sandbox's newest command.
    pub async fn latest(&self, id: SandboxId) -> OutboxCommand {
        commands_of(&self.db, id)
            .await
            .pop()
            .expect("the sandbox has a command")
    }

    /// Applies the host's report on `command` through the reconciler.
    pub async fn deliver(
        &self,
        command: &OutboxCommand,
        outcome: ResultOutcome,
    ) -> berth_reconciler::results::Applied {
        berth_reconciler::results::apply_with(
            &self.db,
            &result_for(command, outcome),
            &lifecycle_only_health(),
        )
        .await
        .expect("apply a result")
    }

    /// Guarantee 4 once every sandbox let go: nothing reserved, no drift.
    pub async fn assert_capacity_released(&self) {
        assert_eq!(reserved(&self.db, self.host).await, (0, 0));
        assert_eq!(
            berth_reconciler::pass::capacity_drift(&self.db)
                .await
                .unwrap(),
            (0, 0)
        );
    }
}

/// Now in milliseconds since the Unix epoch (a heartbeat's send time).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
