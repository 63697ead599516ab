//! Heartbeat ingest in batches, and how old each host's evidence is.
//!
//! # Guarantees
//! - One statement upserts a whole batch of heartbeats ([`upsert`]), so ingest keeps up with a
//!   fleet: the consumer's rate is bounded by statements, not by heartbeats.
//! - The newest heartbeat of a host wins: a row is updated only by a heartbeat whose `seq` is
//!   at least the stored one (hostd's `seq` rises across restarts too), so a late or duplicated
//!   older heartbeat never overwrites a newer inventory or refreshes `last_seen`.
//! - `last_seen` is the database clock at the upsert; `heartbeat_sent_at` is the host's clock
//!   when it began observing the inventory. Their difference is the ingest lag ([`Applied`]).
//! - The statement that stores an inventory also judges it against the sandbox rows and
//!   rewrites the host's findings ([`crate::findings`]): what the reconciler's pass acts on.
//!
//! # Assumptions
//! Host clocks are kept within seconds of the database's (NTP). A host clock behind makes its
//! evidence look older (the pass then judges nothing there and says so); one ahead makes it
//! look newer by the skew, which the reconciler's inventory grace absorbs when it is smaller.

use std::collections::HashMap;
use std::time::Duration;

use berth_schemas::wire::Heartbeat;
use berth_schemas::{HostEvent, HostId, HostState};
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};

use crate::op::{timed, Op};
use crate::StoreError;

/// A heartbeat [`upsert`] applied.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Applied {
    /// The host whose row it updated.
    pub host: HostId,
    /// Seconds from the host's send time to the upsert (database clock), at least 0: how far
    /// behind heartbeat ingest runs (and any clock skew of the host).
    pub lag_seconds: f64,
}

/// The host's send time ([`Heartbeat::sent_at_ms`]) as a timestamp.
fn sent_at(hb: &Heartbeat) -> DateTime<Utc> {
    DateTime::<Utc>::from_timestamp_millis(i64::try_from(hb.sent_at_ms).unwrap_or(i64::MAX))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// Upserts each host's row from its newest heartbeat in `batch` (by `seq`; of equal ones, the
/// later in the slice), in one statement. A heartbeat older than the host's stored one changes
/// nothing. The state follows [`HostEvent::Heartbeat`]: a `lost` host that speaks again is
/// `ready`; `draining` and `cordoned` are operator decisions and stay. Each applied inventory
/// is judged in the same statement and its host's findings rewritten ([`crate::findings`]).
/// Returns what was applied (heartbeats superseded in the batch or by the stored row are left
/// out).
///
/// Errors: [`StoreError`].
pub async fn upsert(
    db: impl PgExecutor<'_>,
    batch: &[Heartbeat],
) -> Result<Vec<Applied>, StoreError> {
    let mut newest: HashMap<HostId, &Heartbeat> = HashMap::new();
    for hb in batch {
        match newest.get(&hb.host_id) {
            Some(kept) if kept.seq > hb.seq => {}
            _ => {
                newest.insert(hb.host_id, hb);
            }
        }
    }
    if newest.is_empty() {
        return Ok(Vec::new());
    }
    let hbs: Vec<&Heartbeat> = newest.into_values().collect();
    let ids: Vec<uuid::Uuid> = hbs.iter().map(|hb| hb.host_id.as_uuid()).collect();
    let names: Vec<&str> = hbs.iter().map(|hb| hb.name.as_str()).collect();
    let cap_vcpus: Vec<i32> = hbs
        .iter()
        .map(|hb| i32::try_from(hb.capacity.vcpus).unwrap_or(i32::MAX))
        .collect();
    let cap_memory: Vec<i64> = hbs
        .iter()
        .map(|hb| i64::from(hb.capacity.memory_mib))
        .collect();
    let runtimes: Vec<serde_json::Value> = hbs
        .iter()
        .map(|hb| serde_json::json!(hb.runtimes.iter().map(|r| &r.name).collect::<Vec<_>>()))
        .collect();
    let snapshots: Vec<bool> = hbs
        .iter()
        .map(|hb| hb.runtimes.iter().any(|r| r.memory_snapshot))
        .collect();
    let used_vcpus: Vec<i32> = hbs
        .iter()
        .map(|hb| i32::try_from(hb.used.vcpus).unwrap_or(i32::MAX))
        .collect();
    let used_memory: Vec<i64> = hbs.iter().map(|hb| i64::from(hb.used.memory_mib)).collect();
    let seqs: Vec<i64> = hbs
        .iter()
        .map(|hb| i64::try_from(hb.seq).unwrap_or(i64::MAX))
        .collect();
    let inventories: Vec<serde_json::Value> = hbs
        .iter()
        .map(|hb| {
            serde_json::Value::Array(
                hb.inventory
                    .iter()
                    .map(|i| {
                        serde_json::json!({
                            "sandbox_id": i.sandbox_id.to_string(),
                            "generation": i.generation.0,
                            "status": i.status.as_str(),
                        })
                    })
                    .collect(),
            )
        })
        .collect();
    let sent: Vec<DateTime<Utc>> = hbs.iter().map(|hb| sent_at(hb)).collect();
    let forwarders: Vec<Option<String>> = hbs.iter().map(|hb| hb.forwarder.clone()).collect();
    // The states a heartbeat moves to `ready` (today: `lost`).
    let revived: Vec<&str> = HostState::ALL
        .into_iter()
        .filter(|s| *s != HostState::Ready && s.on(HostEvent::Heartbeat) == Ok(HostState::Ready))
        .map(HostState::as_str)
        .collect();
    // The applied heartbeats' inventories, flattened for the judgement (`crate::findings`).
    let mut item_hosts = Vec::new();
    let mut item_sandboxes = Vec::new();
    let mut item_generations = Vec::new();
    let mut item_statuses = Vec::new();
    for hb in &hbs {
        for item in &hb.inventory {
            item_hosts.push(hb.host_id.as_uuid());
            item_sandboxes.push(item.sandbox_id.as_uuid());
            item_generations.push(item.generation.0);
            item_statuses.push(item.status.as_str());
        }
    }
    let rows: Vec<(HostId, f64)> = timed(
        Op::HostUpsert,
        sqlx::query_as(&format!(
            "WITH up AS (
             INSERT INTO hosts (id, name, capacity_vcpus, capacity_memory_mib, runtimes,
                                memory_snapshot, used_vcpus, used_memory_mib, heartbeat_seq,
                                inventory, heartbeat_sent_at, last_seen, forwarder)
             SELECT b.id, b.name, b.cap_vcpus, b.cap_memory,
                    ARRAY(SELECT jsonb_array_elements_text(b.runtimes)), b.snapshot,
                    b.used_vcpus, b.used_memory, b.seq, b.inventory, b.sent, now(), b.forwarder
               FROM UNNEST($1::uuid[], $2::text[], $3::int4[], $4::int8[], $5::jsonb[],
                           $6::bool[], $7::int4[], $8::int8[], $9::int8[], $10::jsonb[],
                           $11::timestamptz[], $14::text[])
                    AS b(id, name, cap_vcpus, cap_memory, runtimes, snapshot, used_vcpus,
                         used_memory, seq, inventory, sent, forwarder)
             ON CONFLICT (id) DO UPDATE SET
                 name = EXCLUDED.name,
                 capacity_vcpus = EXCLUDED.capacity_vcpus,
                 capacity_memory_mib = EXCLUDED.capacity_memory_mib,
                 runtimes = EXCLUDED.runtimes,
                 memory_snapshot = EXCLUDED.memory_snapshot,
                 used_vcpus = EXCLUDED.used_vcpus,
                 used_memory_mib = EXCLUDED.used_memory_mib,
                 heartbeat_seq = EXCLUDED.heartbeat_seq,
                 inventory = EXCLUDED.inventory,
                 heartbeat_sent_at = EXCLUDED.heartbeat_sent_at,
                 forwarder = EXCLUDED.forwarder,
                 last_seen = now(),
                 state = CASE WHEN hosts.state = ANY($12) THEN $13 ELSE hosts.state END,
                 state_changed_at = CASE WHEN hosts.state = ANY($12) THEN now()
                                         ELSE hosts.state_changed_at END
              WHERE hosts.heartbeat_seq <= EXCLUDED.heartbeat_seq
             RETURNING id, heartbeat_seq AS seq,
                       GREATEST(EXTRACT(EPOCH FROM now() - heartbeat_sent_at), 0)::float8 AS lag)
             {judge}
             SELECT id, lag FROM up",
            judge = crate::findings::judge_inventories_sql(),
        ))
        .bind(&ids)
        .bind(&names)
        .bind(&cap_vcpus)
        .bind(&cap_memory)
        .bind(&runtimes)
        .bind(&snapshots)
        .bind(&used_vcpus)
        .bind(&used_memory)
        .bind(&seqs)
        .bind(&inventories)
        .bind(&sent)
        .bind(&revived)
        .bind(HostState::Ready.as_str())
        .bind(&forwarders)
        .bind(&item_hosts)
        .bind(&item_sandboxes)
        .bind(&item_generations)
        .bind(&item_statuses)
        .fetch_all(db),
    )
    .await?;
    Ok(rows
        .into_iter()
        .map(|(host, lag_seconds)| Applied { host, lag_seconds })
        .collect())
}

/// The SQL age of a host's evidence (alias `h`): the time since it began observing its newest
/// applied inventory, on the database clock, never less than the time since that heartbeat
/// arrived. Decades for a host that never sent a send time (the Unix epoch stands in for it;
/// Postgres 15 refuses arithmetic on infinite timestamps).
pub const EVIDENCE_AGE_SQL: &str =
    "GREATEST(now() - COALESCE(h.heartbeat_sent_at, 'epoch'::timestamptz), now() - h.last_seen)";

/// The SQL time a host's newest applied inventory was taken (alias `h`), on the database clock
/// as well as it is known: the host's send time, but never later than its arrival.
pub const INVENTORY_TAKEN_SQL: &str =
    "LEAST(COALESCE(h.heartbeat_sent_at, 'epoch'::timestamptz), h.last_seen)";

/// Hosts in service (not `lost`) whose newest inventory is older than `max_age`
/// ([`EVIDENCE_AGE_SQL`]), with that age in seconds (`f64::INFINITY` for a host whose
/// heartbeats carry no send time), oldest first. The reconciler judges none of their
/// sandboxes.
///
/// Errors: [`StoreError`].
pub async fn stale_evidence(
    conn: &mut PgConnection,
    max_age: Duration,
) -> Result<Vec<(HostId, f64)>, StoreError> {
    let rows: Vec<(HostId, Option<f64>)> = timed(
        Op::HeartbeatEvidence,
        sqlx::query_as(&format!(
            "SELECT h.id, CASE WHEN h.heartbeat_sent_at IS NULL THEN NULL
                               ELSE EXTRACT(EPOCH FROM {EVIDENCE_AGE_SQL})::float8 END AS age
               FROM hosts h
              WHERE h.state <> $1 AND {EVIDENCE_AGE_SQL} >= make_interval(secs => $2)
              ORDER BY age DESC NULLS FIRST"
        ))
        .bind(HostState::Lost.as_str())
        .bind(max_age.as_secs_f64())
        .fetch_all(conn),
    )
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, age)| (id, age.unwrap_or(f64::INFINITY)))
        .collect())
}
