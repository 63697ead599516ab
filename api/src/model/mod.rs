//! Request and response bodies of the sandbox API, and their validation. The bodies of the
//! settings routes (PATCH, renew) are in [`settings`].

pub mod settings;
pub mod snapshot;

use berth_schemas::network::Network;
use berth_schemas::preview::AGENT_PORT;
use berth_schemas::state::ExpiryAction;
use berth_schemas::wire::Resources;
use berth_schemas::{Generation, HostId, SandboxId, SandboxState};
use berth_store::SandboxRow;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;

/// The template used when a create names none.
pub const DEFAULT_TEMPLATE: &str = "base";
/// vCPUs when a create names none.
pub const DEFAULT_VCPUS: u32 = 1;
/// Memory when a create names none, in MiB.
pub const DEFAULT_MEMORY_MIB: u32 = 512;
/// The largest sandbox, in vCPUs.
pub const MAX_VCPUS: u32 = 32;
/// The smallest sandbox, in MiB.
pub const MIN_MEMORY_MIB: u32 = 64;
/// The largest sandbox, in MiB (64 GiB).
pub const MAX_MEMORY_MIB: u32 = 65_536;
/// The smallest writable disk a create may ask for, in MiB: below this an ext4 image is
/// mostly its own metadata.
pub const MIN_DISK_MIB: u32 = 64;
/// The writable disk a create gets when it names none, unless the operator sets another
/// (`--sandbox-disk-default-mib`), in MiB.
pub const DEFAULT_DISK_MIB: u32 = 2048;
/// The largest writable disk a create may ask for, unless the operator sets another
/// (`--sandbox-disk-max-mib`), in MiB (64 GiB).
pub const DEFAULT_MAX_DISK_MIB: u32 = 65_536;
/// At most this many metadata keys.
pub const MAX_METADATA_KEYS: usize = 64;
/// A metadata key or value is at most this many bytes.
pub const MAX_METADATA_LEN: usize = 256;

/// `POST /v1/sandboxes` body. Unknown fields are refused.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// Template name; default `base`.
    pub template: Option<String>,
    /// Whole vCPUs, 1 to 32; default 1.
    pub vcpus: Option<u32>,
    /// Memory in MiB, 64 to 65536; default 512.
    pub memory_mib: Option<u32>,
    /// Up to 64 string → string pairs, each at most 256 bytes.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// Stop after this many minutes without activity (API calls on it, exec); 1 to 10080.
    pub auto_stop_minutes: Option<u32>,
    /// Delete after this many minutes stopped; 1 to 525600.
    pub auto_delete_minutes: Option<u32>,
    /// Archive (upload to object storage and free the host's disk) after this many days
    /// stopped; 1 to 3650.
    pub auto_archive_days: Option<u32>,
    /// Back up its disk to the object store every this many minutes while it runs (1 to
    /// 525600); absent: no periodic backups (see "Backups").
    pub backup_interval_min: Option<u32>,
    /// The size of the sandbox's writable disk in MiB: what it may write beyond its template
    /// (an exec that writes more gets `ENOSPC`). 64 to the operator's maximum (default 65536);
    /// default 2048 unless the operator set another. Kept across stops.
    pub disk_mib: Option<u32>,
    /// Where the sandbox's own connections may go: `{"egress": "public"}` (the default: public
    /// addresses only, never private, link-local — the metadata address 169.254.169.254
    /// among them —, CGNAT, loopback or multicast ranges), `{"egress": "none"}` (nothing), or
    /// `{"egress": ["10.1.0.0/16", "203.0.113.7", …]}` (only those IPv4 networks, private
    /// ones included; at most 64). The host's own addresses and other sandboxes are never
    /// reachable. Sandboxes have IPv4 only.
    #[schema(value_type = Option<Object>, example = json!({"egress": ["10.1.0.0/16"]}))]
    pub network: Option<serde_json::Value>,
    /// Whether a preview request to the sandbox while it is stopped starts it (and is held
    /// until it runs); default `true`. With `false` such a request gets 409 with the state.
    pub auto_resume: Option<bool>,
    /// Ports (1 to 65535, at most 16) that anyone may reach through the preview proxy without
    /// a key or token; default none (every port is private to the owning org).
    pub public_ports: Option<Vec<u16>>,
    /// When the reconciler applies `on_expiry` (RFC 3339), in the future and at most a year
    /// ahead; `PATCH` and `POST …/renew` move it. Not with `timeout_seconds`.
    pub expires_at: Option<String>,
    /// The expiry as seconds from now (1 to 31536000); not with `expires_at`.
    pub timeout_seconds: Option<i64>,
    /// What the expiry does: `stop` (the default; the disk is kept) or `delete`.
    pub on_expiry: Option<String>,
    /// Environment variables set for every exec in the sandbox (an exec's own `env` wins) and
    /// for its entrypoint; at most 256 names, 64 KiB with `entrypoint`. Not shown back.
    pub env: Option<std::collections::BTreeMap<String, String>>,
    /// An argv started in the background (output discarded, through `sh`) each time the
    /// sandbox boots from its disk: at create, and at a start after a disk-only stop (a memory
    /// restore keeps it running). Default: none.
    pub entrypoint: Option<Vec<String>>,
}

/// Environment variables as name and value pairs.
pub type EnvPairs = Vec<(String, String)>;

/// At most this many `env` names.
pub const MAX_ENV_VARS: usize = 256;
/// At most this many bytes of `env` names and values and `entrypoint` words together: they
/// travel to the host in every command (one NATS message).
pub const MAX_ENV_ENTRYPOINT_BYTES: usize = 64 * 1024;

/// `env` and `entrypoint` checked: names non-empty without `=` or NUL, values and words
/// without NUL, a non-empty program name, within [`MAX_ENV_VARS`] and
/// [`MAX_ENV_ENTRYPOINT_BYTES`].
///
/// Errors: [`ApiError::InvalidRequest`] naming `env` or `entrypoint`.
pub fn valid_env_and_entrypoint(
    env: std::collections::BTreeMap<String, String>,
    entrypoint: Vec<String>,
) -> Result<(EnvPairs, Vec<String>), ApiError> {
    if env.len() > MAX_ENV_VARS {
        return Err(ApiError::invalid(
            "env",
            format!("env holds at most {MAX_ENV_VARS} names"),
        ));
    }
    if env
        .iter()
        .any(|(k, v)| k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0'))
    {
        return Err(ApiError::invalid(
            "env",
            "env names are non-empty without '=' or NUL; values hold no NUL",
        ));
    }
    if entrypoint.iter().any(|w| w.contains('\0'))
        || entrypoint.first().is_some_and(|p| p.is_empty())
    {
        return Err(ApiError::invalid(
            "entrypoint",
            "entrypoint names a program first and holds no NUL bytes",
        ));
    }
    let bytes = env.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
        + entrypoint.iter().map(String::len).sum::<usize>();
    if bytes > MAX_ENV_ENTRYPOINT_BYTES {
        return Err(ApiError::invalid(
            "env",
            format!("env and entrypoint together hold at most {MAX_ENV_ENTRYPOINT_BYTES} bytes"),
        ));
    }
    Ok((env.into_iter().collect(), entrypoint))
}

/// At most this many `public_ports`.
pub const MAX_PUBLIC_PORTS: usize = 16;

/// `public_ports` checked (1 to 65535, not the agent's [`AGENT_PORT`], at most
/// [`MAX_PUBLIC_PORTS`]), sorted and deduplicated.
///
/// Errors: [`ApiError::InvalidRequest`] naming `public_ports`.
pub fn valid_public_ports(ports: Vec<u16>) -> Result<Vec<u16>, ApiError> {
    if ports.contains(&0) {
        return Err(ApiError::invalid(
            "public_ports",
            "public_ports are 1 to 65535",
        ));
    }
    if ports.contains(&AGENT_PORT) {
        return Err(ApiError::invalid(
            "public_ports",
            format!("public_ports may not hold {AGENT_PORT}: it is Berth's agent's port"),
        ));
    }
    let mut ports = ports;
    ports.sort_unstable();
    ports.dedup();
    if ports.len() > MAX_PUBLIC_PORTS {
        return Err(ApiError::invalid(
            "public_ports",
            format!("public_ports holds at most {MAX_PUBLIC_PORTS} ports"),
        ));
    }
    Ok(ports)
}

/// The operator's bounds on `disk_mib`: the default a create gets and the largest it may ask
/// for, in MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskLimits {
    default_mib: u32,
    max_mib: u32,
}

/// Why [`DiskLimits::new`] refused the operator's settings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "sandbox disk limits need {MIN_DISK_MIB} <= default ({default_mib}) <= max ({max_mib}) MiB"
)]
pub struct InvalidDiskLimits {
    /// The default asked for.
    pub default_mib: u32,
    /// The maximum asked for.
    pub max_mib: u32,
}

impl DiskLimits {
    /// A default and a maximum, both in MiB.
    ///
    /// Errors: [`InvalidDiskLimits`] unless `MIN_DISK_MIB <= default_mib <= max_mib`.
    pub fn new(default_mib: u32, max_mib: u32) -> Result<Self, InvalidDiskLimits> {
        if MIN_DISK_MIB <= default_mib && default_mib <= max_mib {
            Ok(Self {
                default_mib,
                max_mib,
            })
        } else {
            Err(InvalidDiskLimits {
                default_mib,
                max_mib,
            })
        }
    }

    /// The disk a create gets when it names none, in MiB.
    pub fn default_mib(&self) -> u32 {
        self.default_mib
    }

    /// The largest disk a create may ask for, in MiB.
    pub fn max_mib(&self) -> u32 {
        self.max_mib
    }
}

impl Default for DiskLimits {
    /// [`DEFAULT_DISK_MIB`] and [`DEFAULT_MAX_DISK_MIB`].
    fn default() -> Self {
        Self {
            default_mib: DEFAULT_DISK_MIB,
            max_mib: DEFAULT_MAX_DISK_MIB,
        }
    }
}

/// A validated create request.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidCreate {
    /// Template name, 1 to 64 bytes, no NUL; [`DEFAULT_TEMPLATE`] when the request named none.
    pub template: String,
    /// Whole vCPUs and MiB, within the API's bounds, defaults applied.
    pub resources: Resources,
    /// A JSON object of string values (empty when absent).
    pub metadata: serde_json::Value,
    /// Minutes without activity before an auto-stop; `None`: never.
    pub auto_stop_minutes: Option<i32>,
    /// Minutes stopped before an auto-delete; `None`: never.
    pub auto_delete_minutes: Option<i32>,
    /// Days stopped before an auto-archive; `None`: never.
    pub auto_archive_days: Option<i32>,
    /// Minutes between periodic backups while running; `None`: none.
    pub backup_interval_min: Option<i32>,
    /// The writable disk in MiB, within the operator's [`DiskLimits`], default applied.
    pub disk_mib: u32,
    /// The network policy; public egress when the request named none.
    pub network: Network,
    /// Whether a preview request starts it when stopped; `true` unless the request said not.
    pub auto_resume: bool,
    /// Its public preview ports, sorted, without repeats.
    pub public_ports: Vec<u16>,
    /// When the expiry applies; `None`: never.
    pub expires_at: Option<DateTime<Utc>>,
    /// What the expiry does; [`ExpiryAction::Stop`] when the request named none.
    pub on_expiry: ExpiryAction,
    /// Environment variables for every exec and the entrypoint, by name.
    pub env: Vec<(String, String)>,
    /// The argv started in the background at each boot from disk; empty: none.
    pub entrypoint: Vec<String>,
    /// The image the OpenSandbox surface was asked for (`image.uri`); `None` otherwise.
    pub image_uri: Option<String>,
}

/// The longest `auto_stop_minutes` (a week).
pub const MAX_AUTO_STOP_MINUTES: u32 = 7 * 24 * 60;
/// The longest `auto_delete_minutes` (a year).
pub const MAX_AUTO_DELETE_MINUTES: u32 = 365 * 24 * 60;
/// The longest `auto_archive_days` (ten years).
pub const MAX_AUTO_ARCHIVE_DAYS: u32 = 3650;
/// The longest `backup_interval_min` (a year).
pub const MAX_BACKUP_INTERVAL_MIN: u32 = 365 * 24 * 60;

/// The 400 of a metadata object over [`MAX_METADATA_KEYS`].
pub(crate) fn too_many_keys() -> ApiError {
    ApiError::invalid(
        "metadata",
        format!("metadata holds at most {MAX_METADATA_KEYS} keys"),
    )
}

/// Checks one metadata pair: a key of 1 to [`MAX_METADATA_LEN`] bytes and a string value of
/// at most that many, neither with NUL. `value` `None` stands for a JSON `null`, which only a
/// PATCH may give (it deletes the key); the caller decides whether it is allowed.
///
/// Errors: 400 naming `metadata`.
pub(crate) fn check_metadata_entry(
    key: &str,
    value: Option<&serde_json::Value>,
) -> Result<(), ApiError> {
    let v = match value {
        None => "",
        Some(v) => v.as_str().ok_or_else(|| {
            ApiError::invalid(
                "metadata",
                format!("metadata value of {key:?} must be a string"),
            )
        })?,
    };
    if key.contains('\0') || v.contains('\0') {
        return Err(ApiError::invalid(
            "metadata",
            "metadata cannot contain NUL bytes",
        ));
    }
    if key.is_empty() || key.len() > MAX_METADATA_LEN || v.len() > MAX_METADATA_LEN {
        return Err(ApiError::invalid(
            "metadata",
            format!("metadata keys are 1 to {MAX_METADATA_LEN} bytes, values at most {MAX_METADATA_LEN}"),
        ));
    }
    Ok(())
}

fn minutes(field: &str, value: Option<u32>, max: u32) -> Result<Option<i32>, ApiError> {
    match value {
        None => Ok(None),
        Some(m) if (1..=max).contains(&m) => Ok(Some(m as i32)),
        Some(m) => Err(ApiError::invalid(
            field,
            format!("{field} must be between 1 and {max}, got {m}"),
        )),
    }
}

impl CreateSandbox {
    /// Applies defaults and checks ranges; `disk` bounds `disk_mib`.
    ///
    /// Errors: [`ApiError::InvalidRequest`] naming the offending field.
    pub fn validate(self, disk: DiskLimits) -> Result<ValidCreate, ApiError> {
        let template = self.template.unwrap_or_else(|| DEFAULT_TEMPLATE.to_owned());
        if template.is_empty() || template.len() > 64 || template.contains('\0') {
            return Err(ApiError::invalid(
                "template",
                "template must be 1 to 64 characters",
            ));
        }
        let vcpus = self.vcpus.unwrap_or(DEFAULT_VCPUS);
        if !(1..=MAX_VCPUS).contains(&vcpus) {
            return Err(ApiError::invalid(
                "vcpus",
                format!("vcpus must be between 1 and {MAX_VCPUS}, got {vcpus}"),
            ));
        }
        let memory_mib = self.memory_mib.unwrap_or(DEFAULT_MEMORY_MIB);
        if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&memory_mib) {
            return Err(ApiError::invalid(
                "memory_mib",
                format!(
                    "memory_mib must be between {MIN_MEMORY_MIB} and {MAX_MEMORY_MIB}, got {memory_mib}"
                ),
            ));
        }
        let disk_mib = self.disk_mib.unwrap_or(disk.default_mib);
        if !(MIN_DISK_MIB..=disk.max_mib).contains(&disk_mib) {
            return Err(ApiError::invalid(
                "disk_mib",
                format!(
                    "disk_mib must be between {MIN_DISK_MIB} and {}, got {disk_mib}",
                    disk.max_mib
                ),
            ));
        }
        let metadata = self.metadata.unwrap_or_default();
        if metadata.len() > MAX_METADATA_KEYS {
            return Err(too_many_keys());
        }
        for (k, v) in &metadata {
            check_metadata_entry(k, Some(v))?;
        }
        let network = match &self.network {
            None => Network::default(),
            Some(value) => {
                Network::from_api(value).map_err(|e| ApiError::invalid("network", e.0))?
            }
        };
        let public_ports = valid_public_ports(self.public_ports.unwrap_or_default())?;
        let now = Utc::now();
        let expires_at = match (self.expires_at, self.timeout_seconds) {
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    "timeout_seconds",
                    "give expires_at or timeout_seconds, not both",
                ))
            }
            (Some(at), None) => Some(settings::expiry_at("expires_at", &at, now)?),
            (None, Some(secs)) => Some(settings::expiry_in("timeout_seconds", secs, now)?),
            (None, None) => None,
        };
        let on_expiry = self
            .on_expiry
            .as_deref()
            .map(settings::on_expiry)
            .transpose()?
            .unwrap_or_default();
        let (env, entrypoint) = valid_env_and_entrypoint(
            self.env.unwrap_or_default(),
            self.entrypoint.unwrap_or_default(),
        )?;
        Ok(ValidCreate {
            env,
            entrypoint,
            image_uri: None,
            expires_at,
            on_expiry,
            network,
            auto_resume: self.auto_resume.unwrap_or(true),
            public_ports,
            template,
            resources: Resources { vcpus, memory_mib },
            metadata: serde_json::Value::Object(metadata),
            auto_stop_minutes: minutes(
                "auto_stop_minutes",
                self.auto_stop_minutes,
                MAX_AUTO_STOP_MINUTES,
            )?,
            auto_delete_minutes: minutes(
                "auto_delete_minutes",
                self.auto_delete_minutes,
                MAX_AUTO_DELETE_MINUTES,
            )?,
            auto_archive_days: minutes(
                "auto_archive_days",
                self.auto_archive_days,
                MAX_AUTO_ARCHIVE_DAYS,
            )?,
            backup_interval_min: minutes(
                "backup_interval_min",
                self.backup_interval_min,
                MAX_BACKUP_INTERVAL_MIN,
            )?,
            disk_mib,
        })
    }
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Sandbox {
    /// The sandbox's id.
    #[schema(value_type = String, format = Uuid)]
    pub id: SandboxId,
    /// Its lifecycle state (see the state table in the API description).
    pub state: SandboxState,
    /// Why the sandbox is in its state, when the host or the reconciler said (e.g. a boot error).
    pub state_reason: Option<String>,
    /// The template it was created from.
    pub template: String,
    /// The host it is placed on; `null` before placement, while `archived` (it holds no host
    /// then: its copy is in the object store, and a start places it on whatever host has room)
    /// and once `deleted` (nothing of it is left on any host).
    #[schema(value_type = Option<String>, format = Uuid)]
    pub host_id: Option<HostId>,
    /// The fencing generation, bumped by every state-changing request.
    #[schema(value_type = i64)]
    pub generation: Generation,
    /// Whole vCPUs.
    pub vcpus: u32,
    /// Memory in MiB.
    pub memory_mib: u32,
    /// The string key/value pairs given at create (`{}` when none).
    #[schema(value_type = Object)]
    pub metadata: serde_json::Value,
    /// The sandbox's IPv4 address on its host, while running.
    pub address: Option<String>,
    /// How the last stop kept the sandbox: `memory` or `disk`.
    pub last_stop: Option<String>,
    /// When the last stop wanted memory (gVisor) but kept the disk only: what failed
    /// (`checkpoint_failed`); `None` otherwise. Cleared by the next stop that keeps what it
    /// wanted.
    pub last_stop_code: Option<String>,
    /// With `last_stop_code`: the runtime's error, one line of at most 512 characters (for
    /// instance `Checkpoint failed: EOF` when the checkpoint ran out of the sandbox's memory).
    pub last_stop_reason: Option<String>,
    /// When the create was accepted.
    pub created_at: DateTime<Utc>,
    /// When the sandbox's state last changed (a request, a host's result or the reconciler),
    /// or its `auto_delete_minutes` was re-armed by a PATCH: auto-delete measures from it.
    pub updated_at: DateTime<Utc>,
    /// Set when a delete was accepted.
    pub deleted_at: Option<DateTime<Utc>>,
    /// Minutes without activity before an auto-stop; `None`: never.
    pub auto_stop_minutes: Option<i32>,
    /// Minutes stopped before an auto-delete; `None`: never.
    pub auto_delete_minutes: Option<i32>,
    /// The size of its writable disk in MiB; 0 for a sandbox created before disk limits (no
    /// limit).
    pub disk_mib: u32,
    /// The network policy, as the create body spells it (`{"egress": "public"}` when the
    /// create named none).
    #[schema(value_type = Object, example = json!({"egress": "public"}))]
    pub network: serde_json::Value,
    /// Whether a preview request starts it when it is stopped.
    #[serde(default = "yes")]
    pub auto_resume: bool,
    /// Ports anyone may reach through the preview proxy without a key, ascending.
    #[serde(default)]
    pub public_ports: Vec<u16>,
    /// When the reconciler applies `on_expiry`; `None`: never (also once an expiry applied).
    pub expires_at: Option<DateTime<Utc>>,
    /// What the expiry does: `stop` or `delete`.
    pub on_expiry: String,
    /// The argv started in the background at each boot from disk; empty: none.
    #[serde(default)]
    pub entrypoint: Vec<String>,
    /// When its stop snapshot was confirmed stored in the object store (after a stop, hostd
    /// uploads it in the background; an archive makes sure of it); `None` while it is not (a
    /// running sandbox, or an upload still under way or failed). Cleared by a start.
    #[serde(default)]
    pub durable_at: Option<DateTime<Utc>>,
    /// Days stopped before the reconciler archives it; `None`: never.
    #[serde(default)]
    pub auto_archive_days: Option<i32>,
    /// Its newest `ready` backup (a disk snapshot in the object store, see "Backups"); `None`
    /// while it has none.
    #[serde(default)]
    #[schema(value_type = Option<String>, format = Uuid)]
    pub last_backup_id: Option<berth_schemas::ids::SnapshotId>,
    /// When that backup became ready (its upload confirmed).
    #[serde(default)]
    pub last_backup_at: Option<DateTime<Utc>>,
    /// Minutes between automatic backups while it runs; `None`: none.
    #[serde(default)]
    pub backup_interval_min: Option<i32>,
}

fn yes() -> bool {
    true
}

/// Whether a sandbox in `state` holds anything on the host its row names, so the API shows
/// that host (`Sandbox::host_id`). An `archived` sandbox does not: the row still names the host
/// its disk was on until the delete that frees it lands (two-phase free), which is no
/// placement. Nor does a `deleted` one, whichever way it got there: deleted from `archived`,
/// the row keeps naming the host its archive freed (an attack run saw that host shown again
/// once the archived sandbox was deleted); deleted on its host, the host reported nothing left.
fn holds_a_host(state: SandboxState) -> bool {
    !matches!(state, SandboxState::Archived | SandboxState::Deleted)
}

impl From<SandboxRow> for Sandbox {
    fn from(row: SandboxRow) -> Self {
        Sandbox {
            id: row.id,
            state: row.state,
            state_reason: row.state_reason,
            template: row.template,
            host_id: row.host_id.filter(|_| holds_a_host(row.state)),
            generation: row.generation,
            vcpus: row.resources.vcpus,
            memory_mib: row.resources.memory_mib,
            metadata: row.metadata,
            address: row.address,
            last_stop: row.last_stop.map(|m| m.as_str().to_owned()),
            last_stop_code: row
                .last_stop_fallback
                .as_ref()
                .map(|f| f.code.as_str().to_owned()),
            last_stop_reason: row.last_stop_fallback.map(|f| f.detail),
            created_at: row.created_at,
            updated_at: row.updated_at,
            deleted_at: row.deleted_at,
            auto_stop_minutes: row.auto_stop_minutes,
            auto_delete_minutes: row.auto_delete_minutes,
            disk_mib: row.disk_mib,
            network: row.network.to_api(),
            auto_resume: row.auto_resume,
            public_ports: row.public_ports,
            expires_at: row.expires_at,
            on_expiry: row.on_expiry.as_str().to_owned(),
            entrypoint: row.entrypoint,
            durable_at: row.durable_at,
            auto_archive_days: row.auto_archive_days,
            last_backup_id: row.last_backup_id,
            last_backup_at: row.last_backup_at,
            backup_interval_min: row.backup_interval_min,
        }
    }
}

impl Sandbox {
    /// The resources the sandbox reserves on its host when it holds capacity.
    pub fn resources(&self) -> Resources {
        Resources {
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
        }
    }
}

/// `GET /v1/sandboxes` response: newest first.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SandboxList {
    /// One page of the caller's sandboxes, newest first.
    pub sandboxes: Vec<Sandbox>,
    /// Pass as `cursor` to get the next page; absent on the last page.
    pub next_cursor: Option<String>,
}

/// `POST /v1/sandboxes/{id}/exec` body.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    /// argv; `cmd[0]` is looked up on the sandbox's `PATH`.
    pub cmd: Vec<String>,
    /// Kill the process after this many milliseconds; default 30000, at most 600000.
    pub timeout_ms: Option<u64>,
    /// Extra environment variables, set over the default `PATH` and `HOME`.
    #[serde(default)]
    pub env: Option<std::collections::BTreeMap<String, String>>,
    /// Working directory (absolute); default `/`.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Text written to the process's stdin, which is then closed (at most 1 MiB).
    #[serde(default)]
    pub stdin: Option<String>,
}

/// `POST /v1/sandboxes/{id}/exec` response. Output is decoded as UTF-8, invalid bytes replaced.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ExecOutput {
    /// The exit status, or 128 + signal number when killed by a signal.
    pub exit_code: i32,
    /// Everything the process wrote to stdout.
    pub stdout: String,
    /// Everything the process wrote to stderr.
    pub stderr: String,
    /// Whether the process was killed at `timeout_ms`.
    pub timed_out: bool,
    /// Whether the sandbox's memory limit killed a process during the exec (exit code 137).
    #[serde(default)]
    pub oom_killed: bool,
}

/// A lifecycle event.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Event {
    /// The event's id (unique; the CloudEvents `id` of its webhook delivery).
    #[schema(value_type = String, format = Uuid)]
    pub id: uuid::Uuid,
    /// The sandbox it is about.
    #[schema(value_type = String, format = Uuid)]
    pub sandbox_id: SandboxId,
    /// `sandbox.<state>`, or `sandbox.updated` for a change of settings (PATCH, renew).
    #[serde(rename = "type")]
    pub kind: String,
    /// The state before; `None` for the first event of a sandbox.
    pub from: Option<String>,
    /// The state after.
    pub to: String,
    /// `user_request`, `host_report`, `timeout`, `auto_stop`, `auto_delete`, `host_lost`,
    /// `runtime_error`, `compensation`, `expired`.
    pub reason: String,
    /// The sandbox's generation after the transition.
    pub generation: i64,
    /// Detail from the host or the reconciler (e.g. a runtime error); `None` when there is none.
    pub message: Option<String>,
    /// On a stop's event: how the stop kept the sandbox (`memory`, `disk`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stop: Option<String>,
    /// On a stop that wanted memory and kept the disk only: what failed (`checkpoint_failed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stop_code: Option<String>,
    /// With `last_stop_code`: the runtime's error (one line, at most 512 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stop_reason: Option<String>,
    /// When the transition was committed (database clock).
    pub at: DateTime<Utc>,
}

/// A template sandboxes can be created from.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Template {
    /// The name a create passes as `template` (`base`, …).
    pub name: String,
    /// What the template holds, for people.
    pub description: String,
    /// The OCI runtime its sandboxes run in: `runc` or `runsc`.
    pub runtime: String,
    /// `ready` (creates may name it), `pulling` (its image is being pulled) or `failed` (the
    /// pull failed: `error_code`, `error_message`).
    pub state: String,
    /// The OCI image it is pulled from, as asked; absent for built-in and imported templates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The image's manifest digest for this platform (`sha256:...`), once pulled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_digest: Option<String>,
    /// The compressed size of the image's layers in bytes, once pulled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_bytes: Option<i64>,
    /// The image's entrypoint followed by its cmd. Berth does not run it unless a create asks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    /// Why the last pull failed: `unknown_image`, `auth_failed`, `unsupported_platform`,
    /// `image_too_large`, `hostile_layer`, `unsupported_layer`, `bad_reference`,
    /// `registry_error`, `io_error`, `pull_timed_out` (no sign of the pull for the
    /// reconciler's `--template-pull-timeout`: the process pulling it died).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    /// Why the last pull failed, for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
    /// What happened to it, oldest first (`GET /v1/templates/{name}` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<Vec<TemplateEvent>>,
}

/// One event of a template.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateEvent {
    /// When.
    pub at: DateTime<Utc>,
    /// `template.pulling`, `template.progress`, `template.ready` or `template.failed`.
    #[serde(rename = "type")]
    pub kind: String,
    /// What happened.
    pub message: String,
}

/// `POST /v1/templates`: a template pulled from an OCI image.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTemplate {
    /// Its name: 1 to 64 of a-z, 0-9 and '-', not starting with '-'.
    pub name: String,
    /// The image: `registry/repo:tag` or `registry/repo@sha256:...` (a registry on a
    /// loopback address is reached over plain HTTP).
    pub image: String,
    /// `runc` or `runsc` (default `runsc`).
    #[serde(default)]
    pub runtime: Option<String>,
    /// One line for listings (default: the image).
    #[serde(default)]
    pub description: Option<String>,
    /// Registry credentials (`{"username", "password"}`): refused with 400. Berth pulls
    /// anonymously: hosts on other machines pull the pinned image again, and Berth has no
    /// encrypted store for secrets to hand them yet. Never stored, never logged.
    #[serde(default, skip_serializing)]
    #[schema(value_type = Option<Object>)]
    pub credentials: Option<serde_json::Value>,
}

#[cfg(test)]
mod tests;
