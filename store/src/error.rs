//! [`StoreError`]: what a store operation can fail with. The API maps it to HTTP (`Fenced` to
//! 409, `NotFound` to 404, `NoCapacity` to 503), never to a bare 500.

use berth_schemas::wire::Resources;
use berth_schemas::{Generation, HostId, SandboxId};

use crate::op::Op;

/// The SQLSTATE of a serialization failure.
const SERIALIZATION_FAILURE: &str = "40001";
/// The SQLSTATE of a detected deadlock.
const DEADLOCK_DETECTED: &str = "40P01";

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A fenced write found the row moved on: its generation is no longer `expected` (or the
    /// row is gone). Someone else's transition won; the caller re-reads and decides again.
    #[error("sandbox {sandbox} is no longer at generation {expected}")]
    Fenced {
        /// The sandbox whose write was fenced out.
        sandbox: SandboxId,
        /// The generation the caller read and wrote at.
        expected: Generation,
    },
    /// A row the operation needs does not exist.
    #[error("{what} {id} not found")]
    NotFound {
        /// The kind of row (`org`, `host`).
        what: &'static str,
        /// Its id or name, as the caller gave it.
        id: String,
    },
    /// A reservation did not fit on the host (or the host no longer admits it).
    #[error("host {host} has no room for {need:?}")]
    NoCapacity {
        /// The host that was full.
        host: HostId,
        /// What the sandbox needed (whole vCPUs, MiB).
        need: Resources,
    },
    /// A column held a value this build cannot read (an unknown state spelling, …).
    #[error("corrupt {column}: {message}")]
    Corrupt {
        /// The column, qualified (`hosts.state`, `sandboxes.state`, …).
        column: &'static str,
        /// What failed to parse.
        message: String,
    },
    /// The database failed during `op`.
    #[error("database ({op}): {source}")]
    Database {
        /// The operation that failed (its metrics label).
        op: Op,
        #[source]
        /// The driver's error.
        source: sqlx::Error,
    },
}

impl StoreError {
    /// Whether running the whole transaction again may succeed: a serialization failure or a
    /// deadlock Postgres broke by aborting this transaction.
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Database {
                source: sqlx::Error::Database(e),
                ..
            } => matches!(
                e.code().as_deref(),
                Some(SERIALIZATION_FAILURE | DEADLOCK_DETECTED)
            ),
            _ => false,
        }
    }

    pub(crate) fn database(op: Op) -> impl Fn(sqlx::Error) -> StoreError + Copy {
        move |source| StoreError::Database { op, source }
    }
}

/// `BEGIN`/`COMMIT` and other plumbing outside a named operation.
impl From<sqlx::Error> for StoreError {
    fn from(source: sqlx::Error) -> Self {
        StoreError::Database {
            op: Op::Transaction,
            source,
        }
    }
}
