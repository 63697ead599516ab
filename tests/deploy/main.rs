//! The deployment files of `deploy/` against the binary they deploy: the configuration
//! reference is what `berth docs config` renders (`config.rs`), the Kubernetes manifests
//! validate against pinned schemas and name only flags and variables the binary knows
//! (`manifests.rs`), and the systemd units pass `systemd-analyze verify` (`units.rs`).
//!
//! No database, NATS or root needed; the validator comes from the venv `.ci/run` makes
//! (`BERTH_DEPLOY_VENV`), and a missing tool fails the test with how to install it.

mod config;
mod kit;
mod manifests;
mod units;
