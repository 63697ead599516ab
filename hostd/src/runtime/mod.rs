//! Runtime drivers: the OCI runtimes behind one small trait — `runc` (namespaces and cgroups)
//! and `runsc` (gVisor, whose checkpoint/restore keeps a sandbox's memory across a stop).
//!
//! Every method is idempotent where it can be: destroying an absent container succeeds;
//! `status` of an absent container is `None`.
//!
//! A host offers every runtime it finds (see [`Runtimes`]); each template names the runtime
//! its sandboxes use, and a sandbox's record remembers it.

pub mod cli;
pub mod exit;
pub mod runc;
pub mod runsc;
pub mod sim;
pub mod statefile;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use futures::future::BoxFuture;
use serde::Deserialize;

use crate::error::HostdError;

/// A container's state as the runtime reports it (the OCI runtime spec's `status` values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContainerStatus {
    /// Being created.
    Creating,
    /// Created; its process not started.
    Created,
    /// Its process runs.
    Running,
    /// Frozen.
    Paused,
    /// Its process exited.
    Stopped,
}

/// What a driver needs to start one container.
#[derive(Debug, Clone, Copy)]
pub struct RunRequest<'a> {
    /// The container's id in the runtime's root.
    pub container_id: &'a str,
    /// The OCI bundle dir (holds `config.json`).
    pub bundle: &'a Path,
    /// Receives the container's stdout and stderr (and the runtime's own errors).
    pub console_log: &'a Path,
    /// Where the runtime writes the pid of the container's init (runc) or sandbox process
    /// (runsc) once it runs (`--pid-file`).
    pub pid_file: &'a Path,
}

impl RunRequest<'_> {
    /// The arguments of `run --detach` that both runtimes take alike: the pid file, the
    /// bundle and the container id.
    pub fn run_args(&self) -> Vec<String> {
        vec![
            "run".to_owned(),
            "--detach".to_owned(),
            "--pid-file".to_owned(),
            self.pid_file.to_string_lossy().into_owned(),
            "--bundle".to_owned(),
            self.bundle.to_string_lossy().into_owned(),
            self.container_id.to_owned(),
        ]
    }
}

/// An OCI runtime.
pub trait RuntimeDriver: Send + Sync + 'static {
    /// The runtime's name as reported in heartbeats and metrics labels (`runc`, `runsc`).
    fn name(&self) -> &'static str;

    /// Whether a stop can keep memory ([`RuntimeDriver::checkpoint`] and
    /// [`RuntimeDriver::restore`] work).
    fn memory_snapshot(&self) -> bool;

    /// The host ids of a container's ids when hostd gives its containers a user namespace
    /// (runc, see [`crate::isolation`]); `None` when the runtime isolates users itself (runsc)
    /// or runs nothing (sim).
    fn user_namespace(&self) -> Option<crate::isolation::IdRange> {
        None
    }

    /// The `pids.max` of the container's host cgroup: how many host tasks (threads included)
    /// its processes may hold. [`crate::oci::PIDS_LIMIT`] where each sandbox process is one
    /// host task (runc); more where the runtime's own tasks count too (runsc).
    fn pids_limit(&self) -> i64 {
        crate::oci::PIDS_LIMIT
    }

    /// Creates and starts the container detached; returns once its process runs.
    ///
    /// Errors: [`HostdError::Tool`] / [`HostdError::Io`] with the runtime's message.
    fn run<'a>(&'a self, req: RunRequest<'a>) -> BoxFuture<'a, Result<(), HostdError>>;

    /// The container's status; `None` when it does not exist.
    fn status<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<ContainerStatus>, HostdError>>;

    /// The host pid of the container's init (runc) or sandbox process (runsc), when it runs.
    fn pid<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<Option<i64>, HostdError>>;

    /// Every container this driver's root holds, by id.
    fn list(&self) -> BoxFuture<'_, Result<HashMap<String, ContainerStatus>, HostdError>>;

    /// Kills and deletes the container; succeeds when it does not exist.
    fn destroy<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>>;

    /// Saves the running container's memory and process state into `image_dir` and stops it
    /// (the container then no longer runs; [`RuntimeDriver::destroy`] removes its remains).
    ///
    /// Errors: [`HostdError::SnapshotUnsupported`] for a runtime without snapshots; the
    /// runtime's error otherwise (the container may be gone after a failed checkpoint).
    fn checkpoint<'a>(
        &'a self,
        container_id: &'a str,
        image_dir: &'a Path,
    ) -> BoxFuture<'a, Result<(), HostdError>> {
        let _ = (container_id, image_dir);
        Box::pin(async move {
            Err(HostdError::SnapshotUnsupported {
                runtime: self.name(),
            })
        })
    }

    /// Freezes every process of the running container (`runc pause`: the cgroup freezer;
    /// `runsc pause`: the sandbox's kernel stops its tasks) until [`RuntimeDriver::thaw`].
    ///
    /// Errors: [`HostdError::SnapshotUnsupported`] for a runtime that cannot; the runtime's
    /// error otherwise.
    fn freeze<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>> {
        let _ = container_id;
        Box::pin(async move {
            Err(HostdError::SnapshotUnsupported {
                runtime: self.name(),
            })
        })
    }

    /// Thaws a container [`RuntimeDriver::freeze`] froze.
    ///
    /// Errors: as [`RuntimeDriver::freeze`].
    fn thaw<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>> {
        let _ = container_id;
        Box::pin(async move {
            Err(HostdError::SnapshotUnsupported {
                runtime: self.name(),
            })
        })
    }

    /// Creates the container from `req` and restores the state saved by
    /// [`RuntimeDriver::checkpoint`] in `image_dir`, detached: its processes continue.
    ///
    /// Errors: as [`RuntimeDriver::checkpoint`].
    fn restore<'a>(
        &'a self,
        req: RunRequest<'a>,
        image_dir: &'a Path,
    ) -> BoxFuture<'a, Result<(), HostdError>> {
        let _ = (req, image_dir);
        Box::pin(async move {
            Err(HostdError::SnapshotUnsupported {
                runtime: self.name(),
            })
        })
    }
}

/// The runtimes one host offers, by name.
#[derive(Clone, Default)]
pub struct Runtimes {
    drivers: Vec<Arc<dyn RuntimeDriver>>,
    /// Whether the only driver answers to every name (see [`Runtimes::catch_all`]).
    catch_all: bool,
}

impl Runtimes {
    /// The runtimes `drivers`, each answering to its own name.
    pub fn new(drivers: Vec<Arc<dyn RuntimeDriver>>) -> Self {
        Self {
            drivers,
            catch_all: false,
        }
    }

    /// One driver that answers to every runtime name: a sim host runs every template in sim
    /// (selected explicitly; see [`sim`]).
    pub fn catch_all(driver: Arc<dyn RuntimeDriver>) -> Self {
        Self {
            drivers: vec![driver],
            catch_all: true,
        }
    }

    /// The driver called `name` (the only one, for [`Runtimes::catch_all`]).
    ///
    /// Errors: [`HostdError::UnsupportedRuntime`] naming the runtimes this host has.
    pub fn get(&self, name: &str) -> Result<Arc<dyn RuntimeDriver>, HostdError> {
        if self.catch_all {
            if let Some(only) = self.drivers.first() {
                return Ok(only.clone());
            }
        }
        self.drivers
            .iter()
            .find(|d| d.name() == name)
            .cloned()
            .ok_or_else(|| HostdError::UnsupportedRuntime {
                name: name.to_owned(),
                offered: self.names().join(", "),
            })
    }

    /// Every driver, in the order given.
    pub fn all(&self) -> &[Arc<dyn RuntimeDriver>] {
        &self.drivers
    }

    /// The names of the drivers.
    pub fn names(&self) -> Vec<&'static str> {
        self.drivers.iter().map(|d| d.name()).collect()
    }
}

impl std::fmt::Debug for Runtimes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}
