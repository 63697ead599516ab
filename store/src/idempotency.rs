//! Retention of the `idempotency_keys` table. The API owns the replay and the store of each
//! response; the reconciler's pass purges old keys through [`purge`].

use std::time::Duration;

use sqlx::PgExecutor;

use crate::op::{timed, Op};
use crate::StoreError;

/// Deletes idempotency keys older than `retention`; returns how many.
pub async fn purge(db: impl PgExecutor<'_>, retention: Duration) -> Result<u64, StoreError> {
    let done = timed(
        Op::IdempotencyPurge,
        sqlx::query(
            "DELETE FROM idempotency_keys WHERE created_at < now() - make_interval(secs => $1)",
        )
        .bind(retention.as_secs_f64())
        .execute(db),
    )
    .await?;
    Ok(done.rows_affected())
}
