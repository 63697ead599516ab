//! Operating Berth: lifecycle events on the stream and over SSE, webhooks, metrics and
//! Prometheus rules, the command relay, and running a fleet (leadership, drain and cordon,
//! start caps, automatic stop and delete), and preview URLs (`preview.rs`).

#[path = "../support/mod.rs"]
mod support;

mod events;
mod fleet;
mod host_health;
mod limits;
mod nats_auth;
mod observability;
mod preview;
mod preview_kit;
mod relay;
mod webhooks;
