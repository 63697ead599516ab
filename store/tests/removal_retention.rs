//! The retention of finished removals (`chunks::REMOVAL_RETENTION`), against a real Postgres:
//! the sweep forgets chunk and manifest removals that finished longer ago than the retention
//! and its day's margin (`chunks::PRUNE_AFTER`) and never one still claimed, and the check a
//! settling snapshot or durability report makes refuses every request older than the
//! retention, so a forgotten removal can never let a snapshot missing a chunk settle. Time is moved by backdating rows on the database's clock.

mod common;

use berth_schemas::ids::SnapshotId;
use berth_schemas::{OrgId, SandboxId};
use berth_store::chunks::{self, ReadyCheck, PRUNE_AFTER, REMOVAL_RETENTION};
use berth_store::{orgs, sweep};
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};

/// A day, in seconds: how far past (or short of) the retention the tests move rows.
const DAY: f64 = 24.0 * 60.0 * 60.0;

fn hash(c: char) -> String {
    c.to_string().repeat(64)
}

/// The retention plus `days` (negative: short of it), in seconds.
fn retention_plus(days: f64) -> f64 {
    REMOVAL_RETENTION.as_secs_f64() + days * DAY
}

#[test]
fn the_prune_waits_a_day_past_the_retention() {
    assert_eq!(PRUNE_AFTER.as_secs_f64(), retention_plus(1.0));
}

/// A `creating` snapshot whose row was inserted `ago` seconds ago (database clock); its id and
/// `created_at`, the time its check is judged against.
async fn requested_ago(db: &PgPool, org: OrgId, ago: f64) -> (SnapshotId, DateTime<Utc>) {
    common::creating_snapshot(db, org, SandboxId::new(), None, ago).await
}

/// A chunk removal of `h`: queued, then claimed `claimed_ago` seconds ago and, with
/// `finished_ago`, finished that long ago (database clock).
async fn removal(conn: &mut PgConnection, h: &str, claimed_ago: f64, finished_ago: Option<f64>) {
    chunks::queue(conn, &[h.to_owned()]).await.unwrap();
    assert!(chunks::claim(conn, h).await.unwrap(), "claimed");
    sqlx::query(
        "UPDATE chunk_removals
            SET removing_at = clock_timestamp() - make_interval(secs => $2),
                removed_at = clock_timestamp() - make_interval(secs => $3::float8)
          WHERE sha256 = $1",
    )
    .bind(h)
    .bind(claimed_ago)
    .bind(finished_ago)
    .execute(conn)
    .await
    .unwrap();
}

/// A manifest removal of `id`: claimed `claimed_ago` seconds ago and, with `finished_ago`,
/// finished that long ago (database clock).
async fn manifest_removal(
    db: &PgPool,
    id: SnapshotId,
    claimed_ago: f64,
    finished_ago: Option<f64>,
) {
    let mut tx = db.begin().await.unwrap();
    assert!(
        sweep::claim_manifest(&mut tx, id).await.unwrap(),
        "nothing names it"
    );
    sweep::finish_manifest(&mut tx, id).await.unwrap();
    sqlx::query(
        "UPDATE manifest_removals
            SET removing_at = clock_timestamp() - make_interval(secs => $2),
                removed_at = clock_timestamp() - make_interval(secs => $3::float8)
          WHERE snapshot_id = $1",
    )
    .bind(id)
    .bind(claimed_ago)
    .bind(finished_ago)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

async fn chunk_rows(db: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT sha256 FROM chunk_removals ORDER BY sha256")
        .fetch_all(db)
        .await
        .unwrap()
}

async fn manifest_removed(db: &PgPool, id: SnapshotId) -> bool {
    let mut tx = db.begin().await.unwrap();
    let removed = sweep::manifest_removed(&mut tx, id).await.unwrap();
    tx.commit().await.unwrap();
    removed
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_snapshot_requested_longer_ago_than_the_retention_is_refused_and_a_younger_one_settles(
    db: PgPool,
) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let x = hash('a');
    let mut conn = db.acquire().await.unwrap();
    // No removal of its chunk at all: only its age refuses it.
    let (old, old_at) = requested_ago(&db, org, retention_plus(1.0 / 24.0)).await;
    assert_eq!(
        chunks::check_for_ready(&mut conn, old, old_at, std::slice::from_ref(&x))
            .await
            .unwrap(),
        ReadyCheck::TooOld
    );
    // An hour short of the retention it is judged as always, and its queued chunk taken back.
    chunks::queue(&mut conn, std::slice::from_ref(&x))
        .await
        .unwrap();
    let (young, young_at) = requested_ago(&db, org, retention_plus(-1.0 / 24.0)).await;
    assert_eq!(
        chunks::check_for_ready(&mut conn, young, young_at, std::slice::from_ref(&x))
            .await
            .unwrap(),
        ReadyCheck::Clear
    );
    assert!(chunk_rows(&db).await.is_empty(), "taken back");
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn pruning_forgets_only_removals_finished_past_the_margin_and_never_a_claimed_one(
    db: PgPool,
) {
    let mut conn = db.acquire().await.unwrap();
    let (old, young, claimed, queued) = (hash('1'), hash('2'), hash('3'), hash('4'));
    removal(
        &mut conn,
        &old,
        retention_plus(3.0),
        Some(retention_plus(2.0)),
    )
    .await;
    removal(
        &mut conn,
        &young,
        retention_plus(-1.0),
        Some(retention_plus(-1.0)),
    )
    .await;
    // Past the retention, inside the margin: stays (a check refuses its requests already).
    let margin = hash('7');
    removal(
        &mut conn,
        &margin,
        retention_plus(0.75),
        Some(retention_plus(0.5)),
    )
    .await;
    // A remover that died long ago, never finished (a takeover will): stays.
    removal(&mut conn, &claimed, retention_plus(3.0), None).await;
    chunks::queue(&mut conn, std::slice::from_ref(&queued))
        .await
        .unwrap();
    sqlx::query(
        "UPDATE chunk_removals SET queued_at = now() - interval '30 days' WHERE sha256 = $1",
    )
    .bind(&queued)
    .execute(&mut *conn)
    .await
    .unwrap();

    let (m_old, m_young, m_claimed) = (SnapshotId::new(), SnapshotId::new(), SnapshotId::new());
    manifest_removal(&db, m_old, retention_plus(3.0), Some(retention_plus(2.0))).await;
    let m_margin = SnapshotId::new();
    manifest_removal(
        &db,
        m_margin,
        retention_plus(0.75),
        Some(retention_plus(0.5)),
    )
    .await;
    manifest_removal(
        &db,
        m_young,
        retention_plus(-1.0),
        Some(retention_plus(-1.0)),
    )
    .await;
    manifest_removal(&db, m_claimed, retention_plus(3.0), None).await;

    assert_eq!(chunks::prune_finished(&mut conn, 10).await.unwrap(), 1);
    assert_eq!(
        chunk_rows(&db).await,
        [young.clone(), claimed, queued, margin]
    );
    assert_eq!(sweep::prune_removed(&mut conn, 10).await.unwrap(), 1);
    assert!(!manifest_removed(&db, m_old).await, "forgotten");
    assert!(manifest_removed(&db, m_young).await);
    assert!(manifest_removed(&db, m_margin).await, "inside the margin");
    assert!(
        manifest_removed(&db, m_claimed).await,
        "an unfinished claim stays"
    );
    assert_eq!(chunks::prune_finished(&mut conn, 10).await.unwrap(), 0);
    assert_eq!(sweep::prune_removed(&mut conn, 10).await.unwrap(), 0);

    // A batch is bounded by its limit; the rest goes with the next.
    let (a, b) = (hash('5'), hash('6'));
    removal(
        &mut conn,
        &a,
        retention_plus(3.0),
        Some(retention_plus(2.0)),
    )
    .await;
    removal(
        &mut conn,
        &b,
        retention_plus(3.0),
        Some(retention_plus(2.0)),
    )
    .await;
    assert_eq!(chunks::prune_finished(&mut conn, 1).await.unwrap(), 1);
    assert_eq!(chunks::prune_finished(&mut conn, 1).await.unwrap(), 1);
    assert_eq!(chunks::prune_finished(&mut conn, 1).await.unwrap(), 0);
}

/// The safety of pruning: a removal that finished inside the retention is remembered and still
/// fails a snapshot requested before it; one that finished past it is forgotten, and the
/// snapshot requested before it (older still) is refused for its age instead of passing.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_removal_finished_inside_the_retention_still_fails_a_report_requested_before_it(
    db: PgPool,
) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let mut conn = db.acquire().await.unwrap();
    let x = hash('b');
    let (uploading, requested_at) = requested_ago(&db, org, retention_plus(-1.0)).await;
    removal(
        &mut conn,
        &x,
        retention_plus(-1.5),
        Some(retention_plus(-1.5)),
    )
    .await;
    assert_eq!(chunks::prune_finished(&mut conn, 10).await.unwrap(), 0);
    assert_eq!(
        chunks::check_for_ready(&mut conn, uploading, requested_at, std::slice::from_ref(&x))
            .await
            .unwrap(),
        ReadyCheck::Lost(vec![x.clone()])
    );

    let y = hash('c');
    let (older, older_at) = requested_ago(&db, org, retention_plus(3.0)).await;
    removal(
        &mut conn,
        &y,
        retention_plus(2.5),
        Some(retention_plus(2.0)),
    )
    .await;
    assert_eq!(chunks::prune_finished(&mut conn, 10).await.unwrap(), 1);
    assert_eq!(
        chunks::check_for_ready(&mut conn, older, older_at, std::slice::from_ref(&y))
            .await
            .unwrap(),
        ReadyCheck::TooOld,
        "its removal is forgotten, so it must not pass"
    );

    // Past the retention but inside the prune's margin: remembered, and a request before it is
    // refused at the retention all the same.
    let z = hash('d');
    let (between, between_at) = requested_ago(&db, org, retention_plus(0.75)).await;
    removal(
        &mut conn,
        &z,
        retention_plus(0.6),
        Some(retention_plus(0.5)),
    )
    .await;
    assert_eq!(chunks::prune_finished(&mut conn, 10).await.unwrap(), 0);
    assert_eq!(
        chunks::check_for_ready(&mut conn, between, between_at, std::slice::from_ref(&z))
            .await
            .unwrap(),
        ReadyCheck::TooOld
    );
}
