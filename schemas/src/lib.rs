//! Berth's contract crate: the types every component agrees on.
//!
//! - [`cloudevents`]: the external event format (CloudEvents 1.0, structured JSON).
//! - [`ids`]: ID newtypes (`SandboxId`, `HostId`, …) and the fencing [`ids::Generation`].
//! - [`state`]: the lifecycle state machine, pure.
//! - [`trace`]: W3C `traceparent` for command messages (trace id = command id).
//! - [`wire`]: NATS messages (postcard in a versioned envelope, pinned by golden bytes).
//! - [`subjects`]: subject and stream names under a configurable prefix.
//! - [`db`] (feature `db`): SQL migrations and the shared outbox/event writes.
//!
//! The pure core (everything but `db`) has no tokio and no I/O.

pub mod cloudevents;
pub mod ids;
pub mod state;
pub mod subjects;
pub mod trace;
pub mod wire;

#[cfg(feature = "db")]
pub mod db;

pub use ids::{
    ApiKeyId, CommandId, DeliveryId, EventId, Generation, HostId, OrgId, SandboxId, WebhookId,
};
pub use state::{CommandKind, Reason, SandboxState};
pub use subjects::Subjects;

#[cfg(feature = "nats")]
pub mod streams;
