//! Bodies of the settings routes — `PATCH /v1/sandboxes/{id}` and
//! `POST /v1/sandboxes/{id}/renew` — and their validation, plus the expiry fields a create
//! shares with them.
//!
//! A PATCH names only what it changes: an absent field stays, a `null` clears a setting
//! (`auto_stop_minutes`, `auto_delete_minutes`, `expires_at`) or, inside `metadata`, deletes
//! that key (a merge, as JSON Merge Patch, RFC 7396, does for one level). Source: issue 15
//! item 3; E2B's `set_timeout` and OpenSandbox's `renew-expiration` for item 4.

use berth_schemas::state::ExpiryAction;
use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Deserializer};
use utoipa::ToSchema;

use super::{
    check_metadata_entry, too_many_keys, MAX_AUTO_ARCHIVE_DAYS, MAX_AUTO_DELETE_MINUTES,
    MAX_AUTO_STOP_MINUTES, MAX_METADATA_KEYS,
};
use crate::error::ApiError;
use crate::service::ServiceError;

/// The farthest ahead an expiry may be set: a year, in seconds.
pub const MAX_EXPIRY_SECONDS: i64 = 365 * 24 * 3600;

/// A field that may be absent (`None`), `null` (`Some(None)`) or a value.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// `PATCH /v1/sandboxes/{id}` body. Unknown fields are refused; at least nothing is required
/// (an empty body changes nothing).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchSandbox {
    /// Merged into the sandbox's metadata: a string sets that key, `null` deletes it. The
    /// result holds at most 64 keys, each key and value at most 256 bytes.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<Object>, example = json!({"team": "ml", "stale": null}))]
    pub metadata: Option<Option<serde_json::Map<String, serde_json::Value>>>,
    /// Stop after this many minutes without activity, counted from now (1 to 10080); `null`
    /// turns auto-stop off.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>, nullable)]
    pub auto_stop_minutes: Option<Option<i64>>,
    /// Delete after this many minutes stopped, counted from now (1 to 525600); `null` turns
    /// auto-delete off.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>, nullable)]
    pub auto_delete_minutes: Option<Option<i64>>,
    /// Archive after this many days stopped, counted from now (1 to 3650); `null` turns
    /// auto-archive off.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>, nullable)]
    pub auto_archive_days: Option<Option<i64>>,
    /// Back up every this many minutes while running (1 to 525600); `null` turns periodic
    /// backups off.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>, nullable)]
    pub backup_interval_min: Option<Option<i64>>,
    /// When the reconciler applies `on_expiry` (RFC 3339, in the future, at most a year
    /// ahead); `null` removes the expiry.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>, format = DateTime, nullable)]
    pub expires_at: Option<Option<String>>,
    /// What the expiry does: `stop` or `delete` (`null` is refused: it has no "unset").
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>)]
    pub on_expiry: Option<Option<String>>,
    /// Whether a preview request starts the sandbox while it is stopped (`null` is refused).
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<bool>)]
    pub auto_resume: Option<Option<bool>>,
    /// The whole new list of public preview ports (1 to 65535, at most 16; repeats count
    /// once); `[]` makes every port private again (`null` is refused: say `[]`).
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<Vec<u16>>)]
    pub public_ports: Option<Option<Vec<u16>>>,
}

/// `Some(value)` of a setting that has no "unset": a JSON `null` for it is a 400 naming it,
/// instead of being taken for "leave it" (a client that meant "clear" would think it worked).
fn not_null<T>(field: &'static str, value: Option<Option<T>>) -> Result<Option<T>, ApiError> {
    match value {
        None => Ok(None),
        Some(Some(v)) => Ok(Some(v)),
        Some(None) => Err(ApiError::invalid(
            field,
            format!("{field} cannot be null: give a value (leave it out to keep it)"),
        )),
    }
}

/// A validated PATCH: `None` leaves a setting, `Some(None)` clears it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ValidPatch {
    /// Keys to set (`Some(value)`) or delete (`None`).
    pub metadata: Option<Vec<(String, Option<String>)>>,
    /// New `auto_stop_minutes`.
    pub auto_stop_minutes: Option<Option<i32>>,
    /// New `auto_delete_minutes`.
    pub auto_delete_minutes: Option<Option<i32>>,
    /// New `auto_archive_days`.
    pub auto_archive_days: Option<Option<i32>>,
    /// New `backup_interval_min`.
    pub backup_interval_min: Option<Option<i32>>,
    /// New `expires_at`.
    pub expires_at: Option<Option<DateTime<Utc>>>,
    /// New `on_expiry`.
    pub on_expiry: Option<ExpiryAction>,
    /// New `auto_resume`.
    pub auto_resume: Option<bool>,
    /// New `public_ports`, sorted and without repeats.
    pub public_ports: Option<Vec<u16>>,
}

impl ValidPatch {
    /// The fields it changes, comma-separated in body order (the event's `message`); empty
    /// when it changes nothing.
    pub fn changed(&self) -> String {
        [
            ("metadata", self.metadata.is_some()),
            ("auto_stop_minutes", self.auto_stop_minutes.is_some()),
            ("auto_delete_minutes", self.auto_delete_minutes.is_some()),
            ("auto_archive_days", self.auto_archive_days.is_some()),
            ("backup_interval_min", self.backup_interval_min.is_some()),
            ("expires_at", self.expires_at.is_some()),
            ("on_expiry", self.on_expiry.is_some()),
            ("auto_resume", self.auto_resume.is_some()),
            ("public_ports", self.public_ports.is_some()),
        ]
        .into_iter()
        .filter(|(_, changed)| *changed)
        .map(|(name, _)| name)
        .collect::<Vec<_>>()
        .join(", ")
    }

    /// `current` metadata with this patch merged in.
    ///
    /// Errors: [`ServiceError::InvalidRequest`] naming `metadata` when the result holds more
    /// than [`MAX_METADATA_KEYS`].
    pub fn merge_metadata(
        &self,
        current: &serde_json::Value,
    ) -> Result<Option<serde_json::Value>, ServiceError> {
        let Some(patch) = &self.metadata else {
            return Ok(None);
        };
        let mut merged = current.as_object().cloned().unwrap_or_default();
        for (k, v) in patch {
            match v {
                Some(v) => merged.insert(k.clone(), serde_json::Value::String(v.clone())),
                None => merged.remove(k),
            };
        }
        if merged.len() > MAX_METADATA_KEYS {
            return Err(ServiceError::InvalidRequest {
                field: "metadata",
                message: format!(
                    "metadata would hold {} keys; at most {MAX_METADATA_KEYS}",
                    merged.len()
                ),
            });
        }
        Ok(Some(serde_json::Value::Object(merged)))
    }
}

fn patch_minutes(
    field: &str,
    value: Option<Option<i64>>,
    max: u32,
) -> Result<Option<Option<i32>>, ApiError> {
    match value {
        None => Ok(None),
        Some(None) => Ok(Some(None)),
        Some(Some(m)) if (1..=i64::from(max)).contains(&m) => {
            Ok(Some(Some(i32::try_from(m).expect("bounded by max"))))
        }
        Some(Some(m)) => Err(ApiError::invalid(
            field,
            format!("{field} must be between 1 and {max} (or null to turn it off), got {m}"),
        )),
    }
}

impl PatchSandbox {
    /// Checks every field against `now`.
    ///
    /// Errors: [`ApiError::InvalidRequest`] naming the field: `metadata` that is `null`, not
    /// string-or-null valued, or too large; minutes out of range (negative, 0, too many);
    /// an `expires_at` that does not parse, is not in the future or is more than a year
    /// ahead; an unknown `on_expiry`; `public_ports` holding 0 or more than 16 ports.
    pub fn validate(self, now: DateTime<Utc>) -> Result<ValidPatch, ApiError> {
        let metadata = match self.metadata {
            None => None,
            Some(None) => {
                return Err(ApiError::invalid(
                    "metadata",
                    "metadata must be an object; a null value inside it deletes that key",
                ))
            }
            Some(Some(map)) => {
                if map.len() > MAX_METADATA_KEYS {
                    return Err(too_many_keys());
                }
                let mut pairs = Vec::with_capacity(map.len());
                for (k, v) in map {
                    let value = (!v.is_null()).then_some(&v);
                    check_metadata_entry(&k, value)?;
                    pairs.push((k, v.as_str().map(str::to_owned)));
                }
                Some(pairs)
            }
        };
        Ok(ValidPatch {
            metadata,
            auto_stop_minutes: patch_minutes(
                "auto_stop_minutes",
                self.auto_stop_minutes,
                MAX_AUTO_STOP_MINUTES,
            )?,
            auto_delete_minutes: patch_minutes(
                "auto_delete_minutes",
                self.auto_delete_minutes,
                MAX_AUTO_DELETE_MINUTES,
            )?,
            auto_archive_days: patch_minutes(
                "auto_archive_days",
                self.auto_archive_days,
                MAX_AUTO_ARCHIVE_DAYS,
            )?,
            backup_interval_min: patch_minutes(
                "backup_interval_min",
                self.backup_interval_min,
                super::MAX_BACKUP_INTERVAL_MIN,
            )?,
            expires_at: match self.expires_at {
                None => None,
                Some(None) => Some(None),
                Some(Some(at)) => Some(Some(expiry_at("expires_at", &at, now)?)),
            },
            on_expiry: not_null("on_expiry", self.on_expiry)?
                .as_deref()
                .map(on_expiry)
                .transpose()?,
            auto_resume: not_null("auto_resume", self.auto_resume)?,
            public_ports: not_null("public_ports", self.public_ports)?
                .map(super::valid_public_ports)
                .transpose()?,
        })
    }
}

/// `POST /v1/sandboxes/{id}/renew` body: exactly one of the two.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewSandbox {
    /// The new expiry (RFC 3339, in the future, at most a year ahead).
    #[schema(value_type = Option<String>, format = DateTime)]
    pub expires_at: Option<String>,
    /// Seconds to add to the current expiry, or to now when it has none or it passed
    /// (1 to 31536000; the result at most a year ahead).
    pub extend_seconds: Option<i64>,
}

/// A validated renew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// Expire at this instant.
    Until(DateTime<Utc>),
    /// Expire this much later than the current expiry (or now, whichever is later).
    Extend(Duration),
}

impl Renewal {
    /// The expiry it sets, given the sandbox's `current` one and `now`.
    ///
    /// Errors: [`ServiceError::InvalidRequest`] naming `extend_seconds` when the result is
    /// more than a year ahead.
    pub fn resolve(
        self,
        current: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<DateTime<Utc>, ServiceError> {
        match self {
            Renewal::Until(at) => Ok(at),
            Renewal::Extend(by) => {
                let at = current.map_or(now, |c| c.max(now)) + by;
                if at > now + Duration::seconds(MAX_EXPIRY_SECONDS) {
                    return Err(ServiceError::InvalidRequest {
                        field: "extend_seconds",
                        message: format!(
                            "an expiry is at most {MAX_EXPIRY_SECONDS} s ahead; {at} is further"
                        ),
                    });
                }
                Ok(at)
            }
        }
    }
}

impl RenewSandbox {
    /// Checks the body against `now`.
    ///
    /// Errors: 400 naming the field: neither or both given, an `expires_at` that does not
    /// parse, is not in the future or is more than a year ahead, `extend_seconds` out of
    /// range.
    pub fn validate(self, now: DateTime<Utc>) -> Result<Renewal, ApiError> {
        match (self.expires_at, self.extend_seconds) {
            (Some(at), None) => Ok(Renewal::Until(expiry_at("expires_at", &at, now)?)),
            (None, Some(secs)) => {
                if !(1..=MAX_EXPIRY_SECONDS).contains(&secs) {
                    return Err(ApiError::invalid(
                        "extend_seconds",
                        format!(
                            "extend_seconds must be between 1 and {MAX_EXPIRY_SECONDS}, got {secs}"
                        ),
                    ));
                }
                Ok(Renewal::Extend(Duration::seconds(secs)))
            }
            _ => Err(ApiError::invalid(
                "expires_at",
                "give exactly one of expires_at and extend_seconds",
            )),
        }
    }
}

/// Parses an RFC 3339 expiry that must lie after `now` and at most [`MAX_EXPIRY_SECONDS`]
/// ahead.
///
/// Errors: 400 naming `field`.
pub fn expiry_at(field: &str, raw: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, ApiError> {
    let at = DateTime::parse_from_rfc3339(raw)
        .map_err(|e| ApiError::invalid(field, format!("{field} must be an RFC 3339 time: {e}")))?
        .with_timezone(&Utc);
    if at <= now {
        return Err(ApiError::invalid(
            field,
            format!("{field} {at} is not in the future"),
        ));
    }
    if at > now + Duration::seconds(MAX_EXPIRY_SECONDS) {
        return Err(ApiError::invalid(
            field,
            format!("{field} is at most {MAX_EXPIRY_SECONDS} s ahead"),
        ));
    }
    Ok(at)
}

/// `now` + `secs` for a `timeout_seconds` of 1 to [`MAX_EXPIRY_SECONDS`].
///
/// Errors: 400 naming `field`.
pub fn expiry_in(field: &str, secs: i64, now: DateTime<Utc>) -> Result<DateTime<Utc>, ApiError> {
    if !(1..=MAX_EXPIRY_SECONDS).contains(&secs) {
        return Err(ApiError::invalid(
            field,
            format!("{field} must be between 1 and {MAX_EXPIRY_SECONDS}, got {secs}"),
        ));
    }
    Ok(now + Duration::seconds(secs))
}

/// Parses `on_expiry`.
///
/// Errors: 400 naming `on_expiry` unless it is `stop` or `delete`.
pub fn on_expiry(raw: &str) -> Result<ExpiryAction, ApiError> {
    raw.parse().map_err(|_| {
        ApiError::invalid(
            "on_expiry",
            format!("on_expiry must be \"stop\" or \"delete\", got {raw:?}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidRequest { field, .. } => field,
            other => panic!("expected invalid_request, got {other:?}"),
        }
    }

    fn patch(json: serde_json::Value) -> Result<ValidPatch, ApiError> {
        serde_json::from_value::<PatchSandbox>(json)
            .expect("the body deserializes")
            .validate(Utc::now())
    }

    #[test]
    fn absent_null_and_values_are_told_apart() {
        let p = patch(serde_json::json!({"auto_stop_minutes": null, "auto_delete_minutes": 5}))
            .unwrap();
        assert_eq!(p.auto_stop_minutes, Some(None));
        assert_eq!(p.auto_delete_minutes, Some(Some(5)));
        assert_eq!(p.expires_at, None);
        assert_eq!(p.changed(), "auto_stop_minutes, auto_delete_minutes");
        assert_eq!(patch(serde_json::json!({})).unwrap(), ValidPatch::default());
        assert_eq!(ValidPatch::default().changed(), "");
    }

    #[test]
    fn preview_settings_are_patched_sorted_and_named_in_the_change() {
        let p = patch(serde_json::json!({"auto_resume": false, "public_ports": [8080, 80, 80]}))
            .unwrap();
        assert_eq!(p.auto_resume, Some(false));
        assert_eq!(p.public_ports, Some(vec![80, 8080]));
        assert_eq!(p.changed(), "auto_resume, public_ports");
        let cleared = patch(serde_json::json!({"public_ports": []})).unwrap();
        assert_eq!(cleared.public_ports, Some(vec![]));
        assert!(
            serde_json::from_value::<PatchSandbox>(serde_json::json!({"auto_resume": "no"}))
                .is_err()
        );
    }

    #[test]
    fn unknown_fields_are_refused() {
        assert!(serde_json::from_value::<PatchSandbox>(serde_json::json!({"vcpus": 2})).is_err());
        assert!(serde_json::from_value::<RenewSandbox>(serde_json::json!({"seconds": 2})).is_err());
    }

    #[test]
    fn bad_values_name_their_field() {
        let past = (Utc::now() - Duration::seconds(5)).to_rfc3339();
        let far = (Utc::now() + Duration::days(400)).to_rfc3339();
        for (body, field) in [
            (
                serde_json::json!({"auto_stop_minutes": -1}),
                "auto_stop_minutes",
            ),
            (
                serde_json::json!({"auto_stop_minutes": 0}),
                "auto_stop_minutes",
            ),
            (
                serde_json::json!({"auto_stop_minutes": 10081}),
                "auto_stop_minutes",
            ),
            (
                serde_json::json!({"auto_delete_minutes": -5}),
                "auto_delete_minutes",
            ),
            (serde_json::json!({"expires_at": past}), "expires_at"),
            (serde_json::json!({"expires_at": far}), "expires_at"),
            (serde_json::json!({"expires_at": "tomorrow"}), "expires_at"),
            (serde_json::json!({"on_expiry": "pause"}), "on_expiry"),
            (serde_json::json!({"on_expiry": null}), "on_expiry"),
            (serde_json::json!({"auto_resume": null}), "auto_resume"),
            (serde_json::json!({"public_ports": null}), "public_ports"),
            (serde_json::json!({"public_ports": [0]}), "public_ports"),
            (
                serde_json::json!({"public_ports": (1..=17).collect::<Vec<u16>>()}),
                "public_ports",
            ),
            (serde_json::json!({"metadata": null}), "metadata"),
            (serde_json::json!({"metadata": {"n": 1}}), "metadata"),
            (serde_json::json!({"metadata": {"": "x"}}), "metadata"),
            (
                serde_json::json!({"metadata": {"k": "x".repeat(257)}}),
                "metadata",
            ),
        ] {
            assert_eq!(
                field_of(patch(body.clone()).unwrap_err()).as_deref(),
                Some(field),
                "{body}"
            );
        }
    }

    #[test]
    fn metadata_merges_and_null_deletes_within_the_key_bound() {
        let p = patch(serde_json::json!({"metadata": {"a": "2", "b": null, "c": "3"}})).unwrap();
        let merged = p
            .merge_metadata(&serde_json::json!({"a": "1", "b": "x", "keep": "y"}))
            .unwrap()
            .unwrap();
        assert_eq!(merged, serde_json::json!({"a": "2", "c": "3", "keep": "y"}));

        let full: serde_json::Map<_, _> = (0..MAX_METADATA_KEYS)
            .map(|i| (format!("k{i}"), serde_json::json!("v")))
            .collect();
        let one_more = patch(serde_json::json!({"metadata": {"extra": "v"}})).unwrap();
        assert_eq!(
            field_of(
                one_more
                    .merge_metadata(&serde_json::Value::Object(full.clone()))
                    .unwrap_err()
                    .into()
            )
            .as_deref(),
            Some("metadata")
        );
        let swap = patch(serde_json::json!({"metadata": {"extra": "v", "k0": null}})).unwrap();
        assert_eq!(
            swap.merge_metadata(&serde_json::Value::Object(full))
                .unwrap()
                .unwrap()
                .as_object()
                .unwrap()
                .len(),
            MAX_METADATA_KEYS
        );
    }

    #[test]
    fn a_renew_takes_exactly_one_field_and_extends_from_the_later_of_now_and_the_expiry() {
        let now = Utc::now();
        let renew = |json| {
            serde_json::from_value::<RenewSandbox>(json)
                .unwrap()
                .validate(now)
        };
        assert!(renew(serde_json::json!({})).is_err());
        let both = serde_json::json!({"expires_at": (now + Duration::hours(1)).to_rfc3339(), "extend_seconds": 5});
        assert!(renew(both).is_err());
        for bad in [0, -3, MAX_EXPIRY_SECONDS + 1] {
            assert_eq!(
                field_of(renew(serde_json::json!({"extend_seconds": bad})).unwrap_err()).as_deref(),
                Some("extend_seconds")
            );
        }
        let extend = renew(serde_json::json!({"extend_seconds": 60})).unwrap();
        let later = now + Duration::hours(2);
        assert_eq!(
            extend.resolve(Some(later), now).unwrap(),
            later + Duration::seconds(60)
        );
        let passed = now - Duration::hours(2);
        assert_eq!(
            extend.resolve(Some(passed), now).unwrap(),
            now + Duration::seconds(60)
        );
        assert_eq!(
            extend.resolve(None, now).unwrap(),
            now + Duration::seconds(60)
        );
        let year = renew(serde_json::json!({"extend_seconds": MAX_EXPIRY_SECONDS})).unwrap();
        assert!(year.resolve(Some(now + Duration::days(1)), now).is_err());
    }
}
