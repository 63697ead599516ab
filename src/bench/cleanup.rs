//! What a bench run leaves behind, removed however it ends (finished, failed, or interrupted
//! by SIGINT/SIGTERM, its measuring future dropped mid-step): the hosts it cordoned are
//! uncordoned, its sandboxes (metadata `berth-bench: <run>`) deleted, and the snapshots and
//! backups it took of them (which outlive their sandbox) deleted.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::Value;

use super::{Client, MAX_WAIT_SECS, RUN_TAG_KEY};

/// How long the clean-up of a run (also of an interrupted one) waits for its sandboxes to be
/// deleted, and then again for their snapshots, before it gives up and says which are left.
const CLEAN_UP_TIMEOUT: Duration = Duration::from_secs(60);
/// The pause before the clean-up lists a run's sandboxes (or a `creating` snapshot) again.
const CLEAN_UP_SETTLE: Duration = Duration::from_millis(500);

/// What a run made that its clean-up must undo, shared by every client of the run.
#[derive(Default)]
pub(super) struct Made {
    /// The hosts it cordoned and has not uncordoned yet: `(operator key, host id)`.
    cordoned: Mutex<Vec<(String, String)>>,
    /// Every sandbox a create, clone or fork of the run answered (the list by run tag misses
    /// clones and forks, and deleted sandboxes once the list no longer shows them).
    sandboxes: Mutex<BTreeSet<String>>,
}

/// The run's [`Made`], shared.
pub(super) type RunMade = Arc<Made>;

impl Client {
    /// A client of the API at `api` (base URL) with `key`; its creates carry `run_tag`.
    pub(super) fn new(api: String, key: String, run_tag: String) -> Self {
        Self {
            http: reqwest::Client::new(),
            api,
            key,
            throttled: Default::default(),
            run_tag,
            made: Default::default(),
        }
    }

    /// The same run's client with another key (an operator's): it shares the connection pool,
    /// the run tag and the record of cordoned hosts.
    pub(super) fn with_key(&self, key: String) -> Self {
        Self {
            http: self.http.clone(),
            api: self.api.clone(),
            key,
            throttled: Default::default(),
            run_tag: self.run_tag.clone(),
            made: self.made.clone(),
        }
    }

    /// `POST /v1/hosts/{host}/{action}` (`cordon` or `uncordon`) with this client's key
    /// (an operator's), recording the cordon until it is undone.
    pub(super) async fn cordon_action(&self, host: &str, action: &str) -> anyhow::Result<()> {
        let path = format!("/v1/hosts/{host}/{action}");
        let (status, body) = self.send(reqwest::Method::POST, &path, None).await?;
        if !(200..300).contains(&status) {
            bail!("{action} host {host}: {status} {body}");
        }
        let mut cordoned = self.made.cordoned.lock().unwrap_or_else(|e| e.into_inner());
        cordoned.retain(|(_, h)| h != host);
        if action == "cordon" {
            cordoned.push((self.key.clone(), host.to_owned()));
        }
        Ok(())
    }

    /// Records the sandboxes a `POST` to `path` answered `answer` made, if it made any.
    pub(super) fn record_made(&self, path: &str, answer: &Value) {
        let path = path.split('?').next().unwrap_or_default();
        let makes = path == "/v1/sandboxes"
            || (path.starts_with("/v1/sandboxes/")
                && (path.ends_with("/clone") || path.ends_with("/fork")));
        if !makes {
            return;
        }
        let ids = answer["id"].as_str().into_iter().chain(
            answer["sandboxes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s["id"].as_str()),
        );
        self.made
            .sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(ids.map(str::to_owned));
    }

    /// Uncordons every host this run cordoned and did not uncordon (a step interrupted or
    /// failed between the two); best effort, what fails is printed.
    async fn uncordon_left(&self) {
        let left =
            std::mem::take(&mut *self.made.cordoned.lock().unwrap_or_else(|e| e.into_inner()));
        for (key, host) in left {
            if let Err(e) = self.with_key(key).cordon_action(&host, "uncordon").await {
                eprintln!("bench: host {host} left cordoned: {e:#}");
            }
        }
    }

    /// Deletes every sandbox of this run that is not deleted yet (a phase that failed or was
    /// interrupted leaves some behind; they would hold the stack's capacity) and waits, up to
    /// [`CLEAN_UP_TIMEOUT`], until they are `deleted`. The list is taken again after each
    /// round: a create that was in flight when the run ended commits after the first list.
    /// Best effort: what is not deleted in time is printed.
    pub(super) async fn clean_up(&self) {
        self.uncordon_left().await;
        let deadline = Instant::now() + CLEAN_UP_TIMEOUT;
        let done = async {
            loop {
                let left = self.left_over().await?;
                if left.is_empty() {
                    return anyhow::Ok(());
                }
                futures::future::join_all(left.iter().map(|id| async move {
                    let path = format!("/v1/sandboxes/{id}");
                    match self.send(reqwest::Method::DELETE, &path, None).await {
                        Ok((200 | 202, _)) => {}
                        other => eprintln!("bench: sandbox {id} not deleted: {other:?}"),
                    }
                    let secs = deadline
                        .saturating_duration_since(Instant::now())
                        .as_secs()
                        .clamp(1, MAX_WAIT_SECS);
                    let path = format!("/v1/sandboxes/{id}/wait?state=deleted&timeout={secs}s");
                    let _ = self.send(reqwest::Method::GET, &path, None).await;
                }))
                .await;
                // A list right after the last create may not see it yet.
                tokio::time::sleep(CLEAN_UP_SETTLE).await;
            }
        };
        let outcome = tokio::time::timeout_at(deadline.into(), done).await;
        let made: Vec<String> = self
            .made
            .sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        self.delete_snapshots(&made).await;
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("bench: could not list this run's sandboxes to clean up: {e:#}"),
            Err(_) => match tokio::time::timeout(CLEAN_UP_SETTLE, self.left_over()).await {
                Ok(Ok(left)) if left.is_empty() => {}
                left => eprintln!(
                    "bench: sandboxes of this run (metadata {RUN_TAG_KEY}={}) not deleted within {CLEAN_UP_TIMEOUT:?}: {left:?}",
                    self.run_tag
                ),
            },
        }
    }

    /// The ids of this run's sandboxes that are not `deleted`.
    async fn left_over(&self) -> anyhow::Result<Vec<String>> {
        let listed = self.run_sandboxes().await?;
        let not_deleted = |s: &Value| s["deleted_at"].is_null() && s["state"] != "deleted";
        let mut left: Vec<String> = listed
            .iter()
            .filter(|s| not_deleted(s))
            .filter_map(|s| s["id"].as_str().map(str::to_owned))
            .collect();
        // Clones and forks carry no run tag: looked at one by one.
        let untagged: Vec<String> = {
            let made = self
                .made
                .sandboxes
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            made.iter()
                .filter(|id| !listed.iter().any(|s| s["id"] == id.as_str()))
                .cloned()
                .collect()
        };
        for id in untagged {
            let path = format!("/v1/sandboxes/{id}");
            if let (200, sandbox) = self.send(reqwest::Method::GET, &path, None).await? {
                if not_deleted(&sandbox) {
                    left.push(id);
                }
            }
        }
        Ok(left)
    }

    /// This run's sandboxes as the list answers them (deleted ones too, while it shows them).
    async fn run_sandboxes(&self) -> anyhow::Result<Vec<Value>> {
        let path = format!(
            "/v1/sandboxes?metadata.{RUN_TAG_KEY}={}&limit=500",
            self.run_tag
        );
        let (status, listed) = self.send(reqwest::Method::GET, &path, None).await?;
        if status != 200 {
            bail!("{status} {listed}");
        }
        Ok(listed["sandboxes"].as_array().cloned().unwrap_or_default())
    }

    /// Deletes every snapshot and backup of `sandboxes` (this run's, deleted or not): each
    /// `creating` one once it settles, each one a boot still reads once that ends (both 409),
    /// up to [`CLEAN_UP_TIMEOUT`]. Best effort: what is left is printed.
    async fn delete_snapshots(&self, sandboxes: &[String]) {
        let deadline = Instant::now() + CLEAN_UP_TIMEOUT;
        let mut left: Vec<String> = Vec::new();
        for id in sandboxes {
            let path = format!("/v1/sandboxes/{id}/snapshots");
            match self.send(reqwest::Method::GET, &path, None).await {
                Ok((200, listed)) => left.extend(
                    listed["snapshots"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|s| s["id"].as_str().map(str::to_owned)),
                ),
                other => eprintln!("bench: snapshots of sandbox {id} not listed: {other:?}"),
            }
        }
        while !left.is_empty() {
            let mut again = Vec::new();
            for snapshot in left {
                let path = format!("/v1/snapshots/{snapshot}");
                match self.send(reqwest::Method::DELETE, &path, None).await {
                    Ok((200..=299 | 404, _)) => {}
                    Ok((409, _)) if Instant::now() < deadline => again.push(snapshot),
                    other => eprintln!("bench: snapshot {snapshot} not deleted: {other:?}"),
                }
            }
            if !again.is_empty() {
                tokio::time::sleep(CLEAN_UP_SETTLE).await;
            }
            left = again;
        }
    }
}
