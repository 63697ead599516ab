//! Wire messages between the control plane and hosts: postcard inside a versioned envelope.
//!
//! # Guarantees
//! - Every message travels as [`Envelope`] `{ version, body }`; [`decode`] refuses a version it
//!   does not know with [`WireError::UnsupportedVersion`] rather than misreading bytes.
//! - Enums and structs are append-only: a change is a new enum variant (postcard encodes the
//!   variant index as a varint), never a reordering. The golden-byte tests below pin the current version.
//!
//! External event consumers get JSON (CloudEvents), not these bytes.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::ids::{CommandId, Generation, HostId, OrgId, SandboxId, SnapshotId};
use crate::state::CommandKind;

/// The envelope version this build writes and reads.
///
/// Version 16: a [`SnapshotOrder`] ends with `disk_only` (a backup, issue 14).
/// Version 15: a command kind, [`CommandKind::Migrate`] (whose
/// [`Command::snapshot`] names the durable stop snapshot to fetch onto another host).
/// Version 14: two command kinds, [`CommandKind::Archive`] and
/// [`CommandKind::Unarchive`] (whose [`Command::snapshot`] names the stop snapshot to fetch),
/// and [`ResultOutcome::Durable`]: a stop snapshot stored in the object store (a second
/// result of a stop, sent once its upload is confirmed, and the success of an archive).
/// Version 13: two command kinds, [`CommandKind::Restore`] and
/// [`CommandKind::Clone`], whose [`Command::snapshot`] names the snapshot to boot from.
/// Version 12: a sandbox's spec ends with the OCI image its template was pulled
/// from, pinned to its digest ([`SandboxSpec::image`]). Version 11: a `sandbox.snapshot` command ([`CommandKind::Snapshot`]) carries a
/// [`SnapshotOrder`] ([`Command::snapshot`]) and is answered by
/// [`ResultOutcome::Snapshotted`]. Version 10: a sandbox's spec ends with its `env` and
/// `entrypoint` (the OpenSandbox compatibility surface). Version 9: a result ends with the
/// host's apply time ([`CommandResult::apply_ms`]); an interactive session on a
/// pseudo-terminal ([`AgentOp::Tty`]) and its input ([`AgentOp::TtyInput`]). Version 7: a stop that wanted memory and kept the disk only says why
/// ([`ResultOutcome::StoppedOnDisk`]). Version 6: a heartbeat ends with its host-side send time
/// ([`Heartbeat::sent_at_ms`]) and a result with the host's heartbeat sequence at the moment the
/// command was applied ([`CommandResult::heartbeat_seq`]). Version 5: a heartbeat ends with the
/// host's port-forwarder address. Version 4: a result may be [`ResultOutcome::Rejected`] (the
/// request's fault, not the host's). Version 3: a sandbox's spec carries its disk limit
/// (`disk_mib`) and then its network policy. Version 2: a command's spec is optional and names
/// the sandbox's runtime.
/// Version 17: no change of bytes, but of meaning: a `sandbox.archive`'s
/// [`Command::snapshot`] names the stop snapshot the control plane recorded durable, the only
/// one the host may reuse, and the host keeps the disk until the control plane's
/// `sandbox.delete` frees it (a host of version 16 frees it on its own, before the chunk check,
/// so it must not meet this control plane).
/// Version 18 (this one): a [`Heartbeat`] ends with its host's [`WarmSlot`]s.
/// Older bytes are refused (every component of a deployment runs the same build).
pub const WIRE_VERSION: u16 = 18;

/// `{ version, body }`; `version` is [`WIRE_VERSION`] when written by this build.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope<T> {
    /// The wire version the body was encoded at; [`decode`] refuses any but [`WIRE_VERSION`].
    pub version: u16,
    /// The message itself, postcard-encoded after the version.
    pub body: T,
}

/// Errors of [`decode`].
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The envelope names a version other than [`WIRE_VERSION`] (a peer of another build).
    #[error("unsupported wire version {found} (this build reads {WIRE_VERSION})")]
    UnsupportedVersion {
        /// The version the envelope carried.
        found: u16,
    },
    /// The bytes are not a postcard envelope of the expected type (truncated or of another
    /// message).
    #[error("malformed message: {0}")]
    Malformed(#[from] postcard::Error),
}

/// Encodes `body` in a version-[`WIRE_VERSION`] envelope.
pub fn encode<T: Serialize>(body: &T) -> Vec<u8> {
    #[derive(Serialize)]
    struct EnvelopeRef<'a, T> {
        version: u16,
        body: &'a T,
    }
    postcard::to_stdvec(&EnvelopeRef {
        version: WIRE_VERSION,
        body,
    })
    .expect("postcard encoding of an owned value into a Vec cannot fail")
}

/// Decodes an envelope, checking its version first.
///
/// Errors: [`WireError::UnsupportedVersion`], [`WireError::Malformed`].
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, WireError> {
    let (version, rest): (u16, &[u8]) = postcard::take_from_bytes(bytes)?;
    if version != WIRE_VERSION {
        return Err(WireError::UnsupportedVersion { found: version });
    }
    Ok(postcard::from_bytes(rest)?)
}

/// Resources in the units the API uses: whole vCPUs and MiB of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Resources {
    /// Whole vCPUs.
    pub vcpus: u32,
    /// Memory in MiB.
    pub memory_mib: u32,
}

/// The OCI runtime a sandbox runs in, as its template names it in Postgres (`templates.runtime`,
/// copied to `sandboxes.runtime` at create). Append-only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Runtime {
    /// runc: a stop keeps the disk only.
    #[default]
    Runc,
    /// runsc (gVisor): a stop checkpoints memory too.
    Runsc,
}

impl Runtime {
    /// Every runtime.
    pub const ALL: [Runtime; 2] = [Runtime::Runc, Runtime::Runsc];

    /// The spelling of `templates.runtime` and of hostd's drivers (`runc`, `runsc`).
    pub fn as_str(self) -> &'static str {
        match self {
            Runtime::Runc => "runc",
            Runtime::Runsc => "runsc",
        }
    }
}

impl std::str::FromStr for Runtime {
    type Err = crate::state::UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Runtime::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| crate::state::UnknownState(s.to_owned()))
    }
}

/// What a host needs to build or boot a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// The org the sandbox belongs to.
    pub org_id: OrgId,
    /// Template name (`base`, …).
    pub template: String,
    /// Its size.
    pub resources: Resources,
    /// The runtime its template names (hostd records written before this field read as runc).
    #[serde(default)]
    pub runtime: Runtime,
    /// The size of the sandbox's writable disk in MiB (`sandboxes.disk_mib`): what it may
    /// write beyond its template. 0 means no limit: a sandbox created before disk limits
    /// (its row and its hostd record predate the field); the API never writes 0.
    #[serde(default)]
    pub disk_mib: u32,
    /// Where its traffic may go (hostd records written before this field read as the default,
    /// public egress). See [`crate::network`].
    #[serde(default)]
    pub network: crate::network::Network,
    /// Environment variables set for every exec in the sandbox and for its entrypoint, in
    /// order (a later pair of the same name wins; an exec's own `env` wins over these).
    /// Empty for a sandbox created without (hostd records written before this field read as
    /// empty). Given by the OpenSandbox compatibility surface's `env`, or the API's `env`.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// The argv hostd starts in the background, with [`SandboxSpec::env`], each time the
    /// sandbox boots from its disk (a create, a start after a disk-only stop; a memory restore
    /// keeps it running). Empty: nothing is started. The OpenSandbox SDK's `entrypoint`.
    #[serde(default)]
    pub entrypoint: Vec<String>,
    /// For a template pulled from an OCI image: the image pinned to its manifest digest
    /// (`registry/repo@sha256:...`, `templates.image_pinned`), which the host pulls into its
    /// image cache if it lacks it. `None` for built-in and imported templates (and in hostd
    /// records written before this field).
    #[serde(default)]
    pub image: Option<String>,
}

/// A command for one host, published on `{p}.cmd.<host_id>` with `Nats-Msg-Id` = `id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Command {
    /// The command's id (`commands.id`), also its `Nats-Msg-Id` for JetStream dedup; the
    /// result echoes it.
    pub id: CommandId,
    /// The sandbox the command acts on.
    pub sandbox_id: SandboxId,
    /// The sandbox generation this command was issued at (the fence).
    pub generation: Generation,
    /// What to do: create, start, stop (with its mode) or delete.
    pub kind: CommandKind,
    /// The sandbox's spec: a host needs it for `Create`, and for `Start` when it has no local
    /// record (for instance a start after a failed create). `None` only for a `Delete` of a
    /// container whose row was purged (the host reported it, so it has its own record).
    pub spec: Option<SandboxSpec>,
    /// For a [`CommandKind::Snapshot`]: which snapshot to take; for a [`CommandKind::Restore`]
    /// or [`CommandKind::Clone`]: which snapshot to boot from (`parent` is `None`); for a
    /// [`CommandKind::Archive`]: the durable stop snapshot the control plane recorded, the only
    /// earlier stop the host may reuse (else `None`: it uploads the disk anew); `None` for
    /// every other kind.
    pub snapshot: Option<SnapshotOrder>,
}

/// What a `sandbox.snapshot` command asks (issue 13 item 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotOrder {
    /// The snapshot row to fill (`snapshots.id`); its manifest is stored under this id.
    pub snapshot_id: SnapshotId,
    /// The sandbox's newest ready snapshot taken on this host: the new one stores only what
    /// changed since it. `None`: a full snapshot.
    pub parent: Option<SnapshotId>,
    /// Capture the disk only, even where the runtime could keep the memory (a backup, issue
    /// 14): no checkpoint, only the brief freeze of the disk capture.
    pub disk_only: bool,
}

/// What a host stored for a snapshot, reported once its manifest is in the object store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotStored {
    /// Whether it holds the memory too (gVisor), not only the disk.
    pub memory: bool,
    /// Bytes of its files.
    pub logical_bytes: u64,
    /// Compressed bytes of the distinct chunks it references.
    pub stored_bytes: u64,
    /// Compressed bytes of the chunks its parent did not reference.
    pub new_bytes: u64,
    /// How long the sandbox was frozen for it, milliseconds (0 for a stopped sandbox).
    pub paused_ms: u32,
    /// Every chunk it references: SHA-256 (lowercase hex) and compressed bytes.
    pub chunks: Vec<(String, u32)>,
}

/// How a stop kept the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopMode {
    /// Memory snapshot plus disk: processes continue on start.
    Memory,
    /// Disk only: the next start cold-boots.
    Disk,
}

impl StopMode {
    /// The API spelling (`memory`, `disk`).
    pub fn as_str(self) -> &'static str {
        match self {
            StopMode::Memory => "memory",
            StopMode::Disk => "disk",
        }
    }
}

/// What a host did with a command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResultOutcome {
    /// The work is done. `address` is the sandbox's IPv4 address when it runs.
    Succeeded {
        /// The sandbox's IPv4 address (dotted quad) after a create or start; `None` otherwise.
        address: Option<String>,
        /// How a stop kept the sandbox; `None` for every kind but a stop.
        last_stop: Option<StopMode>,
    },
    /// The runtime failed; `reason` is a human-readable cause.
    Failed {
        /// The runtime's error, for the event and the operator; not parsed.
        reason: String,
    },
    /// The host refused the command without acting: its generation is older than the last the
    /// host applied for that sandbox.
    RefusedStale {
        /// The newest generation the host applied for this sandbox.
        applied: Generation,
    },
    /// The command failed because of what it asked, not because of the host: a template or
    /// runtime the host does not offer, a command without the spec it needs. Another host
    /// would fail it the same way, so it is never retried elsewhere and never counts against
    /// the host's health ([`crate::state::Fault::Request`]). `Failed` is the host's fault.
    Rejected {
        /// Why, for the event and the user; not parsed.
        reason: String,
    },
    /// A stop that wanted to keep memory (a runtime with memory snapshots, its container
    /// running) kept the disk only: it succeeded like `Succeeded { last_stop: Some(Disk) }`,
    /// and says why. The sandbox's processes are gone; its next start cold-boots.
    StoppedOnDisk {
        /// Why the memory snapshot was not kept.
        fallback: StopFallback,
    },
    /// A snapshot is durable in the object store (its manifest stored); the sandbox is as it
    /// was. A snapshot that failed is [`ResultOutcome::Failed`], and the sandbox is untouched.
    Snapshotted(SnapshotStored),
    /// A stopped sandbox's stop snapshot is durable in the object store (its manifest stored,
    /// issue 14): sent by a host as a second result of a `sandbox.stop` once its background
    /// upload is confirmed, and as the success of a `sandbox.archive` (the local disk is freed
    /// only after that). A failed upload of a stop sends nothing; of an archive, `Failed`.
    Durable(StopDurable),
}

/// A stop snapshot stored in the object store (wire v14).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopDurable {
    /// The manifest's id: an unarchive fetches it ([`Command::snapshot`]).
    pub snapshot_id: SnapshotId,
    /// Whether it holds the memory too (a gVisor memory stop), not only the disk.
    pub memory: bool,
    /// Compressed bytes of the distinct chunks it references.
    pub stored_bytes: u64,
    /// Every chunk it references: SHA-256 (lowercase hex) and compressed bytes.
    pub chunks: Vec<(String, u32)>,
}

/// The most characters of a runtime's error a [`StopFallback`] carries (it travels in a
/// result, is stored on the sandbox and in its event); a longer error keeps its start.
pub const STOP_FALLBACK_DETAIL_MAX_CHARS: usize = 512;

/// Why a stop that wanted memory kept the disk only (issue 12 item 4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopFallback {
    /// What failed, for programs.
    pub code: StopFallbackCode,
    /// The runtime's error, for people; at most [`STOP_FALLBACK_DETAIL_MAX_CHARS`] characters.
    pub detail: String,
}

impl StopFallback {
    /// A fallback with `detail` cut to [`STOP_FALLBACK_DETAIL_MAX_CHARS`] characters (an
    /// ellipsis marks a cut), whitespace runs (a runtime's multi-line error) made one space.
    pub fn new(code: StopFallbackCode, detail: &str) -> Self {
        let flat = detail.split_whitespace().collect::<Vec<_>>().join(" ");
        let detail = if flat.chars().count() > STOP_FALLBACK_DETAIL_MAX_CHARS {
            let mut cut: String = flat
                .chars()
                .take(STOP_FALLBACK_DETAIL_MAX_CHARS - 1)
                .collect();
            cut.push('…');
            cut
        } else {
            flat
        };
        Self { code, detail }
    }
}

/// What made a memory stop keep the disk only. Append-only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopFallbackCode {
    /// The runtime's checkpoint failed (gVisor: `runsc checkpoint` reported an error, for
    /// instance `EOF` when the sandbox's cgroup ran out of memory mid-checkpoint).
    CheckpointFailed,
}

impl StopFallbackCode {
    /// Every code.
    pub const ALL: [StopFallbackCode; 1] = [StopFallbackCode::CheckpointFailed];

    /// The spelling stored in Postgres and shown by the API (`checkpoint_failed`).
    pub fn as_str(self) -> &'static str {
        match self {
            StopFallbackCode::CheckpointFailed => "checkpoint_failed",
        }
    }
}

impl std::str::FromStr for StopFallbackCode {
    type Err = crate::state::UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        StopFallbackCode::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| crate::state::UnknownState(s.to_owned()))
    }
}

impl ResultOutcome {
    /// Whose fault a failure was: `Some(Fault::Request)` for [`ResultOutcome::Rejected`],
    /// `Some(Fault::Host)` for [`ResultOutcome::Failed`], `None` for the rest.
    pub fn fault(&self) -> Option<crate::state::Fault> {
        match self {
            ResultOutcome::Failed { .. } => Some(crate::state::Fault::Host),
            ResultOutcome::Rejected { .. } => Some(crate::state::Fault::Request),
            ResultOutcome::Succeeded { .. }
            | ResultOutcome::StoppedOnDisk { .. }
            | ResultOutcome::Snapshotted(_)
            | ResultOutcome::Durable(_)
            | ResultOutcome::RefusedStale { .. } => None,
        }
    }
}

/// A command's result, published on `{p}.result.<host_id>` after the work is done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandResult {
    /// The [`Command::id`] this answers.
    pub command_id: CommandId,
    /// The command's sandbox.
    pub sandbox_id: SandboxId,
    /// The host that did the work (the subject's `<host_id>`).
    pub host_id: HostId,
    /// The command's generation, echoed so the reconciler can fence the result.
    pub generation: Generation,
    /// The command's kind, echoed.
    pub kind: CommandKind,
    /// What the host did.
    pub outcome: ResultOutcome,
    /// The host's newest [`Heartbeat::seq`] when the work was done: every heartbeat with a
    /// greater `seq` observed its inventory after this command was applied, so only those are
    /// evidence about the sandbox's state after it (the reconciler's pass judges nothing on an
    /// older one). 0 when the host had not sent a heartbeat yet.
    pub heartbeat_seq: u64,
    /// Milliseconds the host spent applying the command, from the start of its apply to its
    /// result (the runtime calls and the agent's boot; no time in NATS or the control plane's
    /// queues): what the reconciler judges a host's boot speed by (wire v9 and later). A replayed result
    /// carries the replay's own time.
    pub apply_ms: u32,
}

/// A sandbox's status as the host sees it, reported in every heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuestStatus {
    /// The container runs and its agent answers.
    Running,
    /// The container runs but its agent does not answer.
    Unhealthy,
    /// Kept on disk (and in memory where the runtime can), no process.
    Stopped,
}

impl GuestStatus {
    /// The spelling stored in a host's inventory (`running`, `unhealthy`, `stopped`).
    pub fn as_str(self) -> &'static str {
        match self {
            GuestStatus::Running => "running",
            GuestStatus::Unhealthy => "unhealthy",
            GuestStatus::Stopped => "stopped",
        }
    }
}

/// One inventory line of a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InventoryItem {
    /// A sandbox the host holds (running or stopped).
    pub sandbox_id: SandboxId,
    /// The last generation the host applied for it.
    pub generation: Generation,
    /// Its status on the host.
    pub status: GuestStatus,
}

/// A runtime a host offers, with what it can do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeInfo {
    /// `runc`, `runsc`.
    pub name: String,
    /// Whether stop can keep memory (checkpoint/restore).
    pub memory_snapshot: bool,
}

/// A host's heartbeat, published every few seconds on `{p}.hb.<host_id>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The sending host (also the subject's `<host_id>`).
    pub host_id: HostId,
    /// Human-readable host name (hostname plus index in `berth dev`).
    pub name: String,
    /// Strictly increasing per host, across hostd restarts too: each heartbeat takes
    /// `max(previous + 1, sent_at_ms)`, so a restarted hostd (whose clock moved on) continues
    /// above its predecessor. Taken before the inventory is observed, so a heartbeat with a
    /// greater `seq` than [`CommandResult::heartbeat_seq`] saw the host after that command.
    /// Lets a consumer drop an older heartbeat that arrives late (the newest wins).
    pub seq: u64,
    /// What the host offers to sandboxes.
    pub capacity: Resources,
    /// What its running sandboxes use, as the host counts them (informational; the control
    /// plane's reservation is authoritative).
    pub used: Resources,
    /// The OCI runtimes the host can run (at least runc).
    pub runtimes: Vec<RuntimeInfo>,
    /// Every sandbox the host holds, one line each; the reconciler compares it with Postgres.
    pub inventory: Vec<InventoryItem>,
    /// Where the host's preview port forwarder listens (`ip:port`); `None`: it runs none.
    pub forwarder: Option<String>,
    /// When the host began observing this heartbeat's inventory, in milliseconds since the
    /// Unix epoch on the host's clock: the inventory is no older than this. The consumer
    /// measures its ingest lag against it, and the reconciler judges a sandbox only on an
    /// inventory taken after the sandbox's last change.
    pub sent_at_ms: u64,
    /// The host's warm pool: sandboxes it booted ahead of any create, each under an id the
    /// host drew ([`SandboxId::new`]), none of them in [`Heartbeat::inventory`]. A create
    /// whose spec has a slot's shape may take the slot's id (issue 16 lever 1); the host then
    /// hands that sandbox over instead of booting one. Their resources are counted out of
    /// [`Heartbeat::capacity`] already.
    pub warm: Vec<WarmSlot>,
}

/// One sandbox of a host's warm pool (see [`Heartbeat::warm`]): booted with the template's
/// files and these limits, its agent answering, no entrypoint run, no egress admitted. A
/// create matches it when its template, runtime, resources, disk size and pinned image are
/// these; the rest of the spec (org, env, entrypoint, network policy) is set at hand-over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmSlot {
    /// The id the sandbox runs under; a create that takes the slot gets this id.
    pub sandbox_id: SandboxId,
    /// Its template's name.
    pub template: String,
    /// Its runtime.
    pub runtime: Runtime,
    /// Its limits.
    pub resources: Resources,
    /// Its disk size in MiB ([`SandboxSpec::disk_mib`]).
    pub disk_mib: u32,
    /// Its pinned image ([`SandboxSpec::image`]); `None` for a built-in or imported template.
    pub image: Option<String>,
}

/// A request for a sandbox's agent, sent through its host by NATS request/reply on
/// `{p}.agent.<host_id>`; it replaced the plain exec request of `{p}.exec.<host_id>`, whose
/// types only the golden-byte test keeps (see `tests::legacy`). New operations are new
/// [`AgentOp`] variants at the end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRequest {
    /// The sandbox whose agent answers; the host refuses one it does not hold.
    pub sandbox_id: SandboxId,
    /// What to ask of the agent.
    pub op: AgentOp,
}

/// What to ask of the agent. Paths are absolute paths inside the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentOp {
    /// Run a process (see [`ExecSpec`]); answered with [`AgentReply::Exec`].
    Exec(ExecSpec),
    /// Describe a path; answered with [`AgentReply::Stat`].
    Stat {
        /// Absolute path in the sandbox.
        path: String,
    },
    /// Read at most `len` bytes of a file from `offset`; answered with [`AgentReply::Data`].
    Read {
        /// Absolute path of the file in the sandbox.
        path: String,
        /// Byte offset to start from.
        offset: u64,
        /// Most bytes to return.
        len: u32,
    },
    /// Write `data` at `offset`, creating the file (mode 0644) and its parent dirs; with
    /// `truncate`, the file is first cut to `offset`. Answered with [`AgentReply::Written`].
    Write {
        /// Absolute path of the file in the sandbox.
        path: String,
        /// Byte offset to write at.
        offset: u64,
        /// The bytes to write.
        data: Vec<u8>,
        /// Cut the file to `offset` before writing.
        truncate: bool,
    },
    /// List a directory; answered with [`AgentReply::Listing`].
    List {
        /// Absolute path of the directory in the sandbox.
        path: String,
    },
    /// Rename `from` to `to` (same filesystem, replacing `to`); answered with
    /// [`AgentReply::Done`].
    Rename {
        /// Absolute path of the existing entry.
        from: String,
        /// Absolute path it gets.
        to: String,
    },
    /// Run a process and stream its output: the host publishes [`AgentReply::Output`]
    /// messages to the request's reply subject as output arrives, then one final
    /// [`AgentReply::Exec`] (without output) or [`AgentReply::Failed`]. The requester
    /// subscribes to its reply subject before publishing.
    ExecStream(ExecSpec),
    /// Like [`AgentOp::ExecStream`], with flow control: the host publishes at most `window`
    /// [`AgentReply::Output`] messages beyond those the requester has credited back with
    /// [`AgentOp::StreamCredit`], and otherwise stops reading the agent (so a slow reader slows
    /// the process's own pipe, never a buffer). The final reply needs no credit.
    ExecStreamWindowed {
        /// The process to run.
        spec: ExecSpec,
        /// Output messages the host may publish before the first credit (at least 1).
        window: u32,
    },
    /// Grants a [`AgentOp::ExecStreamWindowed`] stream `chunks` more output messages. Sent
    /// without a reply subject to the same `{p}.agent.<host>` subject; `reply_to` is the
    /// stream's reply subject, which names the stream. An unknown stream is ignored.
    StreamCredit {
        /// The reply subject of the stream's request.
        reply_to: String,
        /// How many more output messages the host may publish.
        chunks: u32,
    },
    /// The requester of a [`AgentOp::ExecStreamWindowed`] stream went away: the host stops
    /// forwarding its output (the process runs on to its timeout). Sent like
    /// [`AgentOp::StreamCredit`]; an unknown stream is ignored.
    StreamCancel {
        /// The reply subject of the stream's request.
        reply_to: String,
    },
    /// Remove a file (not a directory); answered with [`AgentReply::Done`], also when it was
    /// already gone. Used to clean up an upload's temporary sibling after a failure.
    Remove {
        /// Absolute path of the file in the sandbox.
        path: String,
    },
    /// Run a process on a new pseudo-terminal of `size` (an interactive shell): its stdin,
    /// stdout and stderr are the terminal, so its output comes as [`AgentReply::Output`] with
    /// `fd` 1, flow-controlled like [`AgentOp::ExecStreamWindowed`] (credits by
    /// [`AgentOp::StreamCredit`], an end by [`AgentOp::StreamCancel`], which hangs the
    /// terminal up), then one final [`AgentReply::Exec`] or [`AgentReply::Failed`]. Its input
    /// comes as [`AgentOp::TtyInput`]. `spec.stdin` is not used.
    Tty {
        /// The process to run (killed with its process group at `spec.timeout_ms`).
        spec: ExecSpec,
        /// The terminal's first size.
        size: TtySize,
        /// Output messages the host may publish before the first credit (at least 1).
        window: u32,
    },
    /// Input for the [`AgentOp::Tty`] session whose reply subject is `reply_to`. Sent with a
    /// reply subject of its own: the host answers [`AgentReply::Done`] once the input is
    /// queued for the agent (a requester sends the next input only then, which bounds what
    /// waits anywhere), or [`AgentReply::Failed`] with [`AgentFailure::NotFound`] when no such
    /// session runs.
    TtyInput {
        /// The reply subject of the session's [`AgentOp::Tty`] request.
        reply_to: String,
        /// Keystrokes or a new size.
        input: TtyInput,
    },
}

/// A terminal's size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtySize {
    /// Lines.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

/// One piece of input for a terminal session. Append-only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TtyInput {
    /// Bytes typed (or pasted) at the terminal, written to its master side.
    Data(Vec<u8>),
    /// The terminal was resized: its processes get `SIGWINCH`.
    Resize(TtySize),
}

/// A process to run in the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecSpec {
    /// argv; `argv[0]` is looked up on the guest's `PATH`.
    pub argv: Vec<String>,
    /// Extra environment, set over the default `PATH` and `HOME`.
    pub env: Vec<(String, String)>,
    /// Working directory; `/` when `None`.
    pub cwd: Option<String>,
    /// Bytes written to the process's stdin, which is then closed.
    pub stdin: Vec<u8>,
    /// Kill the process group after this many milliseconds.
    pub timeout_ms: u64,
}

/// What a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// Anything else (device, socket, FIFO).
    Other,
}

/// A path's metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// What the path is.
    pub kind: FileKind,
    /// Bytes.
    pub size: u64,
    /// Permission bits (`0o644`).
    pub mode: u32,
    /// Last modification, seconds since the Unix epoch.
    pub modified_unix: i64,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// The entry's file name (no directory part).
    pub name: String,
    /// Its metadata.
    pub stat: FileStat,
}

/// Why an agent request failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentFailure {
    /// The host has no such sandbox.
    NotFound,
    /// The sandbox exists but does not run (or is being stopped).
    NotRunning,
    /// The path does not exist in the sandbox.
    NoSuchPath,
    /// The request exceeds a size limit (`limit` bytes or entries).
    TooLarge {
        /// The limit that was exceeded, in bytes (or entries, for a listing).
        limit: u64,
    },
    /// Anything else the agent or the host reported (spawn failed, not a directory, …).
    Agent(String),
    /// The path is not a regular file (a device, FIFO or socket): refused without reading it,
    /// since such a read has no end (`/dev/zero`) or blocks (a FIFO without a writer).
    NotRegularFile,
}

/// The reply to an [`AgentRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentReply {
    /// The process ended (or was killed at its timeout, `timed_out`). `exit_code` is the exit
    /// status, or 128 + signal number when killed by a signal. `oom_killed`: the sandbox's
    /// memory cgroup killed a process during the exec (the host counted an OOM kill).
    Exec {
        /// Exit status, or 128 + signal number when killed by a signal.
        exit_code: i32,
        /// Everything the process wrote to stdout (empty in a streamed exec's final reply).
        stdout: Vec<u8>,
        /// Everything the process wrote to stderr (empty in a streamed exec's final reply).
        stderr: Vec<u8>,
        /// The process was killed at its [`ExecSpec::timeout_ms`].
        timed_out: bool,
        /// The sandbox's memory cgroup killed a process during the exec.
        oom_killed: bool,
    },
    /// The answer to [`AgentOp::Stat`].
    Stat(FileStat),
    /// The answer to [`AgentOp::Read`].
    Data {
        /// At most the requested `len` bytes from the requested offset.
        data: Vec<u8>,
        /// The file ends after `data`.
        eof: bool,
    },
    /// The answer to [`AgentOp::Write`].
    Written {
        /// How many bytes were written.
        bytes: u64,
    },
    /// The answer to [`AgentOp::List`]: the directory's entries.
    Listing(Vec<DirEntry>),
    /// The answer to an operation with nothing to return ([`AgentOp::Rename`]).
    Done,
    /// The operation failed, for the reason given.
    Failed(AgentFailure),
    /// A piece of a streamed exec's output: `fd` 1 is stdout, 2 is stderr.
    Output {
        /// 1 for stdout, 2 for stderr.
        fd: u8,
        /// The bytes, in the order the process wrote them on that fd.
        data: Vec<u8>,
    },
}

#[cfg(test)]
mod tests;
