//! hostd's NATS faces, each a loop that turns messages into calls on the [`crate::host::Host`]
//! and its use cases, and their answers back into messages:
//! - [`commands`]: the JetStream command consumer on `{p}.cmd.<host>`, which applies each
//!   command (`apply`) and publishes its result on `{p}.result.<host>`, continuing the
//!   command's `traceparent`;
//! - [`agent`]: core-NATS request/reply on `{p}.agent.<host>` (exec and files);
//! - [`heartbeat`]: core-NATS heartbeats on `{p}.hb.<host>`.

pub mod agent;
pub mod commands;
pub mod heartbeat;
