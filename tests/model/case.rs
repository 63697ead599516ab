//! One case against the real code: its org, intruder, host and model; each step sent
//! through the router or the reconciler and compared with the model.

use super::*;

/// What every case shares: one database, the router, the lease and the pass configuration.
pub(crate) struct Env {
    pub(crate) db: PgPool,
    pub(crate) api: Api,
    pub(crate) lease: Lease,
    pub(crate) pass: PassConfig,
    /// How often each kind of outcome happened, printed at the end to show what was covered.
    pub(crate) seen: Mutex<BTreeMap<String, u64>>,
}

impl Env {
    pub(crate) async fn start(pool: PgPoolOptions, connect: PgConnectOptions) -> Env {
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

    pub(crate) fn saw(&self, what: String) {
        *self.seen.lock().unwrap().entry(what).or_default() += 1;
    }
}

/// A request that carried an `Idempotency-Key`, resolved to its sandbox.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Keyed {
    Create(Body, u8),
    Lifecycle(usize, Action, u8),
}

/// One case: its org, the intruding org, its host and the model.
pub(crate) struct Case<'a> {
    pub(crate) env: &'a Env,
    pub(crate) org: Org,
    pub(crate) other: Org,
    pub(crate) host: HostId,
    pub(crate) model: Model,
    pub(crate) last_keyed: Option<Keyed>,
}

pub(crate) fn fail(message: String) -> TestCaseError {
    TestCaseError::fail(message)
}

impl<'a> Case<'a> {
    pub(crate) async fn new(env: &'a Env) -> Case<'a> {
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

    pub(crate) fn expect_replay(
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

    pub(crate) async fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
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
                // The relay has published every command by the time they time out.
                inproc::relay_all(&self.env.db).await;
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

    pub(crate) async fn create(
        &mut self,
        body: Body,
        key: Option<u8>,
    ) -> Result<(), TestCaseError> {
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

    pub(crate) async fn lifecycle(
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
                    // A stopped sandbox whose host is full would start elsewhere from its
                    // durable stop; no stop of the model is durable (no host uploads), so that
                    // is a passing condition (`unavailable`, retry later), not a full fleet
                    // (`api/src/service/migrate.rs::start_stopped`).
                    let code = if sb.state == SandboxState::Stopped {
                        "unavailable"
                    } else {
                        "no_capacity"
                    };
                    prop_assert_eq!(reply.code(), code, "{}", reply.body);
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

    pub(crate) async fn deliver(
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
            heartbeat_seq: 0,
            apply_ms: 0,
        };
        for delivery in 0..(1 + usize::from(twice)) {
            let expected = self.model.result(c, reported);
            let applied =
                results::apply_with(&self.env.db, &result, &inproc::lifecycle_only_health())
                    .await
                    .map_err(|e| fail(format!("apply failed: {e}")))?;
            prop_assert_eq!(applied, expected, "delivery {} of {:?}", delivery + 1, cmd);
            self.env
                .saw(format!("result {:?} {reported:?} -> {applied:?}", cmd.kind));
        }
        Ok(())
    }
}
