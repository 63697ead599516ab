//! The `sandboxes` table: one row type ([`SandboxRow`]) read through one column list
//! ([`COLUMNS`]) and one `from_row`, and every write of a sandbox's state.
//!
//! # Guarantees
//! - Fenced: [`write_transition`] and [`write_result`] update a row only at the generation the
//!   caller read (`WHERE id = $1 AND generation = $2`); a miss is [`StoreError::Fenced`].
//! - Capacity (guarantee 4): the hold on the host's capacity changes only here, as the
//!   decision's [`Capacity`](berth_schemas::Capacity) says, in the same transaction as the state write, the command and
//!   the event (guarantee 1).
//! - Org scoping (guarantee 7): [`get`], [`lock`] and [`list`] take the caller's org.

use berth_schemas::ids::SnapshotId;
use berth_schemas::network::Network;
use berth_schemas::state::ExpiryAction;
use berth_schemas::wire::{
    Command, Resources, Runtime, SandboxSpec, SnapshotOrder, StopFallback, StopMode,
};
use berth_schemas::{
    CommandId, CommandKind, Generation, HostId, OrgId, Reason, SandboxId, SandboxState,
};
use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgExecutor, Row};

use crate::events::{self, NewEvent};
use crate::op::{timed, Op};
use crate::{commands, StoreError};

/// The columns [`SandboxRow::from_row`] reads, unqualified (select from `sandboxes`).
pub const COLUMNS: &str = "id, org_id, template, host_id, state, state_reason, generation, \
     holds_capacity, vcpus, memory_mib, runtime, metadata, address, last_stop, created_at, updated_at, \
     deleted_at, auto_stop_minutes, auto_delete_minutes, disk_mib, network, auto_resume, \
     public_ports, expires_at, on_expiry, last_stop_code, last_stop_reason, env, entrypoint, \
     image_uri, image, durable_at, durable_snapshot, auto_archive_days, migrated_from, \
     seed_snapshot, last_backup_id, last_backup_at, backup_interval_min";

/// [`COLUMNS`] qualified with a table alias (`s.id, s.org_id, …`), for joins.
pub fn columns_of(alias: &str) -> String {
    COLUMNS
        .split(", ")
        .map(|c| format!("{alias}.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One sandbox row.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    /// The sandbox (`sandboxes.id`, UUIDv7).
    pub id: SandboxId,
    /// The org that owns it; every API read is scoped by it.
    pub org_id: OrgId,
    /// The template it was created from (`base`, …; a `templates.name`).
    pub template: String,
    /// Its template's image pinned at create (`templates.image_pinned`), for a template pulled
    /// from an OCI image; `None` otherwise.
    pub image: Option<String>,
    /// The host it is placed on (always set today: placement happens at create).
    pub host_id: Option<HostId>,
    /// Its lifecycle state (`sandboxes.state`, kebab-case).
    pub state: SandboxState,
    /// Why it is in its state (a boot failure's message, …).
    pub state_reason: Option<String>,
    /// The fence: bumped by every transition the control plane starts.
    pub generation: Generation,
    /// Whether its resources are counted in its host's reservation (guarantee 4).
    pub holds_capacity: bool,
    /// Its size: whole vCPUs and MiB (the `vcpus` and `memory_mib` columns).
    pub resources: Resources,
    /// The runtime its template named at create.
    pub runtime: Runtime,
    /// The user's metadata object.
    pub metadata: serde_json::Value,
    /// Its IPv4 address while running.
    pub address: Option<String>,
    /// How the last stop kept it.
    pub last_stop: Option<StopMode>,
    /// Why the last stop kept the disk only although it wanted memory (`last_stop_code`,
    /// `last_stop_reason`); `None` when it kept what it wanted.
    pub last_stop_fallback: Option<StopFallback>,
    /// When the create was accepted (database clock).
    pub created_at: DateTime<Utc>,
    /// When the row last changed (database clock); auto-delete measures from it.
    pub updated_at: DateTime<Utc>,
    /// Set when a delete was accepted.
    pub deleted_at: Option<DateTime<Utc>>,
    /// Minutes without activity after which a `running` sandbox is stopped; `None`: never.
    pub auto_stop_minutes: Option<i32>,
    /// Minutes after which a `stopped` or `failed-start` sandbox is deleted; `None`: never.
    pub auto_delete_minutes: Option<i32>,
    /// The size of its writable disk in MiB (`sandboxes.disk_mib`); 0 for a row created before
    /// disk limits (no limit).
    pub disk_mib: u32,
    /// Its network policy (the `network` column, in the API's JSON spelling).
    pub network: Network,
    /// Whether a preview request starts it when it is stopped (`sandboxes.auto_resume`).
    pub auto_resume: bool,
    /// The ports anyone may reach through the preview proxy without a key, ascending.
    pub public_ports: Vec<u16>,
    /// When the reconciler's pass applies [`SandboxRow::on_expiry`]; `None`: never.
    pub expires_at: Option<DateTime<Utc>>,
    /// What its expiry does: stop (the default) or delete.
    pub on_expiry: ExpiryAction,
    /// Environment variables for every exec and its entrypoint (`sandboxes.env`, a JSON
    /// object of strings), in key order.
    pub env: Vec<(String, String)>,
    /// The argv started in the background at each boot from disk (`sandboxes.entrypoint`);
    /// empty: none.
    pub entrypoint: Vec<String>,
    /// The image named at create through the OpenSandbox surface; `None` otherwise.
    pub image_uri: Option<String>,
    /// When its stop snapshot was confirmed stored in the object store (issue 14): written
    /// only after the host reported the upload confirmed, at the stop's generation; cleared
    /// by a start. `None`: not durable (yet).
    pub durable_at: Option<DateTime<Utc>>,
    /// The manifest of that stop snapshot (an unarchive fetches it); set with `durable_at`.
    pub durable_snapshot: Option<SnapshotId>,
    /// Days a `stopped` sandbox waits before the reconciler archives it; `None`: never.
    pub auto_archive_days: Option<i32>,
    /// While `migrating`: the host it came from, which still holds its last stop's disk
    /// (issue 14, start elsewhere). `None` in every other state.
    pub migrated_from: Option<HostId>,
    /// The snapshot a clone boots from, until it first runs (`sandboxes.seed_snapshot`): a
    /// start of a clone whose boot failed boots from it again
    /// ([`berth_schemas::state::on_request_unseeded`]). `None` once it ran, and for a sandbox
    /// made from a template.
    pub seed_snapshot: Option<SnapshotId>,
    /// Its newest `ready` backup (issue 14), written when that backup settled ready, never
    /// before its upload was confirmed; `None` while it has none.
    pub last_backup_id: Option<SnapshotId>,
    /// When [`Self::last_backup_id`] became ready.
    pub last_backup_at: Option<DateTime<Utc>>,
    /// Minutes between the reconciler's backups of it while running; `None`: no periodic
    /// backups.
    pub backup_interval_min: Option<i32>,
}

impl SandboxRow {
    /// Reads a row selected with [`COLUMNS`] (or [`columns_of`]).
    ///
    /// Errors: [`StoreError::Corrupt`] for a state or stop mode this build does not know.
    pub fn from_row(row: &PgRow) -> Result<Self, StoreError> {
        let get = StoreError::database(Op::SandboxGet);
        let state: String = row.try_get("state").map_err(get)?;
        let last_stop: Option<String> = row.try_get("last_stop").map_err(get)?;
        Ok(Self {
            id: row.try_get("id").map_err(get)?,
            org_id: row.try_get("org_id").map_err(get)?,
            template: row.try_get("template").map_err(get)?,
            image: row.try_get("image").map_err(get)?,
            host_id: row.try_get("host_id").map_err(get)?,
            state: state.parse().map_err(|e| corrupt("sandboxes.state", e))?,
            state_reason: row.try_get("state_reason").map_err(get)?,
            generation: row.try_get("generation").map_err(get)?,
            holds_capacity: row.try_get("holds_capacity").map_err(get)?,
            resources: resources(
                row.try_get("vcpus").map_err(get)?,
                row.try_get("memory_mib").map_err(get)?,
            ),
            runtime: runtime(&row.try_get::<String, _>("runtime").map_err(get)?)?,
            metadata: row.try_get("metadata").map_err(get)?,
            address: row.try_get("address").map_err(get)?,
            last_stop: last_stop.as_deref().map(stop_mode).transpose()?,
            last_stop_fallback: stop_fallback(
                row.try_get("last_stop_code").map_err(get)?,
                row.try_get("last_stop_reason").map_err(get)?,
            )?,
            created_at: row.try_get("created_at").map_err(get)?,
            updated_at: row.try_get("updated_at").map_err(get)?,
            deleted_at: row.try_get("deleted_at").map_err(get)?,
            auto_stop_minutes: row.try_get("auto_stop_minutes").map_err(get)?,
            auto_delete_minutes: row.try_get("auto_delete_minutes").map_err(get)?,
            disk_mib: u32::try_from(row.try_get::<i32, _>("disk_mib").map_err(get)?)
                .map_err(|e| corrupt("sandboxes.disk_mib", e))?,
            network: network(&row.try_get("network").map_err(get)?)?,
            auto_resume: row.try_get("auto_resume").map_err(get)?,
            public_ports: row
                .try_get::<Vec<i32>, _>("public_ports")
                .map_err(get)?
                .into_iter()
                .map(|p| u16::try_from(p).map_err(|e| corrupt("sandboxes.public_ports", e)))
                .collect::<Result<_, _>>()?,
            expires_at: row.try_get("expires_at").map_err(get)?,
            on_expiry: row
                .try_get::<String, _>("on_expiry")
                .map_err(get)?
                .parse()
                .map_err(|e| corrupt("sandboxes.on_expiry", e))?,
            env: env(row.try_get("env").map_err(get)?)?,
            entrypoint: row.try_get("entrypoint").map_err(get)?,
            image_uri: row.try_get("image_uri").map_err(get)?,
            durable_at: row.try_get("durable_at").map_err(get)?,
            durable_snapshot: row.try_get("durable_snapshot").map_err(get)?,
            auto_archive_days: row.try_get("auto_archive_days").map_err(get)?,
            migrated_from: row.try_get("migrated_from").map_err(get)?,
            seed_snapshot: row.try_get("seed_snapshot").map_err(get)?,
            last_backup_id: row.try_get("last_backup_id").map_err(get)?,
            last_backup_at: row.try_get("last_backup_at").map_err(get)?,
            backup_interval_min: row.try_get("backup_interval_min").map_err(get)?,
        })
    }

    /// Whether a delete was accepted (`deleted_at` is set).
    pub fn deleting(&self) -> bool {
        self.deleted_at.is_some()
    }

    /// The spec a host needs for a command about this sandbox.
    pub fn spec(&self) -> SandboxSpec {
        SandboxSpec {
            org_id: self.org_id,
            template: self.template.clone(),
            resources: self.resources,
            runtime: self.runtime,
            disk_mib: self.disk_mib,
            network: self.network.clone(),
            env: self.env.clone(),
            entrypoint: self.entrypoint.clone(),
            image: self.image.clone(),
        }
    }
}

/// An `env` column's value (a JSON object of strings) as its pairs, in key order.
fn env(value: serde_json::Value) -> Result<Vec<(String, String)>, StoreError> {
    let serde_json::Value::Object(map) = value else {
        return Err(corrupt("sandboxes.env", "not a JSON object"));
    };
    map.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(v) => Ok((k, v)),
            other => Err(corrupt(
                "sandboxes.env",
                format!("{k}: {other} is not a string"),
            )),
        })
        .collect()
}

/// Pairs as an `env` column's value (a JSON object of strings; a later pair of a name wins).
fn env_column(pairs: &[(String, String)]) -> serde_json::Value {
    serde_json::Value::Object(
        pairs
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect(),
    )
}

/// `vcpus` and `memory_mib` columns (both `integer`) as [`Resources`]; the only place they are
/// read. A negative value (which the table's CHECKs forbid) reads as 0.
pub(crate) fn resources(vcpus: i32, memory_mib: i32) -> Resources {
    Resources {
        vcpus: u32::try_from(vcpus).unwrap_or(0),
        memory_mib: u32::try_from(memory_mib).unwrap_or(0),
    }
}

/// [`Resources`] as the `integer` columns they are written to; the only place they are written.
pub(crate) fn resource_columns(r: Resources) -> (i32, i32) {
    (
        i32::try_from(r.vcpus).unwrap_or(i32::MAX),
        i32::try_from(r.memory_mib).unwrap_or(i32::MAX),
    )
}

fn stop_mode(s: &str) -> Result<StopMode, StoreError> {
    [StopMode::Memory, StopMode::Disk]
        .into_iter()
        .find(|m| m.as_str() == s)
        .ok_or_else(|| corrupt("sandboxes.last_stop", s))
}

/// The `last_stop_code` and `last_stop_reason` columns (set together, a CHECK says) as a
/// [`StopFallback`].
pub(crate) fn stop_fallback(
    code: Option<String>,
    reason: Option<String>,
) -> Result<Option<StopFallback>, StoreError> {
    let Some(code) = code else {
        return Ok(None);
    };
    Ok(Some(StopFallback {
        code: code
            .parse()
            .map_err(|e| corrupt("sandboxes.last_stop_code", e))?,
        detail: reason.unwrap_or_default(),
    }))
}

/// A `network` column's value (`{"egress": …}`, see [`Network::from_api`]).
pub(crate) fn network(value: &serde_json::Value) -> Result<Network, StoreError> {
    Network::from_api(value).map_err(|e| corrupt("sandboxes.network", e))
}

/// A `runtime` column's value (`runc`, `runsc`).
pub(crate) fn runtime(s: &str) -> Result<Runtime, StoreError> {
    s.parse().map_err(|e| corrupt("runtime", e))
}

fn corrupt(column: &'static str, message: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        column,
        message: message.to_string(),
    }
}

fn rows(rows: &[PgRow]) -> Result<Vec<SandboxRow>, StoreError> {
    rows.iter().map(SandboxRow::from_row).collect()
}

/// A sandbox to create, already placed on `host_id` (whose capacity the caller reserved).
#[derive(Debug, Clone)]
pub struct NewSandbox {
    /// Its id: a warm slot's the create claimed in this transaction ([`crate::warm::claim`]);
    /// `None`: a new one ([`SandboxId::new`]).
    pub id: Option<SandboxId>,
    /// The org that owns it.
    pub org_id: OrgId,
    /// The template to provision from (a `templates.name`, already checked to exist).
    pub template: String,
    /// The runtime the template names.
    pub runtime: Runtime,
    /// The template's image pinned to its digest (`templates.image_pinned`); `None` for a
    /// template not pulled from an image.
    pub image: Option<String>,
    /// The host placement chose; its capacity is already reserved in this transaction.
    pub host_id: HostId,
    /// Its size: whole vCPUs and MiB.
    pub resources: Resources,
    /// The user's metadata object, stored as given.
    pub metadata: serde_json::Value,
    /// Minutes without activity before auto-stop; `None`: never.
    pub auto_stop_minutes: Option<i32>,
    /// Minutes stopped (or failed) before auto-delete; `None`: never.
    pub auto_delete_minutes: Option<i32>,
    /// Days stopped before auto-archive; `None`: never.
    pub auto_archive_days: Option<i32>,
    /// Minutes between the reconciler's backups while running; `None`: none.
    pub backup_interval_min: Option<i32>,
    /// The size of its writable disk in MiB (validated by the API, never 0).
    pub disk_mib: u32,
    /// Its network policy, already validated.
    pub network: Network,
    /// Whether a preview request starts it when it is stopped.
    pub auto_resume: bool,
    /// Ports reachable through the preview proxy without a key (validated: 1 to 65535).
    pub public_ports: Vec<u16>,
    /// When its expiry applies; `None`: never.
    pub expires_at: Option<DateTime<Utc>>,
    /// What its expiry does.
    pub on_expiry: ExpiryAction,
    /// Environment variables for every exec and the entrypoint (validated names).
    pub env: Vec<(String, String)>,
    /// The argv started in the background at each boot from disk; empty: none.
    pub entrypoint: Vec<String>,
    /// The image named through the OpenSandbox surface, shown back by its `GET`.
    pub image_uri: Option<String>,
    /// A clone's ready snapshot: the row is written `resuming` with a `sandbox.clone` command
    /// naming it, instead of `provisioning` with a `sandbox.create`.
    pub from_snapshot: Option<SnapshotId>,
}

/// Writes a new `provisioning` sandbox (or, cloned from a snapshot, `resuming`) holding the
/// capacity its placement reserved, its `sandbox.create` (`sandbox.clone`) command and its
/// event, in the caller's transaction (guarantee 1), under [`NewSandbox::id`] or a new id.
/// Returns the row and the command id.
pub async fn create(
    conn: &mut PgConnection,
    new: NewSandbox,
) -> Result<(SandboxRow, CommandId), StoreError> {
    // `SandboxId::default()` is a new (UUIDv7) id.
    let id = new.id.unwrap_or_default();
    let generation = Generation::INITIAL;
    let (vcpus, memory_mib) = resource_columns(new.resources);
    let (state, kind) = match new.from_snapshot {
        None => (SandboxState::Provisioning, CommandKind::Create),
        Some(_) => (SandboxState::Resuming, CommandKind::Clone),
    };
    let row = timed(
        Op::SandboxInsert,
        sqlx::query(&format!(
            "INSERT INTO sandboxes (id, org_id, template, host_id, state, generation, vcpus,
                                    memory_mib, holds_capacity, metadata, auto_stop_minutes,
                                    auto_delete_minutes, runtime, disk_mib, network,
                                    auto_resume, public_ports, expires_at, on_expiry, env,
                                    entrypoint, image_uri, image, auto_archive_days,
                                    seed_snapshot, backup_interval_min)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, true, $9, $10, $11, $12, $13, $14, $15, $16,
                     $17, $18, $19, $20, $21, $22, $23, $24,
                     COALESCE($25, (SELECT backup_interval_min FROM orgs WHERE id = $2)))
             RETURNING {COLUMNS}"
        ))
        .bind(id)
        .bind(new.org_id)
        .bind(&new.template)
        .bind(new.host_id)
        .bind(state.as_str())
        .bind(generation)
        .bind(vcpus)
        .bind(memory_mib)
        .bind(&new.metadata)
        .bind(new.auto_stop_minutes)
        .bind(new.auto_delete_minutes)
        .bind(new.runtime.as_str())
        .bind(i32::try_from(new.disk_mib).unwrap_or(i32::MAX))
        .bind(new.network.to_api())
        .bind(new.auto_resume)
        .bind(
            new.public_ports
                .iter()
                .map(|p| i32::from(*p))
                .collect::<Vec<i32>>(),
        )
        .bind(new.expires_at)
        .bind(new.on_expiry.as_str())
        .bind(env_column(&new.env))
        .bind(&new.entrypoint)
        .bind(&new.image_uri)
        .bind(&new.image)
        .bind(new.auto_archive_days)
        .bind(new.from_snapshot)
        .bind(new.backup_interval_min)
        .fetch_one(&mut *conn),
    )
    .await?;
    let row = SandboxRow::from_row(&row)?;
    let command = Command {
        snapshot: new.from_snapshot.map(|snapshot_id| SnapshotOrder {
            snapshot_id,
            parent: None,
            disk_only: false,
        }),
        id: CommandId::new(),
        sandbox_id: id,
        generation,
        kind,
        spec: Some(row.spec()),
    };
    commands::insert(&mut *conn, new.host_id, &command).await?;
    events::insert(
        conn,
        &NewEvent {
            sandbox_id: id,
            org_id: new.org_id,
            from: None,
            to: state,
            reason: Reason::UserRequest,
            generation,
            command_id: Some(command.id),
            message: None,
            stop: None,
        },
    )
    .await?;
    Ok((row, command.id))
}

/// The org's sandbox `id`, or `None` (also for another org's sandbox: guarantee 7).
pub async fn get(
    db: impl PgExecutor<'_>,
    org: OrgId,
    id: SandboxId,
) -> Result<Option<SandboxRow>, StoreError> {
    let row = timed(
        Op::SandboxGet,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes WHERE id = $1 AND org_id = $2"
        ))
        .bind(id)
        .bind(org)
        .fetch_optional(db),
    )
    .await?;
    row.as_ref().map(SandboxRow::from_row).transpose()
}

/// Locks the sandbox's row (`FOR UPDATE`) in the caller's transaction and reads it; scoped to
/// `org` when given (a user's request), any org otherwise (the control plane).
pub async fn lock(
    conn: &mut PgConnection,
    id: SandboxId,
    org: Option<OrgId>,
) -> Result<Option<SandboxRow>, StoreError> {
    let row = timed(
        Op::SandboxLock,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes
              WHERE id = $1 AND ($2::uuid IS NULL OR org_id = $2)
              FOR UPDATE"
        ))
        .bind(id)
        .bind(org)
        .fetch_optional(conn),
    )
    .await?;
    row.as_ref().map(SandboxRow::from_row).transpose()
}

/// One page of the org's sandboxes, newest first: those in `state` (without it, all but
/// tombstones) whose metadata holds every pair of `metadata` (a JSON object of strings) when
/// given, older than `before` when given, at most `limit`.
pub async fn list(
    db: impl PgExecutor<'_>,
    org: OrgId,
    state: Option<SandboxState>,
    metadata: Option<&serde_json::Value>,
    before: Option<SandboxId>,
    limit: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    let found = timed(
        Op::SandboxList,
        sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes
              WHERE org_id = $1
                AND ($2::text IS NULL AND state <> 'deleted' OR state = $2)
                AND ($3::uuid IS NULL OR id < $3)
                AND ($5::jsonb IS NULL OR metadata @> $5)
              ORDER BY id DESC
              LIMIT $4"
        ))
        .bind(org)
        .bind(state.map(SandboxState::as_str))
        .bind(before)
        .bind(limit)
        .bind(metadata)
        .fetch_all(db),
    )
    .await?;
    rows(&found)
}

/// One sandbox by id, of whichever org (the preview proxy learns the org from the row, then
/// checks the caller against it); `None` when no row has that id.
pub async fn find(
    db: impl PgExecutor<'_>,
    id: SandboxId,
) -> Result<Option<SandboxRow>, StoreError> {
    let found = timed(
        Op::SandboxGet,
        sqlx::query(&format!("SELECT {COLUMNS} FROM sandboxes WHERE id = $1"))
            .bind(id)
            .fetch_optional(db),
    )
    .await?;
    found.as_ref().map(SandboxRow::from_row).transpose()
}

/// Marks the sandbox active now (`last_activity_at`, which auto-stop measures from).
pub async fn touch(db: impl PgExecutor<'_>, id: SandboxId) -> Result<(), StoreError> {
    timed(
        Op::SandboxTouch,
        sqlx::query("UPDATE sandboxes SET last_activity_at = now() WHERE id = $1")
            .bind(id)
            .execute(db),
    )
    .await?;
    Ok(())
}

/// What the org's capacity-holding sandboxes use (its quota's measure).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// How many sandboxes hold capacity (the `max_running` measure).
    pub sandboxes: i64,
    /// Their summed vCPUs (whole vCPUs).
    pub vcpus: i64,
    /// Their summed memory, MiB.
    pub memory_mib: i64,
}

/// Sums the org's sandboxes that hold capacity and are not being deleted.
pub async fn org_usage(conn: &mut PgConnection, org: OrgId) -> Result<Usage, StoreError> {
    let (sandboxes, vcpus, memory_mib): (i64, i64, i64) = timed(
        Op::SandboxOrgUsage,
        sqlx::query_as(
            "SELECT count(*), COALESCE(sum(vcpus), 0)::int8, COALESCE(sum(memory_mib), 0)::int8
               FROM sandboxes WHERE org_id = $1 AND holds_capacity AND deleted_at IS NULL",
        )
        .bind(org)
        .fetch_one(conn),
    )
    .await?;
    Ok(Usage {
        sandboxes,
        vcpus,
        memory_mib,
    })
}

mod archive;
mod backup;
mod compat;
mod converge;
mod migrate;
mod settings;
mod superseded;
mod write;

pub use archive::{
    deleted_with_durable, free_archived_copy, take_durable, unarchive, write_durable,
};
pub use backup::{restore_from_backup, vacate_for_backup, BackupRestore};
pub use compat::{execd_token, find_with_execd_token, list_in_states};
pub use converge::{
    capacity_drift, count_by_state, guest_tallies, lock_due, lock_failed_guests, lock_stranded,
    lock_timed_out, note_failover_deferred, purge_tombstones, CommandTimeouts, Due, GuestTally,
    Judging, Stranded, TimedOut,
};
pub use migrate::{leave_old_host, migrate};
pub use settings::{clear_expiry, lock_expired, update_settings, SettingsChange};
pub use superseded::{supersede, supersede_unnamed, superseded_count, take_superseded, Superseded};
pub use write::{move_create, write_result, write_transition, ResultWrite, Transition, Written};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_column_list_is_qualified_with_the_alias() {
        let qualified = columns_of("s");
        assert!(qualified.starts_with("s.id, s.org_id, "));
        assert_eq!(qualified.matches("s.").count(), COLUMNS.split(", ").count());
    }

    #[test]
    fn resources_round_trip_through_their_columns() {
        let r = Resources {
            vcpus: 3,
            memory_mib: 1536,
        };
        let (v, m) = resource_columns(r);
        assert_eq!(resources(v, m), r);
        assert_eq!(resources(-1, -1), Resources::default());
    }
}
