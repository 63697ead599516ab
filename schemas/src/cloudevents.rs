//! Berth's external events: CloudEvents 1.0 in structured JSON mode, so any consumer can read
//! them without Berth's wire crate.
//!
//! Source: CloudEvents 1.0.2 core spec (`specversion`, `id`, `source`, `type`, `subject`,
//! `time`, `datacontenttype`, `data`) and its JSON event format (structured mode, media type
//! `application/cloudevents+json`).
//!
//! # Guarantees
//! - `id` is the event row's id: the same event always carries the same id on NATS, on the
//!   SSE stream and in webhook deliveries, so a consumer deduplicates by it.
//! - `source` + `id` is unique (the id alone is a UUIDv7, unique already).
//! - The document is built from the stored row only; rendering it twice gives the same bytes.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::ids::{CommandId, EventId, Generation, OrgId, SandboxId, WebhookId};
use crate::state::SandboxState;

/// `specversion` of every event.
pub const SPEC_VERSION: &str = "1.0";
/// The media type of a structured-mode CloudEvent (the `Content-Type` of a webhook delivery
/// and of a NATS message's header).
pub const CONTENT_TYPE: &str = "application/cloudevents+json";
/// `datacontenttype` of every event: `data` is a JSON object.
pub const DATA_CONTENT_TYPE: &str = "application/json";
/// Every Berth event type starts with this (reverse-DNS, as the spec recommends).
pub const TYPE_PREFIX: &str = "dev.berth.";
/// The type of the event saying a webhook was disabled after a run of failed deliveries.
pub const WEBHOOK_DISABLED: &str = "dev.berth.webhook.disabled";
/// The type of the event saying a sandbox's settings changed (`PATCH`, renew) without a
/// state change: `from` and `to` are both its state, `message` names what changed.
pub const SANDBOX_UPDATED: &str = "dev.berth.sandbox.updated";
/// [`SANDBOX_UPDATED`] as the `events.type` column spells it.
pub const SANDBOX_UPDATED_ROW: &str = "sandbox.updated";
/// The `events.type` spellings of a snapshot's events (issue 13 item 3): requested, durable,
/// failed. Their CloudEvent types are `dev.berth.` + these; `data.snapshot_id` names the
/// snapshot, `from` and `to` are both its sandbox's state (a snapshot does not move it).
pub const SNAPSHOT_EVENT_ROWS: [&str; 3] =
    ["snapshot.created", "snapshot.ready", "snapshot.failed"];

/// One CloudEvent with typed `data`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CloudEvent<T> {
    /// Always [`SPEC_VERSION`] (`"1.0"`).
    pub specversion: String,
    /// The `events` row's id (UUIDv7); the same on NATS, SSE and webhooks, so consumers dedupe by it.
    pub id: EventId,
    /// `/berth/orgs/<org_id>`: the org the event belongs to.
    pub source: String,
    /// `dev.berth.sandbox.<state>`, [`SANDBOX_UPDATED`] or [`WEBHOOK_DISABLED`].
    #[serde(rename = "type")]
    pub kind: String,
    /// `sandboxes/<sandbox_id>` or `webhooks/<webhook_id>`.
    pub subject: String,
    /// When the event happened (the row's `at`, database clock), RFC 3339.
    pub time: DateTime<Utc>,
    /// Always [`DATA_CONTENT_TYPE`] (`application/json`).
    pub datacontenttype: String,
    /// The event's payload: [`SandboxEventData`] or [`WebhookDisabledData`].
    pub data: T,
}

/// `data` of a sandbox lifecycle event: one row of `events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxEventData {
    /// The sandbox whose state changed (`events.sandbox_id`).
    pub sandbox_id: SandboxId,
    /// The org that owns the sandbox (`events.org_id`).
    pub org_id: OrgId,
    /// The state before; `null` for the first event of a sandbox.
    pub from: Option<SandboxState>,
    /// The state entered; also the last segment of the event's `type`.
    pub to: SandboxState,
    /// Why: `user_request`, `host_report`, `timeout`, `runtime_error`, …
    pub reason: String,
    /// The sandbox generation the change was written at.
    pub generation: Generation,
    /// The host command the change queued or completed, if any.
    pub command_id: Option<CommandId>,
    /// Detail, e.g. why a boot failed.
    pub message: Option<String>,
    /// On a stop's event: how it kept the sandbox (`memory`, `disk`); absent on other events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stop: Option<String>,
    /// On a stop's event that wanted memory and kept the disk only: what failed
    /// (`checkpoint_failed`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stop_code: Option<String>,
    /// With `last_stop_code`: the runtime's error (bounded, one line); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stop_reason: Option<String>,
    /// On a snapshot's event: the snapshot; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<crate::ids::SnapshotId>,
}

/// `data` of [`WEBHOOK_DISABLED`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookDisabledData {
    /// The webhook that was disabled.
    pub webhook_id: WebhookId,
    /// The org that owns the webhook.
    pub org_id: OrgId,
    /// The webhook's target URL, as registered.
    pub url: String,
    /// How many attempts in a row failed.
    pub consecutive_failures: i32,
    /// Why it was disabled (`webhooks.disabled_reason`): the failure count and the last error.
    pub reason: String,
}

/// The CloudEvent type of a sandbox entering `to`: `dev.berth.sandbox.<to>`.
pub fn sandbox_event_type(to: SandboxState) -> String {
    format!("{TYPE_PREFIX}sandbox.{}", to.as_str())
}

/// Normalizes an event type a client names: `dev.berth.sandbox.running` as is, the short
/// form `sandbox.running` (the `type` of the events listing) gets the prefix. `None` when it
/// names no event Berth emits.
pub fn normalize_type(raw: &str) -> Option<String> {
    let full = if raw.starts_with(TYPE_PREFIX) {
        raw.to_owned()
    } else {
        format!("{TYPE_PREFIX}{raw}")
    };
    let known = full == WEBHOOK_DISABLED
        || full == SANDBOX_UPDATED
        || SNAPSHOT_EVENT_ROWS
            .iter()
            .any(|r| full.strip_prefix(TYPE_PREFIX) == Some(*r))
        || full
            .strip_prefix("dev.berth.sandbox.")
            .and_then(|s| s.parse::<SandboxState>().ok())
            .is_some_and(SandboxState::is_written);
    known.then_some(full)
}

fn org_source(org: OrgId) -> String {
    format!("/berth/orgs/{org}")
}

impl CloudEvent<SandboxEventData> {
    /// The CloudEvent of one sandbox state change.
    pub fn sandbox(id: EventId, time: DateTime<Utc>, data: SandboxEventData) -> Self {
        let kind = sandbox_event_type(data.to);
        Self::sandbox_of_kind(id, time, kind, data)
    }

    /// The CloudEvent of a change of a sandbox's settings ([`SANDBOX_UPDATED`]).
    pub fn sandbox_updated(id: EventId, time: DateTime<Utc>, data: SandboxEventData) -> Self {
        Self::sandbox_of_kind(id, time, SANDBOX_UPDATED.to_owned(), data)
    }

    /// The CloudEvent of a snapshot's event: `kind_row` is one of [`SNAPSHOT_EVENT_ROWS`].
    pub fn snapshot(
        id: EventId,
        time: DateTime<Utc>,
        kind_row: &str,
        data: SandboxEventData,
    ) -> Self {
        Self::sandbox_of_kind(id, time, format!("{TYPE_PREFIX}{kind_row}"), data)
    }

    fn sandbox_of_kind(
        id: EventId,
        time: DateTime<Utc>,
        kind: String,
        data: SandboxEventData,
    ) -> Self {
        Self {
            specversion: SPEC_VERSION.to_owned(),
            id,
            source: org_source(data.org_id),
            kind,
            subject: format!("sandboxes/{}", data.sandbox_id),
            time,
            datacontenttype: DATA_CONTENT_TYPE.to_owned(),
            data,
        }
    }
}

impl CloudEvent<WebhookDisabledData> {
    /// The event saying a webhook was disabled.
    pub fn webhook_disabled(id: EventId, time: DateTime<Utc>, data: WebhookDisabledData) -> Self {
        Self {
            specversion: SPEC_VERSION.to_owned(),
            id,
            source: org_source(data.org_id),
            kind: WEBHOOK_DISABLED.to_owned(),
            subject: format!("webhooks/{}", data.webhook_id),
            time,
            datacontenttype: DATA_CONTENT_TYPE.to_owned(),
            data,
        }
    }
}

impl<T: Serialize> CloudEvent<T> {
    /// The structured-mode JSON document.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a CloudEvent of plain fields always serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn sample() -> CloudEvent<SandboxEventData> {
        CloudEvent::sandbox(
            EventId(Uuid::from_u128(1)),
            DateTime::parse_from_rfc3339("2025-01-02T03:04:05.678Z")
                .unwrap()
                .with_timezone(&Utc),
            SandboxEventData {
                sandbox_id: SandboxId(Uuid::from_u128(2)),
                org_id: OrgId(Uuid::from_u128(3)),
                from: Some(SandboxState::Provisioning),
                to: SandboxState::Running,
                reason: "host_report".to_owned(),
                generation: Generation(1),
                command_id: Some(CommandId(Uuid::from_u128(4))),
                message: None,
                last_stop: None,
                last_stop_code: None,
                last_stop_reason: None,
                snapshot_id: None,
            },
        )
    }

    #[test]
    fn a_sandbox_event_renders_as_a_structured_cloudevent() {
        let json: serde_json::Value = serde_json::from_str(&sample().to_json()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "specversion": "1.0",
                "id": "00000000-0000-0000-0000-000000000001",
                "source": "/berth/orgs/00000000-0000-0000-0000-000000000003",
                "type": "dev.berth.sandbox.running",
                "subject": "sandboxes/00000000-0000-0000-0000-000000000002",
                "time": "2025-01-02T03:04:05.678Z",
                "datacontenttype": "application/json",
                "data": {
                    "sandbox_id": "00000000-0000-0000-0000-000000000002",
                    "org_id": "00000000-0000-0000-0000-000000000003",
                    "from": "provisioning",
                    "to": "running",
                    "reason": "host_report",
                    "generation": 1,
                    "command_id": "00000000-0000-0000-0000-000000000004",
                    "message": null
                }
            })
        );
    }

    #[test]
    fn a_stop_that_kept_the_disk_only_carries_its_mode_code_and_reason_in_data() {
        let mut event = sample();
        event.data.from = Some(SandboxState::Stopping);
        event.data.to = SandboxState::Stopped;
        event.data.last_stop = Some("disk".into());
        event.data.last_stop_code = Some("checkpoint_failed".into());
        event.data.last_stop_reason = Some("Checkpoint failed: EOF".into());
        let json: serde_json::Value = serde_json::from_str(&event.to_json()).unwrap();
        assert_eq!(json["data"]["last_stop"], "disk");
        assert_eq!(json["data"]["last_stop_code"], "checkpoint_failed");
        assert_eq!(json["data"]["last_stop_reason"], "Checkpoint failed: EOF");
        let back: CloudEvent<SandboxEventData> = serde_json::from_value(json).unwrap();
        assert_eq!(back.data, event.data);
    }

    #[test]
    fn rendering_the_same_event_twice_gives_the_same_bytes() {
        assert_eq!(sample().to_json(), sample().to_json());
    }

    #[test]
    fn event_types_are_normalized_and_unknown_ones_refused() {
        assert_eq!(
            normalize_type("sandbox.running").as_deref(),
            Some("dev.berth.sandbox.running")
        );
        assert_eq!(
            normalize_type("dev.berth.sandbox.failed-start").as_deref(),
            Some("dev.berth.sandbox.failed-start")
        );
        assert_eq!(
            normalize_type("dev.berth.webhook.disabled").as_deref(),
            Some(WEBHOOK_DISABLED)
        );
        assert_eq!(
            normalize_type("sandbox.updated").as_deref(),
            Some(SANDBOX_UPDATED)
        );
        for bad in ["sandbox.lost", "sandbox.nope", "running", "", "dev.berth."] {
            assert_eq!(normalize_type(bad), None, "{bad:?}");
        }
    }
}
