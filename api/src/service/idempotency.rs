//! The storage half of `Idempotency-Key`: the same key with the same request replays the stored
//! response; the same key with a different request is refused. (Parsing the header and rendering
//! the stored response are [`crate::http::idempotency`].)
//!
//! Keys are scoped by org; the operator's keys (which have no org) share one scope,
//! [`OPERATOR`]. A state-changing use case stores its response in the same
//! transaction as the change, so a retry after a crash either finds the stored response or
//! finds that nothing happened — never a second sandbox. Only 2xx responses are stored: an
//! error changed nothing, so a retry decides again. Source: Stripe's idempotent requests and
//! the IETF draft "The Idempotency-Key HTTP Header Field".

use berth_schemas::OrgId;
use berth_store::idempotency::{self, StoredKey};
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use super::ServiceError;

/// The scope of the operator's keys (`POST /v1/templates`): an operator key has no org.
pub const OPERATOR: Option<OrgId> = None;

/// A request's key and the fingerprint of what it asked: method, path, and the body's canonical
/// JSON ([`canonical_json`]: the same JSON with other key order or whitespace is the same
/// request), or its bytes when it is not JSON.
#[derive(Debug, Clone)]
pub struct IdempotencyKey {
    /// The key as the client sent it.
    pub key: String,
    fingerprint: Vec<u8>,
}

impl IdempotencyKey {
    /// The key `key` of a request `method path` with `body`.
    pub fn new(key: String, method: &str, path: &str, body: &[u8]) -> Self {
        let canonical = serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .map(|v| canonical_json(&v));
        // Tagged, so a JSON body and a non-JSON one of the same bytes never match.
        let (kind, body): (&[u8], &[u8]) = match &canonical {
            Some(c) => (b"json", c.as_bytes()),
            None => (b"raw", body),
        };
        let mut h = Sha256::new();
        for part in [
            method.as_bytes(),
            b"\0",
            path.as_bytes(),
            b"\0",
            kind,
            b"\0",
            body,
        ] {
            h.update(part);
        }
        Self {
            key,
            fingerprint: h.finalize().to_vec(),
        }
    }
}

/// `value` as compact JSON with every object's keys in byte order, whatever order the client
/// sent them in (and whichever order `serde_json`'s map keeps: this does not depend on its
/// `preserve_order` feature).
pub fn canonical_json(value: &serde_json::Value) -> String {
    use serde_json::Value;
    let mut out = String::new();
    fn write(v: &Value, out: &mut String) {
        match v {
            Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                out.push('{');
                for (i, (k, v)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push(':');
                    write(v, out);
                }
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(v, out);
                }
                out.push(']');
            }
            scalar => out.push_str(&scalar.to_string()),
        }
    }
    write(value, &mut out);
    out
}

/// A response as a key keeps it: the HTTP status code and the JSON body, rendered by the HTTP
/// layer.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// The JSON body.
    pub body: serde_json::Value,
}

/// A stored response for `key`, if any. In a transaction, the key stays locked until it ends
/// ([`idempotency::lock`]): concurrent requests with one key are answered one after the
/// other, the later ones with the first one's stored response.
///
/// Errors: [`ServiceError::IdempotencyKeyReused`] when the key was used for another request.
pub async fn replay(
    conn: &mut PgConnection,
    org: impl Into<Option<OrgId>>,
    key: &IdempotencyKey,
) -> Result<Option<StoredResponse>, ServiceError> {
    let org = org.into();
    idempotency::lock(&mut *conn, org, &key.key).await?;
    let Some(stored) = idempotency::find(conn, org, &key.key).await? else {
        return Ok(None);
    };
    if stored.fingerprint != key.fingerprint {
        return Err(ServiceError::IdempotencyKeyReused(key.key.clone()));
    }
    Ok(Some(StoredResponse {
        status: u16::try_from(stored.status).unwrap_or(500),
        body: stored.response,
    }))
}

/// [`replay`] on a connection of the pool.
pub async fn replay_on(
    db: &PgPool,
    org: impl Into<Option<OrgId>>,
    key: &IdempotencyKey,
) -> Result<Option<StoredResponse>, ServiceError> {
    let mut conn = db.acquire().await?;
    replay(&mut conn, org, key).await
}

/// Stores `response` in the caller's transaction. Returns `false` when another request with
/// the same key committed first (the caller rolls back and replays that one).
pub async fn store(
    conn: &mut PgConnection,
    org: impl Into<Option<OrgId>>,
    key: &IdempotencyKey,
    response: &StoredResponse,
) -> Result<bool, ServiceError> {
    Ok(idempotency::insert(
        conn,
        org,
        &key.key,
        &StoredKey {
            fingerprint: key.fingerprint.clone(),
            status: i32::from(response.status),
            response: response.body.clone(),
        },
    )
    .await?)
}

/// [`store`] outside a transaction, for a use case that is not transactional (exec: stored
/// after it ran; a lost race stores nothing).
pub async fn store_on(
    db: &PgPool,
    org: impl Into<Option<OrgId>>,
    key: &IdempotencyKey,
    response: &StoredResponse,
) -> Result<bool, ServiceError> {
    let mut conn = db.acquire().await?;
    store(&mut conn, org, key, response).await
}

/// Stores `response` under the request's key (if it carried one) in `tx` and commits,
/// answering `response`. When a concurrent request with the same key committed first, rolls
/// back and answers what that one answered.
///
/// Errors: database errors; [`ServiceError::IdempotencyKeyReused`] from the replay.
pub async fn commit(
    mut tx: Transaction<'_, Postgres>,
    db: &PgPool,
    org: impl Into<Option<OrgId>>,
    key: Option<&IdempotencyKey>,
    response: StoredResponse,
) -> Result<StoredResponse, ServiceError> {
    let org = org.into();
    if let Some(key) = key {
        if !store(&mut tx, org, key, &response).await? {
            tx.rollback().await?;
            return match replay_on(db, org, key).await? {
                Some(stored) => Ok(stored),
                None => Err(ServiceError::Internal("idempotency row vanished".into())),
            };
        }
    }
    tx.commit().await?;
    // The use case may have written commands or events: this process's relay publishes them
    // now (no `NOTIFY` in the transaction, migration 0025).
    crate::outbox::wake();
    Ok(response)
}

/// Runs `act`, a use case that is not one transaction of its own (a template's registration and
/// the start of its pull), under `key`: the key is locked in a transaction held open while
/// `act` runs on other connections, so a concurrent request with the key waits and then
/// replays; the response `render` makes of the outcome is stored at the end. Without a key,
/// `act` just runs. `act` must be idempotent by itself for a crash between its end and the
/// store: the retry runs it again.
///
/// Errors: those of `act` and `render` (nothing is stored: a retry decides again);
/// [`ServiceError::IdempotencyKeyReused`]; database errors.
pub async fn around<T>(
    db: &PgPool,
    org: impl Into<Option<OrgId>>,
    key: Option<&IdempotencyKey>,
    act: impl std::future::Future<Output = Result<T, ServiceError>>,
    render: impl FnOnce(&T) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<T>, ServiceError> {
    let Some(key) = key else {
        let outcome = act.await?;
        let response = render(&outcome)?;
        return Ok(Replayable::Fresh(outcome, response));
    };
    let org = org.into();
    let mut tx = db.begin().await?;
    if let Some(stored) = replay(&mut tx, org, key).await? {
        return Ok(Replayable::Replayed(stored));
    }
    let outcome = act.await?;
    let fresh = render(&outcome)?;
    let answered = commit(tx, db, org, Some(key), fresh.clone()).await?;
    if answered != fresh {
        return Ok(Replayable::Replayed(answered));
    }
    Ok(Replayable::Fresh(outcome, answered))
}

/// What a replayable use case answers: its typed outcome, freshly decided, or the response a
/// key stored for an earlier identical request.
#[derive(Debug)]
pub enum Replayable<T> {
    /// Decided now; the response was rendered and stored (with a key) before the commit.
    Fresh(T, StoredResponse),
    /// An earlier request with the same key decided this.
    Replayed(StoredResponse),
}

impl<T> Replayable<T> {
    /// The response to send, fresh or replayed.
    pub fn into_response(self) -> StoredResponse {
        match self {
            Replayable::Fresh(_, r) | Replayable::Replayed(r) => r,
        }
    }
}
