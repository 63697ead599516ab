//! What the OpenSandbox compatibility surface (`api/src/compat/`) reads and writes of a
//! sandbox beyond the native API's: its execd token, and lists over several states.
//!
//! # Guarantees
//! - A sandbox's execd token is made once ([`execd_token`] keeps the first one written, even
//!   when two lookups race) and is only ever returned to a caller of the sandbox's org.

use berth_schemas::{OrgId, SandboxId, SandboxState};
use sqlx::{PgExecutor, Row};

use super::{rows, SandboxRow, COLUMNS};
use crate::op::{timed, Op};
use crate::StoreError;

/// The org's sandbox `id`'s execd token: the one it has, or `fresh` written as its first.
/// `None` when the org has no such sandbox (guarantee 7).
pub async fn execd_token(
    db: impl PgExecutor<'_>,
    org: OrgId,
    id: SandboxId,
    fresh: &str,
) -> Result<Option<String>, StoreError> {
    let token = timed(
        Op::SandboxExecdToken,
        sqlx::query_scalar(
            "UPDATE sandboxes SET execd_token = COALESCE(execd_token, $3)
              WHERE id = $1 AND org_id = $2
          RETURNING execd_token",
        )
        .bind(id)
        .bind(org)
        .bind(fresh)
        .fetch_optional(db),
    )
    .await?;
    Ok(token)
}

/// Sandbox `id` of whichever org, with its execd token (`None` before the first lookup): the
/// execd surface learns the org from the row after checking the token against it.
pub async fn find_with_execd_token(
    db: impl PgExecutor<'_>,
    id: SandboxId,
) -> Result<Option<(SandboxRow, Option<String>)>, StoreError> {
    let found = timed(
        Op::SandboxFindExecd,
        sqlx::query(&format!(
            "SELECT {COLUMNS}, execd_token FROM sandboxes WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(db),
    )
    .await?;
    let Some(found) = found else {
        return Ok(None);
    };
    let token: Option<String> = found
        .try_get("execd_token")
        .map_err(StoreError::database(Op::SandboxFindExecd))?;
    Ok(Some((SandboxRow::from_row(&found)?, token)))
}

/// At most `limit` sandboxes of `org` in any of `states` (empty: every state but `deleted`)
/// whose metadata holds every pair of `metadata` when given, newest first.
pub async fn list_in_states(
    db: impl PgExecutor<'_>,
    org: OrgId,
    states: &[SandboxState],
    metadata: Option<&serde_json::Value>,
    limit: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    let states: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
    let found = timed(
        Op::SandboxListStates,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes
              WHERE org_id = $1
                AND (cardinality($2::text[]) = 0 AND state <> 'deleted' OR state = ANY($2))
                AND ($3::jsonb IS NULL OR metadata @> $3)
              ORDER BY id DESC
              LIMIT $4"
        ))
        .bind(org)
        .bind(&states)
        .bind(metadata)
        .bind(limit)
        .fetch_all(db),
    )
    .await?;
    rows(&found)
}
