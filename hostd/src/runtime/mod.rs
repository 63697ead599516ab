//! Runtime drivers: the OCI runtime behind a small trait, so `runsc` (gVisor, with checkpoint
//! and restore) can join `runc` without touching the lifecycle code.
//!
//! Every method is idempotent where it can be: destroying an absent container succeeds;
//! `status` of an absent container is `None`.

pub mod runc;

use std::collections::HashMap;
use std::path::Path;

use futures::future::BoxFuture;
use serde::Deserialize;

use crate::error::HostdError;

/// A container's state as the runtime reports it (the OCI runtime spec's `status` values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContainerStatus {
    Creating,
    Created,
    Running,
    Paused,
    Stopped,
}

/// What a driver needs to start one container.
#[derive(Debug, Clone, Copy)]
pub struct RunRequest<'a> {
    pub container_id: &'a str,
    /// The OCI bundle dir (holds `config.json`).
    pub bundle: &'a Path,
    /// Receives the container's stdout and stderr (and the runtime's own errors).
    pub console_log: &'a Path,
}

/// An OCI runtime.
pub trait RuntimeDriver: Send + Sync + 'static {
    /// The runtime's name as reported in heartbeats and metrics labels (`runc`).
    fn name(&self) -> &'static str;

    /// Whether a stop can keep memory (checkpoint/restore).
    fn memory_snapshot(&self) -> bool;

    /// Creates and starts the container detached; returns once its process runs.
    ///
    /// Errors: [`HostdError::Tool`] / [`HostdError::Io`] with the runtime's message.
    fn run<'a>(&'a self, req: RunRequest<'a>) -> BoxFuture<'a, Result<(), HostdError>>;

    /// The container's status; `None` when it does not exist.
    fn status<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<ContainerStatus>, HostdError>>;

    /// Every container this driver's root holds, by id.
    fn list(&self) -> BoxFuture<'_, Result<HashMap<String, ContainerStatus>, HostdError>>;

    /// Kills and deletes the container; succeeds when it does not exist.
    fn destroy<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>>;
}
