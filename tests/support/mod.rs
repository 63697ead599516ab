//! The one test kit of the root package, shared by every test binary (each includes it with
//! `#[path = "../support/mod.rs"] mod support;`):
//!
//! - [`env`]: NATS URL, unique names, timeouts for a loaded machine, polling, tools;
//! - [`stack`] and [`http`]: the end-to-end stack (the control plane of `berth::stack` plus
//!   real `berth hostd` processes) and what a test does with it;
//! - [`inproc`]: the API router driven request by request, host rows and synthesized host
//!   results, for tests that need no hostd;
//! - [`s3`] and [`throttle`]: a real S3 server (`s3s-fs`) and a slow link to put in front of it;
//! - [`cleanup`]: removal of everything a test's hosts made, run from `Drop` so it also runs
//!   when the test panics.
// Each binary uses a part of the kit.
#![allow(dead_code)]

pub mod api_process;
pub mod cleanup;
pub mod env;
pub mod http;
pub mod inproc;
pub mod nats_server;
pub mod registry;
pub mod s3;
pub mod stack;
pub mod throttle;

// Not every binary uses every shortcut.
#[allow(unused_imports)]
pub use env::{eventually, nats_url, unique, unique_subjects, SETTLE_TIMEOUT};
#[allow(unused_imports)]
pub use stack::Stack;
