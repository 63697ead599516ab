//! The command relay's claim against a real Postgres (a fresh database per test): the per-host
//! cap of in-flight boots holds back only that host's boots, oldest first.

use berth_schemas::{CommandId, HostId};
use berth_store::commands;
use sqlx::PgPool;

/// A registered host row (the claim reads nothing else of it).
async fn host(db: &PgPool) -> HostId {
    let id = HostId::new();
    sqlx::query(
        "INSERT INTO hosts (id, name, capacity_vcpus, capacity_memory_mib) VALUES ($1, 'h', 8, 8192)",
    )
    .bind(id.0)
    .execute(db)
    .await
    .unwrap();
    id
}

/// A command of `kind` for `host`, inserted `age_s` seconds ago, published or not.
async fn command(db: &PgPool, host: HostId, kind: &str, age_s: i64, published: bool) -> CommandId {
    let id = CommandId::new();
    sqlx::query(
        "INSERT INTO commands (id, sandbox_id, host_id, kind, generation, payload, created_at,
                               published_at)
         VALUES ($1, gen_random_uuid(), $2, $3, 1, '\\x00',
                 now() - make_interval(secs => $4),
                 CASE WHEN $5 THEN now() END)",
    )
    .bind(id.0)
    .bind(host.0)
    .bind(kind)
    .bind(age_s as f64)
    .bind(published)
    .execute(db)
    .await
    .unwrap();
    id
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_host_at_its_boot_cap_holds_back_only_its_own_boots(db: PgPool) {
    let (full, partial, idle) = (host(&db).await, host(&db).await, host(&db).await);
    // `full` has its 3 boots in flight and 20 queued, older than everything else.
    for _ in 0..3 {
        command(&db, full, "sandbox.create", 1000, true).await;
    }
    for i in 0..20 {
        command(&db, full, "sandbox.create", 900 - i, false).await;
    }
    // A stop of `full` is never held back by the boot cap.
    let stop = command(&db, full, "sandbox.stop", 500, false).await;
    // `partial` has one clone in flight, so two of its four queued boots may go.
    command(&db, partial, "sandbox.clone", 1000, true).await;
    let mut partial_queued = Vec::new();
    for (i, kind) in [
        "sandbox.start",
        "sandbox.restore",
        "sandbox.unarchive",
        "sandbox.create",
    ]
    .into_iter()
    .enumerate()
    {
        partial_queued.push(command(&db, partial, kind, 400 - i as i64, false).await);
    }
    // `idle` has one queued create, the newest of all.
    let idle_create = command(&db, idle, "sandbox.create", 10, false).await;
    // A completed boot does not count as in flight.
    sqlx::query(
        "UPDATE commands SET completed_at = now() WHERE host_id = $1 AND published_at IS NOT NULL",
    )
    .bind(idle.0)
    .execute(&db)
    .await
    .unwrap();

    let mut conn = db.acquire().await.unwrap();
    let claimed: Vec<CommandId> = commands::claim_publishable(&mut conn, 128, 3)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(
        claimed,
        [stop, partial_queued[0], partial_queued[1], idle_create],
        "oldest first; nothing of `full`'s boots, two of `partial`'s"
    );

    // The batch bound cuts the oldest-first list.
    let claimed: Vec<CommandId> = commands::claim_publishable(&mut conn, 2, 3)
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.id)
        .collect();
    assert_eq!(claimed, [stop, partial_queued[0]]);
}

/// A result's command is checked and completed in one statement: completed once (with its
/// latency on the database's clock), then found already completed; a result naming another
/// host, sandbox, generation or kind, or no command at all, writes nothing and says how the
/// command was issued.
#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_results_command_is_completed_once_and_only_as_issued(db: PgPool) {
    use berth_schemas::{CommandKind, Generation};
    use commands::{CommandOutcome, Completion, Issued};

    let (host, other_host) = (host(&db).await, host(&db).await);
    let id = command(&db, host, "sandbox.stop", 3, true).await;
    let sandbox: berth_schemas::SandboxId =
        sqlx::query_scalar("SELECT sandbox_id FROM commands WHERE id = $1")
            .bind(id.0)
            .fetch_one(&db)
            .await
            .unwrap();
    let issued = Issued {
        sandbox_id: sandbox,
        host_id: host,
        generation: Generation(1),
        kind: CommandKind::Stop,
    };
    let mut conn = db.acquire().await.unwrap();
    let outcome = CommandOutcome::Succeeded;

    // Not as issued: nothing is written, and the command as issued comes back.
    for wrong in [
        Issued {
            host_id: other_host,
            ..issued
        },
        Issued {
            sandbox_id: berth_schemas::SandboxId::new(),
            ..issued
        },
        Issued {
            generation: Generation(2),
            ..issued
        },
        Issued {
            kind: CommandKind::Delete,
            ..issued
        },
    ] {
        let found = commands::complete_issued(&mut conn, id, wrong, outcome, 7)
            .await
            .unwrap();
        assert_eq!(found, Completion::NotAsIssued(Some(issued)), "{wrong:?}");
    }
    let open: bool = sqlx::query_scalar("SELECT completed_at IS NULL FROM commands WHERE id = $1")
        .bind(id.0)
        .fetch_one(&db)
        .await
        .unwrap();
    assert!(open, "a result not matching its command completes nothing");
    let unknown = commands::complete_issued(&mut conn, CommandId::new(), issued, outcome, 7)
        .await
        .unwrap();
    assert_eq!(unknown, Completion::NotAsIssued(None));

    // As issued: completed, 3 s (and a little) after its insert, with the host's sequence.
    let Completion::Completed { latency } =
        commands::complete_issued(&mut conn, id, issued, outcome, 7)
            .await
            .unwrap()
    else {
        panic!("the command as issued is completed");
    };
    assert!((3.0..60.0).contains(&latency), "latency {latency}");
    let (seq, written): (i64, String) =
        sqlx::query_as("SELECT host_seq, outcome FROM commands WHERE id = $1")
            .bind(id.0)
            .fetch_one(&db)
            .await
            .unwrap();
    assert_eq!((seq, written.as_str()), (7, outcome.as_str()));

    // Again (a redelivered result): already completed, and the first completion stands.
    let again = commands::complete_issued(&mut conn, id, issued, CommandOutcome::Failed, 9)
        .await
        .unwrap();
    assert_eq!(again, Completion::AlreadyCompleted);
    let seq: i64 = sqlx::query_scalar("SELECT host_seq FROM commands WHERE id = $1")
        .bind(id.0)
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(seq, 7);
}
