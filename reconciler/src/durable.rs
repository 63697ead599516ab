//! A host's report that a stop snapshot is stored in the object store (issue 14,
//! [`ResultOutcome::Durable`]): the second result of a `sandbox.stop`, sent once its background
//! upload is confirmed, and the success of a `sandbox.archive`. `durable_at` is written only
//! from such a report (DESIGN.md guarantee 9), and only while the sandbox is still at the
//! generation the snapshot was taken at: a late report for a sandbox that moved on (started,
//! deleted) changes nothing (the fence, guarantee 4 of the issue) but handing the snapshot it
//! stored, which no row will name, to the collector.

use berth_schemas::wire::{CommandResult, StopDurable};
use berth_schemas::SandboxState;
use berth_store::{chunks, sandboxes, SandboxRow, StoreError};
use sqlx::PgConnection;
use tracing::{debug, info, warn};

use crate::results::{Applied, Rejection};

/// Records `durable` for the locked `row` at `generation` in the caller's transaction;
/// whether it was written. A stop snapshot with a chunk a snapshot delete's claimed removal
/// may have taken from under its upload is not recorded (the next archive uploads again).
pub(crate) async fn record(
    conn: &mut PgConnection,
    row: &SandboxRow,
    generation: berth_schemas::Generation,
    durable: &StopDurable,
) -> Result<bool, StoreError> {
    let chunks: Vec<(String, i64)> = durable
        .chunks
        .iter()
        .map(|(h, n)| (h.clone(), i64::from(*n)))
        .collect();
    let hashes: Vec<String> = chunks.iter().map(|(h, _)| h.clone()).collect();
    let lost = chunks::check_for_ready(
        conn,
        durable.snapshot_id,
        captured_by(row, durable),
        &hashes,
    )
    .await?;
    if !lost.is_empty() {
        warn!(lost = lost.len(), snapshot_id = %durable.snapshot_id,
            "a stop snapshot lost chunks to a snapshot delete; not recorded as durable");
        return Ok(false);
    }
    sandboxes::write_durable(conn, row.id, generation, durable.snapshot_id, &chunks).await
}

/// How far a host's clock may run ahead of the database's, for [`captured_by`].
const HOST_CLOCK_MARGIN: chrono::TimeDelta = chrono::TimeDelta::minutes(10);

/// A time no later than the first look the stop snapshot's upload took at the store (whether
/// a chunk was there already), for [`chunks::check_for_ready`]: a chunk removal that finished
/// after it may have been skipped by the upload, so the snapshot must not be recorded. The
/// snapshot's id is a UUIDv7 hostd mints as the capture begins (`hostd/src/apply/archive.rs`),
/// so its time, less [`HOST_CLOCK_MARGIN`], comes before any upload of it; the row's
/// `updated_at` does not (the `stopped` result may be applied after the upload began, and a
/// settings change or an archive that reuses an earlier stop moves it later). Earlier is the
/// safe side: a removal counted as lost that was not costs one upload again.
fn captured_by(row: &SandboxRow, durable: &StopDurable) -> chrono::DateTime<chrono::Utc> {
    let captured = durable
        .snapshot_id
        .as_uuid()
        .get_timestamp()
        .and_then(|t| {
            let (secs, nanos) = t.to_unix();
            chrono::DateTime::from_timestamp(i64::try_from(secs).ok()?, nanos)
        })
        .unwrap_or(row.updated_at);
    captured.min(row.updated_at) - HOST_CLOCK_MARGIN
}

/// Applies a stop's durability report (the command already matched what was issued).
pub(crate) async fn apply_stop(
    conn: &mut PgConnection,
    result: &CommandResult,
    durable: &StopDurable,
) -> Result<Applied, StoreError> {
    let Some(row) = sandboxes::lock(&mut *conn, result.sandbox_id, None).await? else {
        return Ok(Applied::Unknown);
    };
    if row.host_id != Some(result.host_id) {
        forget(conn, &row, durable).await?;
        return Ok(Applied::Rejected(Rejection::NotPlacement));
    }
    if result.generation != row.generation || row.deleting() || row.state != SandboxState::Stopped {
        debug!(row_generation = %row.generation, state = %row.state,
            "a late stop durability report; the sandbox moved on");
        forget(conn, &row, durable).await?;
        return Ok(Applied::Stale);
    }
    if record(conn, &row, result.generation, durable).await? {
        info!(snapshot_id = %durable.snapshot_id, stored_bytes = durable.stored_bytes,
            "stop snapshot durable");
        Ok(Applied::Durable)
    } else {
        forget(conn, &row, durable).await?;
        Ok(Applied::Stale)
    }
}

/// A stored stop snapshot the sandbox will never name (its report came late, or lost chunks)
/// goes to the collector like a superseded one, so what its upload stored does not stay in the
/// object store for good (a start cancels a stop's upload only before it stores anything; once
/// staged, the upload finishes and reports).
async fn forget(
    conn: &mut PgConnection,
    row: &SandboxRow,
    durable: &StopDurable,
) -> Result<(), StoreError> {
    let hashes: Vec<String> = durable.chunks.iter().map(|(h, _)| h.clone()).collect();
    if sandboxes::supersede_unnamed(conn, row.id, durable.snapshot_id, &hashes).await? {
        info!(snapshot_id = %durable.snapshot_id, "a late stop snapshot goes to the collector");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use berth_schemas::ids::SnapshotId;
    use berth_schemas::SandboxId;
    use chrono::{TimeDelta, Utc};
    use sqlx::PgPool;
    use uuid::Uuid;

    use super::*;

    /// A stop snapshot id minted `ago` (as hostd mints one when its capture begins).
    fn captured(ago: TimeDelta, hash: &str) -> StopDurable {
        let at = Utc::now() - ago;
        let ts = uuid::Timestamp::from_unix(
            uuid::NoContext,
            u64::try_from(at.timestamp()).unwrap(),
            at.timestamp_subsec_nanos(),
        );
        StopDurable {
            snapshot_id: SnapshotId::from(Uuid::new_v7(ts)),
            memory: false,
            stored_bytes: 1,
            chunks: vec![(hash.to_owned(), 1)],
        }
    }

    /// A removal of `hash` that finished `ago`.
    async fn removed(conn: &mut PgConnection, hash: &str, ago: TimeDelta) {
        sqlx::query(
            "INSERT INTO chunk_removals (sha256, removing_at, removed_at)
             VALUES ($1, now() - make_interval(secs => $2) - interval '1 second',
                     now() - make_interval(secs => $2))",
        )
        .bind(hash)
        .bind(ago.as_seconds_f64())
        .execute(conn)
        .await
        .unwrap();
    }

    /// The row's `updated_at` is no bound on when a stop's upload looked at the store: a
    /// removal that finished after the capture began, but before the row last changed (its
    /// `stopped` applied late, a settings change), may have taken a chunk the upload skipped.
    /// Such a snapshot is not recorded; one captured well after the removal is, and takes the
    /// chunk back from the removal queue.
    #[sqlx::test(migrator = "berth_store::MIGRATOR")]
    async fn a_stop_whose_upload_began_before_a_removal_finished_is_not_recorded(db: PgPool) {
        let mut conn = db.acquire().await.unwrap();
        let (org, host, id) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        sqlx::query("INSERT INTO orgs (id, name) VALUES ($1, 'o')")
            .bind(org)
            .execute(&mut *conn)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO hosts (id, name, capacity_vcpus, capacity_memory_mib)
             VALUES ($1, 'h', 4, 4096)",
        )
        .bind(host)
        .execute(&mut *conn)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO sandboxes (id, org_id, template, state, vcpus, memory_mib, runtime, host_id)
             VALUES ($1, $2, 'base', 'stopped', 1, 256, 'runc', $3)",
        )
        .bind(id)
        .bind(org)
        .bind(host)
        .execute(&mut *conn)
        .await
        .unwrap();
        let (lost, kept) = ("a".repeat(64), "b".repeat(64));
        removed(&mut conn, &lost, TimeDelta::minutes(2)).await;
        removed(&mut conn, &kept, TimeDelta::minutes(30)).await;
        let row = sandboxes::lock(&mut conn, SandboxId::from(id), None)
            .await
            .unwrap()
            .unwrap();
        assert!(row.updated_at > Utc::now() - TimeDelta::minutes(1));

        // Captured 3 minutes ago: its upload may have skipped the chunk removed a minute later.
        let early = captured(TimeDelta::minutes(3), &lost);
        assert!(!record(&mut conn, &row, row.generation, &early)
            .await
            .unwrap());
        // Captured 5 minutes ago, past the margin of a removal 30 minutes old: recorded.
        let late = captured(TimeDelta::minutes(5), &kept);
        assert!(record(&mut conn, &row, row.generation, &late)
            .await
            .unwrap());
        let queued: Vec<String> = sqlx::query_scalar("SELECT sha256 FROM chunk_removals")
            .fetch_all(&mut *conn)
            .await
            .unwrap();
        assert_eq!(
            queued,
            [lost],
            "the recorded snapshot's chunk is taken back"
        );
    }
}
