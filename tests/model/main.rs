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

#[path = "../support/mod.rs"]
mod support;

mod case;
mod checks;
mod model;

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use axum::http::Method;
use berth_reconciler::pass::{self, PassConfig};
use berth_reconciler::results::{self, Applied};
use berth_scheduler::placement::Overcommit;
use berth_schemas::state::Request;
use berth_schemas::wire::{CommandResult, Resources, ResultOutcome};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, SandboxId, SandboxState};
use berth_store::leases::Lease;
use chrono::{DateTime, Utc};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Row};

use self::case::*;
use self::model::*;
use crate::support::inproc::{self, Api, Org, Reply};

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

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
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
