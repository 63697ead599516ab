//! The heartbeat consumer: each `{p}.hb.<host>` message upserts that host's row, stamping
//! `last_seen` with the database clock (never the host's or ours, so hosts with skewed clocks
//! are judged fairly).
//!
//! Heartbeats are core NATS (at most once): only the latest matters, and a lost one is
//! replaced a few seconds later. Scheduler replicas share the queue group [`QUEUE_GROUP`].
//!
//! # Only a host speaks for itself
//! A heartbeat is applied only when it arrived on its own host's subject (the payload's
//! `host_id` is the subject's last token: NATS permissions let a host publish only there) and
//! that host is registered (`berth admin add-host`, `store::hosts::register`). Everything else
//! is dropped, counted in `berth_heartbeats_rejected_total{reason}` (`foreign_subject`,
//! `unregistered`) and logged; it never creates or refreshes a host row.

use berth_schemas::wire::{self, Heartbeat};
use std::collections::HashMap;

use berth_schemas::{HostId, Subjects};
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
                // Arrival order is send order for one host (one connection): the last wins.
                Ok(hb) => {
                    if newest.insert(hb.host_id, hb).is_some() {
                        metrics::counter!("berth_heartbeats_total", "outcome" => "superseded")
                            .increment(1);
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
        for hb in newest.values() {
            if !registered.contains(&hb.host_id) {
                warn!(host_id = %hb.host_id, name = %hb.name, "heartbeat of an unregistered host; dropped (berth admin add-host)");
                reject(Rejected::Unregistered);
                continue;
            }
            match apply(db, hb).await {
                Ok(()) => {
                    debug!(host_id = %hb.host_id, seq = hb.seq, "heartbeat applied");
                    metrics::counter!("berth_heartbeats_total", "outcome" => "applied")
                        .increment(1);
                }
                Err(error) => {
                    warn!(host_id = %hb.host_id, %error, "heartbeat not applied");
                    metrics::counter!("berth_heartbeats_total", "outcome" => "error").increment(1);
                }
            }
        }
    }
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

/// Upserts the host row from one heartbeat ([`berth_store::hosts::upsert_heartbeat`]): a
/// `lost` host that speaks again becomes `ready`; `draining` and `cordoned` are operator
/// decisions and stay.
pub async fn apply(db: &PgPool, hb: &Heartbeat) -> Result<(), StoreError> {
    berth_store::hosts::upsert_heartbeat(db, hb).await
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
}
