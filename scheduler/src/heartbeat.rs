//! The heartbeat consumer: each `{p}.hb.<host>` message upserts that host's row, stamping
//! `last_seen` with the database clock (never the host's or ours, so hosts with skewed clocks
//! are judged fairly).
//!
//! Heartbeats are core NATS (at most once): only the latest matters, and a lost one is
//! replaced a few seconds later. Scheduler replicas share the queue group [`QUEUE_GROUP`].
//!
//! # Keeping up
//! Everything waiting on the subscription is taken at once (up to [`MAX_BATCH`]); of each
//! host only the heartbeat with the greatest `seq` is kept, and the batch is upserted in one
//! statement whose row check lets only a newer heartbeat replace a stored one (so replicas and
//! late deliveries cannot go back in time), then the applied heartbeats' warm slots in the
//! same transaction. The ingest lag — database time of the upsert minus
//! the host's send time — is exported as `berth_heartbeat_ingest_lag_seconds` (the largest of
//! the latest batch) and alerted on (`deploy/prometheus/alerts.yml`).
//!
//! # Only a host speaks for itself
//! A heartbeat is applied only when it arrived on its own host's subject (the payload's
//! `host_id` is the subject's last token: NATS permissions let a host publish only there) and
//! that host is registered (`berth admin add-host`, `store::hosts::register`). Everything else
//! is dropped, counted in `berth_heartbeats_rejected_total{reason}` (`foreign_subject`,
//! `unregistered`) and logged; it never creates or refreshes a host row.
//!
//! # Warm slots
//! The warm slots an applied heartbeat lists (`Heartbeat::warm`, issue 16 lever 1) become its
//! host's rows of `warm_slots` in the upsert's transaction (`store::warm::replace`: one more
//! statement or two per batch, and only for heartbeats the upsert applied). A host's slots are
//! checked first ([`checked_slots`]): absurdly long strings, an id listed twice and slots past
//! [`MAX_WARM_SLOTS`] are dropped.

use berth_schemas::wire::{self, Heartbeat, WarmSlot};
use std::collections::HashMap;

use berth_schemas::{HostId, SandboxId, Subjects};
use berth_store::warm::Reported;
use berth_store::StoreError;
use futures::StreamExt;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::SchedulerError;

/// The most heartbeats taken from the subscription at once.
const MAX_BATCH: usize = 4096;

/// The queue group heartbeat consumers share, so each heartbeat is applied once.
pub const QUEUE_GROUP: &str = "berth-scheduler";

/// Consumes heartbeats until `shutdown` fires.
pub async fn consume(
    subjects: &Subjects,
    db: &PgPool,
    nats: &async_nats::Client,
    shutdown: CancellationToken,
) -> Result<(), SchedulerError> {
    let subject = subjects.heartbeat_all();
    let sub = nats
        .queue_subscribe(subject.clone(), QUEUE_GROUP.to_owned())
        .await
        .map_err(|source| SchedulerError::Subscribe { subject, source })?;
    // Everything already waiting is taken at once and only each host's newest heartbeat is
    // applied: a consumer that falls behind catches up instead of stamping old inventories
    // with a fresh `last_seen` (which would make the reconciler act on stale observations).
    let mut batches = sub.ready_chunks(MAX_BATCH);
    loop {
        let batch = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            batch = batches.next() => match batch {
                Some(batch) => batch,
                None => return Ok(()),
            },
        };
        let mut newest: HashMap<HostId, Heartbeat> = HashMap::new();
        for msg in batch {
            match wire::decode::<Heartbeat>(&msg.payload) {
                Ok(hb) if subject_host(&msg.subject) != Some(hb.host_id) => {
                    warn!(host_id = %hb.host_id, subject = %msg.subject, "heartbeat on another host's subject; dropped");
                    reject(Rejected::ForeignSubject);
                }
                // The greatest `seq` of a host wins (its row is checked again on upsert).
                Ok(hb) => {
                    let newer = newest
                        .get(&hb.host_id)
                        .is_none_or(|kept| kept.seq <= hb.seq);
                    if newest.contains_key(&hb.host_id) {
                        metrics::counter!("berth_heartbeats_total", "outcome" => "superseded")
                            .increment(1);
                    }
                    if newer {
                        newest.insert(hb.host_id, hb);
                    }
                }
                Err(error) => {
                    warn!(%error, subject = %msg.subject, "dropping undecodable heartbeat");
                    metrics::counter!("berth_heartbeats_total", "outcome" => "malformed")
                        .increment(1);
                }
            }
        }
        let ids: Vec<HostId> = newest.keys().copied().collect();
        let registered = match berth_store::hosts::registered(db, &ids).await {
            Ok(registered) => registered,
            Err(error) => {
                warn!(%error, "host registrations not read; heartbeats of this batch dropped");
                metrics::counter!("berth_heartbeats_total", "outcome" => "error")
                    .increment(ids.len() as u64);
                continue;
            }
        };
        let mut accepted = Vec::with_capacity(newest.len());
        for hb in newest.into_values() {
            if registered.contains(&hb.host_id) {
                accepted.push(hb);
            } else {
                warn!(host_id = %hb.host_id, name = %hb.name, "heartbeat of an unregistered host; dropped (berth admin add-host)");
                reject(Rejected::Unregistered);
            }
        }
        if accepted.is_empty() {
            continue;
        }
        match apply_batch(db, &accepted).await {
            Ok(applied) => {
                debug!(
                    applied = applied.len(),
                    batch = accepted.len(),
                    "heartbeats applied"
                );
                metrics::counter!("berth_heartbeats_total", "outcome" => "applied")
                    .increment(applied.len() as u64);
                // Older than what the host's row already holds (the newest wins).
                metrics::counter!("berth_heartbeats_total", "outcome" => "superseded")
                    .increment((accepted.len() - applied.len()) as u64);
                record_lag(&applied);
            }
            Err(error) => {
                warn!(%error, batch = accepted.len(), "heartbeats not applied");
                metrics::counter!("berth_heartbeats_total", "outcome" => "error")
                    .increment(accepted.len() as u64);
            }
        }
    }
}

/// Exports the ingest lag of a batch: `berth_heartbeat_ingest_lag_seconds` (the largest lag
/// of the latest batch: seconds from a host's send time to its upsert, database clock) and
/// the histogram `berth_heartbeat_ingest_lag_histogram_seconds` of every applied heartbeat.
fn record_lag(applied: &[berth_store::heartbeats::Applied]) {
    let mut max = 0.0_f64;
    for a in applied {
        metrics::histogram!("berth_heartbeat_ingest_lag_histogram_seconds").record(a.lag_seconds);
        max = max.max(a.lag_seconds);
    }
    metrics::gauge!("berth_heartbeat_ingest_lag_seconds").set(max);
}

/// Why a heartbeat was not applied (the `reason` label of `berth_heartbeats_rejected_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// Its payload names another host than its subject.
    ForeignSubject,
    /// Its host is not registered.
    Unregistered,
}

impl Rejected {
    /// The metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejected::ForeignSubject => "foreign_subject",
            Rejected::Unregistered => "unregistered",
        }
    }
}

fn reject(reason: Rejected) {
    metrics::counter!("berth_heartbeats_rejected_total", "reason" => reason.as_str()).increment(1);
}

/// The host a heartbeat subject `{p}.hb.<host>` names (its last token), if it is a host id.
pub fn subject_host(subject: &str) -> Option<HostId> {
    subject.rsplit('.').next()?.parse().ok()
}

/// Applies one heartbeat: [`apply_batch`] of a batch of one.
pub async fn apply(db: &PgPool, hb: &Heartbeat) -> Result<(), StoreError> {
    apply_batch(db, std::slice::from_ref(hb)).await?;
    Ok(())
}

/// Upserts a batch of registered hosts' heartbeats ([`berth_store::heartbeats::upsert`]: each
/// host's newest wins, also against its row) and, in the same transaction, makes the warm
/// slots of each applied heartbeat its host's ([`berth_store::warm::replace`], after
/// [`checked_slots`]). Two or three statements for the whole batch; run again when Postgres
/// aborts the transaction for a deadlock. Returns the heartbeats applied, with their lag.
pub async fn apply_batch(
    db: &PgPool,
    batch: &[Heartbeat],
) -> Result<Vec<berth_store::heartbeats::Applied>, StoreError> {
    berth_store::retry_transaction(|| apply_once(db, batch)).await
}

async fn apply_once(
    db: &PgPool,
    batch: &[Heartbeat],
) -> Result<Vec<berth_store::heartbeats::Applied>, StoreError> {
    let mut tx = db.begin().await?;
    let applied = berth_store::heartbeats::upsert(&mut *tx, batch).await?;
    // The heartbeat the upsert applied of each host: its greatest `seq`, of equal ones the
    // later in the batch (`warm::replace` checks the seq against the row again).
    let mut newest: HashMap<HostId, &Heartbeat> = HashMap::new();
    for hb in batch {
        if newest
            .get(&hb.host_id)
            .is_none_or(|kept| kept.seq <= hb.seq)
        {
            newest.insert(hb.host_id, hb);
        }
    }
    let slots: Vec<(HostId, u64, Vec<WarmSlot>)> = applied
        .iter()
        .filter_map(|a| newest.get(&a.host))
        .map(|hb| (hb.host_id, hb.seq, checked_slots(hb)))
        .collect();
    let reported: Vec<Reported<'_>> = slots
        .iter()
        .map(|(host, seq, slots)| Reported {
            host: *host,
            seq: *seq,
            slots,
        })
        .collect();
    berth_store::warm::replace(&mut tx, &reported).await?;
    tx.commit().await?;
    Ok(applied)
}

/// The most warm slots stored of one heartbeat; the rest are dropped. A pool is a few
/// sandboxes per shape; this only bounds what a faulty host can write.
pub const MAX_WARM_SLOTS: usize = 64;

/// The longest template name or image reference of a warm slot stored, in bytes (template
/// names have at most 64, a pinned image reference a few hundred); a longer one is dropped.
pub const MAX_WARM_SLOT_STRING_BYTES: usize = 1024;

/// The warm slots of `hb` worth storing: not one whose template or image is longer than
/// [`MAX_WARM_SLOT_STRING_BYTES`] or whose id is listed twice (or is in the heartbeat's own
/// inventory), and at most [`MAX_WARM_SLOTS`]. Each dropped slot is counted in
/// `berth_warm_slots_dropped_total{reason}` (`too_long`, `duplicate_id`, `too_many`).
pub fn checked_slots(hb: &Heartbeat) -> Vec<WarmSlot> {
    let mut seen: HashMap<SandboxId, usize> = HashMap::new();
    for id in hb
        .warm
        .iter()
        .map(|s| s.sandbox_id)
        .chain(hb.inventory.iter().map(|i| i.sandbox_id))
    {
        *seen.entry(id).or_default() += 1;
    }
    let mut kept = Vec::new();
    for slot in &hb.warm {
        let reason = if slot.template.len() > MAX_WARM_SLOT_STRING_BYTES
            || slot
                .image
                .as_ref()
                .is_some_and(|i| i.len() > MAX_WARM_SLOT_STRING_BYTES)
        {
            Some("too_long")
        } else if seen.get(&slot.sandbox_id) != Some(&1) {
            Some("duplicate_id")
        } else if kept.len() >= MAX_WARM_SLOTS {
            Some("too_many")
        } else {
            None
        };
        match reason {
            None => kept.push(slot.clone()),
            Some(reason) => {
                debug!(host_id = %hb.host_id, sandbox_id = %slot.sandbox_id, reason, "warm slot dropped");
                metrics::counter!("berth_warm_slots_dropped_total", "reason" => reason)
                    .increment(1);
            }
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_subject_names_the_host_in_its_last_token() {
        let host = HostId::new();
        assert_eq!(subject_host(&format!("t1.x.hb.{host}")), Some(host));
        assert_eq!(subject_host("t1.hb.not-a-host"), None);
        assert_eq!(subject_host(""), None);
    }

    fn slot() -> WarmSlot {
        WarmSlot {
            sandbox_id: SandboxId::new(),
            template: "base".into(),
            runtime: wire::Runtime::Runc,
            resources: wire::Resources {
                vcpus: 1,
                memory_mib: 256,
            },
            disk_mib: 1024,
            image: None,
        }
    }

    fn heartbeat(warm: Vec<WarmSlot>, inventory: Vec<SandboxId>) -> Heartbeat {
        Heartbeat {
            host_id: HostId::new(),
            name: "h".into(),
            seq: 1,
            capacity: wire::Resources::default(),
            used: wire::Resources::default(),
            runtimes: Vec::new(),
            inventory: inventory
                .into_iter()
                .map(|sandbox_id| wire::InventoryItem {
                    sandbox_id,
                    generation: berth_schemas::Generation(1),
                    status: wire::GuestStatus::Running,
                })
                .collect(),
            forwarder: None,
            sent_at_ms: 0,
            warm,
        }
    }

    #[test]
    fn warm_slots_with_absurd_strings_or_ids_listed_twice_are_dropped() {
        let good = slot();
        let long_template = WarmSlot {
            template: "t".repeat(MAX_WARM_SLOT_STRING_BYTES + 1),
            ..slot()
        };
        let long_image = WarmSlot {
            image: Some("i".repeat(MAX_WARM_SLOT_STRING_BYTES + 1)),
            ..slot()
        };
        let twice = slot();
        let in_inventory = slot();
        let hb = heartbeat(
            vec![
                good.clone(),
                long_template,
                long_image,
                twice.clone(),
                twice,
                in_inventory.clone(),
            ],
            vec![in_inventory.sandbox_id],
        );
        assert_eq!(checked_slots(&hb), vec![good]);
    }

    #[test]
    fn at_most_max_warm_slots_are_kept_of_one_heartbeat() {
        let many: Vec<WarmSlot> = (0..MAX_WARM_SLOTS + 3).map(|_| slot()).collect();
        let kept = checked_slots(&heartbeat(many.clone(), Vec::new()));
        assert_eq!(kept, many[..MAX_WARM_SLOTS].to_vec());
    }
}
