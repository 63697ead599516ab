//! Leader election on Postgres: one row per lease, renewed on the database clock (`now()`),
//! never a local one, with a `term` bumped on every takeover.
//!
//! # Guarantees
//! - At most one holder at a time: a lease is taken only when it is free or expired.
//! - Fencing: [`Lease::check`] locks the lease row `FOR SHARE` in the caller's transaction and
//!   verifies (holder, term) and expiry. A takeover's `UPDATE` waits for that transaction, and
//!   a transaction that starts after the takeover sees the new term and refuses — so a deposed
//!   leader cannot commit a write.

use std::time::Duration;

use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use crate::op::{timed, Op};
use crate::StoreError;

/// A leader term: who holds the lease and under which term.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The lease's name (`leases.name`, e.g. `reconciler`).
    pub name: &'static str,
    /// The candidate holding it (a fresh UUIDv7 per reconciler process).
    pub holder: Uuid,
    /// The fencing term: unchanged on renewal, bumped on every takeover.
    pub term: i64,
}

impl Lease {
    /// Whether this lease is still held, checked and locked in the caller's transaction.
    pub async fn check(&self, conn: &mut PgConnection) -> Result<bool, StoreError> {
        let held: Option<i64> = timed(
            Op::LeaseCheck,
            sqlx::query_scalar(
                "SELECT term FROM leases
              WHERE name = $1 AND holder = $2 AND term = $3 AND expires_at > now()
              FOR SHARE",
            )
            .bind(self.name)
            .bind(self.holder)
            .bind(self.term)
            .fetch_optional(conn),
        )
        .await?;
        Ok(held.is_some())
    }
}

/// Takes or renews the lease `name` for `holder` for `ttl`. Returns the lease when held
/// (with its term: unchanged on renewal, bumped on takeover), `None` when another holder's
/// lease has not expired.
pub async fn acquire(
    db: impl PgExecutor<'_>,
    name: &'static str,
    holder: Uuid,
    ttl: Duration,
) -> Result<Option<Lease>, StoreError> {
    let term: Option<i64> = timed(
        Op::LeaseAcquire,
        sqlx::query_scalar(
            "INSERT INTO leases (name, holder, term, expires_at)
         VALUES ($1, $2, 1, now() + make_interval(secs => $3))
         ON CONFLICT (name) DO UPDATE
            SET holder = EXCLUDED.holder,
                term = CASE WHEN leases.holder = EXCLUDED.holder AND leases.expires_at > now()
                            THEN leases.term ELSE leases.term + 1 END,
                expires_at = EXCLUDED.expires_at
          WHERE leases.holder = EXCLUDED.holder OR leases.expires_at <= now()
         RETURNING term",
        )
        .bind(name)
        .bind(holder)
        .bind(ttl.as_secs_f64())
        .fetch_optional(db),
    )
    .await?;
    Ok(term.map(|term| Lease { name, holder, term }))
}

/// Gives the lease up (on shutdown), so a standby takes over without waiting for expiry.
pub async fn release(db: impl PgExecutor<'_>, lease: &Lease) -> Result<(), StoreError> {
    timed(
        Op::LeaseRelease,
        sqlx::query(
            "UPDATE leases SET expires_at = now() WHERE name = $1 AND holder = $2 AND term = $3",
        )
        .bind(lease.name)
        .bind(lease.holder)
        .bind(lease.term)
        .execute(db),
    )
    .await?;
    Ok(())
}
