//! The OpenSandbox bodies (camelCase, as the SDK's generated client reads and writes them),
//! their validation into Berth's create, and how a Berth sandbox is shown to the SDK: its
//! state as OpenSandbox's open enum, timestamps in RFC 3339 UTC, optional fields omitted.

use std::collections::BTreeMap;

use berth_schemas::state::ExpiryAction;
use berth_schemas::wire::Resources;
use berth_schemas::SandboxState;
use berth_store::SandboxRow;
use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};

use super::CompatError;
use crate::model::{
    check_metadata_entry, valid_env_and_entrypoint, DiskLimits, ValidCreate, MAX_MEMORY_MIB,
    MAX_METADATA_KEYS, MAX_VCPUS, MIN_MEMORY_MIB,
};

/// The shortest `timeout` OpenSandbox accepts, in seconds.
pub const MIN_TIMEOUT_SECONDS: i64 = 60;
/// Memory when `resourceLimits` names none, in MiB (Berth's default, not the SDK's 2 GiB: the
/// SDK always sends its own).
pub const DEFAULT_MEMORY_MIB: u32 = crate::model::DEFAULT_MEMORY_MIB;

/// `POST /v1/sandboxes`: by `image` or by `templateId`. Every field the SDK may send is
/// listed; those Berth cannot honour are refused when set ([`CreateBody::validate`]), and an
/// unknown field is refused too.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CreateBody {
    /// `{"uri": …, "auth"?: …}`: a Berth template's name, or an OCI image reference pulled
    /// into a template on first use (`compat::image`); `auth` is refused.
    pub image: Option<ImageSpec>,
    /// A Berth template's name.
    pub template_id: Option<String>,
    /// Seconds until the sandbox is deleted, at least 60; `null`: never.
    pub timeout: Option<i64>,
    /// `{"cpu": "1" | "500m", "memory": "2Gi" | "512Mi" | …}`; other keys are refused.
    pub resource_limits: Option<BTreeMap<String, String>>,
    /// Started in the background at each boot from disk.
    pub entrypoint: Option<Vec<String>>,
    /// Set for every command and the entrypoint.
    pub env: Option<BTreeMap<String, String>>,
    /// String pairs, filterable by the list.
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// Must be `false`: endpoints are always authorised (by the execd token).
    pub secure_access: Option<bool>,
    /// Refused when set (Berth's network policies are its own API's).
    pub network_policy: Option<serde_json::Value>,
    /// Refused when not empty.
    pub extensions: Option<serde_json::Map<String, serde_json::Value>>,
    /// Refused when not empty.
    pub volumes: Option<Vec<serde_json::Value>>,
    /// Refused when set.
    pub platform: Option<serde_json::Value>,
    /// Refused when set.
    pub snapshot_id: Option<String>,
    /// Refused when set.
    pub credential_proxy: Option<serde_json::Value>,
    /// Refused when set.
    pub resource_requests: Option<serde_json::Value>,
    /// Refused when set.
    pub lifecycle: Option<serde_json::Value>,
}

/// `image` of a create.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageSpec {
    /// A Berth template's name (`base`, `python`, …) or an OCI image reference
    /// (`registry/repo:tag`).
    pub uri: String,
    /// Registry credentials: refused.
    pub auth: Option<serde_json::Value>,
}

/// A create, validated: Berth's create and what the SDK is shown back.
#[derive(Debug, Clone)]
pub struct ValidCompatCreate {
    /// What Berth creates.
    pub create: ValidCreate,
    /// Whether it came by `image` (its template is resolved by `compat::image::template_for`).
    pub by_image: bool,
}

fn refuse_set(field: &str, set: bool) -> Result<(), CompatError> {
    if set {
        Err(CompatError::invalid(
            field,
            "is not supported by Berth; leave it unset",
        ))
    } else {
        Ok(())
    }
}

impl CreateBody {
    /// Checks every field and builds Berth's create (`on_expiry: delete`, as an OpenSandbox
    /// timeout terminates the sandbox).
    ///
    /// Errors: 400 `invalid_request` naming the field.
    pub fn validate(self, disk: DiskLimits) -> Result<ValidCompatCreate, CompatError> {
        refuse_set("secureAccess", self.secure_access == Some(true))?;
        refuse_set("networkPolicy", self.network_policy.is_some())?;
        refuse_set(
            "extensions",
            self.extensions.as_ref().is_some_and(|e| !e.is_empty()),
        )?;
        refuse_set(
            "volumes",
            self.volumes.as_ref().is_some_and(|v| !v.is_empty()),
        )?;
        refuse_set("platform", self.platform.is_some())?;
        refuse_set("snapshotId", self.snapshot_id.is_some())?;
        refuse_set("credentialProxy", self.credential_proxy.is_some())?;
        refuse_set("resourceRequests", self.resource_requests.is_some())?;
        refuse_set("lifecycle", self.lifecycle.is_some())?;
        let (template, image_uri) = match (self.image, self.template_id) {
            (Some(_), Some(_)) => {
                return Err(CompatError::invalid(
                    "image",
                    "give image or templateId, not both",
                ))
            }
            (None, None) => return Err(CompatError::invalid("image", "give image or templateId")),
            (Some(image), None) => {
                refuse_set("image.auth", image.auth.is_some())?;
                (image.uri.clone(), Some(image.uri))
            }
            (None, Some(template)) => (template, None),
        };
        let (field, max) = if image_uri.is_some() {
            ("image.uri", crate::templates::MAX_IMAGE_REF_LEN)
        } else {
            ("templateId", crate::templates::MAX_NAME_LEN)
        };
        if template.is_empty() || template.len() > max || template.contains('\0') {
            return Err(CompatError::invalid(
                field,
                format!("must be 1 to {max} characters"),
            ));
        }
        let expires_at = match self.timeout {
            None => None,
            Some(secs) if secs < MIN_TIMEOUT_SECONDS => {
                return Err(CompatError::invalid(
                    "timeout",
                    format!("must be at least {MIN_TIMEOUT_SECONDS} seconds, got {secs}"),
                ))
            }
            Some(secs) => Some(
                crate::model::settings::expiry_in("timeout", secs, Utc::now())
                    .map_err(CompatError::from)?,
            ),
        };
        let resources = resources(self.resource_limits.unwrap_or_default())?;
        let metadata = self.metadata.unwrap_or_default();
        if metadata.len() > MAX_METADATA_KEYS {
            return Err(crate::model::too_many_keys().into());
        }
        for (k, v) in &metadata {
            check_metadata_entry(k, Some(v))?;
        }
        let (env, entrypoint) = valid_env_and_entrypoint(
            self.env.unwrap_or_default(),
            self.entrypoint.unwrap_or_default(),
        )?;
        Ok(ValidCompatCreate {
            by_image: image_uri.is_some(),
            create: ValidCreate {
                template,
                resources,
                metadata: serde_json::Value::Object(metadata),
                auto_stop_minutes: None,
                auto_delete_minutes: None,
                auto_archive_days: None,
                backup_interval_min: None,
                disk_mib: disk.default_mib(),
                network: Default::default(),
                auto_resume: true,
                public_ports: Vec::new(),
                expires_at,
                on_expiry: ExpiryAction::Delete,
                env,
                entrypoint,
                image_uri,
            },
        })
    }
}

/// `resourceLimits` as Berth's whole vCPUs and MiB: `cpu` in cores (`"2"`, `"1.5"`) or
/// millicores (`"500m"`), rounded up to whole vCPUs; `memory` in bytes with an optional
/// binary (`Ki`, `Mi`, `Gi`, `Ti`) or decimal (`k`, `M`, `G`, `T`) suffix, rounded up to MiB.
///
/// Errors: 400 naming `resourceLimits.<key>` for an unknown key, a value that does not parse,
/// or one out of Berth's bounds.
pub fn resources(limits: BTreeMap<String, String>) -> Result<Resources, CompatError> {
    let mut vcpus = crate::model::DEFAULT_VCPUS;
    let mut memory_mib = DEFAULT_MEMORY_MIB;
    for (key, value) in limits {
        match key.as_str() {
            "cpu" => {
                let millis = cpu_millis(&value).ok_or_else(|| {
                    CompatError::invalid(
                        "resourceLimits.cpu",
                        format!("{value:?} is not cores (\"2\") or millicores (\"500m\")"),
                    )
                })?;
                let whole = millis.div_ceil(1000);
                if !(1..=u64::from(MAX_VCPUS)).contains(&whole) {
                    return Err(CompatError::invalid(
                        "resourceLimits.cpu",
                        format!("must be more than 0 and at most {MAX_VCPUS} cores"),
                    ));
                }
                vcpus = whole as u32;
            }
            "memory" => {
                let bytes = memory_bytes(&value).ok_or_else(|| {
                    CompatError::invalid(
                        "resourceLimits.memory",
                        format!("{value:?} is not a quantity like \"512Mi\" or \"2Gi\""),
                    )
                })?;
                let mib = bytes.div_ceil(1 << 20);
                if !(u64::from(MIN_MEMORY_MIB)..=u64::from(MAX_MEMORY_MIB)).contains(&mib) {
                    return Err(CompatError::invalid(
                        "resourceLimits.memory",
                        format!("must be {MIN_MEMORY_MIB} MiB to {MAX_MEMORY_MIB} MiB"),
                    ));
                }
                memory_mib = mib as u32;
            }
            other => {
                return Err(CompatError::invalid(
                    &format!("resourceLimits.{other}"),
                    "Berth limits cpu and memory only",
                ))
            }
        }
    }
    Ok(Resources { vcpus, memory_mib })
}

/// `"2"`, `"1.5"`, `"500m"` as millicores.
fn cpu_millis(value: &str) -> Option<u64> {
    let value = value.trim();
    if let Some(m) = value.strip_suffix('m') {
        return m.parse::<u64>().ok();
    }
    let cores: f64 = value.parse().ok()?;
    (cores.is_finite() && (0.0..=1e6).contains(&cores)).then(|| (cores * 1000.0).ceil() as u64)
}

/// A Kubernetes-style quantity of bytes (`"2Gi"`, `"512Mi"`, `"1G"`, `"1048576"`).
fn memory_bytes(value: &str) -> Option<u64> {
    let value = value.trim();
    const SUFFIXES: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (number, unit) = SUFFIXES
        .iter()
        .find_map(|(s, unit)| value.strip_suffix(s).map(|n| (n, *unit)))
        .unwrap_or((value, 1));
    number.parse::<u64>().ok()?.checked_mul(unit)
}

/// OpenSandbox's state of a Berth sandbox (an open string enum in the SDK): provisioning →
/// `Pending`; starting, resuming, restoring, unarchiving, migrating → `Resuming`; running →
/// `Running`; stopping → `Pausing`, or `Stopping` when a delete was accepted; stopped,
/// archiving, archived → `Paused`; failed-start → `Failed`; deleted → `Terminated`.
pub fn state_of(state: SandboxState, deleting: bool) -> &'static str {
    use SandboxState as S;
    match state {
        S::Pending | S::Provisioning => "Pending",
        S::Starting | S::Resuming | S::Restoring | S::Unarchiving | S::Migrating => "Resuming",
        S::Running => "Running",
        S::Stopping if deleting => "Stopping",
        S::Stopping => "Pausing",
        S::Stopped | S::Archiving | S::Archived => "Paused",
        S::FailedStart | S::FailedProvision | S::Lost => "Failed",
        S::Deleted => "Terminated",
    }
}

/// The Berth states an OpenSandbox state filter covers (a superset: `Pausing` and `Stopping`
/// both cover `stopping`, told apart by [`state_of`] afterwards); `None` for a state
/// OpenSandbox does not have.
pub fn berth_states(state: &str) -> Option<Vec<SandboxState>> {
    let matching: Vec<SandboxState> = SandboxState::ALL
        .into_iter()
        .filter(|s| state_of(*s, false) == state || state_of(*s, true) == state)
        .collect();
    (!matching.is_empty()).then_some(matching)
}

/// RFC 3339 UTC with microseconds, as the SDK's `isoparse` reads it.
pub fn time(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// `status` of a sandbox: `reason` is Berth's own state, `message` the reason it is in it
/// (omitted when there is none).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// OpenSandbox's state ([`state_of`]).
    pub state: &'static str,
    /// Berth's state (`running`, `stopped`, …).
    pub reason: String,
    /// Why it is in its state, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When its state last changed.
    pub last_transition_at: String,
}

/// `image` of a sandbox shown back.
#[derive(Debug, Serialize)]
pub struct ImageShown {
    /// The image it was created from, or its template's name.
    pub uri: String,
}

/// A sandbox as the SDK reads it (`GET /v1/sandboxes/{id}`, list items, the create's 202).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxShown {
    /// The sandbox's id.
    pub id: String,
    /// The image (or template) it runs.
    pub image: ImageShown,
    /// Its state.
    pub status: Status,
    /// Its metadata (a JSON object of strings).
    pub metadata: serde_json::Value,
    /// Its entrypoint (`[]` when none).
    pub entrypoint: Vec<String>,
    /// When the create was accepted.
    pub created_at: String,
    /// When it is deleted unless renewed; omitted when never.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
}

impl From<&SandboxRow> for SandboxShown {
    fn from(row: &SandboxRow) -> Self {
        Self {
            id: row.id.to_string(),
            image: ImageShown {
                uri: row
                    .image_uri
                    .clone()
                    .unwrap_or_else(|| row.template.clone()),
            },
            status: Status {
                state: state_of(row.state, row.deleting()),
                reason: row.state.as_str().to_owned(),
                message: row.state_reason.clone(),
                last_transition_at: time(row.updated_at),
            },
            metadata: row.metadata.clone(),
            entrypoint: row.entrypoint.clone(),
            created_at: time(row.created_at),
            expires_at: row.expires_at.map(time),
        }
    }
}

/// `POST /v1/sandboxes/{id}/renew-expiration` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RenewBody {
    /// The new expiry (RFC 3339; Python's `isoformat()` with microseconds and `+00:00`).
    pub expires_at: String,
}

/// `GET /v1/sandboxes` pagination.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pagination {
    /// This page, from 1.
    pub page: u32,
    /// Items per page.
    pub page_size: u32,
    /// Matching sandboxes over every page.
    pub total_items: u64,
    /// Pages in all.
    pub total_pages: u64,
    /// Whether a next page has items.
    pub has_next_page: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_berth_state_has_an_opensandbox_state_and_deleting_tells_stopping_from_pausing() {
        for state in SandboxState::ALL {
            assert!(!state_of(state, false).is_empty());
        }
        assert_eq!(state_of(SandboxState::Provisioning, false), "Pending");
        assert_eq!(state_of(SandboxState::Starting, false), "Resuming");
        assert_eq!(state_of(SandboxState::Running, false), "Running");
        assert_eq!(state_of(SandboxState::Stopping, false), "Pausing");
        assert_eq!(state_of(SandboxState::Stopping, true), "Stopping");
        assert_eq!(state_of(SandboxState::Stopped, false), "Paused");
        assert_eq!(state_of(SandboxState::Archived, false), "Paused");
        assert_eq!(state_of(SandboxState::FailedStart, false), "Failed");
        assert_eq!(state_of(SandboxState::Deleted, true), "Terminated");
    }

    #[test]
    fn a_state_filter_covers_the_berth_states_that_show_as_it() {
        assert_eq!(
            berth_states("Running").unwrap(),
            vec![SandboxState::Running]
        );
        assert!(berth_states("Paused")
            .unwrap()
            .contains(&SandboxState::Stopped));
        assert_eq!(
            berth_states("Pausing").unwrap(),
            vec![SandboxState::Stopping]
        );
        assert_eq!(
            berth_states("Stopping").unwrap(),
            vec![SandboxState::Stopping]
        );
        assert_eq!(berth_states("Sleeping"), None);
        assert_eq!(berth_states("running"), None, "the enum is case-sensitive");
    }

    #[test]
    fn resource_limits_read_cores_millicores_and_binary_or_decimal_memory() {
        let r = |cpu: &str, mem: &str| {
            resources(BTreeMap::from([
                ("cpu".to_owned(), cpu.to_owned()),
                ("memory".to_owned(), mem.to_owned()),
            ]))
        };
        assert_eq!(
            r("1", "2Gi").unwrap(),
            Resources {
                vcpus: 1,
                memory_mib: 2048
            }
        );
        assert_eq!(
            r("500m", "512Mi").unwrap(),
            Resources {
                vcpus: 1,
                memory_mib: 512
            }
        );
        assert_eq!(r("1.5", "1G").unwrap().vcpus, 2);
        assert_eq!(r("1.5", "1G").unwrap().memory_mib, 954);
        for (cpu, mem) in [
            ("0", "512Mi"),
            ("33", "512Mi"),
            ("x", "512Mi"),
            ("1", "1Mi"),
            ("1", "lots"),
        ] {
            assert_eq!(r(cpu, mem).unwrap_err().status, 400, "{cpu} {mem}");
        }
        let gpu = resources(BTreeMap::from([("gpu".to_owned(), "1".to_owned())])).unwrap_err();
        assert!(
            gpu.message.contains("resourceLimits.gpu"),
            "{}",
            gpu.message
        );
    }

    #[test]
    fn fields_berth_cannot_honour_are_refused_by_name() {
        let base = || CreateBody {
            template_id: Some("base".into()),
            ..Default::default()
        };
        let refused = |body: CreateBody, field: &str| {
            let e = body.validate(DiskLimits::default()).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.starts_with(field), "{field}: {}", e.message);
        };
        refused(
            CreateBody {
                secure_access: Some(true),
                ..base()
            },
            "secureAccess",
        );
        refused(
            CreateBody {
                volumes: Some(vec![serde_json::json!({})]),
                ..base()
            },
            "volumes",
        );
        refused(
            CreateBody {
                timeout: Some(59),
                ..base()
            },
            "timeout",
        );
        refused(CreateBody::default(), "image");
        refused(
            CreateBody {
                image: Some(ImageSpec {
                    uri: "base".into(),
                    auth: Some(serde_json::json!({"username": "u"})),
                }),
                ..Default::default()
            },
            "image.auth",
        );
        let ok = CreateBody {
            timeout: Some(600),
            secure_access: Some(false),
            extensions: Some(Default::default()),
            ..base()
        }
        .validate(DiskLimits::default())
        .unwrap();
        assert_eq!(ok.create.on_expiry, ExpiryAction::Delete);
        assert!(ok.create.expires_at.is_some());
        assert!(!ok.by_image);
    }
}
