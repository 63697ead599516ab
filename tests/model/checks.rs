//! What is compared with the model after every step: commands, rows, events, capacity
//! (guarantee 4) and what each org can see (guarantee 7).

use super::*;

impl<'a> Case<'a> {
    /// Compares the database and the API with the model, and checks the guarantees.
    pub(crate) async fn check(&mut self) -> Result<(), TestCaseError> {
        self.check_commands().await?;
        self.check_rows().await?;
        self.check_events().await?;
        self.check_capacity().await?;
        self.check_views().await
    }

    pub(crate) async fn check_commands(&mut self) -> Result<(), TestCaseError> {
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
            let spec = oc
                .command
                .spec
                .as_ref()
                .ok_or_else(|| fail(format!("a command without a spec: {oc:?}")))?;
            prop_assert_eq!(spec.org_id, self.org.id);
            prop_assert_eq!(spec.resources, self.model.sandboxes[i].resources);
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

    pub(crate) async fn check_rows(&mut self) -> Result<(), TestCaseError> {
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

    pub(crate) async fn check_events(&self) -> Result<(), TestCaseError> {
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

    pub(crate) async fn check_capacity(&self) -> Result<(), TestCaseError> {
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

    pub(crate) async fn check_views(&self) -> Result<(), TestCaseError> {
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
