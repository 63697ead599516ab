//! Berth's contract crate: the types every component agrees on.
//!
//! - [`cloudevents`]: the external event format (CloudEvents 1.0, structured JSON).
//! - [`host_state`]: the host state machine (`ready`, `draining`, `cordoned`, `lost`), pure.
//! - [`ids`]: ID newtypes (`SandboxId`, `HostId`, …) and the fencing [`ids::Generation`].
//! - [`network`]: a sandbox's network policy (egress `public`, `none` or an allow-list).
//! - [`state`]: the lifecycle state machine, pure.
//! - [`trace`]: W3C `traceparent` for command messages (trace id = command id).
//! - [`wire`]: NATS messages (postcard in a versioned envelope, pinned by golden bytes).
//! - [`subjects`]: subject and stream names under a configurable prefix.
//! - `nats_auth` (feature `nats`): who may publish and subscribe to what (nkey users and
//!   their permissions), credentials files and how a component connects.
//!
//! No tokio, no SQL, no I/O: the feature `db` only derives `sqlx::Type` for the ID newtypes;
//! the migrations and every query live in the `store` crate.

pub mod cloudevents;
pub mod host_state;
pub mod ids;
pub mod network;
pub mod preview;
pub mod state;
pub mod subjects;
pub mod template_state;
pub mod trace;
pub mod wire;

pub use host_state::{HostCondition, HostEvent, HostState};
pub use ids::{
    ApiKeyId, CommandId, DeliveryId, EventId, Generation, HostId, OrgId, SandboxId, WebhookId,
};
pub use state::{Capacity, CommandKind, Reason, SandboxState};
pub use subjects::Subjects;

#[cfg(feature = "nats")]
pub mod nats_auth;
#[cfg(feature = "nats")]
pub mod streams;
