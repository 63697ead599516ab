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

/// The snapshot a restore or clone boots from (`commands.snapshot_id`, migration 0026).
fn boots_from(command: &Command) -> Option<berth_schemas::ids::SnapshotId> {
    match command.kind {
        CommandKind::Restore | CommandKind::Clone => command.snapshot.map(|o| o.snapshot_id),
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

/// Marks the command completed with `outcome`, unless it already is, with `host_seq`: the
/// host's heartbeat sequence when it applied the command (`CommandResult::heartbeat_seq`; the
/// reconciler judges the sandbox only on a later heartbeat of that host).
pub async fn complete(
    conn: &mut PgConnection,
    id: CommandId,
    outcome: CommandOutcome,
    host_seq: u64,
) -> Result<(), StoreError> {
    timed(
        Op::CommandComplete,
        sqlx::query(
            "UPDATE commands SET completed_at = now(), outcome = $2, host_seq = $3
              WHERE id = $1 AND completed_at IS NULL",
        )
        .bind(id)
        .bind(outcome.as_str())
        .bind(i64::try_from(host_seq).unwrap_or(i64::MAX))
        .execute(conn),
    )
    .await?;
    Ok(())
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

/// Seconds from a completed command's insert to its completion, or `None` while it is open.
pub async fn latency(db: impl PgExecutor<'_>, id: CommandId) -> Result<Option<f64>, StoreError> {
    timed(
        Op::CommandLatency,
        sqlx::query_scalar(
            "SELECT EXTRACT(EPOCH FROM completed_at - created_at)::float8
               FROM commands WHERE id = $1 AND completed_at IS NOT NULL",
        )
        .bind(id)
        .fetch_optional(db),
    )
    .await
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

/// The kinds that boot a sandbox (`sandbox.create`, `sandbox.start`): the relay holds them back
/// beyond a host's cap of in-flight boots.
const BOOT_KINDS: [CommandKind; 2] = [CommandKind::Create, CommandKind::Start];

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

/// Locks (skipping rows another relay holds) up to `batch` unpublished commands, oldest first.
/// Creates and starts beyond a host's `max_boots` in-flight boots (published, not completed)
/// wait in the outbox (queued, not refused); other kinds pass — the generation fence keeps a
/// stop or delete that overtakes a queued start correct (the host refuses the older start).
pub async fn claim_publishable(
    conn: &mut PgConnection,
    batch: i64,
    max_boots: i64,
) -> Result<Vec<OutboxCommand>, StoreError> {
    let boots: Vec<&str> = BOOT_KINDS.iter().map(|k| k.as_str()).collect();
    let eligible: Vec<CommandId> = timed(
        Op::CommandClaim,
        sqlx::query_scalar(
            "WITH in_flight AS (
                 SELECT host_id, count(*) AS n FROM commands
                  WHERE published_at IS NOT NULL AND completed_at IS NULL AND kind = ANY($3)
                  GROUP BY host_id),
             queued AS (
                 SELECT id, host_id, kind, created_at,
                        row_number() OVER (PARTITION BY host_id, kind = ANY($3)
                                           ORDER BY created_at) AS rn
                   FROM commands WHERE published_at IS NULL)
             SELECT q.id FROM queued q LEFT JOIN in_flight f ON f.host_id = q.host_id
              WHERE NOT (q.kind = ANY($3)) OR q.rn + COALESCE(f.n, 0) <= $2
              ORDER BY q.created_at
              LIMIT $1",
        )
        .bind(batch)
        .bind(max_boots)
        .bind(&boots)
        .fetch_all(&mut *conn),
    )
    .await?;
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
