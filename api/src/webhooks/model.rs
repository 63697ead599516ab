//! Webhook bodies (the create request, a webhook, its deliveries and attempts), the create's
//! validation, secrets, and the OpenAPI text about events and webhooks.

use base64::Engine;
use berth_schemas::cloudevents::normalize_type;
use berth_schemas::{DeliveryId, EventId, WebhookId};
use chrono::{DateTime, Utc};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;

/// The longest webhook URL, in bytes.
pub const MAX_URL_LEN: usize = 2048;
/// The shortest secret a client may choose, in bytes.
pub const MIN_SECRET_LEN: usize = 16;
/// The longest secret, in bytes.
pub const MAX_SECRET_LEN: usize = 256;
/// A webhook subscribes to at most this many event types.
pub const MAX_EVENT_TYPES: usize = 32;
/// An org has at most this many webhooks.
pub const MAX_WEBHOOKS_PER_ORG: i64 = 32;
/// Prefix of generated secrets.
pub const SECRET_PREFIX: &str = "whsec_";
/// Default page of `GET /v1/webhooks/{id}/deliveries`.
pub const DEFAULT_DELIVERY_PAGE: i64 = 50;
/// Largest page of `GET /v1/webhooks/{id}/deliveries`.
pub const MAX_DELIVERY_PAGE: i64 = 500;

/// `POST /v1/webhooks` body. Unknown fields are refused.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWebhook {
    /// `http://` or `https://` URL, at most 2048 bytes, without user info. Deliveries are
    /// `POST`ed to it.
    pub url: String,
    /// HMAC-SHA256 key for `Berth-Signature`, 16 to 256 bytes. Omitted: one is generated and
    /// returned once, in this response.
    pub secret: Option<String>,
    /// CloudEvent types to receive (`dev.berth.sandbox.running`, or the short
    /// `sandbox.running`); omitted or empty: every type.
    pub event_types: Option<Vec<String>>,
}

/// A webhook.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Webhook {
    /// The webhook's id.
    #[schema(value_type = String, format = Uuid)]
    pub id: WebhookId,
    /// Where deliveries are POSTed (http or https).
    pub url: String,
    /// Empty: every type.
    pub event_types: Vec<String>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// Set when the webhook was disabled after a run of failed deliveries.
    pub disabled_at: Option<DateTime<Utc>>,
    /// Why it was disabled (the last failure); `None` while active.
    pub disabled_reason: Option<String>,
    /// Failed attempts since the last successful one.
    pub consecutive_failures: i32,
    /// The signing secret: only in the response to the create.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

/// One event sent (or being sent) to one webhook, with its attempts.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Delivery {
    /// The delivery's id (sent in the delivery-id header).
    #[schema(value_type = String, format = Uuid)]
    pub id: DeliveryId,
    /// The event delivered (the CloudEvent's `id`).
    #[schema(value_type = String, format = Uuid)]
    pub event_id: EventId,
    /// The CloudEvent `type` (`dev.berth.sandbox.running`, …).
    pub event_type: String,
    /// `pending`, `succeeded`, or `abandoned` (the webhook was disabled or deleted first).
    pub state: String,
    /// When the next attempt is due (pending only).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// When the event was queued for this webhook.
    pub created_at: DateTime<Utc>,
    /// When it succeeded or was abandoned; `None` while pending.
    pub completed_at: Option<DateTime<Utc>>,
    /// Every attempt, first first.
    pub attempts: Vec<Attempt>,
}

/// One HTTP attempt of a delivery.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Attempt {
    /// 1 for the first.
    pub attempt: i32,
    /// When the attempt ended.
    pub at: DateTime<Utc>,
    /// The receiver's status, when it answered.
    pub status_code: Option<i32>,
    /// Why it failed; `null` on success.
    pub error: Option<String>,
    /// How long it took, in milliseconds.
    pub duration_ms: i32,
}

/// A validated create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidWebhook {
    /// The parsed URL, re-serialized (http or https, a host, no credentials).
    pub url: String,
    /// `None`: generate one.
    pub secret: Option<String>,
    /// Full CloudEvent types, deduplicated (short forms expanded); empty: every type.
    pub event_types: Vec<String>,
}

impl CreateWebhook {
    /// Checks the URL (scheme, length, no user info), the secret's length and the types.
    ///
    /// Errors: [`ApiError::InvalidRequest`] naming the field.
    pub fn validate(self) -> Result<ValidWebhook, ApiError> {
        if self.url.len() > MAX_URL_LEN {
            return Err(ApiError::invalid(
                "url",
                format!("url is at most {MAX_URL_LEN} bytes"),
            ));
        }
        let url = reqwest::Url::parse(&self.url)
            .map_err(|e| ApiError::invalid("url", format!("url is not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ApiError::invalid("url", "url must be http:// or https://"));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(ApiError::invalid("url", "url needs a host"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(ApiError::invalid(
                "url",
                "url must not carry credentials; authenticate deliveries by their signature",
            ));
        }
        if let Some(secret) = &self.secret {
            if secret.contains('\0') {
                return Err(ApiError::invalid("secret", "secret cannot hold NUL"));
            }
            if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&secret.len()) {
                return Err(ApiError::invalid(
                    "secret",
                    format!("secret must be {MIN_SECRET_LEN} to {MAX_SECRET_LEN} bytes"),
                ));
            }
        }
        let raw_types = self.event_types.unwrap_or_default();
        if raw_types.len() > MAX_EVENT_TYPES {
            return Err(ApiError::invalid(
                "event_types",
                format!("at most {MAX_EVENT_TYPES} event types"),
            ));
        }
        let mut event_types = Vec::with_capacity(raw_types.len());
        for t in &raw_types {
            let full = normalize_type(t).ok_or_else(|| {
                ApiError::invalid("event_types", format!("unknown event type {t:?}"))
            })?;
            if !event_types.contains(&full) {
                event_types.push(full);
            }
        }
        Ok(ValidWebhook {
            url: url.to_string(),
            secret: self.secret,
            event_types,
        })
    }
}

/// A new random secret: `whsec_` and 43 URL-safe base64 characters (32 random bytes).
pub fn generate_secret() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!(
        "{SECRET_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

/// What the OpenAPI description says about webhooks and the event stream.
pub const DOC: &str = r#"
## Events

Every state change of a sandbox is an event, published as a CloudEvents 1.0 JSON document
(structured mode): `id` (the event id: the same everywhere, deduplicate by it), `source`
(`/berth/orgs/<org_id>`), `type` (`dev.berth.sandbox.<state>`), `subject`
(`sandboxes/<sandbox_id>`), `time`, and `data` `{sandbox_id, org_id, from, to, reason,
generation, command_id, message}`. Three ways to receive them:

- `GET /v1/events`: Server-Sent Events, the backlog then live; each message has `id:` = the
  event id and `data:` = the CloudEvent. Reconnect with `Last-Event-ID` to resume after the
  last event seen, with no gap and no repeat. Filters: `sandbox_id`, `type` (comma-separated).
- NATS JetStream: stream `{P}_EVENTS`, subjects `{p}.events.sandbox.<org_id>.<sandbox_id>`,
  replayable from any point, `Nats-Msg-Id` = event id.
- Webhooks (below).

## Webhooks

`POST /v1/webhooks` `{url, secret, event_types}` registers an endpoint. Each event is `POST`ed
to it as `application/cloudevents+json`, at least once, in order, one at a time, with headers:

| header | value |
|---|---|
| `Berth-Signature` | `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>` |
| `Berth-Event-Id` | the CloudEvent `id`: deduplicate by it |
| `Berth-Delivery-Id` | the delivery (the same on every attempt) |
| `Berth-Delivery-Attempt` | 1, 2, … |

Verify: recompute the HMAC over the timestamp, a `.`, and the raw body bytes; compare in
constant time; refuse timestamps older than five minutes. Answer 2xx to acknowledge; anything
else (or no answer within the attempt timeout, 10 s by default; redirects are not followed) is retried with exponential
backoff (by default 5 s doubling to 1 h, with jitter). After a run of failed attempts (20 by
default) the webhook is
disabled (`disabled_at`, `disabled_reason`), its pending deliveries are abandoned, and a
`dev.berth.webhook.disabled` CloudEvent is published on `{p}.events.webhook.<org_id>.<id>`.
`GET /v1/webhooks/{id}/deliveries` shows every delivery with each attempt.
"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn create(url: &str) -> CreateWebhook {
        CreateWebhook {
            url: url.to_owned(),
            secret: None,
            event_types: None,
        }
    }

    fn field_of(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidRequest { field, .. } => field,
            _ => None,
        }
    }

    #[test]
    fn http_and_https_urls_are_accepted() {
        for url in ["http://127.0.0.1:9000/hook", "https://example.com/a?b=c"] {
            assert!(create(url).validate().is_ok(), "{url}");
        }
    }

    #[test]
    fn other_schemes_long_urls_and_credentials_are_refused() {
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_LEN));
        for url in [
            "ftp://example.com/x",
            "file:///etc/passwd",
            "not a url",
            "https://user:pw@example.com/",
            long.as_str(),
        ] {
            assert_eq!(
                field_of(create(url).validate().unwrap_err()).as_deref(),
                Some("url"),
                "{url}"
            );
        }
    }

    #[test]
    fn secrets_and_types_are_checked_and_types_normalized() {
        let mut c = create("http://127.0.0.1/");
        c.secret = Some("short".into());
        assert_eq!(
            field_of(c.validate().unwrap_err()).as_deref(),
            Some("secret")
        );
        let mut c = create("http://127.0.0.1/");
        c.event_types = Some(vec!["sandbox.running".into(), "bogus".into()]);
        assert_eq!(
            field_of(c.validate().unwrap_err()).as_deref(),
            Some("event_types")
        );
        let mut c = create("http://127.0.0.1/");
        c.event_types = Some(vec![
            "sandbox.running".into(),
            "dev.berth.sandbox.running".into(),
        ]);
        assert_eq!(
            c.validate().unwrap().event_types,
            ["dev.berth.sandbox.running"]
        );
    }

    #[test]
    fn the_openapi_document_lists_the_routes_and_names_the_signature_headers() {
        let doc = crate::openapi::document();
        for path in [
            "/v1/events",
            "/v1/webhooks",
            "/v1/webhooks/{id}",
            "/v1/webhooks/{id}/deliveries",
        ] {
            assert!(doc.paths.paths.contains_key(path), "{path}");
        }
        let description = doc.info.description.unwrap();
        for header in [
            crate::webhooks::signature::SIGNATURE_HEADER,
            crate::webhooks::signature::EVENT_ID_HEADER,
            crate::webhooks::signature::DELIVERY_ID_HEADER,
            crate::webhooks::signature::ATTEMPT_HEADER,
        ] {
            assert!(description.contains(header), "{header}");
        }
    }

    #[test]
    fn generated_secrets_are_long_random_and_prefixed() {
        let (a, b) = (generate_secret(), generate_secret());
        assert!(a.starts_with(SECRET_PREFIX) && a.len() == SECRET_PREFIX.len() + 43);
        assert_ne!(a, b);
    }
}
