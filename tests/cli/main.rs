//! The user's CLI (`berth sandbox …`, `berth template ls|pull`, `berth login`, `berth completions`)
//! driven as the built binary against the end-to-end stack: real Postgres, NATS, `berth hostd`
//! and runc/runsc sandboxes. `commands.rs` covers each subcommand, `errors.rs` the messages and
//! exit codes of what goes wrong, `shell.rs` the interactive terminal through a pty the test
//! opens, `snapshots.rs` and `archive.rs` snapshot, fork, restore and archive.

#[path = "../support/mod.rs"]
mod support;

mod archive;
mod commands;
mod errors;
mod kit;
mod shell;
mod snapshots;
mod templates;
