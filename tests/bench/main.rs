//! `berth bench` against a test stack (or, `--failover`, on a private stack of its own): a mode
//! runs to its end and prints every row of its table (the figures themselves are recorded in
//! `RESULTS.md`, never asserted: they depend on the machine).

#[path = "../support/mod.rs"]
mod support;

mod failover;
mod storage;
