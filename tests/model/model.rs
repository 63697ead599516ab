//! The model: what the test sends (bodies, routes, reported outcomes, steps as proptest
//! strategies) and what it predicts (statuses, states, generations, capacity, commands).

use super::*;

/// How many random sequences to run.
pub(crate) const CASES: u32 = 200;
/// The longest sequence of steps in one case.
pub(crate) const MAX_STEPS: usize = 32;
/// Each case's host. With the default overcommit placement may reserve 256 vCPUs and 100,000
/// MiB: one `Large` sandbox and dozens of small ones fit, a second `Large` does not, so
/// `no_capacity` is reachable for creates and for starts.
pub(crate) const HOST_CAPACITY: Resources = Resources {
    vcpus: 64,
    memory_mib: 100_000,
};

/// A create body the test sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Body {
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
    pub(crate) fn json(self) -> &'static str {
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
    pub(crate) fn resources(self) -> Resources {
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
pub(crate) enum Action {
    Stop,
    Pause,
    Start,
    Resume,
    Delete,
}

impl Action {
    pub(crate) fn request(self) -> Request {
        match self {
            Action::Stop | Action::Pause => Request::Stop,
            Action::Start | Action::Resume => Request::Start,
            Action::Delete => Request::Delete,
        }
    }

    pub(crate) fn route(self, id: SandboxId) -> (Method, String) {
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
pub(crate) enum Reported {
    Succeeded,
    Failed,
    /// hostd refused the command as older than what it applied.
    RefusedStale,
}

/// One step of a case.
#[derive(Clone, Debug)]
pub(crate) enum Op {
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

pub(crate) fn body() -> impl Strategy<Value = Body> {
    prop_oneof![
        6 => Just(Body::Small),
        3 => Just(Body::Large),
        2 => Just(Body::Tagged),
        1 => Just(Body::Empty),
        1 => Just(Body::Invalid),
        1 => Just(Body::UnknownTemplate),
    ]
}

pub(crate) fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        Just(Action::Stop),
        Just(Action::Pause),
        Just(Action::Start),
        Just(Action::Resume),
        Just(Action::Delete),
    ]
}

pub(crate) fn reported() -> impl Strategy<Value = Reported> {
    prop_oneof![
        5 => Just(Reported::Succeeded),
        3 => Just(Reported::Failed),
        1 => Just(Reported::RefusedStale),
    ]
}

pub(crate) fn op() -> impl Strategy<Value = Op> {
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
pub(crate) enum Expect {
    Accepted(SandboxState, CommandKind),
    Unchanged,
    Conflict,
}

pub(crate) fn expect_request(state: SandboxState, deleting: bool, request: Request) -> Expect {
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
pub(crate) struct ModelSandbox {
    pub(crate) id: SandboxId,
    pub(crate) resources: Resources,
    pub(crate) state: SandboxState,
    pub(crate) generation: i64,
    pub(crate) deleting: bool,
    pub(crate) holds: bool,
    /// Event rows written for it.
    pub(crate) events: usize,
    /// `deleted_at` as first seen; it must never change.
    pub(crate) deleted_at: Option<DateTime<Utc>>,
    /// The highest generation seen in the database.
    pub(crate) seen_generation: i64,
    /// Whether the database ever showed it `deleted`.
    pub(crate) seen_deleted: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct ModelCommand {
    /// Learned from the outbox after the step that wrote it.
    pub(crate) id: Option<CommandId>,
    pub(crate) sandbox: usize,
    pub(crate) kind: CommandKind,
    pub(crate) generation: i64,
    pub(crate) completed: bool,
}

/// A response stored under an idempotency key.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    pub(crate) fingerprint: String,
    pub(crate) status: u16,
    pub(crate) body: Value,
}

#[derive(Debug, Default)]
pub(crate) struct Model {
    pub(crate) sandboxes: Vec<ModelSandbox>,
    pub(crate) commands: Vec<ModelCommand>,
    pub(crate) keys: HashMap<String, Stored>,
    pub(crate) reserved: Resources,
}

impl Model {
    pub(crate) fn fits(&self, need: Resources) -> bool {
        let limit = Overcommit::default().limit(HOST_CAPACITY);
        self.reserved.vcpus + need.vcpus <= limit.vcpus
            && self.reserved.memory_mib + need.memory_mib <= limit.memory_mib
    }

    pub(crate) fn reserve(&mut self, i: usize) {
        let r = self.sandboxes[i].resources;
        self.reserved.vcpus += r.vcpus;
        self.reserved.memory_mib += r.memory_mib;
        self.sandboxes[i].holds = true;
    }

    pub(crate) fn release(&mut self, i: usize) {
        if self.sandboxes[i].holds {
            let r = self.sandboxes[i].resources;
            self.reserved.vcpus -= r.vcpus;
            self.reserved.memory_mib -= r.memory_mib;
            self.sandboxes[i].holds = false;
        }
    }

    pub(crate) fn queue(&mut self, sandbox: usize, kind: CommandKind) {
        self.commands.push(ModelCommand {
            id: None,
            sandbox,
            kind,
            generation: self.sandboxes[sandbox].generation,
            completed: false,
        });
    }

    /// A host result for command `c`: what `results::apply` must answer, with the model moved.
    pub(crate) fn result(&mut self, c: usize, reported: Reported) -> Applied {
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
    pub(crate) fn pass(&mut self) {
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
