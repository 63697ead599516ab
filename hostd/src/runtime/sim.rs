//! The `sim` runtime driver: containers are entries in a table, "running" after a configured
//! boot delay. It is the runtime half of a sim host; the rest (no netns, overlay or agent) is
//! `backend::sim`, whose docs say what a sim host replaces and why.
//!
//! # Selection
//! Only explicitly: a hostd whose runtimes include [`SIM`] offers nothing else, and its
//! [`super::Runtimes::catch_all`] hands the sim driver out for every template's runtime name.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;
use futures::FutureExt;

use super::{ContainerStatus, RunRequest, RuntimeDriver};
use crate::error::HostdError;

/// The runtime's name.
pub const SIM: &str = "sim";

/// The default simulated boot time (what `run` waits before the container "runs").
pub const DEFAULT_SIM_BOOT: Duration = Duration::from_millis(0);

/// One sim container's life in this process: when it began running, and when it was destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Life {
    /// When `run` made it running (wall clock).
    pub ran_at: SystemTime,
    /// When `destroy` removed it, if it did.
    pub destroyed_at: Option<SystemTime>,
}

impl Life {
    /// Whether the container ran at `t`.
    pub fn alive_at(&self, t: SystemTime) -> bool {
        self.ran_at <= t && self.destroyed_at.is_none_or(|d| d > t)
    }
}

/// The latest life of every sim container of every sim host in this process, by container id
/// (the sandbox id): the witness `berth bench --runtime sim` asks whether a guest the
/// reconciler failed was in fact alive (a false failure). A sim guest never dies by itself.
static LIVES: LazyLock<Mutex<HashMap<String, Life>>> = LazyLock::new(Default::default);

fn lives() -> MutexGuard<'static, HashMap<String, Life>> {
    // Entries are replaced whole, so a poisoned table is still consistent.
    LIVES.lock().unwrap_or_else(|e| e.into_inner())
}

/// The latest life of the sim container `container_id` in this process, if it ever ran.
pub fn life(container_id: &str) -> Option<Life> {
    lives().get(container_id).copied()
}

/// The sim driver: containers are entries in a table.
#[derive(Debug, Default)]
pub struct Sim {
    boot: Duration,
    containers: Mutex<HashMap<String, ContainerStatus>>,
}

impl Sim {
    /// A driver whose `run` takes `boot`.
    pub fn new(boot: Duration) -> Self {
        Self {
            boot,
            containers: Mutex::new(HashMap::new()),
        }
    }

    fn table(&self) -> MutexGuard<'_, HashMap<String, ContainerStatus>> {
        // Entries are replaced whole, so a poisoned table is still consistent.
        self.containers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl RuntimeDriver for Sim {
    fn name(&self) -> &'static str {
        SIM
    }

    fn memory_snapshot(&self) -> bool {
        false
    }

    fn run<'a>(&'a self, req: RunRequest<'a>) -> BoxFuture<'a, Result<(), HostdError>> {
        async move {
            if !self.boot.is_zero() {
                tokio::time::sleep(self.boot).await;
            }
            self.table()
                .insert(req.container_id.to_owned(), ContainerStatus::Running);
            lives().insert(
                req.container_id.to_owned(),
                Life {
                    ran_at: SystemTime::now(),
                    destroyed_at: None,
                },
            );
            Ok(())
        }
        .boxed()
    }

    fn status<'a>(
        &'a self,
        container_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<ContainerStatus>, HostdError>> {
        let status = self.table().get(container_id).copied();
        async move { Ok(status) }.boxed()
    }

    fn pid<'a>(&'a self, _container_id: &'a str) -> BoxFuture<'a, Result<Option<i64>, HostdError>> {
        async move { Ok(None) }.boxed()
    }

    fn list(&self) -> BoxFuture<'_, Result<HashMap<String, ContainerStatus>, HostdError>> {
        let all = self.table().clone();
        async move { Ok(all) }.boxed()
    }

    fn destroy<'a>(&'a self, container_id: &'a str) -> BoxFuture<'a, Result<(), HostdError>> {
        if self.table().remove(container_id).is_some() {
            if let Some(life) = lives().get_mut(container_id) {
                life.destroyed_at.get_or_insert_with(SystemTime::now);
            }
        }
        async move { Ok(()) }.boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn a_sim_container_runs_after_its_boot_delay_and_is_gone_after_destroy() {
        let sim = Sim::new(Duration::from_millis(20));
        let dir = std::path::Path::new("/nonexistent");
        sim.run(RunRequest {
            container_id: "c1",
            bundle: dir,
            console_log: dir,
            pid_file: dir,
        })
        .await
        .unwrap();
        assert_eq!(
            sim.status("c1").await.unwrap(),
            Some(ContainerStatus::Running)
        );
        assert_eq!(sim.list().await.unwrap().len(), 1);
        let ran = life("c1").expect("its life is recorded");
        assert!(ran.alive_at(SystemTime::now()));
        sim.destroy("c1").await.unwrap();
        sim.destroy("c1").await.unwrap();
        assert_eq!(sim.status("c1").await.unwrap(), None);
        let ended = life("c1").unwrap();
        assert!(!ended.alive_at(SystemTime::now()));
        assert!(ended.alive_at(ran.ran_at));
    }

    #[test]
    fn every_runtime_name_resolves_to_the_sim_driver_on_a_sim_host() {
        let runtimes = super::super::Runtimes::catch_all(Arc::new(Sim::default()));
        assert_eq!(runtimes.get("runc").unwrap().name(), SIM);
        assert_eq!(runtimes.get("runsc").unwrap().name(), SIM);
    }
}
