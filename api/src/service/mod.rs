//! The API's use cases, one function each, each running one transaction. No axum here: a use
//! case takes typed input (ids, validated requests, the caller's org) and returns typed output
//! or a [`ServiceError`], which [`crate::error::ApiError`] maps to HTTP.
//!
//! # Guarantees
//! - Every sandbox and webhook query is scoped by the caller's org (guarantee 7).
//! - A state change commits its row, command and event in one transaction (guarantee 1).

pub mod backup;
pub mod events;
pub mod hosts;
pub mod idempotency;
pub mod keys;
pub mod migrate;
pub mod orgs;
pub mod quota;
pub mod resume;
pub mod sandboxes;
pub mod settings;
pub mod snapshots;
pub mod templates;
pub mod wait;
pub mod webhooks;

use berth_schemas::{SandboxId, SandboxState};

/// Every refusal or failure of a use case.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// No such resource in the caller's org (another org's looks the same); names it.
    #[error("{0} not found")]
    NotFound(String),
    /// The org's quota `limit` (e.g. `max_running`) would be passed.
    #[error("org quota {limit} = {value} reached")]
    QuotaExceeded {
        /// The quota's column name (`max_running`, …).
        limit: &'static str,
        /// The org's value of that quota.
        value: i64,
    },
    /// The create names a template that is not registered.
    #[error("unknown template {0:?}")]
    UnknownTemplate(String),
    /// The template exists but cannot be used or changed as asked: `code` is
    /// `template_not_ready` (its image is pulling or its pull failed) or `template_exists`
    /// (a `POST /v1/templates` naming a taken name with another image or runtime).
    #[error("{message}")]
    TemplateConflict {
        /// The stable error code.
        code: &'static str,
        /// The template's state (`pulling`, `ready`, `failed`).
        state: String,
        /// What conflicted, for the client.
        message: String,
    },
    /// The Idempotency-Key was used for a different request.
    #[error("Idempotency-Key {0:?} was used for a different request")]
    IdempotencyKeyReused(String),
    /// No ready host with a recent heartbeat has the headroom.
    #[error("no host has capacity for {vcpus} vCPUs and {memory_mib} MiB")]
    NoCapacity {
        /// The vCPUs asked for (whole vCPUs).
        vcpus: u32,
        /// The memory asked for, in MiB.
        memory_mib: u32,
    },
    /// No host can take the sandbox now, though hosts with room exist: their heartbeats are
    /// stale (a control-plane outage leaves every host so) or they are degraded. Never "no
    /// capacity": the client retries after `retry_after`.
    #[error("{message}")]
    Unavailable {
        /// What made the hosts with room unusable, for the client.
        message: String,
        /// When a retry may succeed.
        retry_after: std::time::Duration,
    },
    /// A conflicting sandbox transition is in flight; carries the current state.
    #[error("{message}")]
    Conflict {
        /// The sandbox's state now.
        state: SandboxState,
        /// What conflicted, for the client.
        message: String,
    },
    /// A host operator action the host's state refuses; carries that state.
    #[error("{message}")]
    HostConflict {
        /// The host's state now, in its API spelling (`ready`, `draining`, …).
        state: String,
        /// What conflicted, for the operator.
        message: String,
    },
    /// `DELETE /v1/keys/{id}` of the org's last working key: the org would be locked out.
    #[error(
        "key {0} is the org's last working key: create another (POST /v1/keys) before revoking it"
    )]
    LastKey(berth_schemas::ApiKeyId),
    /// The org already has its maximum number of webhooks.
    #[error("an org has at most {max} webhooks; delete one first")]
    TooManyWebhooks {
        /// The most webhooks an org may have.
        max: i64,
    },
    /// A value the request gave is refused once the sandbox is read (metadata that would grow
    /// too large, an expiry extended too far); names the field.
    #[error("{message}")]
    InvalidRequest {
        /// The offending field.
        field: &'static str,
        /// What is wrong, for the client.
        message: String,
    },
    /// A wait ended without the sandbox reaching its target: it settled in `state`, from
    /// which nothing leads there without a new request (or is being deleted).
    #[error("sandbox {sandbox} is {state}; it cannot become {target} without a new request")]
    WaitConflict {
        /// The sandbox waited on.
        sandbox: SandboxId,
        /// Its state now.
        state: SandboxState,
        /// The state waited for.
        target: SandboxState,
    },
    /// A wait's timeout passed (or the API is shutting down) before the sandbox reached its
    /// target.
    #[error("sandbox {sandbox} did not become {target} within the wait; it is {state}")]
    WaitTimeout {
        /// The sandbox waited on.
        sandbox: SandboxId,
        /// Its state when the wait ended.
        state: SandboxState,
        /// The state waited for.
        target: SandboxState,
    },
    /// A snapshot request or delete its snapshot's state refuses (HTTP 409 with that state).
    #[error("{message}")]
    SnapshotConflict {
        /// The snapshot's state (`creating`).
        state: String,
        /// What conflicted.
        message: String,
    },
    /// A start of a clone that never ran (it boots from its snapshot again) whose snapshot is
    /// no longer `ready` (HTTP 409 `snapshot_unavailable` with the sandbox's state).
    #[error("{message}")]
    SnapshotUnavailable {
        /// The sandbox's state (`failed-start`).
        state: SandboxState,
        /// What is missing, for the client.
        message: String,
    },
    /// A fork's clones do not all fit: every host is full for the `placed + 1`-th of `count`
    /// (nothing was written). HTTP 503 `no_capacity` with `Retry-After`.
    #[error(
        "no host has capacity for all {count} sandboxes of this fork ({vcpus} vCPUs and \
         {memory_mib} MiB each; the fleet has room for {placed}); nothing was written: retry \
         after {} s, or fork fewer",
        .retry_after.as_secs()
    )]
    ForkNoCapacity {
        /// How many clones the fork asked for.
        count: u32,
        /// How many fitted before one did not.
        placed: u32,
        /// Each clone's vCPUs.
        vcpus: u32,
        /// Each clone's memory, in MiB.
        memory_mib: u32,
        /// When a retry may find the room (sandboxes stop and are deleted).
        retry_after: std::time::Duration,
    },
    /// A broken invariant; logged, never shown.
    #[error("{0}")]
    Internal(String),
    /// Postgres failed (a query on a table only the API owns).
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The store refused or failed (fenced, not found, no capacity, database).
    #[error(transparent)]
    Store(#[from] berth_store::StoreError),
}

/// Whether Postgres answers a trivial query (`GET /readyz`).
pub async fn database_answers(db: &sqlx::PgPool) -> bool {
    berth_store::ping(db).await
}
