//! The `templates` table: the registry of template names and the runtime each runs on. Written
//! by migrations (the built-in templates), by `berth template import` and by image pulls
//! (`POST /v1/templates`, migration 0018: `state`, `image*`, `template_events`); read by
//! creates.

use berth_schemas::template_state::TemplateState;
use berth_schemas::wire::Runtime;
use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use crate::op::{timed, Op};
use crate::StoreError;

/// A registered template.
#[derive(Debug, Clone, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct TemplateRow {
    /// The name creates use (`base`, …).
    pub name: String,
    /// A one-line description for listings.
    pub description: String,
    /// `runc` or `runsc`.
    pub runtime: String,
    /// The image it is pulled from, as asked; `None` for built-in and imported templates.
    #[sqlx(default)]
    pub image: Option<String>,
    /// The image pinned to its manifest digest, once resolved (what hosts pull).
    #[sqlx(default)]
    pub image_pinned: Option<String>,
    /// The manifest digest, once resolved.
    #[sqlx(default)]
    pub image_digest: Option<String>,
    /// The compressed size of its layers in bytes, once resolved.
    #[sqlx(default)]
    pub image_bytes: Option<i64>,
    /// The image's entrypoint (and cmd), run at boot only when a create asks for it.
    #[sqlx(default)]
    pub entrypoint: Option<sqlx::types::Json<Vec<String>>>,
    /// `pulling`, `ready` or `failed` ([`TemplateRow::state`]).
    #[sqlx(default)]
    pub state: Option<String>,
    /// Why the last pull failed: a stable code (`unknown_image`, `auth_failed`, ...).
    #[sqlx(default)]
    pub error_code: Option<String>,
    /// Why the last pull failed, for people.
    #[sqlx(default)]
    pub error_message: Option<String>,
}

/// The columns every read selects.
const COLUMNS: &str = "name, description, runtime, image, image_pinned, image_digest, image_bytes,
                       entrypoint, state, error_code, error_message";

impl TemplateRow {
    /// The runtime as the wire names it.
    ///
    /// Errors: [`StoreError::Corrupt`] for a spelling this build does not know (the table's
    /// CHECK allows only `runc` and `runsc`).
    pub fn runtime(&self) -> Result<Runtime, StoreError> {
        crate::sandboxes::runtime(&self.runtime)
    }

    /// The template's state (`ready` for a row written without one).
    ///
    /// Errors: [`StoreError::Corrupt`] for a spelling this build does not know.
    pub fn state(&self) -> Result<TemplateState, StoreError> {
        match &self.state {
            None => Ok(TemplateState::Ready),
            Some(s) => s.parse().map_err(|e| StoreError::Corrupt {
                column: "templates.state",
                message: format!("{e:?}"),
            }),
        }
    }
}

/// The template named `name`, or `None`.
pub async fn get(db: impl PgExecutor<'_>, name: &str) -> Result<Option<TemplateRow>, StoreError> {
    timed(
        Op::TemplateGet,
        sqlx::query_as(&format!("SELECT {COLUMNS} FROM templates WHERE name = $1"))
            .bind(name)
            .fetch_optional(db),
    )
    .await
}

/// Every template, by name.
pub async fn list(db: impl PgExecutor<'_>) -> Result<Vec<TemplateRow>, StoreError> {
    timed(
        Op::TemplateList,
        sqlx::query_as(&format!("SELECT {COLUMNS} FROM templates ORDER BY name")).fetch_all(db),
    )
    .await
}

/// Registers `template`, or updates its description and runtime.
pub async fn upsert(db: impl PgExecutor<'_>, template: &TemplateRow) -> Result<(), StoreError> {
    timed(
        Op::TemplateUpsert,
        sqlx::query(
            "INSERT INTO templates (name, description, runtime) VALUES ($1, $2, $3)
             ON CONFLICT (name) DO UPDATE
                SET description = EXCLUDED.description, runtime = EXCLUDED.runtime",
        )
        .bind(&template.name)
        .bind(&template.description)
        .bind(&template.runtime)
        .execute(db),
    )
    .await?;
    Ok(())
}

/// Registers template `name` pulled from `image` on `runtime`, in state `pulling`. Returns
/// false (and writes nothing) when the name is taken.
pub async fn insert_image(
    db: impl PgExecutor<'_>,
    name: &str,
    description: &str,
    runtime: &str,
    image: &str,
) -> Result<bool, StoreError> {
    let done = timed(
        Op::TemplateInsertImage,
        sqlx::query(
            "INSERT INTO templates (name, description, runtime, image, state)
             VALUES ($1, $2, $3, $4, 'pulling') ON CONFLICT (name) DO NOTHING",
        )
        .bind(name)
        .bind(description)
        .bind(runtime)
        .bind(image)
        .execute(db),
    )
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Moves failed image template `name` back to `pulling` (fenced: only from `failed`). Returns
/// whether it did.
pub async fn restart_pull(db: impl PgExecutor<'_>, name: &str) -> Result<bool, StoreError> {
    let done = timed(
        Op::TemplateRestartPull,
        sqlx::query(
            "UPDATE templates SET state = 'pulling', error_code = NULL, error_message = NULL,
                                  updated_at = now()
             WHERE name = $1 AND state = 'failed' AND image IS NOT NULL",
        )
        .bind(name)
        .execute(db),
    )
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A pull's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullOutcome {
    /// Resolved and cached.
    Pulled {
        /// `registry/repo@sha256:...`.
        pinned: String,
        /// `sha256:...`.
        digest: String,
        /// Compressed size of the layers in bytes.
        bytes: i64,
        /// The image's entrypoint followed by its cmd.
        entrypoint: Vec<String>,
    },
    /// Failed.
    Failed {
        /// A stable code.
        code: String,
        /// For people.
        message: String,
    },
}

/// Writes the outcome of the pull of `name`, fenced on its state still being `pulling` (a
/// stale pull writes nothing). Returns whether it wrote.
pub async fn finish_pull(
    db: impl PgExecutor<'_>,
    name: &str,
    outcome: &PullOutcome,
) -> Result<bool, StoreError> {
    let query = match outcome {
        PullOutcome::Pulled {
            pinned,
            digest,
            bytes,
            entrypoint,
        } => sqlx::query(
            "UPDATE templates SET state = 'ready', image_pinned = $2, image_digest = $3,
                                  image_bytes = $4, entrypoint = $5, updated_at = now()
             WHERE name = $1 AND state = 'pulling'",
        )
        .bind(name)
        .bind(pinned)
        .bind(digest)
        .bind(bytes)
        .bind(sqlx::types::Json(entrypoint)),
        PullOutcome::Failed { code, message } => sqlx::query(
            "UPDATE templates SET state = 'failed', error_code = $2, error_message = $3,
                                  updated_at = now()
             WHERE name = $1 AND state = 'pulling'",
        )
        .bind(name)
        .bind(code)
        .bind(message),
    };
    let done = timed(Op::TemplateFinishPull, query.execute(db)).await?;
    Ok(done.rows_affected() == 1)
}

/// One event of a template.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct TemplateEventRow {
    /// When.
    pub at: DateTime<Utc>,
    /// `template.pulling`, `template.layer`, `template.ready`, `template.failed`.
    #[sqlx(rename = "type")]
    pub kind: String,
    /// What happened.
    pub message: String,
}

/// Appends an event to template `name`.
pub async fn add_event(
    db: impl PgExecutor<'_>,
    name: &str,
    kind: &str,
    message: &str,
) -> Result<(), StoreError> {
    timed(
        Op::TemplateEventInsert,
        sqlx::query("INSERT INTO template_events (template, type, message) VALUES ($1, $2, $3)")
            .bind(name)
            .bind(kind)
            .bind(message)
            .execute(db),
    )
    .await?;
    Ok(())
}

/// The events of template `name`, oldest first.
pub async fn events(
    db: impl PgExecutor<'_>,
    name: &str,
) -> Result<Vec<TemplateEventRow>, StoreError> {
    timed(
        Op::TemplateEventList,
        sqlx::query_as(
            "SELECT at, type, message FROM template_events WHERE template = $1 ORDER BY id",
        )
        .bind(name)
        .fetch_all(db),
    )
    .await
}

/// Template `name` locked `FOR SHARE` in the caller's transaction, or `None`: a create reads
/// its template this way, so a concurrent [`delete`] waits for the create to commit (and then
/// sees its sandbox) or runs first (and the create finds no template).
pub async fn get_shared(
    db: impl PgExecutor<'_>,
    name: &str,
) -> Result<Option<TemplateRow>, StoreError> {
    timed(
        Op::TemplateGetShared,
        sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM templates WHERE name = $1 FOR SHARE"
        ))
        .bind(name)
        .fetch_optional(db),
    )
    .await
}

/// What [`delete`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deleted {
    /// The row and its events are gone. `digest`: the manifest digest it had pulled, when no
    /// other template has the same (its cached root may be freed).
    Deleted {
        /// The row as it was.
        row: TemplateRow,
        /// Its digest, when no other template shares it.
        unshared_digest: Option<String>,
    },
    /// No such template.
    NotFound,
    /// Not from an image (built-in or imported): not deleted.
    NotAnImage(TemplateRow),
    /// `sandboxes` sandboxes that are not deleted, or `snapshots` snapshots that are not
    /// failed, name it: not deleted.
    InUse {
        /// The row.
        row: TemplateRow,
        /// How many sandboxes.
        sandboxes: i64,
        /// How many snapshots (`creating` or `ready`: a restore or clone boots them on it).
        snapshots: i64,
    },
}

/// Deletes image template `name` with its events, in one transaction: the row is locked
/// `FOR UPDATE` first (a create holding it `FOR SHARE`, [`get_shared`], commits first), then
/// refused while any sandbox not yet deleted names it (a stopped sandbox's overlay still
/// reads its root), or any snapshot not failed does (a restore or clone lays its files over
/// the template's root: deleting it would let a later template of the same name, another
/// image, take its place).
pub async fn delete(db: &sqlx::PgPool, name: &str) -> Result<Deleted, StoreError> {
    let mut tx = db.begin().await?;
    let row: Option<TemplateRow> = timed(
        Op::TemplateDelete,
        sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM templates WHERE name = $1 FOR UPDATE"
        ))
        .bind(name)
        .fetch_optional(&mut *tx),
    )
    .await?;
    let Some(row) = row else {
        return Ok(Deleted::NotFound);
    };
    if row.image.is_none() {
        return Ok(Deleted::NotAnImage(row));
    }
    let (sandboxes, snapshots): (i64, i64) = timed(
        Op::TemplateDelete,
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM sandboxes WHERE template = $1 AND state <> 'deleted'),
                    (SELECT count(*) FROM snapshots WHERE template = $1 AND state <> 'failed')",
        )
        .bind(name)
        .fetch_one(&mut *tx),
    )
    .await?;
    if sandboxes > 0 || snapshots > 0 {
        return Ok(Deleted::InUse {
            row,
            sandboxes,
            snapshots,
        });
    }
    timed(
        Op::TemplateDelete,
        sqlx::query("DELETE FROM templates WHERE name = $1")
            .bind(name)
            .execute(&mut *tx),
    )
    .await?;
    let unshared_digest = match &row.image_digest {
        None => None,
        Some(digest) => {
            let shared: bool = timed(
                Op::TemplateDelete,
                sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM templates WHERE image_digest = $1)",
                )
                .bind(digest)
                .fetch_one(&mut *tx),
            )
            .await?;
            (!shared).then(|| digest.clone())
        }
    };
    tx.commit().await?;
    Ok(Deleted::Deleted {
        row,
        unshared_digest,
    })
}

/// The error code a pull swept by [`fail_stale_pulls`] fails with.
pub const PULL_TIMED_OUT: &str = "pull_timed_out";

/// Fails every template `pulling` with no sign of its pull (its last event, or the start of
/// the pull) for `quiet`: the process pulling it died (an API restarted mid-pull), and nothing
/// else would ever finish it. Each gets error [`PULL_TIMED_OUT`] and a `template.failed`
/// event, in one statement, at most `batch` of them; a pull that finishes later is fenced ([`finish_pull`] writes only
/// from `pulling`). Returns the names failed.
pub async fn fail_stale_pulls(
    db: impl PgExecutor<'_>,
    quiet: std::time::Duration,
    batch: i64,
) -> Result<Vec<String>, StoreError> {
    let secs = quiet.as_secs_f64();
    let message = format!(
        "no sign of the pull for {secs:.0} s: the process pulling it stopped; \
         POST /v1/templates again (or create by the image again) to retry"
    );
    timed(
        Op::TemplateFailStalePulls,
        sqlx::query_scalar(
            "WITH stale AS (
                 SELECT t.name FROM templates t
                 WHERE t.state = 'pulling'
                   AND greatest(t.updated_at,
                                (SELECT max(e.at) FROM template_events e WHERE e.template = t.name))
                       < now() - make_interval(secs => $1)
                 ORDER BY t.updated_at LIMIT $4
                 FOR UPDATE SKIP LOCKED
             ), failed AS (
                 UPDATE templates t SET state = 'failed', error_code = $2, error_message = $3,
                                        updated_at = now()
                 FROM stale WHERE t.name = stale.name AND t.state = 'pulling'
                 RETURNING t.name
             ), logged AS (
                 INSERT INTO template_events (template, type, message)
                 SELECT name, 'template.failed', $2 || ': ' || $3 FROM failed
             )
             SELECT name FROM failed ORDER BY name",
        )
        .bind(secs)
        .bind(PULL_TIMED_OUT)
        .bind(&message)
        .bind(batch)
        .fetch_all(db),
    )
    .await
}
