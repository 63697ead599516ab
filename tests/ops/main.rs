//! Operating Berth: lifecycle events on the stream and over SSE, webhooks, metrics and
//! Prometheus rules, the command relay, and running a fleet (leadership, drain and cordon,
//! start caps, automatic stop and delete), preview URLs (`preview.rs`), a sandbox's settings
//! after create (PATCH, expiry, renew, the metadata filter) and waiting for a state without
//! polling; a `berth dev` stack restarted with cordoned and draining hosts (`dev_restart.rs`);
//! issue 14's hostd crashes mid-transfer (`crash14.rs`) and start and delete raced
//! against its transitional states (`race14.rs`); warm pools' slots taken by creates of their
//! shape (`warm.rs`).

#[path = "../support/mod.rs"]
mod support;

mod archive;
mod backup_policy;
mod backups;
mod clone_requests;
mod collect;
mod compat;
mod crash14;
mod dev_restart;
mod drain;
mod events;
mod failover;
mod fleet;
mod host_health;
mod hostile;
mod keys;
mod limits;
mod migrate;
mod nats_auth;
mod observability;
mod preview;
mod preview_abuse;
mod preview_kit;
mod preview_origin;
mod proxy_limits;
mod race14;
mod relay;
mod requests;
mod restore_attacks;
mod resume;
mod settings;
mod snapshots;
mod sweep;
mod templates;
mod wait;
mod warm;
mod webhooks;
