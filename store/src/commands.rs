//! The `commands` table: the transactional outbox of host commands. A command is written in the
//! same transaction as the state change that decided it, published by the API's relay
//! (`Nats-Msg-Id` = its id), and completed when its result is applied or it times out.

use berth_schemas::wire::{self, Command};
use berth_schemas::{CommandId, CommandKind, Generation, HostId, SandboxId};
use sqlx::{PgConnection, PgExecutor};

use crate::op::{timed, Op};
use crate::StoreError;

/// How a command ended, as `commands.outcome` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandOutcome {
    /// The host reported success.
    Succeeded,
    /// The host reported a failure (the result's message says why).
    Failed,
    /// The host refused it: its generation was older than what the host had applied.
    RefusedStale,
    /// The reconciler gave up waiting for it.
    Timeout,
}

impl CommandOutcome {
    /// The `commands.outcome` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            CommandOutcome::Succeeded => "succeeded",
            CommandOutcome::Failed => "failed",
            CommandOutcome::RefusedStale => "refused_stale",
            CommandOutcome::Timeout => "timeout",
        }
    }
}

/// The snapshot a restore, clone or migrate boots from (`commands.snapshot_id`, migration
/// 0026): a snapshot row for the first two and a restore from backup; a durable stop, which has
/// no snapshot row, for a start elsewhere.
fn boots_from(command: &Command) -> Option<berth_schemas::ids::SnapshotId> {
    match command.kind {
        CommandKind::Restore | CommandKind::Clone | CommandKind::Migrate => {
            command.snapshot.map(|o| o.snapshot_id)
        }
        _ => None,
    }
}

/// Inserts `command` into the outbox for `host`, in the caller's transaction.
pub async fn insert(
    conn: &mut PgConnection,
    host: HostId,
    command: &Command,
) -> Result<(), StoreError> {
    timed(
        Op::CommandInsert,
        sqlx::query(
            "INSERT INTO commands (id, sandbox_id, host_id, kind, generation, payload, snapshot_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(command.id)
        .bind(command.sandbox_id)
        .bind(host)
        .bind(command.kind.as_str())
        .bind(command.generation)
        .bind(wire::encode(command))
        .bind(boots_from(command))
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// What the outbox holds of one command: to whom and for what it was issued. The reconciler
/// compares a result with it before believing the result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Issued {
    /// The sandbox the command acts on.
    pub sandbox_id: SandboxId,
    /// The host it was published to.
    pub host_id: HostId,
    /// The sandbox generation it was issued at.
    pub generation: Generation,
    /// What it asks.
    pub kind: CommandKind,
}

/// The command `id` as it was issued, or `None` when the outbox has no such command (never
/// issued, or purged with its sandbox).
///
/// Errors: [`StoreError::Corrupt`] when the row's kind is not one this build knows.
pub async fn issued(conn: &mut PgConnection, id: CommandId) -> Result<Option<Issued>, StoreError> {
    let row: Option<(SandboxId, HostId, Generation, String)> = timed(
        Op::CommandIssued,
        sqlx::query_as("SELECT sandbox_id, host_id, generation, kind FROM commands WHERE id = $1")
            .bind(id)
            .fetch_optional(conn),
    )
    .await?;
    row.map(|(sandbox_id, host_id, generation, kind)| {
        Ok(Issued {
            sandbox_id,
            host_id,
            generation,
            kind: kind.parse().map_err(|_| StoreError::Corrupt {
                column: "commands.kind",
                message: format!("{kind:?} (command {id})"),
            })?,
        })
    })
    .transpose()
}

/// What [`complete_issued`] found of a command a result names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Completion {
    /// The command was issued exactly as the result says and was open: it is completed now,
    /// `latency` seconds after its insert (both on the database's clock).
    Completed {
        /// Seconds from the command's insert to this completion.
        latency: f64,
    },
    /// The command was issued as the result says but was already completed (a redelivered or
    /// repeated result): nothing was written.
    AlreadyCompleted,
    /// No such command, or it differs from the result: `None` when the outbox has no such
    /// command (never issued, or purged with its sandbox); otherwise how it was issued.
    NotAsIssued(Option<Issued>),
}

/// Checks a result against the command it names and completes the command in one statement on
/// the common path: when the outbox issued `id` to `expected.host_id` for
/// `expected.sandbox_id` at `expected.generation` as `expected.kind`, and it is open, it is
/// marked completed with `outcome` and `host_seq`: the host's heartbeat
/// sequence when it applied the command (`CommandResult::heartbeat_seq`; the reconciler judges
/// the sandbox only on a later heartbeat of that host). Otherwise nothing is
/// written and the command is read to tell the caller why ([`Completion`]). The result
/// consumer runs this once per result, so it replaces reading the command, completing it
/// and reading its latency (three round trips) with one.
///
/// Errors: [`StoreError::Corrupt`] when the command's kind is not one this build knows.
pub async fn complete_issued(
    conn: &mut PgConnection,
    id: CommandId,
    expected: Issued,
    outcome: CommandOutcome,
    host_seq: u64,
) -> Result<Completion, StoreError> {
    let latency: Option<f64> = timed(
        Op::CommandComplete,
        sqlx::query_scalar(
            "UPDATE commands SET completed_at = now(), outcome = $6, host_seq = $7
              WHERE id = $1 AND host_id = $2 AND sandbox_id = $3 AND generation = $4
                AND kind = $5 AND completed_at IS NULL
          RETURNING EXTRACT(EPOCH FROM completed_at - created_at)::float8",
        )
        .bind(id)
        .bind(expected.host_id)
        .bind(expected.sandbox_id)
        .bind(expected.generation)
        .bind(expected.kind.as_str())
        .bind(outcome.as_str())
        .bind(i64::try_from(host_seq).unwrap_or(i64::MAX))
        .fetch_optional(&mut *conn),
    )
    .await?;
    if let Some(latency) = latency {
        return Ok(Completion::Completed { latency });
    }
    Ok(match issued(conn, id).await? {
        Some(found) if found == expected => Completion::AlreadyCompleted,
        found => Completion::NotAsIssued(found),
    })
}

/// Completes, as timed out, every open command of the sandbox up to `generation`.
pub async fn time_out_open(
    conn: &mut PgConnection,
    sandbox: SandboxId,
    generation: Generation,
) -> Result<(), StoreError> {
    timed(
        Op::CommandTimeOut,
        sqlx::query(
            "UPDATE commands SET completed_at = now(), outcome = $3
              WHERE sandbox_id = $1 AND completed_at IS NULL AND generation <= $2",
        )
        .bind(sandbox)
        .bind(generation)
        .bind(CommandOutcome::Timeout.as_str())
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// When the command `id` was inserted (the database's clock), or `None` when the outbox has
/// no such command.
pub async fn inserted_at(
    conn: &mut PgConnection,
    id: CommandId,
) -> Result<Option<chrono::DateTime<chrono::Utc>>, StoreError> {
    timed(
        Op::CommandIssued,
        sqlx::query_scalar("SELECT created_at FROM commands WHERE id = $1")
            .bind(id)
            .fetch_optional(conn),
    )
    .await
}

/// Whether a `kind` command for the sandbox at `generation` was already queued (a
/// compensation is queued once per generation).
pub async fn exists(
    conn: &mut PgConnection,
    sandbox: SandboxId,
    generation: Generation,
    kind: CommandKind,
) -> Result<bool, StoreError> {
    timed(
        Op::CommandExists,
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM commands
                             WHERE sandbox_id = $1 AND generation = $2 AND kind = $3)",
        )
        .bind(sandbox)
        .bind(generation)
        .bind(kind.as_str())
        .fetch_one(conn),
    )
    .await
}

/// Deletes the completed commands of purged sandboxes.
pub async fn purge_completed(
    conn: &mut PgConnection,
    sandboxes: &[SandboxId],
) -> Result<(), StoreError> {
    timed(
        Op::CommandPurge,
        sqlx::query("DELETE FROM commands WHERE sandbox_id = ANY($1) AND completed_at IS NOT NULL")
            .bind(sandboxes)
            .execute(conn),
    )
    .await?;
    Ok(())
}

/// How many hosts `sandbox`'s create was sent to (the first placement and any retry
/// elsewhere): what [`berth_schemas::state::retries_elsewhere`] counts.
pub async fn creates_issued(
    conn: &mut PgConnection,
    sandbox: SandboxId,
) -> Result<u32, StoreError> {
    let n: i64 = timed(
        Op::CommandCreatesIssued,
        sqlx::query_scalar(
            "SELECT count(DISTINCT host_id) FROM commands WHERE sandbox_id = $1 AND kind = $2",
        )
        .bind(sandbox)
        .bind(CommandKind::Create.as_str())
        .fetch_one(conn),
    )
    .await?;
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// The database's clock (`now()`, microseconds since the Unix epoch): the clock every
/// timestamp of the shared tables is written in, so samples compared with them take it too.
pub async fn database_now(db: impl PgExecutor<'_>) -> Result<i64, StoreError> {
    timed(
        Op::DatabaseNow,
        sqlx::query_scalar("SELECT (EXTRACT(EPOCH FROM now()) * 1e6)::int8").fetch_one(db),
    )
    .await
}

/// Moves the results watermark (table `results_watermark`, migration 0024) forward to
/// `applied_through_us` (database clock, microseconds since the Unix epoch): every result
/// published before then has been applied. Never moves it back (several reconciler processes
/// advance it). The command timeouts count to it ([`crate::sandboxes::lock_timed_out`]).
pub async fn advance_results_watermark(
    db: impl PgExecutor<'_>,
    applied_through_us: i64,
) -> Result<(), StoreError> {
    timed(
        Op::ResultsWatermarkAdvance,
        sqlx::query(
            "INSERT INTO results_watermark (applied_through)
                  VALUES (to_timestamp($1::float8 / 1e6))
             ON CONFLICT (id) DO UPDATE
                 SET applied_through = GREATEST(results_watermark.applied_through,
                                                EXCLUDED.applied_through)",
        )
        .bind(applied_through_us)
        .execute(db),
    )
    .await?;
    Ok(())
}

/// Seconds the results watermark trails the database clock, or `None` before any reconciler
/// sampled it.
pub async fn results_watermark_lag(db: impl PgExecutor<'_>) -> Result<Option<f64>, StoreError> {
    timed(
        Op::ResultsWatermarkLag,
        sqlx::query_scalar(
            "SELECT EXTRACT(EPOCH FROM now() - applied_through)::float8 FROM results_watermark",
        )
        .fetch_optional(db),
    )
    .await
}

/// The kinds that boot a sandbox (`sandbox.create`, `.start`, `.restore`, `.clone`,
/// `.unarchive`, `.migrate`; the relay holds them back beyond a host's cap of in-flight boots), as the SQL
/// list the partial indexes of migration 0031 name, word for word (the planner uses a partial
/// index only when the query repeats its predicate).
pub(crate) const BOOTS_SQL: &str = "('sandbox.create', 'sandbox.start', 'sandbox.restore', \
     'sandbox.clone', 'sandbox.unarchive', 'sandbox.migrate')";

/// The claim's other kinds, never held back: the oldest `$1` (a CTE of both claim queries).
const OTHERS: &str = "others AS (
    SELECT id, created_at FROM commands
     WHERE published_at IS NULL
       AND kind NOT IN ('sandbox.create', 'sandbox.start', 'sandbox.restore', 'sandbox.clone',
                        'sandbox.unarchive', 'sandbox.migrate')
     ORDER BY created_at
     LIMIT $1)";

/// An unpublished command as the relay publishes it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct OutboxCommand {
    /// The command id (`Nats-Msg-Id`).
    pub id: CommandId,
    /// Its sandbox.
    pub sandbox_id: SandboxId,
    /// The host whose subject it goes to.
    pub host_id: HostId,
    /// `commands.kind` (`sandbox.create`, …).
    pub kind: String,
    /// The postcard envelope, exactly as committed.
    pub payload: Vec<u8>,
}

/// How many of the oldest queued boots, in batches, the relay's claim looks at first.
const CLAIM_WINDOW_BATCHES: i64 = 4;

/// Locks (skipping rows another relay holds) up to `batch` unpublished commands, oldest first.
/// Boots ([`BOOTS_SQL`]) beyond a host's `max_boots` in flight (published, not completed) wait
/// in the outbox (queued, not refused); other kinds pass — the generation fence keeps a stop or
/// delete that overtakes a queued start correct (the host refuses the older start).
///
/// Cost, never the whole backlog (migrations 0027 and 0031; it ranked every unpublished command before,
/// 117 ms per batch at 11,000 in the 1,000-host sim):
/// - first the oldest `batch` × [`CLAIM_WINDOW_BATCHES`] queued boots, ranked per host against
///   the in-flight boots of just those hosts: about 3 ms whatever the backlog;
/// - only when that window is full and yields less than a batch (hosts at their cap hold it
///   back), every host with queued boots is asked for its free slots (one skip-scan probe per
///   such host, about 16 ms at 1,000 hosts), so a host at its cap never holds back another's.
pub async fn claim_publishable(
    conn: &mut PgConnection,
    batch: i64,
    max_boots: i64,
) -> Result<Vec<OutboxCommand>, StoreError> {
    let window = batch * CLAIM_WINDOW_BATCHES;
    let (mut eligible, seen): (Vec<CommandId>, i64) = timed(
        Op::CommandClaim,
        sqlx::query_as(&format!(
            "WITH head AS (
                 SELECT id, host_id, created_at FROM commands
                  WHERE published_at IS NULL AND kind IN {BOOTS_SQL}
                  ORDER BY created_at
                  LIMIT $3),
             flight AS (
                 SELECT h.host_id,
                        (SELECT count(*) FROM commands f
                          WHERE f.host_id = h.host_id AND f.published_at IS NOT NULL
                            AND f.completed_at IS NULL AND f.kind IN {BOOTS_SQL}) AS n
                   FROM (SELECT DISTINCT host_id FROM head) h),
             ranked AS (
                 SELECT id, created_at,
                        row_number() OVER (PARTITION BY host_id ORDER BY created_at) + f.n AS slot
                   FROM head JOIN flight f USING (host_id)),
             {OTHERS}
             SELECT ARRAY(SELECT id FROM (SELECT id, created_at FROM ranked WHERE slot <= $2
                                          UNION ALL SELECT id, created_at FROM others) e
                           ORDER BY created_at
                           LIMIT $1),
                    (SELECT count(*) FROM head)"
        ))
        .bind(batch)
        .bind(max_boots)
        .bind(window)
        .fetch_one(&mut *conn),
    )
    .await?;
    if seen == window && (eligible.len() as i64) < batch {
        eligible = timed(
            Op::CommandClaim,
            sqlx::query_scalar(&format!(
                "WITH RECURSIVE waiting(host_id) AS (
                     (SELECT host_id FROM commands
                       WHERE published_at IS NULL AND kind IN {BOOTS_SQL}
                       ORDER BY host_id LIMIT 1)
                   UNION ALL
                     SELECT (SELECT c.host_id FROM commands c
                              WHERE c.published_at IS NULL AND c.kind IN {BOOTS_SQL}
                                AND c.host_id > w.host_id
                              ORDER BY c.host_id LIMIT 1)
                       FROM waiting w WHERE w.host_id IS NOT NULL),
                 boots AS (
                     SELECT q.id, q.created_at
                       FROM waiting w
                      CROSS JOIN LATERAL (
                            SELECT count(*) AS n FROM commands f
                             WHERE f.host_id = w.host_id AND f.published_at IS NOT NULL
                               AND f.completed_at IS NULL AND f.kind IN {BOOTS_SQL}) f
                      CROSS JOIN LATERAL (
                            SELECT c.id, c.created_at FROM commands c
                             WHERE c.host_id = w.host_id AND c.published_at IS NULL
                               AND c.kind IN {BOOTS_SQL}
                             ORDER BY c.created_at
                             LIMIT GREATEST($2 - f.n, 0)) q
                      WHERE w.host_id IS NOT NULL),
                 {OTHERS}
                 SELECT id FROM (SELECT id, created_at FROM boots
                                 UNION ALL SELECT id, created_at FROM others) e
                  ORDER BY created_at
                  LIMIT $1"
            ))
            .bind(batch)
            .bind(max_boots)
            .fetch_all(&mut *conn),
        )
        .await?;
    }
    timed(
        Op::CommandClaim,
        sqlx::query_as(
            "SELECT id, sandbox_id, host_id, kind, payload FROM commands
              WHERE id = ANY($1) AND published_at IS NULL
              ORDER BY created_at
              FOR UPDATE SKIP LOCKED",
        )
        .bind(&eligible)
        .fetch_all(conn),
    )
    .await
}

/// Marks `published` (acked by JetStream) published, and counts one more publish attempt on
/// the rest of `claimed`.
pub async fn mark_published(
    conn: &mut PgConnection,
    published: &[CommandId],
    claimed: &[CommandId],
) -> Result<(), StoreError> {
    timed(
        Op::CommandMarkPublished,
        sqlx::query("UPDATE commands SET published_at = now() WHERE id = ANY($1)")
            .bind(published)
            .execute(&mut *conn),
    )
    .await?;
    timed(
        Op::CommandMarkPublished,
        sqlx::query(
            "UPDATE commands SET publish_attempts = publish_attempts + 1
              WHERE published_at IS NULL AND id = ANY($1)",
        )
        .bind(claimed)
        .execute(conn),
    )
    .await?;
    Ok(())
}

/// The command outbox's backlog: (unpublished rows, age of the oldest in seconds).
pub async fn backlog(db: impl PgExecutor<'_>) -> Result<(i64, f64), StoreError> {
    timed(
        Op::CommandBacklog,
        sqlx::query_as(
            "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8
               FROM commands WHERE published_at IS NULL",
        )
        .fetch_one(db),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kinds that boot a sandbox.
    const BOOT_KINDS: [CommandKind; 6] = [
        CommandKind::Create,
        CommandKind::Start,
        CommandKind::Restore,
        CommandKind::Clone,
        CommandKind::Unarchive,
        CommandKind::Migrate,
    ];

    /// The claim's kind list is [`BOOT_KINDS`], and it is the text of migration 0031's partial
    /// indexes (otherwise the planner would ignore them and the claim would scan the backlog).
    #[test]
    fn the_claims_boot_list_is_the_boot_kinds_and_the_indexes_predicate() {
        let listed: Vec<String> = BOOT_KINDS
            .iter()
            .map(|k| format!("'{}'", k.as_str()))
            .collect();
        assert_eq!(BOOTS_SQL, format!("({})", listed.join(", ")));
        let migration = include_str!("../migrations/0031_outbox_claim_migrate.sql");
        assert_eq!(migration.matches(BOOTS_SQL).count(), 3, "{migration}");
        let others: String = OTHERS.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            others.contains(&format!("kind NOT IN {BOOTS_SQL}")),
            "{others}"
        );
    }
}
