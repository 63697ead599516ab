//! The webhook delivery worker, run inside the API process ([`crate::serve`] spawns it).
//!
//! Each round it (1) fans published events out into `webhook_deliveries`, following each
//! webhook's cursor on `events.seq`, and (2) sends the oldest pending delivery of every webhook
//! whose next attempt is due, signed (see [`super::signature`]), logging each attempt
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
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, instrument, warn};

use super::signature::{self as webhook_signature, sign};
use super::store;
use crate::service::events::{published_after, EventFilter};

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
    /// The pause between rounds when no work is waiting ([`DEFAULT_POLL_INTERVAL`]).
    pub poll_interval: Duration,
    /// The wait after a delivery's first failure, doubled per failure ([`retry_delay`]).
    pub backoff_initial: Duration,
    /// The longest wait between two attempts of one delivery.
    pub backoff_max: Duration,
    /// The HTTP timeout of one attempt; a claim lasts this plus a safety margin.
    pub attempt_timeout: Duration,
    /// Failed attempts in a row that disable a webhook.
    pub disable_after: u32,
    /// The most events fanned out per webhook, and deliveries claimed, in one round.
    pub batch: i64,
    /// How long finished deliveries (and their attempts) are kept before pruning.
    pub delivery_retention: Duration,
    /// Whether deliveries may go to loopback, private, link-local and other special-use
    /// addresses ([`super::target`]); off by default, on for an on-premise receiver.
    pub allow_private_targets: bool,
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
            allow_private_targets: false,
        }
    }
}

/// The delivery HTTP client: no redirects (a receiver could redirect to a refused target),
/// the attempt timeout, and, unless `allow_private_targets`, a resolver that drops refused
/// addresses ([`super::target::GuardedResolver`]).
///
/// Errors: reqwest's, when the TLS backend cannot start.
pub fn client(config: &WebhookConfig) -> reqwest::Result<reqwest::Client> {
    let builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(config.attempt_timeout)
        .user_agent(USER_AGENT);
    if config.allow_private_targets {
        builder.build()
    } else {
        builder
            .dns_resolver(std::sync::Arc::new(super::target::GuardedResolver))
            .build()
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
    /// Postgres failed; the round's uncommitted work is retried next round.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The published events could not be read.
    #[error(transparent)]
    Store(#[from] berth_store::StoreError),
    /// The HTTP client failed outside an attempt (an attempt's own failure is its outcome).
    #[error("http client: {0}")]
    Client(#[from] reqwest::Error),
}

/// Runs the worker until `shutdown` fires. Errors are logged and retried next round.
pub async fn run(db: PgPool, config: WebhookConfig, shutdown: CancellationToken) {
    let http = match client(&config) {
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
            if let Err(error) = store::prune(&db, config.delivery_retention).await {
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
    let allow_private = config.allow_private_targets;
    let outcomes = join_all(claimed.into_iter().map(|c| async move {
        let outcome = attempt(http, &c, allow_private).await;
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
async fn fan_out(db: &PgPool, batch: i64) -> Result<usize, DeliveryError> {
    let mut tx = db.begin().await?;
    let hooks = store::lock_active(&mut tx).await?;
    let mut most = 0;
    for hook in &hooks {
        let records = published_after(
            &mut *tx,
            hook.org_id,
            hook.cursor_seq,
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
            .filter(|r| hook.event_types.is_empty() || hook.event_types.contains(&r.event.kind))
        {
            store::queue_delivery(&mut tx, hook.id, record).await?;
        }
        store::advance_cursor(&mut tx, hook.id, last).await?;
    }
    tx.commit().await?;
    Ok(most)
}

/// A delivery this worker holds the claim of.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The claimed delivery.
    pub delivery_id: DeliveryId,
    /// The webhook it goes to.
    pub webhook_id: WebhookId,
    /// The event it carries (sent in the event-id header).
    pub event_id: EventId,
    /// This attempt's number, 1 for the first (sent in the attempt header).
    pub attempt: i32,
    /// The receiver's URL (http or https, no credentials).
    pub url: String,
    /// The webhook's signing secret.
    pub secret: String,
    /// The CloudEvent JSON, exactly the bytes that are signed and sent.
    pub body: String,
}

/// Claims the oldest pending delivery of each active webhook whose attempt is due.
async fn claim(db: &PgPool, config: &WebhookConfig) -> Result<Vec<Claim>, sqlx::Error> {
    store::claim_due(db, config.batch, config.attempt_timeout + CLAIM_MARGIN).await
}

/// How one attempt ended.
#[derive(Debug, Clone)]
pub struct AttemptOutcome {
    /// The receiver's HTTP status; `None` when it did not answer (connect error, timeout).
    pub status_code: Option<u16>,
    /// `None` on success (a 2xx answer).
    pub error: Option<String>,
    /// From sending the request to the answer or the failure.
    pub duration: Duration,
}

/// Sends one signed attempt.
#[instrument(skip_all, fields(webhook_id = %claim.webhook_id, event_id = %claim.event_id,
    delivery_id = %claim.delivery_id, attempt = claim.attempt))]
async fn attempt(http: &reqwest::Client, claim: &Claim, allow_private: bool) -> AttemptOutcome {
    let started = Instant::now();
    let refused = !allow_private
        && reqwest::Url::parse(&claim.url).is_ok_and(|url| super::target::literal_is_refused(&url));
    if refused {
        return finish(
            started,
            None,
            Some(super::target::REFUSED_TARGET.to_owned()),
        );
    }
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
        Err(e) => (None, Some(failure_class(&e).to_owned())),
    };
    finish(started, status_code, error)
}

/// Records an attempt's metrics and outcome.
fn finish(started: Instant, status_code: Option<u16>, error: Option<String>) -> AttemptOutcome {
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

/// What an attempt's log says about a failed request: a class only, never the underlying
/// error (which would tell a tenant whether a port is open, a name resolves or a TLS peer
/// exists: a port scanner for the networks the control plane reaches).
fn failure_class(e: &reqwest::Error) -> &'static str {
    let refused = std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |e| {
        e.source()
    })
    .any(|e| e.to_string() == super::target::REFUSED_TARGET);
    if refused {
        super::target::REFUSED_TARGET
    } else if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else {
        "request failed"
    }
}

/// Logs the attempt and moves the delivery and its webhook on, in one transaction.
async fn record(
    db: &PgPool,
    config: &WebhookConfig,
    claim: &Claim,
    outcome: &AttemptOutcome,
) -> Result<(), sqlx::Error> {
    let mut tx = db.begin().await?;
    store::log_attempt(&mut tx, claim, outcome).await?;
    let Some(error) = &outcome.error else {
        store::mark_succeeded(&mut tx, claim).await?;
        return tx.commit().await;
    };
    let failed = u32::try_from(claim.attempt).unwrap_or(1);
    let delay = retry_delay(config, failed, rand::rng().random::<f64>());
    let run = store::schedule_retry(&mut tx, claim, delay).await?;
    if u32::try_from(run).unwrap_or(0) >= config.disable_after {
        let reason = format!("{run} delivery attempts in a row failed; the last: {error}");
        if store::disable(&mut tx, claim.webhook_id, &reason, EventId::new()).await? {
            store::abandon_pending(&mut tx, claim.webhook_id).await?;
            metrics::counter!("berth_webhooks_disabled_total").increment(1);
            warn!(webhook_id = %claim.webhook_id, run, "webhook disabled after failed deliveries");
        }
    }
    tx.commit().await
}

/// Sets `berth_webhook_deliveries_pending` and `berth_webhook_oldest_pending_age_seconds`.
async fn record_backlog(db: &PgPool) -> Result<(), sqlx::Error> {
    let (pending, oldest) = store::pending_backlog(db).await?;
    metrics::gauge!("berth_webhook_deliveries_pending").set(pending as f64);
    metrics::gauge!("berth_webhook_oldest_pending_age_seconds").set(oldest);
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
