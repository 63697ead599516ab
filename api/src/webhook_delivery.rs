//! The webhook delivery worker, run inside the API process ([`crate::serve`] spawns it).
//!
//! Each round it (1) fans published events out into `webhook_deliveries`, following each
//! webhook's cursor on `events.seq`, and (2) sends the oldest pending delivery of every webhook
//! whose next attempt is due, signed (see [`crate::webhook_signature`]), logging each attempt
//! in `webhook_attempts`.
//!
//! # Guarantees
//! - At least once: a delivery is claimed by pushing its `next_attempt_at` past the attempt
//!   timeout (a lease); it is marked `succeeded` only after a 2xx answer. A worker that dies
//!   mid-attempt leaves the claim to expire, and the delivery is sent again. Receivers
//!   deduplicate by `Berth-Event-Id`.
//! - In order per webhook: only a webhook's oldest pending delivery (by publish order) is
//!   attempted, so a receiver sees one webhook's events in order, one at a time.
//! - Several API replicas may run workers: fan-out locks webhook rows `FOR UPDATE SKIP
//!   LOCKED`; a claim is a conditional `UPDATE` only one worker wins.
//! - A failed attempt is retried after an exponential backoff with jitter ([`retry_delay`]).
//!   After [`WebhookConfig::disable_after`] failed attempts in a row (across deliveries; any
//!   success resets the run) the webhook is disabled, its pending deliveries are abandoned,
//!   and its row carries a `dev.berth.webhook.disabled` CloudEvent that the relay publishes on
//!   `{p}.events.webhook.<org>.<webhook>`. An `events` row belongs to a sandbox, so this event
//!   is not one; the webhook row is its outbox instead.

use std::time::{Duration, Instant};

use berth_schemas::{DeliveryId, EventId, WebhookId};
use futures::future::join_all;
use rand::Rng;
use sqlx::{PgPool, Row};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, instrument, warn};

use crate::events::{published_after, EventFilter};
use crate::webhook_signature::{self, sign};

/// Pause between rounds when there was nothing to do.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// Wait after the first failed attempt; each further failure doubles it.
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_secs(5);
/// The longest wait between two attempts.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(3600);
/// Each failure multiplies the wait by this.
pub const BACKOFF_MULTIPLIER: u32 = 2;
/// How long one attempt may take (connect, send, answer).
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Failed attempts in a row after which a webhook is disabled (with the defaults above, about
/// 13 hours of an unreachable receiver).
pub const DEFAULT_DISABLE_AFTER: u32 = 20;
/// Deliveries fanned out or attempted per round.
pub const DEFAULT_BATCH: i64 = 64;
/// Finished deliveries and their attempts are kept this long.
pub const DEFAULT_DELIVERY_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// A claim outlives the attempt timeout by this, so a slow answer is never attempted twice.
const CLAIM_MARGIN: Duration = Duration::from_secs(5);
/// How often finished deliveries past their retention are deleted.
const PRUNE_INTERVAL: Duration = Duration::from_secs(3600);
/// The `User-Agent` of deliveries.
const USER_AGENT: &str = concat!("berth-webhooks/", env!("CARGO_PKG_VERSION"));

/// Timing and limits of webhook delivery. Tests shrink every duration.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub poll_interval: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub attempt_timeout: Duration,
    /// Failed attempts in a row that disable a webhook.
    pub disable_after: u32,
    pub batch: i64,
    pub delivery_retention: Duration,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        Self {
            poll_interval: DEFAULT_POLL_INTERVAL,
            backoff_initial: DEFAULT_BACKOFF_INITIAL,
            backoff_max: DEFAULT_BACKOFF_MAX,
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
            disable_after: DEFAULT_DISABLE_AFTER,
            batch: DEFAULT_BATCH,
            delivery_retention: DEFAULT_DELIVERY_RETENTION,
        }
    }
}

/// The wait before the next attempt after `failed_attempts` failures of one delivery:
/// `min(initial × 2^(failed_attempts−1), max)`, with "equal jitter" — half of it fixed, half
/// scaled by `jitter` in `[0, 1)` — so receivers recovering from an outage are not hit by
/// every sender at once. Never less than half the un-jittered wait.
pub fn retry_delay(config: &WebhookConfig, failed_attempts: u32, jitter: f64) -> Duration {
    let exponent = failed_attempts.saturating_sub(1).min(32);
    let base = config
        .backoff_initial
        .saturating_mul(BACKOFF_MULTIPLIER.saturating_pow(exponent))
        .min(config.backoff_max);
    base / 2 + base.div_f64(2.0).mul_f64(jitter.clamp(0.0, 1.0))
}

/// Errors of one round.
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("http client: {0}")]
    Client(#[from] reqwest::Error),
}

/// Runs the worker until `shutdown` fires. Errors are logged and retried next round.
pub async fn run(db: PgPool, config: WebhookConfig, shutdown: CancellationToken) {
    let http = match reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(config.attempt_timeout)
        .user_agent(USER_AGENT)
        .build()
    {
        Ok(c) => c,
        Err(error) => {
            warn!(%error, "webhook delivery cannot start: no HTTP client");
            return;
        }
    };
    describe_metrics();
    info!("webhook delivery running");
    let mut last_prune: Option<Instant> = None;
    loop {
        let busy = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = round(&db, &http, &config) => match r {
                Ok(busy) => busy,
                Err(error) => {
                    warn!(%error, "webhook round failed; retrying");
                    false
                }
            },
        };
        if last_prune.is_none_or(|t| t.elapsed() >= PRUNE_INTERVAL) {
            last_prune = Some(Instant::now());
            if let Err(error) = prune(&db, config.delivery_retention).await {
                debug!(%error, "old webhook deliveries not pruned");
            }
        }
        if let Err(error) = record_backlog(&db).await {
            debug!(%error, "webhook gauges not updated");
        }
        if !busy {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(config.poll_interval) => {}
            }
        }
    }
}

/// Registers the worker's metrics with their help text, at zero, so dashboards and alerts see
/// them before the first delivery.
fn describe_metrics() {
    metrics::describe_counter!(
        "berth_webhook_attempts_total",
        "Webhook delivery attempts, by outcome (succeeded: a 2xx answer)."
    );
    metrics::describe_histogram!(
        "berth_webhook_attempt_duration_seconds",
        metrics::Unit::Seconds,
        "Duration of one webhook delivery attempt."
    );
    metrics::describe_counter!(
        "berth_webhooks_disabled_total",
        "Webhooks disabled after a run of failed attempts."
    );
    metrics::describe_gauge!(
        "berth_webhook_deliveries_pending",
        "Webhook deliveries not yet acknowledged by their receiver."
    );
    metrics::describe_gauge!(
        "berth_webhook_oldest_pending_age_seconds",
        metrics::Unit::Seconds,
        "Age of the oldest pending webhook delivery."
    );
    for outcome in ["succeeded", "failed"] {
        metrics::counter!("berth_webhook_attempts_total", "outcome" => outcome).increment(0);
    }
    metrics::counter!("berth_webhooks_disabled_total").increment(0);
}

/// One round: fan out, then attempt what is due. Returns whether more work is waiting (a full
/// batch, or a delivery succeeded so its webhook's next one is due).
pub async fn round(
    db: &PgPool,
    http: &reqwest::Client,
    config: &WebhookConfig,
) -> Result<bool, DeliveryError> {
    let fanned = fan_out(db, config.batch).await?;
    let claimed = claim(db, config).await?;
    let n = claimed.len();
    let outcomes = join_all(claimed.into_iter().map(|c| async move {
        let outcome = attempt(http, &c).await;
        (c, outcome)
    }))
    .await;
    let mut delivered = false;
    for (claim, outcome) in outcomes {
        record(db, config, &claim, &outcome).await?;
        delivered |= outcome.error.is_none();
    }
    // After a success the webhook's next delivery is due at once: go again without pausing.
    Ok(delivered || fanned >= config.batch as usize || n >= config.batch as usize)
}

/// Queues, for every active webhook, the published events after its cursor that it subscribes
/// to, and advances the cursor past everything read. Returns the most events read for one
/// webhook (a full batch means more are waiting).
async fn fan_out(db: &PgPool, batch: i64) -> Result<usize, sqlx::Error> {
    let mut tx = db.begin().await?;
    let hooks = sqlx::query(
        "SELECT id, org_id, event_types, cursor_seq FROM webhooks
          WHERE disabled_at IS NULL AND deleted_at IS NULL
          FOR UPDATE SKIP LOCKED",
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut most = 0;
    for hook in &hooks {
        let webhook: WebhookId = hook.try_get("id")?;
        let types: Vec<String> = hook.try_get("event_types")?;
        let records = published_after(
            &mut tx,
            hook.try_get("org_id")?,
            hook.try_get("cursor_seq")?,
            &EventFilter::default(),
            batch,
        )
        .await?;
        most = most.max(records.len());
        let Some(last) = records.last().and_then(|r| r.seq) else {
            continue;
        };
        for record in records
            .iter()
            .filter(|r| types.is_empty() || types.contains(&r.event.kind))
        {
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
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query("UPDATE webhooks SET cursor_seq = $2 WHERE id = $1")
            .bind(webhook)
            .bind(last)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(most)
}

/// A delivery this worker holds the claim of.
#[derive(Debug, Clone)]
pub struct Claim {
    pub delivery_id: DeliveryId,
    pub webhook_id: WebhookId,
    pub event_id: EventId,
    pub attempt: i32,
    pub url: String,
    pub secret: String,
    pub body: String,
}

/// Claims the oldest pending delivery of each active webhook whose attempt is due.
async fn claim(db: &PgPool, config: &WebhookConfig) -> Result<Vec<Claim>, sqlx::Error> {
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
    .bind(config.batch)
    .bind((config.attempt_timeout + CLAIM_MARGIN).as_secs_f64())
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

/// How one attempt ended.
#[derive(Debug, Clone)]
pub struct AttemptOutcome {
    pub status_code: Option<u16>,
    /// `None` on success (a 2xx answer).
    pub error: Option<String>,
    pub duration: Duration,
}

/// Sends one signed attempt.
#[instrument(skip_all, fields(webhook_id = %claim.webhook_id, event_id = %claim.event_id,
    delivery_id = %claim.delivery_id, attempt = claim.attempt))]
async fn attempt(http: &reqwest::Client, claim: &Claim) -> AttemptOutcome {
    let started = Instant::now();
    let timestamp = chrono::Utc::now().timestamp();
    let signature = sign(&claim.secret, timestamp, claim.body.as_bytes());
    let sent = http
        .post(&claim.url)
        .header(
            reqwest::header::CONTENT_TYPE,
            berth_schemas::cloudevents::CONTENT_TYPE,
        )
        .header(webhook_signature::SIGNATURE_HEADER, signature)
        .header(
            webhook_signature::EVENT_ID_HEADER,
            claim.event_id.to_string(),
        )
        .header(
            webhook_signature::DELIVERY_ID_HEADER,
            claim.delivery_id.to_string(),
        )
        .header(webhook_signature::ATTEMPT_HEADER, claim.attempt.to_string())
        .body(claim.body.clone())
        .send()
        .await;
    let (status_code, error) = match sent {
        Ok(resp) if resp.status().is_success() => (Some(resp.status().as_u16()), None),
        Ok(resp) => (
            Some(resp.status().as_u16()),
            Some(format!("receiver answered {}", resp.status())),
        ),
        Err(e) if e.is_timeout() => (None, Some("timed out".to_owned())),
        Err(e) => (None, Some(error_chain(&e))),
    };
    let duration = started.elapsed();
    let outcome = if error.is_none() {
        "succeeded"
    } else {
        "failed"
    };
    metrics::counter!("berth_webhook_attempts_total", "outcome" => outcome).increment(1);
    metrics::histogram!("berth_webhook_attempt_duration_seconds").record(duration.as_secs_f64());
    debug!(outcome, ?status_code, "webhook attempt");
    AttemptOutcome {
        status_code,
        error,
        duration,
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Logs the attempt and moves the delivery and its webhook on, in one transaction.
async fn record(
    db: &PgPool,
    config: &WebhookConfig,
    claim: &Claim,
    outcome: &AttemptOutcome,
) -> Result<(), sqlx::Error> {
    let mut tx = db.begin().await?;
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
    .execute(&mut *tx)
    .await?;
    let Some(error) = &outcome.error else {
        sqlx::query(
            "UPDATE webhook_deliveries SET state = 'succeeded', completed_at = now()
              WHERE id = $1 AND state = 'pending'",
        )
        .bind(claim.delivery_id)
        .execute(&mut *tx)
        .await?;
        sqlx::query("UPDATE webhooks SET consecutive_failures = 0 WHERE id = $1")
            .bind(claim.webhook_id)
            .execute(&mut *tx)
            .await?;
        return tx.commit().await;
    };
    let failed = u32::try_from(claim.attempt).unwrap_or(1);
    let delay = retry_delay(config, failed, rand::rng().random::<f64>());
    sqlx::query(
        "UPDATE webhook_deliveries SET next_attempt_at = now() + make_interval(secs => $2)
          WHERE id = $1 AND state = 'pending'",
    )
    .bind(claim.delivery_id)
    .bind(delay.as_secs_f64())
    .execute(&mut *tx)
    .await?;
    let run: i32 = sqlx::query_scalar(
        "UPDATE webhooks SET consecutive_failures = consecutive_failures + 1
          WHERE id = $1 RETURNING consecutive_failures",
    )
    .bind(claim.webhook_id)
    .fetch_one(&mut *tx)
    .await?;
    if u32::try_from(run).unwrap_or(0) >= config.disable_after {
        let reason = format!("{run} delivery attempts in a row failed; the last: {error}");
        let disabled = sqlx::query(
            "UPDATE webhooks SET disabled_at = now(), disabled_reason = $2, disabled_event_id = $3
              WHERE id = $1 AND disabled_at IS NULL",
        )
        .bind(claim.webhook_id)
        .bind(&reason)
        .bind(EventId::new())
        .execute(&mut *tx)
        .await?;
        if disabled.rows_affected() == 1 {
            sqlx::query(
                "UPDATE webhook_deliveries SET state = 'abandoned', completed_at = now()
                  WHERE webhook_id = $1 AND state = 'pending'",
            )
            .bind(claim.webhook_id)
            .execute(&mut *tx)
            .await?;
            metrics::counter!("berth_webhooks_disabled_total").increment(1);
            warn!(webhook_id = %claim.webhook_id, run, "webhook disabled after failed deliveries");
        }
    }
    tx.commit().await
}

/// Deletes finished deliveries (and their attempts) older than `retention`.
async fn prune(db: &PgPool, retention: Duration) -> Result<(), sqlx::Error> {
    sqlx::query(
        "DELETE FROM webhook_deliveries
          WHERE state <> 'pending' AND completed_at < now() - make_interval(secs => $1)",
    )
    .bind(retention.as_secs_f64())
    .execute(db)
    .await?;
    Ok(())
}

/// Sets `berth_webhook_deliveries_pending` and `berth_webhook_oldest_pending_age_seconds`.
async fn record_backlog(db: &PgPool) -> Result<(), sqlx::Error> {
    let row = sqlx::query(
        "SELECT count(*) AS pending,
                COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8 AS oldest
           FROM webhook_deliveries WHERE state = 'pending'",
    )
    .fetch_one(db)
    .await?;
    metrics::gauge!("berth_webhook_deliveries_pending").set(row.get::<i64, _>("pending") as f64);
    metrics::gauge!("berth_webhook_oldest_pending_age_seconds").set(row.get::<f64, _>("oldest"));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> WebhookConfig {
        WebhookConfig {
            backoff_initial: Duration::from_secs(5),
            backoff_max: Duration::from_secs(60),
            ..Default::default()
        }
    }

    #[test]
    fn the_retry_delay_doubles_per_failure_up_to_the_cap() {
        let c = config();
        let no_jitter: Vec<u64> = (1..=6)
            .map(|n| retry_delay(&c, n, 0.999_999).as_secs())
            .collect();
        assert_eq!(no_jitter, [4, 9, 19, 39, 59, 59]);
        assert_eq!(retry_delay(&c, 1, 0.0), Duration::from_millis(2500));
        assert_eq!(retry_delay(&c, 3, 0.0), Duration::from_secs(10));
        assert_eq!(retry_delay(&c, 1_000, 0.0), Duration::from_secs(30));
    }

    #[test]
    fn jitter_never_takes_the_delay_below_half_or_above_the_full_wait() {
        let c = config();
        for n in 1..10 {
            for j in [0.0, 0.3, 0.7, 1.0, 5.0, -1.0] {
                let d = retry_delay(&c, n, j);
                let full = retry_delay(&c, n, 1.0);
                assert!(d >= full / 2 && d <= full, "attempt {n}, jitter {j}: {d:?}");
            }
        }
    }
}
