//! A model-based property test of the sandbox lifecycle, through the real code paths on the
//! real Postgres (no hostd, no NATS streams):
//!
//! - user requests go through the real axum router: create, stop, pause, start, resume and
//!   delete, with and without `Idempotency-Key` (replays, and reuse with another request);
//! - host results are synthesized from the commands the API and the reconciler wrote to the
//!   outbox and fed to `berth_reconciler::results::apply` — twice, late, out of order, for
//!   superseded generations, and refused as stale;
//! - the reconciler's leader pass runs with command timeouts of zero, so every command still
//!   awaited times out when a pass runs.
//!
//! A small model (written from DESIGN.md and the request table of `schemas/src/state.rs`, not
//! from the code) predicts every HTTP status, every state, generation, capacity hold, command
//! and event count. After every step the test compares the database and the API with the model
//! and checks the guarantees observable without hosts: 1 (row, placement, command and event
//! commit together; a refused request writes nothing), 3 (a deleted sandbox never comes back),
//! 4 (host reservations equal the capacity-holding sandboxes, drift 0) and 7 (another org sees
//! nothing).
//!
//! One database serves every case; each case gets its own org, a second org as the intruder,
//! and its own host (the previous cases' hosts are cordoned, so placement is predictable).

mod inproc;

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use axum::http::Method;
use berth_reconciler::lease::Lease;
use berth_reconciler::pass::{self, PassConfig};
use berth_reconciler::results::{self, Applied};
use berth_scheduler::placement::Overcommit;
use berth_schemas::state::Request;
use berth_schemas::wire::{CommandResult, Resources, ResultOutcome};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, SandboxId, SandboxState};
use chrono::{DateTime, Utc};
use inproc::{Api, Org, Reply};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Row};

/// How many random sequences to run.
const CASES: u32 = 200;
/// The longest sequence of steps in one case.
const MAX_STEPS: usize = 32;
/// Each case's host. With the default overcommit placement may reserve 256 vCPUs and 100,000
/// MiB: one `Large` sandbox and dozens of small ones fit, a second `Large` does not, so
/// `no_capacity` is reachable for creates and for starts.
const HOST_CAPACITY: Resources = Resources {
    vcpus: 64,
    memory_mib: 100_000,
};

/// A create body the test sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    Small,
    Large,
    Tagged,
    /// An empty body: every default.
    Empty,
    /// Refused by validation (400).
    Invalid,
    /// Refused as `unknown_template` (422).
    UnknownTemplate,
}

impl Body {
    fn json(self) -> &'static str {
        match self {
            Body::Small => r#"{"vcpus":1,"memory_mib":256}"#,
            Body::Large => r#"{"vcpus":8,"memory_mib":65536}"#,
            Body::Tagged => r#"{"vcpus":2,"memory_mib":512,"metadata":{"team":"model"}}"#,
            Body::Empty => "",
            Body::Invalid => r#"{"vcpus":0}"#,
            Body::UnknownTemplate => r#"{"template":"no-such-template"}"#,
        }
    }

    /// What a sandbox created from this body reserves.
    fn resources(self) -> Resources {
        let (vcpus, memory_mib) = match self {
            Body::Small => (1, 256),
            Body::Large => (8, 65_536),
            Body::Tagged => (2, 512),
            Body::Empty => (1, 512),
            Body::Invalid | Body::UnknownTemplate => (0, 0),
        };
        Resources { vcpus, memory_mib }
    }
}

/// A lifecycle route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Stop,
    Pause,
    Start,
    Resume,
    Delete,
}

impl Action {
    fn request(self) -> Request {
        match self {
            Action::Stop | Action::Pause => Request::Stop,
            Action::Start | Action::Resume => Request::Start,
            Action::Delete => Request::Delete,
        }
    }

    fn route(self, id: SandboxId) -> (Method, String) {
        let verb = match self {
            Action::Stop => "stop",
            Action::Pause => "pause",
            Action::Start => "start",
            Action::Resume => "resume",
            Action::Delete => return (Method::DELETE, format!("/v1/sandboxes/{id}")),
        };
        (Method::POST, format!("/v1/sandboxes/{id}/{verb}"))
    }
}

/// What the synthesized host reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reported {
    Succeeded,
    Failed,
    /// hostd refused the command as older than what it applied.
    RefusedStale,
}

/// One step of a case.
#[derive(Clone, Debug)]
enum Op {
    /// `POST /v1/sandboxes`, with `Idempotency-Key: key-<n>` when `key` is set.
    Create { body: Body, key: Option<u8> },
    /// A lifecycle request on one of the case's sandboxes.
    Lifecycle {
        sandbox: Index,
        action: Action,
        key: Option<u8>,
    },
    /// A host result for one of the case's commands (any of them: old, superseded, repeated).
    Deliver {
        command: Index,
        reported: Reported,
        twice: bool,
    },
    /// A host result for the newest command of one sandbox: what moves a lifecycle on.
    DeliverLatest {
        sandbox: Index,
        reported: Reported,
        twice: bool,
    },
    /// The last request that carried an `Idempotency-Key`, sent again unchanged.
    Retry,
    /// One reconciler pass with zero command timeouts.
    Pass,
    /// The other org tries a lifecycle request on one of this org's sandboxes.
    Intrude { sandbox: Index, action: Action },
}

fn body() -> impl Strategy<Value = Body> {
    prop_oneof![
        6 => Just(Body::Small),
        3 => Just(Body::Large),
        2 => Just(Body::Tagged),
        1 => Just(Body::Empty),
        1 => Just(Body::Invalid),
        1 => Just(Body::UnknownTemplate),
    ]
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        Just(Action::Stop),
        Just(Action::Pause),
        Just(Action::Start),
        Just(Action::Resume),
        Just(Action::Delete),
    ]
}

fn reported() -> impl Strategy<Value = Reported> {
    prop_oneof![
        5 => Just(Reported::Succeeded),
        3 => Just(Reported::Failed),
        1 => Just(Reported::RefusedStale),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let key = || proptest::option::weighted(0.4, 0u8..3);
    prop_oneof![
        2 => (body(), key()).prop_map(|(body, key)| Op::Create { body, key }),
        6 => (any::<Index>(), action(), key())
            .prop_map(|(sandbox, action, key)| Op::Lifecycle { sandbox, action, key }),
        3 => (any::<Index>(), reported(), proptest::bool::weighted(0.25))
            .prop_map(|(command, reported, twice)| Op::Deliver { command, reported, twice }),
        6 => (any::<Index>(), reported(), proptest::bool::weighted(0.25))
            .prop_map(|(sandbox, reported, twice)| Op::DeliverLatest { sandbox, reported, twice }),
        2 => Just(Op::Retry),
        2 => Just(Op::Pass),
        1 => (any::<Index>(), action()).prop_map(|(sandbox, action)| Op::Intrude { sandbox, action }),
    ]
}

/// What the model expects of a lifecycle request (DESIGN.md "Lifecycle" and the table in the
/// module docs of `schemas/src/state.rs`, restricted to the states this test reaches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Accepted(SandboxState, CommandKind),
    Unchanged,
    Conflict,
}

fn expect_request(state: SandboxState, deleting: bool, request: Request) -> Expect {
    use SandboxState as S;
    if deleting || state == S::Deleted {
        return if request == Request::Delete {
            Expect::Unchanged
        } else {
            Expect::Conflict
        };
    }
    match (request, state) {
        (Request::Delete, _) => Expect::Accepted(S::Stopping, CommandKind::Delete),
        (Request::Start, S::Stopped | S::FailedStart) => {
            Expect::Accepted(S::Starting, CommandKind::Start)
        }
        (Request::Start, S::Provisioning | S::Starting | S::Running) => Expect::Unchanged,
        (Request::Start, S::Stopping) => Expect::Conflict,
        (Request::Stop, S::Running) => Expect::Accepted(S::Stopping, CommandKind::Stop),
        (Request::Stop, S::Stopping | S::Stopped | S::FailedStart) => Expect::Unchanged,
        (Request::Stop, S::Provisioning | S::Starting) => Expect::Conflict,
        (_, other) => panic!("the model never reaches {other}"),
    }
}

#[derive(Debug, Clone)]
struct ModelSandbox {
    id: SandboxId,
    resources: Resources,
    state: SandboxState,
    generation: i64,
    deleting: bool,
    holds: bool,
    /// Event rows written for it.
    events: usize,
    /// `deleted_at` as first seen; it must never change.
    deleted_at: Option<DateTime<Utc>>,
    /// The highest generation seen in the database.
    seen_generation: i64,
    /// Whether the database ever showed it `deleted`.
    seen_deleted: bool,
}

#[derive(Debug, Clone)]
struct ModelCommand {
    /// Learned from the outbox after the step that wrote it.
    id: Option<CommandId>,
    sandbox: usize,
    kind: CommandKind,
    generation: i64,
    completed: bool,
}

/// A response stored under an idempotency key.
#[derive(Debug, Clone)]
struct Stored {
    fingerprint: String,
    status: u16,
    body: Value,
}

#[derive(Debug, Default)]
struct Model {
    sandboxes: Vec<ModelSandbox>,
    commands: Vec<ModelCommand>,
    keys: HashMap<String, Stored>,
    reserved: Resources,
}

impl Model {
    fn fits(&self, need: Resources) -> bool {
        let limit = Overcommit::default().limit(HOST_CAPACITY);
        self.reserved.vcpus + need.vcpus <= limit.vcpus
            && self.reserved.memory_mib + need.memory_mib <= limit.memory_mib
    }

    fn reserve(&mut self, i: usize) {
        let r = self.sandboxes[i].resources;
        self.reserved.vcpus += r.vcpus;
        self.reserved.memory_mib += r.memory_mib;
        self.sandboxes[i].holds = true;
    }

    fn release(&mut self, i: usize) {
        if self.sandboxes[i].holds {
            let r = self.sandboxes[i].resources;
            self.reserved.vcpus -= r.vcpus;
            self.reserved.memory_mib -= r.memory_mib;
            self.sandboxes[i].holds = false;
        }
    }

    fn queue(&mut self, sandbox: usize, kind: CommandKind) {
        self.commands.push(ModelCommand {
            id: None,
            sandbox,
            kind,
            generation: self.sandboxes[sandbox].generation,
            completed: false,
        });
    }

    /// A host result for command `c`: what `results::apply` must answer, with the model moved.
    fn result(&mut self, c: usize, reported: Reported) -> Applied {
        use SandboxState as S;
        self.commands[c].completed = true;
        let (i, kind, generation) = {
            let cmd = &self.commands[c];
            (cmd.sandbox, cmd.kind, cmd.generation)
        };
        let sb = &self.sandboxes[i];
        if reported == Reported::RefusedStale || generation != sb.generation {
            return Applied::Stale;
        }
        let ok = reported == Reported::Succeeded;
        let (to, releases) = match (kind, sb.state, ok, sb.deleting) {
            (CommandKind::Create, S::Provisioning, true, false) => (S::Running, false),
            (CommandKind::Create, S::Provisioning, false, false) => (S::FailedStart, true),
            (CommandKind::Start, S::Starting, true, false) => (S::Running, false),
            (CommandKind::Start, S::Starting, false, false) => (S::FailedStart, true),
            (CommandKind::Stop, S::Stopping, true, false) => (S::Stopped, true),
            (CommandKind::Stop, S::Stopping, false, false) => (S::Running, false),
            (CommandKind::Delete, S::Stopping, true, true) => (S::Deleted, true),
            // A success the row already failed: undone on the host, once per generation.
            (CommandKind::Create | CommandKind::Start, S::FailedStart, true, _) => {
                let undo = if kind == CommandKind::Create {
                    CommandKind::Delete
                } else {
                    CommandKind::Stop
                };
                let queued = self
                    .commands
                    .iter()
                    .any(|c| c.sandbox == i && c.kind == undo && c.generation == sb.generation);
                if queued {
                    return Applied::Duplicate;
                }
                self.queue(i, undo);
                return Applied::Compensated;
            }
            _ => return Applied::Duplicate,
        };
        if releases {
            self.release(i);
        }
        let sb = &mut self.sandboxes[i];
        sb.state = to;
        sb.events += 1;
        Applied::Transitioned { to }
    }

    /// A pass with zero command timeouts: every sandbox (not being deleted) still waiting on
    /// its current command fails, releases its capacity and gets a compensating command.
    fn pass(&mut self) {
        use SandboxState as S;
        for i in 0..self.sandboxes.len() {
            let sb = &self.sandboxes[i];
            if sb.deleting {
                continue;
            }
            let awaited = self.commands.iter().find(|c| {
                c.sandbox == i
                    && !c.completed
                    && c.generation == sb.generation
                    && matches!(
                        (c.kind, sb.state),
                        (CommandKind::Create, S::Provisioning)
                            | (CommandKind::Start, S::Starting)
                            | (CommandKind::Stop, S::Stopping)
                    )
            });
            let Some(awaited) = awaited else { continue };
            let undo = if awaited.kind == CommandKind::Create {
                CommandKind::Delete
            } else {
                CommandKind::Stop
            };
            let old = sb.generation;
            for c in &mut self.commands {
                if c.sandbox == i && c.generation <= old {
                    c.completed = true;
                }
            }
            self.release(i);
            let sb = &mut self.sandboxes[i];
            sb.state = S::FailedStart;
            sb.generation += 1;
            sb.events += 1;
            self.queue(i, undo);
        }
    }
}

/// What every case shares: one database, the router, the lease and the pass configuration.
struct Env {
    db: PgPool,
    api: Api,
    lease: Lease,
    pass: PassConfig,
    /// How often each kind of outcome happened, printed at the end to show what was covered.
    seen: Mutex<BTreeMap<String, u64>>,
}

impl Env {
    async fn start(pool: PgPoolOptions, connect: PgConnectOptions) -> Env {
        let db = pool
            .max_connections(8)
            .connect_with(connect)
            .await
            .expect("connect to the test database");
        let nats = async_nats::connect(inproc::nats_url())
            .await
            .expect("connect to NATS");
        let api = Api::new(db.clone(), nats, inproc::unique_subjects());
        let lease = inproc::lease(&db).await;
        Env {
            db,
            api,
            lease,
            pass: inproc::eager_timeouts(),
            seen: Mutex::default(),
        }
    }

    fn saw(&self, what: String) {
        *self.seen.lock().unwrap().entry(what).or_default() += 1;
    }
}

/// A request that carried an `Idempotency-Key`, resolved to its sandbox.
#[derive(Debug, Clone, Copy)]
enum Keyed {
    Create(Body, u8),
    Lifecycle(usize, Action, u8),
}

/// One case: its org, the intruding org, its host and the model.
struct Case<'a> {
    env: &'a Env,
    org: Org,
    other: Org,
    host: HostId,
    model: Model,
    last_keyed: Option<Keyed>,
}

fn fail(message: String) -> TestCaseError {
    TestCaseError::fail(message)
}

impl<'a> Case<'a> {
    async fn new(env: &'a Env) -> Case<'a> {
        let host = HostId::new();
        inproc::heartbeat(&env.db, host, HOST_CAPACITY).await;
        // Earlier cases' hosts leave placement, so this case's sandboxes all land here.
        sqlx::query("UPDATE hosts SET state = 'cordoned' WHERE id <> $1 AND state = 'ready'")
            .bind(host)
            .execute(&env.db)
            .await
            .expect("cordon earlier hosts");
        Case {
            env,
            org: inproc::org(&env.db).await,
            other: inproc::org(&env.db).await,
            host,
            model: Model::default(),
            last_keyed: None,
        }
    }

    fn expect_replay(
        &self,
        stored: &Stored,
        fingerprint: &str,
        reply: &Reply,
    ) -> Result<(), TestCaseError> {
        self.env.saw(format!(
            "idempotency {}",
            if stored.fingerprint == fingerprint {
                "replay"
            } else {
                "reused"
            }
        ));
        if stored.fingerprint == fingerprint {
            prop_assert_eq!(
                reply.status,
                stored.status,
                "a replay answers the stored status"
            );
            prop_assert_eq!(
                &reply.body,
                &stored.body,
                "a replay answers the stored body"
            );
        } else {
            prop_assert_eq!(reply.status, 422, "{}", reply.body);
            prop_assert_eq!(reply.code(), "idempotency_key_reused");
        }
        Ok(())
    }

    async fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Create { body, key } => self.create(body, key).await,
            Op::Lifecycle {
                sandbox,
                action,
                key,
            } => {
                if self.model.sandboxes.is_empty() {
                    return Ok(());
                }
                self.lifecycle(sandbox.index(self.model.sandboxes.len()), action, key)
                    .await
            }
            Op::Deliver {
                command,
                reported,
                twice,
            } => {
                if self.model.commands.is_empty() {
                    return Ok(());
                }
                self.deliver(command.index(self.model.commands.len()), reported, twice)
                    .await
            }
            Op::DeliverLatest {
                sandbox,
                reported,
                twice,
            } => {
                if self.model.sandboxes.is_empty() {
                    return Ok(());
                }
                let i = sandbox.index(self.model.sandboxes.len());
                let c = self
                    .model
                    .commands
                    .iter()
                    .rposition(|c| c.sandbox == i)
                    .expect("every sandbox has its create command");
                self.deliver(c, reported, twice).await
            }
            Op::Retry => match self.last_keyed {
                None => Ok(()),
                Some(Keyed::Create(body, key)) => self.create(body, Some(key)).await,
                Some(Keyed::Lifecycle(i, action, key)) => {
                    self.lifecycle(i, action, Some(key)).await
                }
            },
            Op::Pass => {
                let report = pass::run_pass(&self.env.db, &self.env.pass, &self.env.lease)
                    .await
                    .map_err(|e| fail(format!("pass failed: {e}")))?;
                prop_assert!(!report.deposed && !report.all_hosts_silent, "{report:?}");
                self.env.saw(format!(
                    "pass timed out {}",
                    report.count(pass::Action::CommandTimeout)
                ));
                self.model.pass();
                Ok(())
            }
            Op::Intrude { sandbox, action } => {
                if self.model.sandboxes.is_empty() {
                    return Ok(());
                }
                let id = self.model.sandboxes[sandbox.index(self.model.sandboxes.len())].id;
                let (method, path) = action.route(id);
                let reply = self
                    .env
                    .api
                    .call(&self.other.key, method, &path, None, None)
                    .await;
                prop_assert_eq!(reply.status, 404, "another org's request: {}", reply.body);
                prop_assert_eq!(reply.code(), "not_found");
                Ok(())
            }
        }
    }

    async fn create(&mut self, body: Body, key: Option<u8>) -> Result<(), TestCaseError> {
        if let Some(k) = key {
            self.last_keyed = Some(Keyed::Create(body, k));
        }
        let key = key.map(|k| format!("key-{k}"));
        let reply = self
            .env
            .api
            .call(
                &self.org.key,
                Method::POST,
                "/v1/sandboxes",
                key.as_deref(),
                Some(body.json()),
            )
            .await;
        let fingerprint = format!("POST /v1/sandboxes {}", body.json());
        self.env
            .saw(format!("create {:?} -> {}", body, reply.status));
        // Validation comes before the idempotency lookup.
        if body == Body::Invalid {
            prop_assert_eq!(reply.status, 400, "{}", reply.body);
            prop_assert_eq!(reply.code(), "invalid_request");
            return Ok(());
        }
        if let Some(stored) = key.as_ref().and_then(|k| self.model.keys.get(k)) {
            return self.expect_replay(stored, &fingerprint, &reply);
        }
        if body == Body::UnknownTemplate {
            prop_assert_eq!(reply.status, 422, "{}", reply.body);
            prop_assert_eq!(reply.code(), "unknown_template");
            return Ok(());
        }
        let need = body.resources();
        if !self.model.fits(need) {
            prop_assert_eq!(reply.status, 503, "{}", reply.body);
            prop_assert_eq!(reply.code(), "no_capacity");
            return Ok(());
        }
        prop_assert_eq!(reply.status, 202, "{}", reply.body);
        prop_assert_eq!(&reply.body["state"], "provisioning");
        prop_assert_eq!(&reply.body["generation"], 1);
        prop_assert_eq!(&reply.body["vcpus"], need.vcpus);
        prop_assert_eq!(&reply.body["memory_mib"], need.memory_mib);
        prop_assert_eq!(
            &reply.body["host_id"],
            &Value::String(self.host.to_string())
        );
        let id: SandboxId = reply.body["id"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| fail(format!("no id in {}", reply.body)))?;
        self.model.sandboxes.push(ModelSandbox {
            id,
            resources: need,
            state: SandboxState::Provisioning,
            generation: 1,
            deleting: false,
            holds: false,
            events: 1,
            deleted_at: None,
            seen_generation: 1,
            seen_deleted: false,
        });
        let i = self.model.sandboxes.len() - 1;
        self.model.reserve(i);
        self.model.queue(i, CommandKind::Create);
        if let Some(k) = key {
            self.model.keys.insert(
                k,
                Stored {
                    fingerprint,
                    status: 202,
                    body: reply.body,
                },
            );
        }
        Ok(())
    }

    async fn lifecycle(
        &mut self,
        i: usize,
        action: Action,
        key: Option<u8>,
    ) -> Result<(), TestCaseError> {
        let sb = self.model.sandboxes[i].clone();
        if let Some(k) = key {
            self.last_keyed = Some(Keyed::Lifecycle(i, action, k));
        }
        let key = key.map(|k| format!("key-{k}"));
        let (method, path) = action.route(sb.id);
        let reply = self
            .env
            .api
            .call(&self.org.key, method.clone(), &path, key.as_deref(), None)
            .await;
        // DELETE takes no Idempotency-Key: it is ignored, never stored nor replayed.
        let key = key.filter(|_| action != Action::Delete);
        let fingerprint = format!("{method} {path}");
        if let Some(stored) = key.as_ref().and_then(|k| self.model.keys.get(k)) {
            return self.expect_replay(stored, &fingerprint, &reply);
        }
        self.env.saw(format!(
            "{:?} from {} -> {}",
            action.request(),
            sb.state,
            reply.status
        ));
        let status = match expect_request(sb.state, sb.deleting, action.request()) {
            Expect::Conflict => {
                prop_assert_eq!(reply.status, 409, "{}", reply.body);
                prop_assert_eq!(reply.code(), "conflict");
                prop_assert_eq!(&reply.body["error"]["state"], sb.state.as_str());
                return Ok(());
            }
            Expect::Unchanged => {
                prop_assert_eq!(reply.status, 200, "{}", reply.body);
                prop_assert_eq!(&reply.body["state"], sb.state.as_str());
                prop_assert_eq!(&reply.body["generation"], sb.generation);
                200
            }
            Expect::Accepted(to, kind) => {
                if kind == CommandKind::Start && !sb.holds && !self.model.fits(sb.resources) {
                    prop_assert_eq!(reply.status, 503, "{}", reply.body);
                    prop_assert_eq!(reply.code(), "no_capacity");
                    return Ok(());
                }
                prop_assert_eq!(reply.status, 202, "{}", reply.body);
                prop_assert_eq!(&reply.body["state"], to.as_str());
                prop_assert_eq!(&reply.body["generation"], sb.generation + 1);
                if kind == CommandKind::Delete {
                    prop_assert!(reply.body["deleted_at"].is_string(), "{}", reply.body);
                }
                if kind == CommandKind::Start && !sb.holds {
                    self.model.reserve(i);
                }
                let m = &mut self.model.sandboxes[i];
                m.state = to;
                m.generation += 1;
                m.deleting |= kind == CommandKind::Delete;
                m.events += 1;
                self.model.queue(i, kind);
                202
            }
        };
        if let Some(k) = key {
            self.model.keys.insert(
                k,
                Stored {
                    fingerprint,
                    status,
                    body: reply.body,
                },
            );
        }
        Ok(())
    }

    async fn deliver(
        &mut self,
        c: usize,
        reported: Reported,
        twice: bool,
    ) -> Result<(), TestCaseError> {
        let cmd = self.model.commands[c].clone();
        let result = CommandResult {
            command_id: cmd.id.expect("ids are learned after every step"),
            sandbox_id: self.model.sandboxes[cmd.sandbox].id,
            host_id: self.host,
            generation: Generation(cmd.generation),
            kind: cmd.kind,
            outcome: match reported {
                Reported::Succeeded => inproc::succeeded(cmd.kind),
                Reported::Failed => inproc::failed(),
                Reported::RefusedStale => ResultOutcome::RefusedStale {
                    applied: Generation(cmd.generation + 1),
                },
            },
        };
        for delivery in 0..(1 + usize::from(twice)) {
            let expected = self.model.result(c, reported);
            let applied = results::apply(&self.env.db, &result)
                .await
                .map_err(|e| fail(format!("apply failed: {e}")))?;
            prop_assert_eq!(applied, expected, "delivery {} of {:?}", delivery + 1, cmd);
            self.env
                .saw(format!("result {:?} {reported:?} -> {applied:?}", cmd.kind));
        }
        Ok(())
    }

    /// Compares the database and the API with the model, and checks the guarantees.
    async fn check(&mut self) -> Result<(), TestCaseError> {
        self.check_commands().await?;
        self.check_rows().await?;
        self.check_events().await?;
        self.check_capacity().await?;
        self.check_views().await
    }

    async fn check_commands(&mut self) -> Result<(), TestCaseError> {
        let db = &self.env.db;
        let outbox = inproc::commands_where(
            db,
            "c.sandbox_id IN (SELECT id FROM sandboxes WHERE org_id = $1)",
            self.org.id.as_uuid(),
        )
        .await;
        prop_assert_eq!(
            outbox.len(),
            self.model.commands.len(),
            "outbox {:?}, model {:?}",
            outbox
                .iter()
                .map(|c| (c.sandbox_id, c.kind, c.generation.0, c.completed))
                .collect::<Vec<_>>(),
            self.model
                .commands
                .iter()
                .map(|c| (
                    self.model.sandboxes[c.sandbox].id,
                    c.kind,
                    c.generation,
                    c.completed
                ))
                .collect::<Vec<_>>()
        );
        for oc in &outbox {
            let i = self
                .model
                .sandboxes
                .iter()
                .position(|s| s.id == oc.sandbox_id)
                .ok_or_else(|| fail(format!("a command for an unknown sandbox: {oc:?}")))?;
            prop_assert_eq!(oc.host_id, self.host);
            prop_assert_eq!(oc.command.spec.org_id, self.org.id);
            prop_assert_eq!(oc.command.spec.resources, self.model.sandboxes[i].resources);
            let known = self.model.commands.iter().position(|m| m.id == Some(oc.id));
            let m = match known {
                Some(m) => m,
                None => self
                    .model
                    .commands
                    .iter()
                    .position(|m| {
                        m.id.is_none()
                            && m.sandbox == i
                            && m.kind == oc.kind
                            && m.generation == oc.generation.0
                    })
                    .ok_or_else(|| {
                        fail(format!(
                            "the outbox holds a command the model did not expect: {:?}; \
                             model: {:?}",
                            (oc.sandbox_id, oc.kind, oc.generation.0, oc.completed),
                            self.model.commands
                        ))
                    })?,
            };
            self.model.commands[m].id = Some(oc.id);
            prop_assert_eq!(
                oc.completed,
                self.model.commands[m].completed,
                "completion of {:?}",
                oc
            );
        }
        Ok(())
    }

    async fn check_rows(&mut self) -> Result<(), TestCaseError> {
        use SandboxState as S;
        let rows = sqlx::query(
            "SELECT id, state, generation, holds_capacity, deleted_at, host_id
               FROM sandboxes WHERE org_id = $1",
        )
        .bind(self.org.id)
        .fetch_all(&self.env.db)
        .await
        .expect("read sandboxes");
        prop_assert_eq!(
            rows.len(),
            self.model.sandboxes.len(),
            "a refused create wrote nothing, an accepted one wrote one row"
        );
        for r in &rows {
            let id: SandboxId = r.get("id");
            let m = self
                .model
                .sandboxes
                .iter_mut()
                .find(|s| s.id == id)
                .ok_or_else(|| fail(format!("an unknown sandbox row {id}")))?;
            let raw: String = r.get("state");
            let state: SandboxState = raw
                .parse()
                .map_err(|e| fail(format!("row state {raw:?}: {e}")))?;
            prop_assert!(state.is_written(), "{state} is never written");
            let generation: i64 = r.get("generation");
            let holds: bool = r.get("holds_capacity");
            let deleted_at: Option<DateTime<Utc>> = r.get("deleted_at");
            let host: Option<HostId> = r.get("host_id");
            prop_assert_eq!(host, Some(self.host));
            prop_assert!(
                generation >= m.seen_generation,
                "generation of {id} went from {} to {generation}",
                m.seen_generation
            );
            m.seen_generation = generation;
            // Guarantee 3: once deleting, only `stopping` then `deleted`, and `deleted` stays.
            if let Some(first) = m.deleted_at {
                prop_assert_eq!(deleted_at, Some(first), "deleted_at of {} stays set", id);
                prop_assert!(
                    matches!(state, S::Stopping | S::Deleted),
                    "{id} left the delete path: {state}"
                );
            }
            if m.seen_deleted {
                prop_assert_eq!(state, S::Deleted, "{} came back from deleted", id);
            }
            if deleted_at.is_some() && m.deleted_at.is_none() {
                m.deleted_at = deleted_at;
            }
            m.seen_deleted |= state == S::Deleted;
            // Capacity is held exactly by what may run: not by stopped, failed-start or deleted
            // sandboxes; always by provisioning, starting, running, and by stopping unless a
            // delete started from a sandbox that held nothing (a stopped one).
            match state {
                S::Stopped | S::FailedStart | S::Deleted => {
                    prop_assert!(!holds, "{id} is {state} and holds capacity")
                }
                S::Provisioning | S::Starting | S::Running => {
                    prop_assert!(holds, "{id} is {state} and holds no capacity")
                }
                S::Stopping if deleted_at.is_none() => {
                    prop_assert!(holds, "{id} is stopping and holds no capacity")
                }
                _ => {}
            }
            prop_assert_eq!(state, m.state, "state of {}", id);
            prop_assert_eq!(generation, m.generation, "generation of {}", id);
            prop_assert_eq!(holds, m.holds, "holds_capacity of {}", id);
            prop_assert_eq!(deleted_at.is_some(), m.deleting, "deleted_at of {}", id);
        }
        Ok(())
    }

    async fn check_events(&self) -> Result<(), TestCaseError> {
        let rows = sqlx::query(
            "SELECT sandbox_id, from_state, to_state, generation, command_id
               FROM events WHERE org_id = $1 ORDER BY at, id",
        )
        .bind(self.org.id)
        .fetch_all(&self.env.db)
        .await
        .expect("read events");
        for (i, m) in self.model.sandboxes.iter().enumerate() {
            let mine: Vec<_> = rows
                .iter()
                .filter(|r| r.get::<SandboxId, _>("sandbox_id") == m.id)
                .collect();
            prop_assert_eq!(mine.len(), m.events, "events of {}", m.id);
            // Guarantee 1: the first event is the create's, naming the create command.
            let first = mine[0];
            let create = self
                .model
                .commands
                .iter()
                .find(|c| c.sandbox == i && c.kind == CommandKind::Create)
                .and_then(|c| c.id);
            prop_assert_eq!(first.get::<Option<String>, _>("from_state"), None);
            prop_assert_eq!(first.get::<String, _>("to_state"), "provisioning");
            prop_assert_eq!(first.get::<i64, _>("generation"), 1);
            prop_assert_eq!(first.get::<Option<CommandId>, _>("command_id"), create);
            let last = mine[mine.len() - 1];
            prop_assert_eq!(last.get::<String, _>("to_state"), m.state.as_str());
            prop_assert_eq!(last.get::<i64, _>("generation"), m.generation);
        }
        prop_assert_eq!(
            rows.len(),
            self.model.sandboxes.iter().map(|s| s.events).sum::<usize>(),
            "no event for a sandbox the model does not know"
        );
        Ok(())
    }

    async fn check_capacity(&self) -> Result<(), TestCaseError> {
        let db = &self.env.db;
        let (vcpus, memory) = inproc::reserved(db, self.host).await;
        let held =
            self.model
                .sandboxes
                .iter()
                .filter(|s| s.holds)
                .fold((0i64, 0i64), |(v, m), s| {
                    (
                        v + i64::from(s.resources.vcpus),
                        m + i64::from(s.resources.memory_mib),
                    )
                });
        prop_assert_eq!(
            (vcpus, memory),
            held,
            "the host reserves what its sandboxes hold"
        );
        prop_assert_eq!(
            (
                i64::from(self.model.reserved.vcpus),
                i64::from(self.model.reserved.memory_mib)
            ),
            held
        );
        let drift = pass::capacity_drift(db).await.expect("capacity drift");
        prop_assert_eq!(drift, (0, 0), "capacity drift over every host");
        let keys: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE org_id = $1")
                .bind(self.org.id)
                .fetch_one(db)
                .await
                .expect("count idempotency keys");
        prop_assert_eq!(
            keys as usize,
            self.model.keys.len(),
            "only accepted answers are stored"
        );
        Ok(())
    }

    async fn check_views(&self) -> Result<(), TestCaseError> {
        let api = &self.env.api;
        let list = api
            .call(
                &self.org.key,
                Method::GET,
                "/v1/sandboxes?limit=500",
                None,
                None,
            )
            .await;
        prop_assert_eq!(list.status, 200, "{}", list.body);
        let mut seen: Vec<(String, String, i64)> = list.body["sandboxes"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|s| {
                        (
                            s["id"].as_str().unwrap_or_default().to_owned(),
                            s["state"].as_str().unwrap_or_default().to_owned(),
                            s["generation"].as_i64().unwrap_or_default(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut expected: Vec<(String, String, i64)> = self
            .model
            .sandboxes
            .iter()
            .filter(|s| s.state != SandboxState::Deleted)
            .map(|s| (s.id.to_string(), s.state.as_str().to_owned(), s.generation))
            .collect();
        seen.sort();
        expected.sort();
        prop_assert_eq!(seen, expected, "the org's listing");
        // Guarantee 7: the other org sees none of them.
        let theirs = api
            .call(
                &self.other.key,
                Method::GET,
                "/v1/sandboxes?limit=500",
                None,
                None,
            )
            .await;
        prop_assert_eq!(theirs.status, 200);
        prop_assert_eq!(&theirs.body["sandboxes"], &Value::Array(Vec::new()));
        for s in &self.model.sandboxes {
            let reply = api
                .call(
                    &self.other.key,
                    Method::GET,
                    &format!("/v1/sandboxes/{}", s.id),
                    None,
                    None,
                )
                .await;
            prop_assert_eq!(
                reply.status,
                404,
                "another org reads {}: {}",
                s.id,
                reply.body
            );
        }
        Ok(())
    }
}

async fn run_case(env: &Env, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut case = Case::new(env).await;
    for (n, op) in ops.iter().enumerate() {
        case.step(op)
            .await
            .map_err(|e| fail(format!("step {n} {op:?}: {e}")))?;
        case.check()
            .await
            .map_err(|e| fail(format!("after step {n} {op:?}: {e}")))?;
    }
    Ok(())
}

#[sqlx::test(migrator = "berth_schemas::db::MIGRATOR")]
async fn random_requests_results_and_passes_keep_every_observable_guarantee(
    pool: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // proptest's runner is synchronous: give it a thread and a runtime of its own, and let it
    // block on each case there.
    tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        let env = rt.block_on(Env::start(pool, connect));
        let mut runner = TestRunner::new(Config {
            cases: CASES,
            failure_persistence: None,
            ..Config::default()
        });
        let outcome = runner.run(&proptest::collection::vec(op(), 1..=MAX_STEPS), |ops| {
            rt.block_on(run_case(&env, ops))
        });
        rt.block_on(env.db.close());
        for (what, n) in env.seen.lock().unwrap().iter() {
            eprintln!("{n:>6}  {what}");
        }
        if let Err(e) = outcome {
            panic!("{e}");
        }
    })
    .await
    .expect("the model run");
}
