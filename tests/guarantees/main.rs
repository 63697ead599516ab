//! The guarantees of DESIGN.md ("Guarantees (each has a test)"), one module per guarantee, end
//! to end against the real Postgres, NATS and `berth hostd` processes, or through the real API
//! router where no host is needed. `tests/README.md` maps each guarantee to its tests.

#[path = "../support/mod.rs"]
mod support;

mod api;
mod archive_check;
mod atomic_create;
mod capacity;
mod evidence;
mod forged_results;
mod lag;
mod late_completion;
mod one_host;
mod orgs;
mod restore;
mod results_backlog;
mod results_delivery;
mod stop_fallback;
