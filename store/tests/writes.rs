//! The store's writes against a real Postgres (a fresh database per test, `#[sqlx::test]`):
//! the generation fence is a typed error, capacity moves only with the state write, and a
//! transaction Postgres aborts is run again.

use std::sync::atomic::{AtomicUsize, Ordering};

use berth_schemas::wire::Resources;
use berth_schemas::{Capacity, CommandKind, HostId, Reason, SandboxState};
use berth_store::hosts::{self, Admit, Overcommit};
use berth_store::sandboxes::{self, Transition};
use berth_store::{SandboxRow, StoreError};
use sqlx::PgPool;

mod common;
use common::{host, placed, transition, HOST_CAPACITY, SIZE};

async fn reserved(db: &PgPool, host: HostId) -> Resources {
    let row = hosts::get(db, host).await.unwrap().unwrap();
    row.reserved
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_write_at_a_generation_the_row_has_left_is_fenced_not_a_missing_row(db: PgPool) {
    let host = host(&db).await;
    let row = placed(&db, host).await;
    let mut tx = db.begin().await.unwrap();
    sandboxes::write_transition(
        &mut tx,
        &row,
        &transition(SandboxState::Stopping, CommandKind::Delete, Capacity::Keep),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // The same (now stale) read again: the generation moved on.
    let mut tx = db.begin().await.unwrap();
    let stale = sandboxes::write_transition(
        &mut tx,
        &row,
        &transition(SandboxState::Stopping, CommandKind::Stop, Capacity::Keep),
    )
    .await;
    match stale {
        Err(StoreError::Fenced { sandbox, expected }) => {
            assert_eq!((sandbox, expected), (row.id, row.generation));
        }
        other => panic!("expected a fence miss, got {other:?}"),
    }
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn capacity_is_released_and_reserved_only_with_the_state_write(db: PgPool) {
    let host = host(&db).await;
    let row = placed(&db, host).await;
    assert_eq!(reserved(&db, host).await, SIZE);
    assert_eq!(sandboxes::capacity_drift(&db).await.unwrap(), (0, 0));

    // A stop that settles releases the reservation with the row's flag.
    let mut tx = db.begin().await.unwrap();
    let written = sandboxes::write_transition(
        &mut tx,
        &row,
        &transition(SandboxState::Stopped, CommandKind::Stop, Capacity::Release),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(!written.row.holds_capacity);
    assert_eq!(reserved(&db, host).await, Resources::default());
    assert_eq!(sandboxes::capacity_drift(&db).await.unwrap(), (0, 0));

    // Releasing again changes nothing.
    let mut tx = db.begin().await.unwrap();
    let again = sandboxes::write_transition(
        &mut tx,
        &written.row,
        &transition(SandboxState::Stopped, CommandKind::Stop, Capacity::Release),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(reserved(&db, host).await, Resources::default());

    // A start reserves it again.
    let mut tx = db.begin().await.unwrap();
    let started = sandboxes::write_transition(
        &mut tx,
        &again.row,
        &transition(
            SandboxState::Starting,
            CommandKind::Start,
            Capacity::Reserve,
        ),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(started.row.holds_capacity);
    assert_eq!(reserved(&db, host).await, SIZE);
    assert_eq!(sandboxes::capacity_drift(&db).await.unwrap(), (0, 0));
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_start_that_does_not_fit_is_refused_and_writes_nothing(db: PgPool) {
    let host = host(&db).await;
    let first = placed(&db, host).await;
    // Stop the first, fill the host with two others, then try to start the first again.
    let mut tx = db.begin().await.unwrap();
    let stopped = sandboxes::write_transition(
        &mut tx,
        &first,
        &transition(SandboxState::Stopped, CommandKind::Stop, Capacity::Release),
    )
    .await
    .unwrap()
    .row;
    tx.commit().await.unwrap();
    placed(&db, host).await;
    placed(&db, host).await;
    assert_eq!(reserved(&db, host).await, HOST_CAPACITY);

    let mut tx = db.begin().await.unwrap();
    let refused = sandboxes::write_transition(
        &mut tx,
        &stopped,
        &transition(
            SandboxState::Starting,
            CommandKind::Start,
            Capacity::Reserve,
        ),
    )
    .await;
    assert!(
        matches!(refused, Err(StoreError::NoCapacity { host: h, need }) if h == host && need == SIZE),
        "{refused:?}"
    );
    drop(tx);
    let now = sandboxes::get(&db, stopped.org_id, stopped.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (now.state, now.generation, now.holds_capacity),
        (SandboxState::Stopped, stopped.generation, false)
    );
    assert_eq!(reserved(&db, host).await, HOST_CAPACITY);
    assert_eq!(sandboxes::capacity_drift(&db).await.unwrap(), (0, 0));
}

/// Two transactions that lock two sandbox rows in opposite orders deadlock; Postgres aborts
/// one, and `retry_transaction` runs it again, so both commit.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_transaction_postgres_aborts_for_a_deadlock_is_run_again(db: PgPool) {
    let host = host(&db).await;
    let (a, b) = (placed(&db, host).await, placed(&db, host).await);
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2));
    let attempts = std::sync::Arc::new(AtomicUsize::new(0));
    let run = |first: SandboxRow, second: SandboxRow| {
        let (db, barrier, attempts) = (db.clone(), barrier.clone(), attempts.clone());
        async move {
            berth_store::retry_transaction(|| {
                let (db, barrier, attempts) = (db.clone(), barrier.clone(), attempts.clone());
                let (first, second) = (first.id, second.id);
                async move {
                    let attempt = attempts.fetch_add(1, Ordering::SeqCst);
                    let mut tx = db.begin().await?;
                    sandboxes::lock(&mut tx, first, None).await?;
                    if attempt < 2 {
                        // Only the first two attempts meet: they lock in opposite orders.
                        barrier.wait().await;
                    }
                    sandboxes::lock(&mut tx, second, None).await?;
                    tx.commit().await?;
                    Ok::<_, StoreError>(())
                }
            })
            .await
        }
    };
    let (one, two) = tokio::join!(run(a.clone(), b.clone()), run(b, a));
    one.unwrap();
    two.unwrap();
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        3,
        "one of the two deadlocked transactions ran again"
    );
}

/// Issue 14: `durable_at` is written only at the stop's generation while the sandbox keeps its
/// stopped disk; a late report for a sandbox that moved on (started, deleted) changes nothing.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_late_durability_report_for_a_sandbox_that_moved_on_changes_nothing(db: PgPool) {
    use berth_schemas::ids::SnapshotId;
    let host = host(&db).await;
    let row = placed(&db, host).await;
    let chunks = vec![("ab".to_owned(), 5_i64)];
    let mut tx = db.begin().await.unwrap();
    // Provisioning: not a stopped disk, nothing written.
    assert!(
        !sandboxes::write_durable(&mut tx, row.id, row.generation, SnapshotId::new(), &chunks)
            .await
            .unwrap()
    );
    let stopped = sandboxes::write_transition(
        &mut tx,
        &row,
        &transition(SandboxState::Stopped, CommandKind::Stop, Capacity::Release),
    )
    .await
    .unwrap()
    .row;
    let snapshot = SnapshotId::new();
    assert!(
        sandboxes::write_durable(&mut tx, row.id, stopped.generation, snapshot, &chunks)
            .await
            .unwrap()
    );
    let durable = sandboxes::lock(&mut tx, row.id, None)
        .await
        .unwrap()
        .unwrap();
    assert!(durable.durable_at.is_some());
    assert_eq!(durable.durable_snapshot, Some(snapshot));
    // Started: the next generation clears it, and the old stop's report is fenced.
    let started = sandboxes::write_transition(
        &mut tx,
        &durable,
        &transition(
            SandboxState::Starting,
            CommandKind::Start,
            Capacity::Reserve,
        ),
    )
    .await
    .unwrap()
    .row;
    assert_eq!((started.durable_at, started.durable_snapshot), (None, None));
    assert!(
        !sandboxes::write_durable(&mut tx, row.id, stopped.generation, snapshot, &chunks)
            .await
            .unwrap(),
        "a late report changes nothing"
    );
    let after = sandboxes::lock(&mut tx, row.id, None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((after.durable_at, after.durable_snapshot), (None, None));
    tx.commit().await.unwrap();
}

/// No trigger on a table that every create and every result apply writes sends a `NOTIFY`
/// (migration 0025): Postgres serializes the commits of notifying transactions, each holding one
/// database-wide lock through its WAL flush, which capped the 1,000-host sim at one commit at a
/// time. (`api_keys` keeps its revocation notify: rare, and needed in every process at once.)
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn no_trigger_on_the_hot_tables_notifies(db: PgPool) {
    let hot = [
        "commands",
        "events",
        "sandboxes",
        "hosts",
        "snapshots",
        "orgs",
        "idempotency_keys",
    ];
    let notifying: Vec<(String, String)> = sqlx::query_as(
        "SELECT c.relname::text, t.tgname::text FROM pg_trigger t
           JOIN pg_class c ON c.oid = t.tgrelid
           JOIN pg_proc p ON p.oid = t.tgfoid
          WHERE NOT t.tgisinternal AND p.prosrc ~* 'notify' AND c.relname = ANY($1)",
    )
    .bind(&hot[..])
    .fetch_all(&db)
    .await
    .unwrap();
    assert!(notifying.is_empty(), "notifying triggers: {notifying:?}");
    // The check itself sees such a trigger: the revocation one on `api_keys`.
    let revocation: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
           JOIN pg_proc p ON p.oid = t.tgfoid
          WHERE NOT t.tgisinternal AND p.prosrc ~* 'notify' AND c.relname = 'api_keys'",
    )
    .fetch_one(&db)
    .await
    .unwrap();
    assert_eq!(revocation, 1);
}

/// The commands queued for sandbox `id`: (host, kind, generation), oldest first.
async fn commands_of(db: &PgPool, id: berth_schemas::SandboxId) -> Vec<(HostId, String, i64)> {
    sqlx::query_as(
        "SELECT host_id, kind, generation FROM commands WHERE sandbox_id = $1 ORDER BY created_at",
    )
    .bind(id)
    .fetch_all(db)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_migration_goes_back_to_its_old_host_releasing_on_the_new_one_and_a_landed_one_deletes_the_old_copy(
    db: PgPool,
) {
    use berth_schemas::ids::SnapshotId;
    use berth_store::sandboxes::ResultWrite;
    let (old, new) = (host(&db).await, host(&db).await);
    let row = placed(&db, old).await;
    let mut tx = db.begin().await.unwrap();
    let stopped = sandboxes::write_transition(
        &mut tx,
        &row,
        &transition(SandboxState::Stopped, CommandKind::Stop, Capacity::Release),
    )
    .await
    .unwrap()
    .row;
    let snapshot = SnapshotId::new();
    assert!(
        sandboxes::write_durable(&mut tx, row.id, stopped.generation, snapshot, &[])
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();
    let lock = |db: PgPool| async move {
        let mut tx = db.begin().await.unwrap();
        let row = sandboxes::lock(&mut tx, row.id, None)
            .await
            .unwrap()
            .unwrap();
        (tx, row)
    };
    let migrate = |db: PgPool| async move {
        let (mut tx, row) = lock(db).await;
        assert!(
            hosts::reserve(&mut tx, new, SIZE, Overcommit::default(), Admit::NewSandbox)
                .await
                .unwrap()
        );
        let (moved, _) = sandboxes::migrate(&mut tx, &row, new, Reason::UserRequest, "why")
            .await
            .unwrap();
        tx.commit().await.unwrap();
        moved
    };
    let result = |to, capacity| ResultWrite {
        to,
        capacity,
        reason: Reason::HostReport,
        command_id: berth_schemas::CommandId::new(),
        address: None,
        last_stop: None,
        stop_fallback: None,
        message: Some("failed"),
    };

    // Failed on the new host: back stopped on the old one, released on the new one.
    let moved = migrate(db.clone()).await;
    assert_eq!(
        (moved.state, moved.host_id, moved.migrated_from),
        (SandboxState::Migrating, Some(new), Some(old))
    );
    assert_eq!(
        (reserved(&db, new).await, reserved(&db, old).await),
        (SIZE, Resources::default())
    );
    let (mut tx, locked) = lock(db.clone()).await;
    sandboxes::write_result(
        &mut tx,
        &locked,
        &result(SandboxState::Stopped, Capacity::Release),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let (_, back) = lock(db.clone()).await;
    assert_eq!(
        (
            back.state,
            back.host_id,
            back.migrated_from,
            back.holds_capacity
        ),
        (SandboxState::Stopped, Some(old), None, false)
    );
    assert_eq!(back.durable_snapshot, Some(snapshot), "still durable");
    assert_eq!(reserved(&db, new).await, Resources::default());

    // Timed out: back on the old host too; the new one gets a delete at the next generation.
    let moved = migrate(db.clone()).await;
    let (mut tx, locked) = lock(db.clone()).await;
    let written = sandboxes::write_transition(
        &mut tx,
        &locked,
        &Transition {
            reason: Reason::Timeout,
            ..transition(
                SandboxState::Stopped,
                CommandKind::Delete,
                Capacity::Release,
            )
        },
    )
    .await
    .unwrap()
    .row;
    tx.commit().await.unwrap();
    assert_eq!((written.host_id, written.migrated_from), (Some(old), None));
    assert_eq!(reserved(&db, new).await, Resources::default());
    let last = commands_of(&db, row.id).await.pop().unwrap();
    assert_eq!(
        last,
        (new, "sandbox.delete".to_owned(), moved.generation.0 + 1)
    );

    // Landed: the old host gets a delete of its stale copy.
    let moved = migrate(db.clone()).await;
    let (mut tx, locked) = lock(db.clone()).await;
    assert!(sandboxes::leave_old_host(&mut tx, &locked)
        .await
        .unwrap()
        .is_some());
    sandboxes::write_result(
        &mut tx,
        &locked,
        &result(SandboxState::Running, Capacity::Keep),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let (_, running) = lock(db.clone()).await;
    assert_eq!(
        (
            running.state,
            running.host_id,
            running.migrated_from,
            running.holds_capacity
        ),
        (SandboxState::Running, Some(new), None, true)
    );
    let last = commands_of(&db, row.id).await.pop().unwrap();
    assert_eq!(last, (old, "sandbox.delete".to_owned(), moved.generation.0));
    assert_eq!(
        (reserved(&db, new).await, reserved(&db, old).await),
        (SIZE, Resources::default())
    );
}
