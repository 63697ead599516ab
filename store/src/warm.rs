//! Warm slots (issue 16 lever 1): the sandboxes each host booted ahead of any create, as its
//! newest heartbeat lists them ([`berth_schemas::wire::Heartbeat::warm`]), and a create's claim
//! of one.
//!
//! # Guarantees
//! - A host's rows are exactly the slots of its newest applied heartbeat: [`replace`] changes a
//!   host's rows only when the heartbeat it was given is the host's stored one (the same
//!   "newest wins" as [`crate::heartbeats::upsert`], run after it in the same transaction), so a
//!   late older heartbeat brings no slot back. Two statements per batch, whatever its size.
//! - A slot whose id names a sandbox is never stored and never claimed: a heartbeat sent before
//!   its host saw the create that took the slot may arrive after that create committed.
//! - A host speaks only for its own slots: a reported id stored for another host is left to it.
//! - Two creates never claim the same slot: [`claim`] deletes the row it locked
//!   (`FOR UPDATE SKIP LOCKED`), in the create's transaction.
//!
//! # Assumptions
//! A slot's id is drawn by its host ([`berth_schemas::SandboxId::new`]) and never reused; the
//! host hands the sandbox over when a create of its id arrives, or builds a fresh one under
//! that id if it no longer holds it (the host's fallback, not the control plane's).

use std::collections::HashMap;
use std::time::Duration;

use berth_schemas::wire::{Resources, Runtime, WarmSlot};
use berth_schemas::{HostId, SandboxId};
use sqlx::{PgConnection, PgExecutor, Row};

use crate::op::{timed, Op};
use crate::sandboxes::{resource_columns, runtime};
use crate::StoreError;

/// What a create asks of a warm slot: a slot matches when every field equals its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape<'a> {
    /// The template's name.
    pub template: &'a str,
    /// The template's runtime.
    pub runtime: Runtime,
    /// The sandbox's limits (whole vCPUs, MiB).
    pub resources: Resources,
    /// Its disk size in MiB.
    pub disk_mib: u32,
    /// The template's pinned image (`templates.image_pinned`); `None` for a built-in or
    /// imported template.
    pub image: Option<&'a str>,
}

/// The warm slots one applied heartbeat listed (see [`replace`]).
#[derive(Debug, Clone, Copy)]
pub struct Reported<'a> {
    /// The heartbeat's host.
    pub host: HostId,
    /// The heartbeat's `seq`: its slots replace the host's rows only while this is the host's
    /// stored `heartbeat_seq`.
    pub seq: u64,
    /// Its slots, already checked by the caller (the heartbeat consumer).
    pub slots: &'a [WarmSlot],
}

fn seq_column(seq: u64) -> i64 {
    i64::try_from(seq).unwrap_or(i64::MAX)
}

fn disk_column(disk_mib: u32) -> i32 {
    i32::try_from(disk_mib).unwrap_or(i32::MAX)
}

/// Makes each host's rows of `batch` exactly its reported slots, for the hosts whose stored
/// `heartbeat_seq` is the reported `seq` (run it after [`crate::heartbeats::upsert`] in the
/// same transaction: then those are the heartbeats it applied; any other is older and changes
/// nothing). A listed slot whose id names a sandbox, is stored for another host, or is listed
/// twice in the batch (by one host or two) is not stored; a stored one whose id names a
/// sandbox is removed. Each stored slot's `reported_at` becomes the database's `now()`.
///
/// One `DELETE` and one `INSERT … ON CONFLICT` for the whole batch (the heartbeat consumer
/// takes up to thousands of heartbeats at once).
///
/// Errors: [`StoreError`].
pub async fn replace(conn: &mut PgConnection, batch: &[Reported<'_>]) -> Result<(), StoreError> {
    if batch.is_empty() {
        return Ok(());
    }
    let hosts: Vec<uuid::Uuid> = batch.iter().map(|r| r.host.as_uuid()).collect();
    let seqs: Vec<i64> = batch.iter().map(|r| seq_column(r.seq)).collect();
    // An id listed twice is nobody's (and one `INSERT … ON CONFLICT` may not touch a row twice).
    let mut listed: HashMap<SandboxId, usize> = HashMap::new();
    for slot in batch.iter().flat_map(|r| r.slots) {
        *listed.entry(slot.sandbox_id).or_default() += 1;
    }
    let mut ids = Vec::new();
    let mut slot_hosts = Vec::new();
    let mut slot_seqs = Vec::new();
    let mut templates = Vec::new();
    let mut runtimes = Vec::new();
    let mut vcpus = Vec::new();
    let mut memory = Vec::new();
    let mut disks = Vec::new();
    let mut images = Vec::new();
    for reported in batch {
        for slot in reported.slots {
            if listed.get(&slot.sandbox_id) != Some(&1) {
                continue;
            }
            let (v, m) = resource_columns(slot.resources);
            ids.push(slot.sandbox_id.as_uuid());
            slot_hosts.push(reported.host.as_uuid());
            slot_seqs.push(seq_column(reported.seq));
            templates.push(slot.template.as_str());
            runtimes.push(slot.runtime.as_str());
            vcpus.push(v);
            memory.push(m);
            disks.push(disk_column(slot.disk_mib));
            images.push(slot.image.as_deref());
        }
    }
    // The batch's applied hosts' rows that are no longer listed, or whose id became a sandbox.
    // Outer joins rather than (NOT) EXISTS under an `OR`, which Postgres would run once per row
    // instead of as one hashed anti-join over the batch.
    timed(
        Op::WarmReplace,
        sqlx::query(
            "DELETE FROM warm_slots d
              USING (SELECT w.sandbox_id
                       FROM warm_slots w
                       JOIN UNNEST($1::uuid[], $2::int8[]) AS b(host, seq) ON b.host = w.host_id
                       JOIN hosts h ON h.id = b.host AND h.heartbeat_seq = b.seq
                       LEFT JOIN UNNEST($3::uuid[], $4::uuid[]) AS s(host, id)
                              ON s.host = w.host_id AND s.id = w.sandbox_id
                       LEFT JOIN sandboxes x ON x.id = w.sandbox_id
                      WHERE s.id IS NULL OR x.id IS NOT NULL) AS gone
              WHERE d.sandbox_id = gone.sandbox_id",
        )
        .bind(&hosts)
        .bind(&seqs)
        .bind(&slot_hosts)
        .bind(&ids)
        .execute(&mut *conn),
    )
    .await?;
    if ids.is_empty() {
        return Ok(());
    }
    // The listed slots, new or refreshed; never a sandbox's id, never another host's row.
    timed(
        Op::WarmReplace,
        sqlx::query(
            "INSERT INTO warm_slots (sandbox_id, host_id, template, runtime, vcpus, memory_mib,
                                     disk_mib, image, reported_at)
             SELECT s.id, s.host, s.template, s.runtime, s.vcpus, s.memory_mib, s.disk_mib,
                    s.image, now()
               FROM UNNEST($1::uuid[], $2::uuid[], $3::int8[], $4::text[], $5::text[],
                           $6::int4[], $7::int4[], $8::int4[], $9::text[])
                    AS s(id, host, seq, template, runtime, vcpus, memory_mib, disk_mib, image)
               JOIN hosts h ON h.id = s.host AND h.heartbeat_seq = s.seq
              WHERE NOT EXISTS (SELECT 1 FROM sandboxes x WHERE x.id = s.id)
             ON CONFLICT (sandbox_id) DO UPDATE SET
                 template = EXCLUDED.template,
                 runtime = EXCLUDED.runtime,
                 vcpus = EXCLUDED.vcpus,
                 memory_mib = EXCLUDED.memory_mib,
                 disk_mib = EXCLUDED.disk_mib,
                 image = EXCLUDED.image,
                 reported_at = EXCLUDED.reported_at
              WHERE warm_slots.host_id = EXCLUDED.host_id",
        )
        .bind(&ids)
        .bind(&slot_hosts)
        .bind(&slot_seqs)
        .bind(&templates)
        .bind(&runtimes)
        .bind(&vcpus)
        .bind(&memory)
        .bind(&disks)
        .bind(&images)
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// The SQL condition that a slot (alias `w`) has `shape` ($1 template, $2 runtime, $3 vCPUs,
/// $4 MiB, $5 disk MiB, $6 image) and is claimable: reported within $7 seconds and not a
/// sandbox's id.
const CLAIMABLE: &str = "w.template = $1 AND w.runtime = $2 AND w.vcpus = $3
                         AND w.memory_mib = $4 AND w.disk_mib = $5
                         AND w.image IS NOT DISTINCT FROM $6
                         AND w.reported_at > now() - make_interval(secs => $7)
                         AND NOT EXISTS (SELECT 1 FROM sandboxes x WHERE x.id = w.sandbox_id)";

/// Binds [`CLAIMABLE`]'s $1–$7: `shape` and `freshness`.
fn bind_claimable<'q, O>(
    query: sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    shape: &Shape<'q>,
    freshness: Duration,
) -> sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    let (vcpus, memory_mib) = resource_columns(shape.resources);
    query
        .bind(shape.template)
        .bind(shape.runtime.as_str())
        .bind(vcpus)
        .bind(memory_mib)
        .bind(disk_column(shape.disk_mib))
        .bind(shape.image)
        .bind(freshness.as_secs_f64())
}

/// Takes one slot of `host` with `shape`, reported within `freshness` (database clock) and
/// whose id names no sandbox, in the caller's transaction: deletes its row and returns its id,
/// which the create then gives its sandbox (in the same transaction). A slot another
/// transaction is claiming is skipped, never waited for. `None`: no such slot.
///
/// Errors: [`StoreError`].
pub async fn claim(
    conn: &mut PgConnection,
    host: HostId,
    shape: &Shape<'_>,
    freshness: Duration,
) -> Result<Option<SandboxId>, StoreError> {
    timed(
        Op::WarmClaim,
        bind_claimable(
            sqlx::query_scalar(&format!(
                "DELETE FROM warm_slots
              WHERE sandbox_id = (SELECT w.sandbox_id FROM warm_slots w
                                   WHERE w.host_id = $8 AND {CLAIMABLE}
                                   ORDER BY w.reported_at DESC, w.sandbox_id
                                   LIMIT 1 FOR UPDATE SKIP LOCKED)
              RETURNING sandbox_id"
            )),
            shape,
            freshness,
        )
        .bind(host)
        .fetch_optional(conn),
    )
    .await
}

/// The hosts holding a slot of `shape` that [`claim`] would take now (reported within
/// `freshness`, not a sandbox's id): placement prefers them.
///
/// Errors: [`StoreError`].
pub async fn hosts_with_slot(
    conn: &mut PgConnection,
    shape: &Shape<'_>,
    freshness: Duration,
) -> Result<Vec<HostId>, StoreError> {
    timed(
        Op::WarmHosts,
        bind_claimable(
            sqlx::query_scalar(&format!(
                "SELECT DISTINCT w.host_id FROM warm_slots w WHERE {CLAIMABLE}"
            )),
            shape,
            freshness,
        )
        .fetch_all(conn),
    )
    .await
}

/// The slots stored for `host`, by id (what its newest applied heartbeat listed, less those
/// claimed since).
///
/// Errors: [`StoreError`].
pub async fn of_host(db: impl PgExecutor<'_>, host: HostId) -> Result<Vec<WarmSlot>, StoreError> {
    let rows = timed(
        Op::WarmList,
        sqlx::query(
            "SELECT sandbox_id, template, runtime, vcpus, memory_mib, disk_mib, image
               FROM warm_slots WHERE host_id = $1 ORDER BY sandbox_id",
        )
        .bind(host)
        .fetch_all(db),
    )
    .await?;
    rows.iter()
        .map(|r| {
            let get = StoreError::database(Op::WarmList);
            let count = |column: &'static str| -> Result<u32, StoreError> {
                let v: i32 = r.try_get(column).map_err(get)?;
                u32::try_from(v).map_err(|e| StoreError::Corrupt {
                    column,
                    message: e.to_string(),
                })
            };
            Ok(WarmSlot {
                sandbox_id: r.try_get("sandbox_id").map_err(get)?,
                template: r.try_get("template").map_err(get)?,
                runtime: runtime(&r.try_get::<String, _>("runtime").map_err(get)?)?,
                resources: Resources {
                    vcpus: count("vcpus")?,
                    memory_mib: count("memory_mib")?,
                },
                disk_mib: count("disk_mib")?,
                image: r.try_get("image").map_err(get)?,
            })
        })
        .collect()
}
