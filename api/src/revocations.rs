//! Revoked keys stop working at once in every process: each API and proxy process listens on
//! Postgres `LISTEN berth_keys_revoked` (migration 0022's trigger notifies at the commit of
//! every change of `api_keys.revoked_at` and every deleted key row, naming the key by the hex
//! SHA-256 it is stored under: migration 0033) and forgets that key's cached lookup
//! ([`Guards::forget_key`]) on each notification; every other key stays cached, so one org's
//! revocations never cost another org's requests a lookup (or a 429 `key_lookups_per_ip`).
//!
//! # Guarantees
//! - A key revoked by any process (`DELETE /v1/keys/{id}`, `berth admin revoke-key`,
//!   `berth admin delete-org`) is refused by this process as soon as the notification arrives,
//!   not after the cache's TTL.
//! - A lost listener connection is replaced; the cache is cleared after every (re)connection,
//!   since notifications sent while it was down are lost. While no connection can be opened a
//!   revoked key may work for at most [`crate::limits::LimitsConfig::key_cache_ttl`].

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::limits::Guards;

/// The channel migration 0022's trigger notifies on.
pub const KEYS_REVOKED_CHANNEL: &str = "berth_keys_revoked";
/// Wait after a failed (re)connection of the listener before the next attempt.
pub const RECONNECT_DELAY: Duration = Duration::from_millis(500);

/// Forgets `guards`' cached keys on every revocation until `shutdown` (see the module).
pub async fn forget_revoked_keys(db: PgPool, guards: Arc<Guards>, shutdown: CancellationToken) {
    loop {
        let listener = async {
            let mut listener = PgListener::connect_with(&db).await?;
            listener.listen(KEYS_REVOKED_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let mut listener = tokio::select! {
            _ = shutdown.cancelled() => return,
            connected = listener => match connected {
                Ok(listener) => listener,
                Err(e) => {
                    warn!(error = %e, "key revocation listener: connect failed; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(RECONNECT_DELAY) => continue,
                    }
                }
            },
        };
        // Whatever was revoked while no connection listened.
        guards.forget_keys();
        loop {
            let received = tokio::select! {
                _ = shutdown.cancelled() => return,
                received = listener.try_recv() => received,
            };
            match received {
                Ok(Some(notification)) => match revoked_hash(notification.payload()) {
                    Some(hash) => {
                        debug!("a key was revoked; its cached lookup forgotten");
                        guards.forget_key(&hash);
                    }
                    // A notification that names no key (an older trigger): forget them all.
                    None => guards.forget_keys(),
                },
                // The connection was lost (sqlx reconnects on the next call): notifications
                // may have been missed.
                Ok(None) => guards.forget_keys(),
                Err(e) => {
                    warn!(error = %e, "key revocation listener failed; reconnecting");
                    break;
                }
            }
        }
    }
}

/// The key hash a notification names (64 hex digits), if it names one.
fn revoked_hash(payload: &str) -> Option<[u8; 32]> {
    let mut hash = [0u8; 32];
    hex::decode_to_slice(payload, &mut hash).ok()?;
    Some(hash)
}

#[cfg(test)]
mod tests {
    use super::revoked_hash;

    #[test]
    fn a_notification_names_a_key_by_its_hex_hash_or_names_none() {
        let hex = "ab".repeat(32);
        assert_eq!(revoked_hash(&hex), Some([0xab; 32]));
        assert_eq!(revoked_hash(""), None);
        assert_eq!(revoked_hash("ab"), None);
        assert_eq!(revoked_hash(&"zz".repeat(32)), None);
    }
}
