//! Webhook use cases: create, list, get, delete, and the delivery log.
//!
//! A new webhook receives events published after it was created (its cursor starts at the
//! latest published event). Every query is scoped by the caller's org: another org's webhook
//! is "not found" (guarantee 7).

use berth_schemas::{OrgId, WebhookId};
use sqlx::PgPool;

use super::idempotency::{self, IdempotencyKey, Replayable, StoredResponse};
use super::ServiceError;
use crate::webhooks::model::{
    generate_secret, Delivery, ValidWebhook, Webhook, MAX_WEBHOOKS_PER_ORG,
};
use crate::webhooks::store;

/// Registers a webhook for `org` (a generated secret when `valid` names none); the answer
/// carries the secret, shown only now. `render` gives the response stored under `key`.
///
/// Errors: [`ServiceError::TooManyWebhooks`], [`ServiceError::IdempotencyKeyReused`].
pub async fn create(
    db: &PgPool,
    org: OrgId,
    valid: ValidWebhook,
    key: Option<&IdempotencyKey>,
    render: impl FnOnce(&Webhook) -> Result<StoredResponse, ServiceError>,
) -> Result<Replayable<Webhook>, ServiceError> {
    let mut tx = db.begin().await?;
    if let Some(key) = key {
        if let Some(stored) = idempotency::replay(&mut tx, org, key).await? {
            return Ok(Replayable::Replayed(stored));
        }
    }
    // Serialize creates of one org so the per-org limit holds.
    store::lock_org(&mut tx, org).await?;
    if store::count_live(&mut tx, org).await? >= MAX_WEBHOOKS_PER_ORG {
        return Err(ServiceError::TooManyWebhooks {
            max: MAX_WEBHOOKS_PER_ORG,
        });
    }
    let cursor = super::events::latest_seq(&mut *tx).await?;
    let secret = valid.secret.clone().unwrap_or_else(generate_secret);
    let mut webhook = store::insert(&mut tx, org, &valid, &secret, cursor).await?;
    webhook.secret = Some(secret);
    let response = idempotency::commit(tx, db, org, key, render(&webhook)?).await?;
    Ok(Replayable::Fresh(webhook, response))
}

/// `org`'s webhooks, oldest first (secrets are never returned).
pub async fn list(db: &PgPool, org: OrgId) -> Result<Vec<Webhook>, ServiceError> {
    Ok(store::list(db, org).await?)
}

/// `org`'s webhook `id`.
///
/// Errors: [`ServiceError::NotFound`].
pub async fn get(db: &PgPool, org: OrgId, id: WebhookId) -> Result<Webhook, ServiceError> {
    let mut conn = db.acquire().await?;
    found(store::get(&mut conn, org, id).await?, id)
}

fn found(webhook: Option<Webhook>, id: WebhookId) -> Result<Webhook, ServiceError> {
    webhook.ok_or_else(|| ServiceError::NotFound(format!("webhook {id}")))
}

/// Deletes `org`'s webhook `id`: deliveries stop; pending ones are abandoned.
///
/// Errors: [`ServiceError::NotFound`].
pub async fn delete(db: &PgPool, org: OrgId, id: WebhookId) -> Result<(), ServiceError> {
    let mut tx = db.begin().await?;
    if !store::mark_deleted(&mut tx, org, id).await? {
        return Err(ServiceError::NotFound(format!("webhook {id}")));
    }
    store::abandon_pending(&mut tx, id).await?;
    tx.commit().await?;
    Ok(())
}

/// The delivery log of `org`'s webhook `id`: the newest `limit` deliveries (by publish order),
/// each with its attempts.
///
/// Errors: [`ServiceError::NotFound`].
pub async fn deliveries(
    db: &PgPool,
    org: OrgId,
    id: WebhookId,
    limit: i64,
) -> Result<Vec<Delivery>, ServiceError> {
    let mut conn = db.acquire().await?;
    let webhook = found(store::get(&mut conn, org, id).await?, id)?;
    Ok(store::deliveries(&mut conn, webhook.id, limit).await?)
}
