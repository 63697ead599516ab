//! The warm pool (issue 16 lever 1): sandboxes booted ahead of any create, their agent
//! answering, handed to a create of the same shape instead of booting one.
//!
//! # How a create finds one
//! Each pooled sandbox runs under a [`SandboxId`] this host drew. The heartbeat lists the
//! ready ones ([`berth_schemas::wire::Heartbeat::warm`]); the API gives a create whose shape
//! ([`Shape`]: template, runtime, resources, disk size, pinned image) matches one of them that
//! slot's id, in the create's transaction. The create command then names a sandbox this host
//! already runs: [`crate::apply::up`] hands it over ([`crate::host::Backend::hand_over`]: the
//! create's network policy admitted, its entrypoint started; its env and org are in its record
//! from then on). What a pooled sandbox was booted with — its own address, netns, veth,
//! cgroup, disk, hostname and limits — is exactly what a fresh create of that shape would
//! get, since the pool builds it through the same [`crate::host::Backend::bring_up`].
//!
//! # Shapes
//! The pool of a template (`--warm-pool base=2`) takes the most frequent shape among the last
//! [`SHAPE_WINDOW`] creates of that template this host saw (ties: the newest; hostd does not
//! read templates from Postgres), so it starts filling at the first create and follows a
//! template whose defaults change, while one tenant's odd create cannot flip it (each flip
//! costs the host a rebuild of the pool and every other tenant its hits). Entries of an older
//! shape are removed. After a crash, the shape is that of the pooled sandboxes kept.
//!
//! # Memory
//! What pooled sandboxes may hold is bounded by [`POOL_MEMORY_SHARE`] of the host's memory
//! ([`WarmPool::held`] is taken off the capacity the heartbeat offers, never more than that
//! share): a pool of a big shape builds only what fits, so no tenant's shape can take the
//! host's capacity away from creates.
//!
//! # Guarantees
//! - A pooled sandbox is never handed over twice, nor removed while handed over: a command
//!   for it first [`WarmPool::claim`]s it, which waits out a build or removal in progress and
//!   takes it out of the pool for good.
//! - Nothing admitted while pooled: egress `none`, no entrypoint, no org.
//! - A pooled sandbox whose container died, whose build was cut by a crash, older than
//!   [`MAX_AGE`], or beyond its template's size is removed whole
//!   ([`crate::apply::delete::remove_everything`]); a create that names one removed meanwhile
//!   builds it fresh under that id.
//! - A hostd that stops gracefully removes its pool ([`empty`]): nothing it built outlives it
//!   but the sandboxes of the control plane. One killed leaves it to the next start, which
//!   adopts it.
//! - Pooled sandboxes' memory counts against the capacity the heartbeat reports
//!   ([`WarmPool::held`]; their vCPUs, a quota of an idle sandbox, do not).
//!
//! # Assumptions
//! Sandbox ids are UUIDv7: a pooled sandbox's id tells when it was drawn, so a handed-over
//! sandbox's id is up to [`MAX_AGE`] older than its create (list order by id is creation
//! order within that bound).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use berth_schemas::network::{Egress, Network};
use berth_schemas::wire::{Resources, Runtime, SandboxSpec, WarmSlot};
use berth_schemas::{Generation, OrgId, SandboxId};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::cleanup::CleanupStack;
use crate::error::HostdError;
use crate::host::Host;
use crate::record::{Phase, SandboxRecord};

/// A pooled sandbox older than this is replaced (bounds how much older than its create a
/// handed-over sandbox's id is; see the module's assumptions).
pub const MAX_AGE: Duration = Duration::from_secs(10 * 60);

/// The first pause after a failed build; each further failure doubles it up to
/// [`MAX_RETRY_PAUSE`].
const FIRST_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// The longest pause between builds that keep failing (a broken template).
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(60);

/// A build waits until the host has run no command or agent request for this long, so a
/// refill does not take the CPU from the create's next steps (its first exec, a stop): on 2
/// cores a refill beside them doubled the exec round trip (`berth bench`).
const QUIET: Duration = Duration::from_millis(20);

/// The longest a build waits for [`QUIET`]: a host that is never quiet still refills its
/// pool, one sandbox per this much time and a build at least (with 2 s, `berth bench`'s
/// back-to-back lifecycle found a warm sandbox for 4 of 20 creates; with 300 ms its faster
/// create-exec-delete cycles for 8 of 20).
const MAX_DEFER: Duration = Duration::from_millis(150);

/// How many of a template's recent creates its pool's shape is chosen from (the most
/// frequent).
pub const SHAPE_WINDOW: usize = 16;

/// The share of the host's memory (1/this) pooled sandboxes may hold at most.
pub const POOL_MEMORY_SHARE: u32 = 8;

/// How often the pool looks at its entries' age without being woken.
const IDLE_CHECK: Duration = Duration::from_secs(30);

/// Gauge of the ready sandboxes of the pool. Label: `template`.
pub const WARM_READY: &str = "berth_hostd_warm_sandboxes";

/// Counter of creates that named a pooled sandbox. Label: `result`: `handed_over`, or
/// `rebuilt` (it was not of the create's shape, or died in the pool, and was built anew).
pub const WARM_HANDOVERS: &str = "berth_hostd_warm_handovers_total";

/// Counter of pool builds. Label: `result`: `ready`, `failed`.
pub const WARM_BUILDS: &str = "berth_hostd_warm_builds_total";

/// How many sandboxes to keep warm per template (`--warm-pool base=2,base-gvisor=1`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WarmConfig {
    /// Template name → pool size. Empty: no pool.
    pub sizes: BTreeMap<String, u32>,
}

impl std::str::FromStr for WarmConfig {
    type Err = String;

    /// Parses `template=size` pairs separated by commas (`base=2,base-gvisor=1`); an empty
    /// string is no pool.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut sizes = BTreeMap::new();
        for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (template, size) = pair
                .split_once('=')
                .ok_or_else(|| format!("`{pair}`: expected template=size"))?;
            let size: u32 = size
                .trim()
                .parse()
                .map_err(|e| format!("`{pair}`: size: {e}"))?;
            let template = template.trim();
            if template.is_empty() || size > 64 {
                return Err(format!("`{pair}`: a template name and a size of 0 to 64"));
            }
            sizes.insert(template.to_owned(), size);
        }
        Ok(Self { sizes })
    }
}

impl std::fmt::Display for WarmConfig {
    /// The `template=size` pairs [`WarmConfig`]'s `FromStr` reads, comma-separated.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pairs: Vec<String> = self.sizes.iter().map(|(t, n)| format!("{t}={n}")).collect();
        f.write_str(&pairs.join(","))
    }
}

/// What a create must match to take a pooled sandbox: what the sandbox was booted with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    /// Template name.
    pub template: String,
    /// Runtime.
    pub runtime: Runtime,
    /// Limits.
    pub resources: Resources,
    /// Disk size, MiB.
    pub disk_mib: u32,
    /// Pinned image.
    pub image: Option<String>,
}

impl Shape {
    /// The shape of a spec.
    pub fn of(spec: &SandboxSpec) -> Self {
        Self {
            template: spec.template.clone(),
            runtime: spec.runtime,
            resources: spec.resources,
            disk_mib: spec.disk_mib,
            image: spec.image.clone(),
        }
    }

    /// The spec a pooled sandbox of this shape is booted with: nothing of any org, no env, no
    /// entrypoint, no egress.
    fn pooled_spec(&self) -> SandboxSpec {
        SandboxSpec {
            org_id: OrgId(uuid::Uuid::nil()),
            template: self.template.clone(),
            resources: self.resources,
            runtime: self.runtime,
            disk_mib: self.disk_mib,
            network: Network {
                egress: Egress::None,
            },
            env: Vec::new(),
            entrypoint: Vec::new(),
            image: self.image.clone(),
        }
    }
}

/// Where one pooled sandbox is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Being booted; not offered.
    Building,
    /// Booted, agent answering: offered in heartbeats.
    Ready,
    /// To be removed (dead, cut by a crash, too old, of an old shape); not offered.
    Stale,
    /// Being removed; not offered.
    Removing,
}

#[derive(Debug)]
struct Entry {
    shape: Shape,
    state: State,
}

#[derive(Debug, Default)]
struct Inner {
    /// Each pooled template's current shape ([`Inner::learn`]).
    shapes: HashMap<String, Shape>,
    /// Each pooled template's last [`SHAPE_WINDOW`] create shapes, oldest first.
    recent: HashMap<String, std::collections::VecDeque<Shape>>,
    entries: HashMap<SandboxId, Entry>,
}

impl Inner {
    /// Records a create's shape; its template's shape becomes the most frequent of the
    /// window (ties: the newest). Whether the template's shape changed.
    fn learn(&mut self, shape: Shape) -> bool {
        let recent = self.recent.entry(shape.template.clone()).or_default();
        recent.push_back(shape.clone());
        if recent.len() > SHAPE_WINDOW {
            recent.pop_front();
        }
        // Newest first, so a tie keeps the newest.
        let mut best: Option<(&Shape, usize)> = None;
        for candidate in recent.iter().rev() {
            let count = recent.iter().filter(|s| *s == candidate).count();
            if best.is_none_or(|(_, n)| count > n) {
                best = Some((candidate, count));
            }
        }
        let chosen = best.map_or(shape, |(s, _)| s.clone());
        let changed = self.shapes.get(&chosen.template) != Some(&chosen);
        self.shapes.insert(chosen.template.clone(), chosen);
        changed
    }

    /// The memory every entry holds, MiB.
    fn memory(&self) -> u32 {
        self.entries
            .values()
            .map(|e| e.shape.resources.memory_mib)
            .sum()
    }
}

/// The pool of one hostd. [`fill`] keeps it at its sizes in the background.
#[derive(Debug, Default)]
pub struct WarmPool {
    sizes: BTreeMap<String, u32>,
    /// The most memory pooled sandboxes may hold, MiB (the host's / [`POOL_MEMORY_SHARE`]).
    budget_mib: u32,
    inner: Mutex<Inner>,
    /// Wakes [`fill`]: a shape was learned, a sandbox was taken.
    wake: Notify,
    /// A build or removal ended (for [`WarmPool::claim`]).
    settled: Notify,
    /// Commands and agent requests in flight on the host, and when the last one ended.
    activity: Mutex<(usize, Option<tokio::time::Instant>)>,
    /// A sandbox became ready: the heartbeat goes out now rather than at its next tick, or
    /// the control plane would learn of one refill per interval at most (`berth bench`: 4 of
    /// 20 sequential creates took a slot with 2-second heartbeats).
    pub offered: Notify,
}

/// What [`fill`] does next.
#[derive(Debug)]
enum Action {
    Build(Shape),
    Remove(SandboxId),
    Idle,
}

impl WarmPool {
    /// A pool of `config`'s sizes, empty, on a host offering `memory_mib` to sandboxes.
    pub fn new(config: &WarmConfig, memory_mib: u32) -> Self {
        Self {
            sizes: config.sizes.clone(),
            budget_mib: memory_mib / POOL_MEMORY_SHARE,
            ..Self::default()
        }
    }

    /// Takes in the pooled sandboxes a previous run left (`records` with `warm` set):
    /// running ones whose runtime still lists them running, of a template still pooled, are
    /// ready; the rest are removed by [`fill`] (never offered). Their shape becomes their template's until a create says otherwise.
    pub fn adopt(&self, records: &[SandboxRecord], running: impl Fn(&SandboxRecord) -> bool) {
        let mut inner = self.inner();
        for record in records.iter().filter(|r| r.warm) {
            let shape = Shape::of(&record.spec);
            let alive = record.phase == Phase::Running && running(record);
            // A template this host no longer pools (a restart without the pool) offers none.
            let pooled = self.sizes.get(&shape.template).is_some_and(|&n| n > 0);
            let state = if alive && pooled {
                State::Ready
            } else {
                State::Stale
            };
            inner
                .shapes
                .entry(shape.template.clone())
                .or_insert_with(|| shape.clone());
            inner
                .entries
                .insert(record.sandbox_id, Entry { shape, state });
        }
        drop(inner);
        self.wake.notify_one();
    }

    /// Learns from a create's spec: when its template's shape changes ([`Inner::learn`]),
    /// the pool fills (or refills, replacing entries of the older shape) with the new one.
    pub fn learn(&self, spec: &SandboxSpec) {
        if self.sizes.get(&spec.template).is_none_or(|&n| n == 0) {
            return;
        }
        let mut inner = self.inner();
        if inner.learn(Shape::of(spec)) {
            let shape = inner.shapes.get(&spec.template);
            tracing::info!(template = %spec.template, ?shape, "warm pool shape learned");
            drop(inner);
            self.wake.notify_one();
        }
    }

    /// Takes a pooled sandbox out of the pool for a command that names it, once no build or
    /// removal of it is under way: `true` when it was ready (the caller now owns it: its
    /// record is live and `warm`), `false` when it is no pooled sandbox (any more).
    pub async fn claim(&self, sandbox: SandboxId) -> bool {
        loop {
            let settled = self.settled.notified();
            {
                let mut inner = self.inner();
                match inner.entries.get(&sandbox).map(|e| e.state) {
                    None => return false,
                    Some(State::Ready | State::Stale) => {
                        let entry = inner.entries.remove(&sandbox);
                        drop(inner);
                        if let Some(entry) = entry {
                            self.gauge(&entry.shape.template);
                        }
                        self.wake.notify_one();
                        return true;
                    }
                    Some(State::Building | State::Removing) => {}
                }
            }
            settled.await;
        }
    }

    /// Counts a command or agent request as in flight until the guard drops: builds wait
    /// for the host to be quiet.
    pub fn busy(&self) -> Busy<'_> {
        self.activity().0 += 1;
        Busy(self)
    }

    /// Resolves once the host ran nothing for [`QUIET`], or after [`MAX_DEFER`].
    async fn quiet(&self) {
        let deadline = tokio::time::Instant::now() + MAX_DEFER;
        while tokio::time::Instant::now() < deadline {
            let wait = match *self.activity() {
                (0, None) => return,
                (0, Some(last)) if last.elapsed() >= QUIET => return,
                (0, Some(last)) => QUIET.saturating_sub(last.elapsed()),
                _ => QUIET,
            };
            tokio::time::sleep(wait).await;
        }
    }

    fn activity(&self) -> MutexGuard<'_, (usize, Option<tokio::time::Instant>)> {
        self.activity.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ready pooled sandboxes, for the heartbeat.
    pub fn slots(&self) -> Vec<WarmSlot> {
        let inner = self.inner();
        let mut slots: Vec<WarmSlot> = inner
            .entries
            .iter()
            .filter(|(_, e)| e.state == State::Ready)
            .map(|(&sandbox_id, e)| WarmSlot {
                sandbox_id,
                template: e.shape.template.clone(),
                runtime: e.shape.runtime,
                resources: e.shape.resources,
                disk_mib: e.shape.disk_mib,
                image: e.shape.image.clone(),
            })
            .collect();
        slots.sort_by_key(|s| s.sandbox_id);
        slots
    }

    /// The memory every pooled sandbox (in any state) holds of the host, MiB: taken off the
    /// capacity the heartbeat offers; never more than the pool's budget (a build waits for
    /// room in it).
    pub fn held(&self) -> u32 {
        self.inner().memory()
    }

    /// The next thing to do: remove a stale, old or outdated entry first, then build toward
    /// the sizes.
    fn next(&self) -> Action {
        let mut inner = self.inner();
        let Inner {
            shapes, entries, ..
        } = &mut *inner;
        for (&id, entry) in entries.iter_mut() {
            let outdated = shapes.get(&entry.shape.template) != Some(&entry.shape)
                || self
                    .sizes
                    .get(&entry.shape.template)
                    .is_none_or(|&n| n == 0);
            let stale = entry.state == State::Stale
                || (entry.state == State::Ready && (outdated || too_old(id)));
            if stale {
                entry.state = State::Removing;
                return Action::Remove(id);
            }
        }
        let held: u32 = entries.values().map(|e| e.shape.resources.memory_mib).sum();
        for (template, &size) in &self.sizes {
            let Some(shape) = shapes.get(template) else {
                continue;
            };
            let mut current = entries.iter_mut().filter(|(_, e)| {
                &e.shape == shape && matches!(e.state, State::Building | State::Ready)
            });
            let have = current.by_ref().take(size as usize).count();
            // One beyond the size (a smaller pool after a restart) goes.
            if let Some((&id, extra)) = current.find(|(_, e)| e.state == State::Ready) {
                extra.state = State::Removing;
                return Action::Remove(id);
            }
            if have < size as usize && held + shape.resources.memory_mib <= self.budget_mib {
                return Action::Build(shape.clone());
            }
        }
        Action::Idle
    }

    fn set(&self, sandbox: SandboxId, state: Option<State>) {
        let mut inner = self.inner();
        let template = inner
            .entries
            .get(&sandbox)
            .map(|e| e.shape.template.clone());
        match state {
            Some(state) => {
                if let Some(entry) = inner.entries.get_mut(&sandbox) {
                    entry.state = state;
                }
            }
            None => {
                inner.entries.remove(&sandbox);
            }
        }
        drop(inner);
        if let Some(template) = template {
            self.gauge(&template);
        }
        if state == Some(State::Ready) {
            self.offered.notify_one();
        }
        self.settled.notify_waiters();
    }

    fn gauge(&self, template: &str) {
        let ready = self
            .inner()
            .entries
            .values()
            .filter(|e| e.shape.template == template && e.state == State::Ready)
            .count();
        ::metrics::gauge!(WARM_READY, "template" => template.to_owned()).set(ready as f64);
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // Writers leave every entry whole, so a poisoned lock still holds a consistent pool.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A command or agent request in flight ([`WarmPool::busy`]).
#[derive(Debug)]
pub struct Busy<'a>(&'a WarmPool);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut activity = self.0.activity();
        activity.0 = activity.0.saturating_sub(1);
        activity.1 = Some(tokio::time::Instant::now());
    }
}

/// Whether a pooled sandbox's id was drawn more than [`MAX_AGE`] ago.
fn too_old(sandbox: SandboxId) -> bool {
    let Some(drawn) = sandbox.as_uuid().get_timestamp() else {
        return false;
    };
    let (secs, nanos) = drawn.to_unix();
    let drawn = std::time::UNIX_EPOCH + Duration::new(secs, nanos);
    std::time::SystemTime::now()
        .duration_since(drawn)
        .is_ok_and(|age| age > MAX_AGE)
}

/// Keeps `host`'s pool at its sizes until `shutdown` (a host without a pool still removes
/// the pooled sandboxes an earlier run with one left): removes what must go, builds one
/// sandbox at a time once the host is quiet (the pool refills behind creates, never ahead of
/// them or beside their next steps), pauses longer after each failed build. A build or removal under way is finished before it returns.
pub async fn fill(host: Arc<Host>, shutdown: CancellationToken) {
    let mut pause = FIRST_RETRY_PAUSE;
    while !shutdown.is_cancelled() {
        let woken = host.warm.wake.notified();
        match host.warm.next() {
            Action::Remove(id) => {
                let removed = remove(&host, id).await;
                host.warm
                    .set(id, if removed { None } else { Some(State::Stale) });
                if !removed {
                    idle(&shutdown, pause, woken).await;
                    pause = (pause * 2).min(MAX_RETRY_PAUSE);
                }
            }
            Action::Build(shape) => {
                host.warm.quiet().await;
                if build(&host, shape).await {
                    pause = FIRST_RETRY_PAUSE;
                } else {
                    idle(&shutdown, pause, woken).await;
                    pause = (pause * 2).min(MAX_RETRY_PAUSE);
                }
            }
            Action::Idle => idle(&shutdown, IDLE_CHECK, woken).await,
        }
    }
}

async fn idle(shutdown: &CancellationToken, at_most: Duration, woken: impl std::future::Future) {
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = woken => {}
        _ = tokio::time::sleep(at_most) => {}
    }
}

/// Removes every pooled sandbox not claimed (a hostd stopping gracefully: what it built for
/// itself does not outlive it). One that cannot be removed is left to the next start.
pub async fn empty(host: &Arc<Host>) {
    let ids: Vec<SandboxId> = {
        let mut inner = host.warm.inner();
        inner
            .entries
            .iter_mut()
            .filter(|(_, e)| matches!(e.state, State::Ready | State::Stale))
            .map(|(&id, e)| {
                e.state = State::Removing;
                id
            })
            .collect()
    };
    for id in ids {
        let removed = remove(host, id).await;
        host.warm
            .set(id, if removed { None } else { Some(State::Stale) });
    }
}

/// Boots one pooled sandbox of `shape`; `true` when it is ready.
async fn build(host: &Arc<Host>, shape: Shape) -> bool {
    let id = SandboxId::new();
    let span = tracing::info_span!("warm", sandbox_id = %id, template = %shape.template);
    async {
        let runtime = crate::apply::runtime_name(host, &shape.pooled_spec());
        let mut record = SandboxRecord::new(id, shape.pooled_spec(), runtime, Generation(0));
        record.warm = true;
        host.warm.inner().entries.insert(
            id,
            Entry {
                shape: shape.clone(),
                state: State::Building,
            },
        );
        let built = boot(host, &mut record).await;
        match built {
            Ok(()) => {
                tracing::info!("warm sandbox ready");
                ::metrics::counter!(WARM_BUILDS, "result" => "ready").increment(1);
                host.warm.set(id, Some(State::Ready));
                true
            }
            Err(error) => {
                tracing::warn!(error = %error.report(), "warm sandbox not built");
                ::metrics::counter!(WARM_BUILDS, "result" => "failed").increment(1);
                host.warm.set(id, None);
                false
            }
        }
    }
    .instrument(span)
    .await
}

/// Writes the pooled record, then brings the sandbox up as a fresh create; on failure undoes
/// it all (the record included: a pooled sandbox leaves no tombstone).
async fn boot(host: &Arc<Host>, record: &mut SandboxRecord) -> Result<(), HostdError> {
    host.put(record)?;
    host.gates.open(record.sandbox_id);
    let mut cleanup = CleanupStack::new();
    let up = host
        .backend
        .bring_up(host, record, true, &mut cleanup)
        .await
        .and_then(|_| {
            record.phase = Phase::Running;
            host.put(record)
        });
    match up {
        Ok(()) => {
            cleanup.disarm();
            Ok(())
        }
        Err(error) => {
            if let Err(undo) = cleanup.run().await {
                tracing::warn!(error = %undo.report(), "warm sandbox's undo failed; removing it whole");
            }
            if let Err(undo) = remove_record_and_all(host, record).await {
                tracing::warn!(error = %undo.report(), "warm sandbox not removed");
            }
            Err(error)
        }
    }
}

/// Removes a pooled sandbox whole; `true` when it is gone.
async fn remove(host: &Arc<Host>, id: SandboxId) -> bool {
    let span = tracing::info_span!("warm", sandbox_id = %id);
    async {
        let Some(record) = host.live(id) else {
            return true;
        };
        match remove_record_and_all(host, &record).await {
            Ok(()) => {
                tracing::info!("warm sandbox removed");
                true
            }
            Err(error) => {
                tracing::warn!(error = %error.report(), "warm sandbox not removed; will retry");
                false
            }
        }
    }
    .instrument(span)
    .await
}

/// Removes everything of a pooled sandbox, its record last.
async fn remove_record_and_all(host: &Host, record: &SandboxRecord) -> Result<(), HostdError> {
    crate::apply::delete::remove_everything(host, record.sandbox_id, Some(record)).await?;
    host.forget(record.sandbox_id);
    Ok(())
}

#[cfg(test)]
mod tests;
