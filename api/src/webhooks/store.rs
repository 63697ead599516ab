//! The SQL on the webhook tables (`webhooks`, `webhook_deliveries`, `webhook_attempts`), which
//! only the API owns: the queries of the webhook routes and of the delivery worker, one named
//! function each.

use std::time::Duration;

use berth_schemas::cloudevents::WebhookDisabledData;
use berth_schemas::{DeliveryId, EventId, OrgId, WebhookId};
use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Row};

use super::delivery::{AttemptOutcome, Claim};
use super::model::{Attempt, Delivery, ValidWebhook, Webhook};
use crate::service::events::EventRecord;

const WEBHOOK_COLUMNS: &str =
    "id, url, event_types, created_at, disabled_at, disabled_reason, consecutive_failures";

fn webhook_from_row(row: &PgRow) -> Result<Webhook, sqlx::Error> {
    Ok(Webhook {
        id: row.try_get("id")?,
        url: row.try_get("url")?,
        event_types: row.try_get("event_types")?,
        created_at: row.try_get("created_at")?,
        disabled_at: row.try_get("disabled_at")?,
        disabled_reason: row.try_get("disabled_reason")?,
        consecutive_failures: row.try_get("consecutive_failures")?,
        secret: None,
    })
}

/// Locks `org`'s row until the caller's transaction ends, so creates of one org serialize and
/// the per-org limit holds.
pub async fn lock_org(conn: &mut PgConnection, org: OrgId) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1 FROM orgs WHERE id = $1 FOR UPDATE")
        .bind(org)
        .execute(conn)
        .await?;
    Ok(())
}

/// How many live (not deleted) webhooks `org` has.
pub async fn count_live(conn: &mut PgConnection, org: OrgId) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM webhooks WHERE org_id = $1 AND deleted_at IS NULL")
        .bind(org)
        .fetch_one(conn)
        .await
}

/// Inserts a webhook whose cursor starts at `cursor` (a publish position); returns it without
/// its secret.
pub async fn insert(
    conn: &mut PgConnection,
    org: OrgId,
    valid: &ValidWebhook,
    secret: &str,
    cursor: i64,
) -> Result<Webhook, sqlx::Error> {
    let row = sqlx::query(&format!(
        "INSERT INTO webhooks (id, org_id, url, secret, event_types, cursor_seq)
         VALUES ($1, $2, $3, $4, $5, $6)
         RETURNING {WEBHOOK_COLUMNS}"
    ))
    .bind(WebhookId::new())
    .bind(org)
    .bind(&valid.url)
    .bind(secret)
    .bind(&valid.event_types)
    .bind(cursor)
    .fetch_one(conn)
    .await?;
    webhook_from_row(&row)
}

/// `org`'s live webhooks, oldest first.
pub async fn list(db: &PgPool, org: OrgId) -> Result<Vec<Webhook>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT {WEBHOOK_COLUMNS} FROM webhooks
          WHERE org_id = $1 AND deleted_at IS NULL ORDER BY id"
    ))
    .bind(org)
    .fetch_all(db)
    .await?;
    rows.iter().map(webhook_from_row).collect()
}

/// `org`'s live webhook `id`, if any.
pub async fn get(
    conn: &mut PgConnection,
    org: OrgId,
    id: WebhookId,
) -> Result<Option<Webhook>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {WEBHOOK_COLUMNS} FROM webhooks
          WHERE id = $1 AND org_id = $2 AND deleted_at IS NULL"
    ))
    .bind(id)
    .bind(org)
    .fetch_optional(conn)
    .await?;
    row.as_ref().map(webhook_from_row).transpose()
}

/// Marks `org`'s live webhook `id` deleted; returns whether there was one.
pub async fn mark_deleted(
    conn: &mut PgConnection,
    org: OrgId,
    id: WebhookId,
) -> Result<bool, sqlx::Error> {
    let deleted = sqlx::query(
        "UPDATE webhooks SET deleted_at = now()
          WHERE id = $1 AND org_id = $2 AND deleted_at IS NULL",
    )
    .bind(id)
    .bind(org)
    .execute(conn)
    .await?;
    Ok(deleted.rows_affected() > 0)
}

/// Abandons every pending delivery of `webhook` (disabled or deleted).
pub async fn abandon_pending(
    conn: &mut PgConnection,
    webhook: WebhookId,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE webhook_deliveries SET state = 'abandoned', completed_at = now()
          WHERE webhook_id = $1 AND state = 'pending'",
    )
    .bind(webhook)
    .execute(conn)
    .await?;
    Ok(())
}

/// The newest `limit` deliveries of `webhook` (by publish order), each with its attempts.
pub async fn deliveries(
    conn: &mut PgConnection,
    webhook: WebhookId,
    limit: i64,
) -> Result<Vec<Delivery>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, event_id, event_type, state, next_attempt_at, created_at, completed_at
           FROM webhook_deliveries WHERE webhook_id = $1
          ORDER BY event_seq DESC LIMIT $2",
    )
    .bind(webhook)
    .bind(limit)
    .fetch_all(&mut *conn)
    .await?;
    let mut out = rows
        .iter()
        .map(|r| {
            let state: String = r.try_get("state")?;
            Ok(Delivery {
                id: r.try_get("id")?,
                event_id: r.try_get("event_id")?,
                event_type: r.try_get("event_type")?,
                next_attempt_at: if state == "pending" {
                    r.try_get("next_attempt_at")?
                } else {
                    None
                },
                state,
                created_at: r.try_get("created_at")?,
                completed_at: r.try_get("completed_at")?,
                attempts: Vec::new(),
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    let ids: Vec<uuid::Uuid> = out.iter().map(|d| d.id.as_uuid()).collect();
    let attempts = sqlx::query(
        "SELECT delivery_id, attempt, at, status_code, error, duration_ms
           FROM webhook_attempts WHERE delivery_id = ANY($1)
          ORDER BY delivery_id, attempt",
    )
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?;
    for a in &attempts {
        let delivery: DeliveryId = a.try_get("delivery_id")?;
        if let Some(d) = out.iter_mut().find(|d| d.id == delivery) {
            d.attempts.push(Attempt {
                attempt: a.try_get("attempt")?,
                at: a.try_get("at")?,
                status_code: a.try_get("status_code")?,
                error: a.try_get("error")?,
                duration_ms: a.try_get("duration_ms")?,
            });
        }
    }
    Ok(out)
}

/// An active webhook as the fan-out reads it.
#[derive(Debug, Clone)]
pub struct FanOutTarget {
    /// The webhook.
    pub id: WebhookId,
    /// Its org: it receives only this org's events.
    pub org_id: OrgId,
    /// Full CloudEvent types; empty: every type.
    pub event_types: Vec<String>,
    /// The publish position of the last event fanned out to it.
    pub cursor_seq: i64,
}

/// The active webhooks no other worker is fanning out, locked until the caller's transaction
/// ends (`FOR UPDATE SKIP LOCKED`).
pub async fn lock_active(conn: &mut PgConnection) -> Result<Vec<FanOutTarget>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, org_id, event_types, cursor_seq FROM webhooks
          WHERE disabled_at IS NULL AND deleted_at IS NULL
          FOR UPDATE SKIP LOCKED",
    )
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(FanOutTarget {
                id: r.try_get("id")?,
                org_id: r.try_get("org_id")?,
                event_types: r.try_get("event_types")?,
                cursor_seq: r.try_get("cursor_seq")?,
            })
        })
        .collect()
}

/// Queues `record` for `webhook` (once: a second queue of the same event does nothing).
pub async fn queue_delivery(
    conn: &mut PgConnection,
    webhook: WebhookId,
    record: &EventRecord,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO webhook_deliveries (id, webhook_id, event_id, event_seq, event_type, body)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (webhook_id, event_id) DO NOTHING",
    )
    .bind(DeliveryId::new())
    .bind(webhook)
    .bind(record.event.id)
    .bind(record.seq)
    .bind(&record.event.kind)
    .bind(record.event.to_json())
    .execute(conn)
    .await?;
    Ok(())
}

/// Moves `webhook`'s fan-out cursor to publish position `seq`.
pub async fn advance_cursor(
    conn: &mut PgConnection,
    webhook: WebhookId,
    seq: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE webhooks SET cursor_seq = $2 WHERE id = $1")
        .bind(webhook)
        .bind(seq)
        .execute(conn)
        .await?;
    Ok(())
}

/// Claims the oldest pending delivery of each active webhook whose attempt is due, at most
/// `batch`, for `lease` (pushes `next_attempt_at` that far and counts the attempt).
pub async fn claim_due(
    db: &PgPool,
    batch: i64,
    lease: Duration,
) -> Result<Vec<Claim>, sqlx::Error> {
    // The conditional UPDATE is the claim: a second worker re-checks `next_attempt_at` after
    // the first one's commit and skips the row.
    let rows = sqlx::query(
        "WITH heads AS (
             SELECT d.id FROM webhooks w
              CROSS JOIN LATERAL (
                  SELECT id, next_attempt_at FROM webhook_deliveries
                   WHERE webhook_id = w.id AND state = 'pending'
                   ORDER BY event_seq LIMIT 1) d
              WHERE w.disabled_at IS NULL AND w.deleted_at IS NULL
                AND d.next_attempt_at <= now()
              LIMIT $1)
         UPDATE webhook_deliveries d
            SET next_attempt_at = now() + make_interval(secs => $2), attempts = d.attempts + 1
           FROM heads, webhooks w
          WHERE d.id = heads.id AND w.id = d.webhook_id
            AND d.state = 'pending' AND d.next_attempt_at <= now()
         RETURNING d.id, d.webhook_id, d.event_id, d.attempts, d.body, w.url, w.secret",
    )
    .bind(batch)
    .bind(lease.as_secs_f64())
    .fetch_all(db)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Claim {
                delivery_id: r.try_get("id")?,
                webhook_id: r.try_get("webhook_id")?,
                event_id: r.try_get("event_id")?,
                attempt: r.try_get("attempts")?,
                url: r.try_get("url")?,
                secret: r.try_get("secret")?,
                body: r.try_get("body")?,
            })
        })
        .collect()
}

/// Logs one attempt of `claim` (once per attempt number).
pub async fn log_attempt(
    conn: &mut PgConnection,
    claim: &Claim,
    outcome: &AttemptOutcome,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO webhook_attempts (delivery_id, attempt, status_code, error, duration_ms)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT DO NOTHING",
    )
    .bind(claim.delivery_id)
    .bind(claim.attempt)
    .bind(outcome.status_code.map(i32::from))
    .bind(outcome.error.as_deref())
    .bind(i32::try_from(outcome.duration.as_millis()).unwrap_or(i32::MAX))
    .execute(conn)
    .await?;
    Ok(())
}

/// Marks `claim`'s delivery succeeded and ends its webhook's run of failures.
pub async fn mark_succeeded(conn: &mut PgConnection, claim: &Claim) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE webhook_deliveries SET state = 'succeeded', completed_at = now()
          WHERE id = $1 AND state = 'pending'",
    )
    .bind(claim.delivery_id)
    .execute(&mut *conn)
    .await?;
    sqlx::query("UPDATE webhooks SET consecutive_failures = 0 WHERE id = $1")
        .bind(claim.webhook_id)
        .execute(conn)
        .await?;
    Ok(())
}

/// Schedules the next attempt of `claim`'s delivery after `delay` and counts the failure on its
/// webhook; returns the webhook's run of failures.
pub async fn schedule_retry(
    conn: &mut PgConnection,
    claim: &Claim,
    delay: Duration,
) -> Result<i32, sqlx::Error> {
    sqlx::query(
        "UPDATE webhook_deliveries SET next_attempt_at = now() + make_interval(secs => $2)
          WHERE id = $1 AND state = 'pending'",
    )
    .bind(claim.delivery_id)
    .bind(delay.as_secs_f64())
    .execute(&mut *conn)
    .await?;
    sqlx::query_scalar(
        "UPDATE webhooks SET consecutive_failures = consecutive_failures + 1
          WHERE id = $1 RETURNING consecutive_failures",
    )
    .bind(claim.webhook_id)
    .fetch_one(conn)
    .await
}

/// Disables `webhook` for `reason`, with a `webhook.disabled` event (`event`) for the relay;
/// returns whether this call disabled it (it was not already).
pub async fn disable(
    conn: &mut PgConnection,
    webhook: WebhookId,
    reason: &str,
    event: EventId,
) -> Result<bool, sqlx::Error> {
    let disabled = sqlx::query(
        "UPDATE webhooks SET disabled_at = now(), disabled_reason = $2, disabled_event_id = $3
          WHERE id = $1 AND disabled_at IS NULL",
    )
    .bind(webhook)
    .bind(reason)
    .bind(event)
    .execute(conn)
    .await?;
    Ok(disabled.rows_affected() == 1)
}

/// Deletes finished deliveries (and their attempts) older than `retention`.
pub async fn prune(db: &PgPool, retention: Duration) -> Result<(), sqlx::Error> {
    sqlx::query(
        "DELETE FROM webhook_deliveries
          WHERE state <> 'pending' AND completed_at < now() - make_interval(secs => $1)",
    )
    .bind(retention.as_secs_f64())
    .execute(db)
    .await?;
    Ok(())
}

/// The number of pending deliveries and the age of the oldest, in seconds.
pub async fn pending_backlog(db: &PgPool) -> Result<(i64, f64), sqlx::Error> {
    let row = sqlx::query(
        "SELECT count(*) AS pending,
                COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8 AS oldest
           FROM webhook_deliveries WHERE state = 'pending'",
    )
    .fetch_one(db)
    .await?;
    Ok((row.try_get("pending")?, row.try_get("oldest")?))
}

/// Locks (skipping rows another relay holds) up to `batch` webhooks disabled since the last
/// round whose `dev.berth.webhook.disabled` event is not yet published (this table is that
/// event's outbox): each as (event id, when it was disabled, the event's data).
pub async fn claim_unpublished_disabled(
    conn: &mut PgConnection,
    batch: i64,
) -> Result<Vec<(EventId, DateTime<Utc>, WebhookDisabledData)>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, org_id, url, consecutive_failures, disabled_reason, disabled_at,
                disabled_event_id
           FROM webhooks
          WHERE disabled_event_id IS NOT NULL AND disabled_published_at IS NULL
          ORDER BY disabled_at
          LIMIT $1
          FOR UPDATE SKIP LOCKED",
    )
    .bind(batch)
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|row| {
            Ok((
                row.try_get("disabled_event_id")?,
                row.try_get("disabled_at")?,
                WebhookDisabledData {
                    webhook_id: row.try_get("id")?,
                    org_id: row.try_get("org_id")?,
                    url: row.try_get("url")?,
                    consecutive_failures: row.try_get("consecutive_failures")?,
                    reason: row
                        .try_get::<Option<String>, _>("disabled_reason")?
                        .unwrap_or_default(),
                },
            ))
        })
        .collect()
}

/// Marks the `webhook.disabled` events of `webhooks` published (JetStream acked them).
pub async fn mark_disabled_published(
    conn: &mut PgConnection,
    webhooks: &[WebhookId],
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE webhooks SET disabled_published_at = now() WHERE id = ANY($1)")
        .bind(webhooks)
        .execute(conn)
        .await?;
    Ok(())
}
