//! The delete-vs-upload race on shared chunks (issue 13 item 8), against a real Postgres: a
//! chunk a snapshot delete orphans while another snapshot is being uploaded is either taken back
//! by that snapshot (and never removed) or, once a remover claimed it, makes that snapshot fail;
//! never both "removed" and "ready". The store-wide sweep of orphans (issue 14) removes chunks
//! through the same protocol, and claims manifests under the lock a durability report takes.

mod common;

use berth_schemas::ids::SnapshotId;
use berth_schemas::{OrgId, SandboxId};
use berth_store::snapshots::{self, Settled};
use berth_store::{chunks, orgs, sandboxes, sweep};
use sqlx::{PgConnection, PgPool};

async fn creating(db: &PgPool, org: OrgId) -> (SnapshotId, chrono::DateTime<chrono::Utc>) {
    common::creating_snapshot(db, org, SandboxId::new(), None, 0.0).await
}

/// Writes snapshot `id` `ready` holding `hashes`, 10 bytes each (`snapshots::write_ready`);
/// whether it was `creating`.
async fn write_ready_with(conn: &mut PgConnection, id: SnapshotId, hashes: &[String]) -> bool {
    let chunks: Vec<(String, i64)> = hashes.iter().map(|h| (h.clone(), 10)).collect();
    snapshots::write_ready(
        conn,
        id,
        &Settled {
            holds: "disk",
            logical_bytes: 10,
            stored_bytes: 10,
            new_bytes: 10,
            paused_ms: 1,
            chunks: &chunks,
        },
    )
    .await
    .unwrap()
}

fn hash(c: char) -> String {
    c.to_string().repeat(64)
}

async fn ready(db: &PgPool, id: SnapshotId, hashes: &[String]) {
    let mut conn = db.acquire().await.unwrap();
    assert!(write_ready_with(&mut conn, id, hashes).await);
}

/// Deletes snapshot `id` the way the API does: row and references, orphans queued, one
/// transaction. Returns the orphans.
async fn delete(db: &PgPool, id: SnapshotId) -> Vec<String> {
    let mut tx = db.begin().await.unwrap();
    snapshots::lock(&mut tx, id).await.unwrap().unwrap();
    let orphans: Vec<String> = snapshots::delete(&mut tx, id)
        .await
        .unwrap()
        .into_iter()
        .map(|(h, _)| h)
        .collect();
    chunks::queue(&mut tx, &orphans).await.unwrap();
    tx.commit().await.unwrap();
    orphans
}

/// Claims and finishes the queued removal of `h`, as a remover does (its object deleted
/// between).
async fn remove(conn: &mut PgConnection, h: &str) {
    assert!(chunks::claim(conn, h).await.unwrap(), "claimed");
    chunks::finish(conn, h).await.unwrap();
}

/// What `check_for_ready` finds lost of `h` for `uploading`, requested at `requested_at`.
async fn lost(
    conn: &mut PgConnection,
    (uploading, requested_at): (SnapshotId, chrono::DateTime<chrono::Utc>),
    h: &str,
) -> Vec<String> {
    lost_chunks(
        chunks::check_for_ready(conn, uploading, requested_at, &[h.to_owned()])
            .await
            .unwrap(),
    )
}

/// The chunks a check found lost (none when clear); these tests' requests are never too old.
fn lost_chunks(check: chunks::ReadyCheck) -> Vec<String> {
    match check {
        chunks::ReadyCheck::Clear => Vec::new(),
        chunks::ReadyCheck::Lost(lost) => lost,
        chunks::ReadyCheck::TooOld => panic!("a request of a moment ago is never too old"),
    }
}

/// One batch of a sweep whose chunk listing began at `listed_at`: of `listed`, the chunks no
/// row references are queued (committed); returns them.
async fn sweep_batch(
    db: &PgPool,
    listed: &[String],
    listed_at: chrono::DateTime<chrono::Utc>,
) -> Vec<String> {
    let mut tx = db.begin().await.unwrap();
    let orphans = sweep::unreferenced_chunks(&mut tx, listed).await.unwrap();
    chunks::queue_swept(&mut tx, &orphans, listed_at)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    orphans
}

async fn queued(db: &PgPool, h: &str) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM chunk_removals WHERE sha256 = $1)")
        .bind(h)
        .fetch_one(db)
        .await
        .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_chunk_claimed_for_removal_under_an_upload_fails_that_snapshot(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let x = hash('a');
    let (old, _) = creating(&db, org).await;
    ready(&db, old, std::slice::from_ref(&x)).await;
    // Another snapshot is requested and uploads; its upload finds `x` stored and skips it.
    let (uploading, requested_at) = creating(&db, org).await;
    assert_eq!(delete(&db, old).await, std::slice::from_ref(&x));
    let mut conn = db.acquire().await.unwrap();
    assert!(
        chunks::claim(&mut conn, &x).await.unwrap(),
        "no reference yet"
    );
    // (the remover deletes the object here)
    chunks::finish(&mut conn, &x).await.unwrap();
    let mut tx = db.begin().await.unwrap();
    let lost = lost_chunks(
        chunks::check_for_ready(&mut tx, uploading, requested_at, std::slice::from_ref(&x))
            .await
            .unwrap(),
    );
    assert_eq!(
        lost,
        std::slice::from_ref(&x),
        "the snapshot must fail, not become ready"
    );
    tx.commit().await.unwrap();

    // A claim whose removal is still under way counts the same.
    let y = hash('b');
    let (old, _) = creating(&db, org).await;
    ready(&db, old, std::slice::from_ref(&y)).await;
    let (uploading, requested_at) = creating(&db, org).await;
    delete(&db, old).await;
    assert!(chunks::claim(&mut conn, &y).await.unwrap());
    let lost = lost_chunks(
        chunks::check_for_ready(&mut conn, uploading, requested_at, std::slice::from_ref(&y))
            .await
            .unwrap(),
    );
    assert_eq!(lost, [y]);
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_settling_snapshot_takes_a_queued_chunk_back_and_the_remover_then_leaves_it(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let x = hash('c');
    let (old, _) = creating(&db, org).await;
    ready(&db, old, std::slice::from_ref(&x)).await;
    let (uploading, requested_at) = creating(&db, org).await;
    assert_eq!(delete(&db, old).await, std::slice::from_ref(&x));
    assert!(queued(&db, &x).await);

    // The snapshot settles first, in one transaction: check, then ready.
    let mut tx = db.begin().await.unwrap();
    let lost = lost_chunks(
        chunks::check_for_ready(&mut tx, uploading, requested_at, std::slice::from_ref(&x))
            .await
            .unwrap(),
    );
    assert!(lost.is_empty());
    // A remover racing the settle waits on the row lock and then finds the reference.
    let racer = {
        let db = db.clone();
        let x = x.clone();
        tokio::spawn(async move {
            let mut conn = db.acquire().await.unwrap();
            chunks::claim(&mut conn, &x).await.unwrap()
        })
    };
    write_ready_with(&mut tx, uploading, std::slice::from_ref(&x)).await;
    tx.commit().await.unwrap();
    assert!(!racer.await.unwrap(), "a referenced chunk is never claimed");
    let mut conn = db.acquire().await.unwrap();
    assert!(!chunks::claim(&mut conn, &x).await.unwrap());
    assert!(!queued(&db, &x).await, "taken back");

    // Deleting the last snapshot that references it orphans it again, and then it goes.
    assert_eq!(delete(&db, uploading).await, std::slice::from_ref(&x));
    assert!(chunks::claim(&mut conn, &x).await.unwrap());
    chunks::finish(&mut conn, &x).await.unwrap();
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_removal_finished_before_a_snapshot_was_requested_does_not_fail_it(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let x = hash('d');
    let (old, _) = creating(&db, org).await;
    ready(&db, old, std::slice::from_ref(&x)).await;
    delete(&db, old).await;
    let mut conn = db.acquire().await.unwrap();
    assert!(chunks::claim(&mut conn, &x).await.unwrap());
    chunks::finish(&mut conn, &x).await.unwrap();
    // Requested after the object was gone: its upload found it missing and stored it again.
    let (later, requested_at) = creating(&db, org).await;
    let lost = lost_chunks(
        chunks::check_for_ready(&mut conn, later, requested_at, std::slice::from_ref(&x))
            .await
            .unwrap(),
    );
    assert!(lost.is_empty());
    assert!(!queued(&db, &x).await, "referenced again: no longer queued");
}

/// The store-wide sweep (issue 14) removes a chunk nothing references through the same
/// protocol, so an upload in flight that skipped it (its last-modified time is old: it was
/// stored by an upload cut before its manifest) is caught by its check.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_sweep_removing_a_chunk_an_upload_skipped_fails_that_snapshot(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let x = hash('e');
    // Requested while `x`, an orphan, is in the store: its upload skips it.
    let uploading = creating(&db, org).await;
    let mut conn = db.acquire().await.unwrap();
    let listed_at = chunks::clock(&mut conn).await.unwrap();
    let orphans = sweep_batch(&db, std::slice::from_ref(&x), listed_at).await;
    assert_eq!(
        orphans,
        std::slice::from_ref(&x),
        "nothing references it yet"
    );
    // (the sweep deletes the object between the claim and the finish)
    remove(&mut conn, &x).await;
    assert_eq!(
        lost(&mut conn, uploading, &x).await,
        [x],
        "the snapshot must fail, not become ready"
    );

    // The sweep never resets a removal under way: a settling snapshot would take it back while
    // its object is being removed.
    let y = hash('f');
    let uploading = creating(&db, org).await;
    chunks::queue(&mut conn, std::slice::from_ref(&y))
        .await
        .unwrap();
    assert!(chunks::claim(&mut conn, &y).await.unwrap());
    let listed_at = chunks::clock(&mut conn).await.unwrap();
    sweep_batch(&db, std::slice::from_ref(&y), listed_at).await;
    assert_eq!(
        lost(&mut conn, uploading, &y).await,
        std::slice::from_ref(&y),
        "still claimed"
    );
    // A removal finished before a listing that still shows the chunk: stored again since, it
    // is queued afresh and claimed again.
    chunks::finish(&mut conn, &y).await.unwrap();
    let listed_at = chunks::clock(&mut conn).await.unwrap();
    sweep_batch(&db, std::slice::from_ref(&y), listed_at).await;
    assert!(chunks::claim(&mut conn, &y).await.unwrap());
    // A referenced chunk is no orphan.
    let z = hash('0');
    let (kept, _) = creating(&db, org).await;
    ready(&db, kept, std::slice::from_ref(&z)).await;
    assert!(
        sweep::unreferenced_chunks(&mut conn, std::slice::from_ref(&z))
            .await
            .unwrap()
            .is_empty()
    );
}

/// The sweep lists `x` (still referenced by snapshot S), S is deleted and its remover removes
/// `x` and finishes, and only then does the sweep's batch reach `x`, now an orphan: the
/// listing saw the object before that removal deleted it, so the finished removal must stay
/// finished, or snapshot U, requested before the removal and whose upload skipped `x`, would
/// take the row back and become ready naming a chunk that is gone.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_removal_finished_after_the_sweeps_listing_stays_finished(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let x = hash('7');
    let (s, _) = creating(&db, org).await;
    ready(&db, s, std::slice::from_ref(&x)).await;
    let uploading = creating(&db, org).await;
    let mut conn = db.acquire().await.unwrap();
    let listed_at = chunks::clock(&mut conn).await.unwrap();
    // (the sweep lists `x` here)
    assert_eq!(delete(&db, s).await, std::slice::from_ref(&x));
    remove(&mut conn, &x).await;
    assert_eq!(
        sweep_batch(&db, std::slice::from_ref(&x), listed_at).await,
        std::slice::from_ref(&x),
        "an orphan by now"
    );
    assert_eq!(
        lost(&mut conn, uploading, &x).await,
        std::slice::from_ref(&x),
        "the removal is still seen"
    );
    assert!(
        !chunks::claim(&mut conn, &x).await.unwrap(),
        "not queued afresh"
    );
}

/// A late stop report of manifest M (the sweep removed M's orphaned chunks; M's report comes
/// after) hands M's chunks to the collector, which queues them (`chunks::queue`): a removal
/// the sweep finished (`x`) or still holds claimed (`y`) must stay as it is, or upload V,
/// requested before those claims and which skipped both, would take the rows back and become
/// ready naming chunks that are gone. If `x` is stored again later, a later look of the sweep
/// queues it afresh and removes it.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn the_collector_queueing_a_removed_chunk_again_never_resets_its_removal(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let (x, y) = (hash('8'), hash('9'));
    let uploading = creating(&db, org).await;
    let mut conn = db.acquire().await.unwrap();
    let listed_at = chunks::clock(&mut conn).await.unwrap();
    sweep_batch(&db, &[x.clone(), y.clone()], listed_at).await;
    remove(&mut conn, &x).await;
    assert!(chunks::claim(&mut conn, &y).await.unwrap());

    // M's late report: the reconciler's `durable::forget`, then the collector's look.
    let m = SnapshotId::new();
    let both = [x.clone(), y.clone()];
    assert!(
        sandboxes::supersede_unnamed(&mut conn, SandboxId::new(), m, &both)
            .await
            .unwrap()
    );
    let mut tx = db.begin().await.unwrap();
    let taken = sandboxes::take_superseded(&mut tx, None)
        .await
        .unwrap()
        .unwrap();
    let mut orphans = taken.orphans;
    orphans.sort();
    assert_eq!(orphans, both);
    chunks::queue(&mut tx, &orphans).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        lost(&mut conn, uploading, &x).await,
        std::slice::from_ref(&x),
        "finished"
    );
    assert_eq!(
        lost(&mut conn, uploading, &y).await,
        std::slice::from_ref(&y),
        "claimed"
    );
    assert!(
        !chunks::claim(&mut conn, &y).await.unwrap(),
        "its remover still holds it"
    );

    // `x` stored again (by an upload cut before its manifest): the next look lists it.
    let listed_at = chunks::clock(&mut conn).await.unwrap();
    sweep_batch(&db, std::slice::from_ref(&x), listed_at).await;
    remove(&mut conn, &x).await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_stale_claim_is_taken_over_by_one_retrier_and_a_live_one_is_left(db: PgPool) {
    let (x, live) = (hash('1'), hash('2'));
    let mut conn = db.acquire().await.unwrap();
    chunks::queue(&mut conn, &[x.clone(), live.clone()])
        .await
        .unwrap();
    assert!(chunks::claim(&mut conn, &x).await.unwrap());
    assert!(chunks::claim(&mut conn, &live).await.unwrap());
    // `x`'s remover died longer than `STALE_CLAIM` ago, between its claim and its finish.
    sqlx::query(
        "UPDATE chunk_removals SET removing_at = now() - make_interval(secs => $2) - interval '1 minute'
          WHERE sha256 = $1",
    )
    .bind(&x)
    .bind(chunks::STALE_CLAIM.as_secs_f64())
    .execute(&mut *conn)
    .await
    .unwrap();
    assert_eq!(
        chunks::stale_claims(&mut conn, 10).await.unwrap(),
        std::slice::from_ref(&x)
    );
    assert!(!chunks::reclaim(&mut conn, &live).await.unwrap());
    let (first, second) = tokio::join!(
        async {
            let mut c = db.acquire().await.unwrap();
            chunks::reclaim(&mut c, &x).await.unwrap()
        },
        async {
            let mut c = db.acquire().await.unwrap();
            chunks::reclaim(&mut c, &x).await.unwrap()
        }
    );
    assert!(first ^ second, "one retrier takes it over");
    chunks::finish(&mut conn, &x).await.unwrap();
    assert!(chunks::stale_claims(&mut conn, 10)
        .await
        .unwrap()
        .is_empty());
}

/// Moves the claim of `h` back by `secs` (database clock); its new `removing_at`.
async fn claimed_ago(conn: &mut PgConnection, h: &str, secs: f64) -> chrono::DateTime<chrono::Utc> {
    sqlx::query_scalar(
        "UPDATE chunk_removals SET removing_at = removing_at - make_interval(secs => $2)
          WHERE sha256 = $1 RETURNING removing_at",
    )
    .bind(h)
    .bind(secs)
    .fetch_one(conn)
    .await
    .unwrap()
}

/// A second review of the sweep: a remover that stalled past the takeover must neither delete
/// (its claim is no longer the row's, or too old on the database's clock, whatever its own
/// monotonic clock says) nor finish the takeover's claim with its late `finish`, which would
/// date the removal before an upload the takeover's delete then races.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_stalled_remover_neither_deletes_nor_finishes_once_its_claim_is_old_or_taken_over(
    db: PgPool,
) {
    let x = hash('1');
    let mut conn = db.acquire().await.unwrap();
    chunks::queue(&mut conn, std::slice::from_ref(&x))
        .await
        .unwrap();
    let mine = chunks::claim_at(&mut conn, &x)
        .await
        .unwrap()
        .expect("claimed");
    assert!(chunks::still_claimed(&mut conn, &x, mine).await.unwrap());

    // Half the stale-claim age later (database clock): too old to delete under.
    let half = chunks::STALE_CLAIM.as_secs_f64() / 2.0;
    let mine = claimed_ago(&mut conn, &x, half + 1.0).await;
    assert!(!chunks::still_claimed(&mut conn, &x, mine).await.unwrap());

    // Past the whole age: taken over. The old claim's finish stamps nothing; the takeover's does.
    let mine = claimed_ago(&mut conn, &x, half).await;
    let theirs = chunks::reclaim_at(&mut conn, &x)
        .await
        .unwrap()
        .expect("taken over");
    assert!(!chunks::still_claimed(&mut conn, &x, mine).await.unwrap());
    assert!(!chunks::finish_claimed(&mut conn, &x, mine).await.unwrap());
    let finished: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT removed_at FROM chunk_removals WHERE sha256 = $1")
            .bind(&x)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    assert_eq!(finished, None, "the stalled remover's finish is refused");
    assert!(chunks::still_claimed(&mut conn, &x, theirs).await.unwrap());
    assert!(chunks::finish_claimed(&mut conn, &x, theirs).await.unwrap());
}

/// Whether the session `waiter` waits for a lock `holder` holds (Postgres's own view).
async fn blocked_by(db: &PgPool, waiter: i32, holder: i32) -> bool {
    sqlx::query_scalar("SELECT $2 = ANY(pg_blocking_pids($1))")
        .bind(waiter)
        .bind(holder)
        .fetch_one(db)
        .await
        .unwrap()
}

/// A manifest's claim and a durability report's check serialize on one lock: a report that
/// comes after the sweep claimed its manifest is refused, and a manifest a report named first
/// (here, the name it leaves: a superseded stop awaiting collection) is never claimed.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_swept_manifest_is_never_recorded_and_a_named_one_is_never_swept(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let (row, _) = creating(&db, org).await;
    let (orphan, named) = (SnapshotId::new(), SnapshotId::new());
    let mut conn = db.acquire().await.unwrap();
    assert_eq!(
        sweep::unnamed_manifests(&mut conn, &[row, orphan])
            .await
            .unwrap(),
        [orphan]
    );
    let mut tx = db.begin().await.unwrap();
    assert!(
        !sweep::claim_manifest(&mut tx, row).await.unwrap(),
        "a snapshot row's"
    );
    assert!(sweep::claim_manifest(&mut tx, orphan).await.unwrap());
    tx.commit().await.unwrap();
    sweep::finish_manifest(&mut conn, orphan).await.unwrap();
    let mut tx = db.begin().await.unwrap();
    assert!(
        sweep::manifest_removed(&mut tx, orphan).await.unwrap(),
        "a late report is refused"
    );
    tx.commit().await.unwrap();

    // The report's transaction holds the lock; the sweep's claim waits and then sees the name.
    let mut report = db.begin().await.unwrap();
    let report_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *report)
        .await
        .unwrap();
    assert!(!sweep::manifest_removed(&mut report, named).await.unwrap());
    let mut sweeper = db.begin().await.unwrap();
    let sweeper_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *sweeper)
        .await
        .unwrap();
    let claim = tokio::spawn(async move {
        let claimed = sweep::claim_manifest(&mut sweeper, named).await.unwrap();
        sweeper.commit().await.unwrap();
        claimed
    });
    // Deterministic: the claim has reached the lock and waits for the report's transaction.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    while !blocked_by(&db, sweeper_pid, report_pid).await {
        assert!(
            !claim.is_finished(),
            "the claim went past the report's lock"
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "the claim never waited"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    sqlx::query("INSERT INTO durable_superseded (snapshot_id, sandbox_id) VALUES ($1, $2)")
        .bind(named)
        .bind(SandboxId::new())
        .execute(&mut *report)
        .await
        .unwrap();
    report.commit().await.unwrap();
    assert!(!claim.await.unwrap(), "named first: never claimed");
}

/// The session id of `conn`.
async fn pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Waits until session `waiter` waits for a lock `holder` holds, failing if `task` (the
/// waiter's work) finishes first or it never waits.
async fn until_blocked<T>(
    db: &PgPool,
    waiter: i32,
    holder: i32,
    task: &tokio::task::JoinHandle<T>,
) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    while !blocked_by(db, waiter, holder).await {
        assert!(!task.is_finished(), "it went past the lock without waiting");
        assert!(tokio::time::Instant::now() < deadline, "it never waited");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// The race a row lock cannot order: a snapshot settles while `x` is still referenced by an
/// older snapshot (no removal row to lock), then a delete of that older snapshot commits and
/// queues `x` (it cannot see the settle's uncommitted reference). The claim must wait for the
/// settle's commit (`chunks::CLAIM_LOCK`) and then find the reference; without the lock it
/// claims at once and the object goes under a snapshot that commits `ready`.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_claim_waits_for_a_settle_that_checked_before_the_chunk_was_queued(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let x = hash('s');
    let (old, _) = creating(&db, org).await;
    ready(&db, old, std::slice::from_ref(&x)).await;
    let (settling, requested_at) = creating(&db, org).await;

    let mut settle = db.begin().await.unwrap();
    let settle_pid = pid(&mut settle).await;
    assert!(lost_chunks(
        chunks::check_for_ready(
            &mut settle,
            settling,
            requested_at,
            std::slice::from_ref(&x)
        )
        .await
        .unwrap()
    )
    .is_empty());
    assert!(!queued(&db, &x).await, "no removal row when it checked");
    assert!(write_ready_with(&mut settle, settling, std::slice::from_ref(&x)).await);

    // The older snapshot's delete does not see the uncommitted reference: it queues `x`.
    assert_eq!(delete(&db, old).await, std::slice::from_ref(&x));
    let mut remover = db.acquire().await.unwrap();
    let remover_pid = pid(&mut remover).await;
    let claim = {
        let x = x.clone();
        tokio::spawn(async move { chunks::claim(&mut remover, &x).await.unwrap() })
    };
    until_blocked(&db, remover_pid, settle_pid, &claim).await;
    settle.commit().await.unwrap();
    assert!(
        !claim.await.unwrap(),
        "the settle committed its reference first: never claimed"
    );
    assert!(!queued(&db, &x).await, "a referenced chunk's row goes");
}

/// Settles hold the lock shared: two in flight at once never wait for each other, and a claim
/// waits for both.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn settling_snapshots_never_wait_for_each_other(db: PgPool) {
    let org = orgs::create(&db, "o").await.unwrap().unwrap();
    let (x, y) = (hash('t'), hash('u'));
    let (a, a_at) = creating(&db, org).await;
    let (b, b_at) = creating(&db, org).await;
    let mut first = db.begin().await.unwrap();
    let first_pid = pid(&mut first).await;
    assert_eq!(
        chunks::check_for_ready(&mut first, a, a_at, std::slice::from_ref(&x))
            .await
            .unwrap(),
        chunks::ReadyCheck::Clear
    );
    let mut second = db.begin().await.unwrap();
    let check = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        chunks::check_for_ready(&mut second, b, b_at, std::slice::from_ref(&y)),
    )
    .await
    .expect("a second settle does not wait for the first")
    .unwrap();
    assert_eq!(check, chunks::ReadyCheck::Clear);

    let mut remover = db.acquire().await.unwrap();
    let remover_pid = pid(&mut remover).await;
    let claim = {
        let x = x.clone();
        tokio::spawn(async move { chunks::claim(&mut remover, &x).await.unwrap() })
    };
    until_blocked(&db, remover_pid, first_pid, &claim).await;
    first.commit().await.unwrap();
    second.commit().await.unwrap();
    assert!(!claim.await.unwrap(), "nothing queued: nothing claimed");
}
