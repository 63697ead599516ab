//! NATS subject and JetStream stream names, all under a configurable prefix `{p}` (default
//! `berth`) so tests can isolate themselves on one shared server.

use crate::ids::{HostId, OrgId, SandboxId, WebhookId};

/// The default subject prefix.
pub const DEFAULT_PREFIX: &str = "berth";

/// How many copies of each stream a clustered JetStream keeps unless told otherwise: one, as
/// on a single nats-server.
pub const DEFAULT_STREAM_REPLICAS: usize = 1;
/// The most replicas JetStream allows a stream.
pub const MAX_STREAM_REPLICAS: usize = 5;

/// Builds every subject and stream name Berth uses from one prefix, and says how many
/// replicas its streams get (the streams of one prefix are one deployment's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
    stream_replicas: usize,
}

/// The prefix was empty or held characters NATS tokens cannot.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid subject prefix {0:?}: use letters, digits, '-' and '_' (dots separate tokens)")]
pub struct InvalidPrefix(pub String);

impl Subjects {
    /// Errors: [`InvalidPrefix`] when `prefix` is empty, or a token holds anything but ASCII
    /// letters, digits, `-` and `_`.
    pub fn new(prefix: &str) -> Result<Self, InvalidPrefix> {
        let ok = !prefix.is_empty()
            && prefix.split('.').all(|t| {
                !t.is_empty()
                    && t.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            });
        if ok {
            Ok(Self {
                prefix: prefix.to_owned(),
                stream_replicas: DEFAULT_STREAM_REPLICAS,
            })
        } else {
            Err(InvalidPrefix(prefix.to_owned()))
        }
    }

    /// The same subjects, whose streams are created with `replicas` copies (JetStream's
    /// `num_replicas`: 3 on a three-node cluster survives one node's loss). Clamped to
    /// 1..=[`MAX_STREAM_REPLICAS`]. A stream that already exists keeps its own count: the
    /// components look streams up and never change them.
    pub fn with_stream_replicas(mut self, replicas: usize) -> Self {
        self.stream_replicas = replicas.clamp(1, MAX_STREAM_REPLICAS);
        self
    }

    /// How many replicas the streams of this prefix are created with.
    pub fn stream_replicas(&self) -> usize {
        self.stream_replicas
    }

    /// The validated prefix every subject starts with (`{p}`, e.g. `berth`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `{p}.cmd.<host>`: commands for one host.
    pub fn cmd(&self, host: HostId) -> String {
        format!("{}.cmd.{host}", self.prefix)
    }

    /// `{p}.cmd.>`: the command stream's subjects.
    pub fn cmd_all(&self) -> String {
        format!("{}.cmd.>", self.prefix)
    }

    /// `{p}.result.<host>`: results from one host.
    pub fn result(&self, host: HostId) -> String {
        format!("{}.result.{host}", self.prefix)
    }

    /// The host a result subject names: `Some(h)` for `{p}.result.<h>`, `None` for any other
    /// subject (another prefix or kind, extra tokens, a token that is not a host id). The
    /// reconciler trusts a result's `host_id` only when it equals this (NATS permissions let a
    /// host publish on its own result subject only).
    pub fn host_of_result(&self, subject: &str) -> Option<HostId> {
        subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(".result.")?
            .parse()
            .ok()
    }

    /// `{p}.result.>`: the result stream's subjects.
    pub fn result_all(&self) -> String {
        format!("{}.result.>", self.prefix)
    }

    /// `{p}.hb.<host>`: heartbeats (core NATS, at most once: only the latest matters).
    pub fn heartbeat(&self, host: HostId) -> String {
        format!("{}.hb.{host}", self.prefix)
    }

    /// `{p}.hb.*`: every host's heartbeat.
    pub fn heartbeat_all(&self) -> String {
        format!("{}.hb.*", self.prefix)
    }

    /// `{p}.agent.<host>`: agent request/reply (exec with env/cwd/stdin, files) to one host.
    pub fn agent(&self, host: HostId) -> String {
        format!("{}.agent.{host}", self.prefix)
    }

    /// `{p}.events.sandbox.<org>.<sandbox>`: one sandbox's lifecycle events (CloudEvents JSON).
    pub fn sandbox_events(&self, org: OrgId, sandbox: SandboxId) -> String {
        format!("{}.events.sandbox.{org}.{sandbox}", self.prefix)
    }

    /// `{p}.events.sandbox.<org>.>`: every sandbox event of one org (a consumer's filter).
    pub fn org_sandbox_events(&self, org: OrgId) -> String {
        format!("{}.events.sandbox.{org}.>", self.prefix)
    }

    /// `{p}.events.webhook.<org>.<webhook>`: events about one webhook (e.g. it was disabled).
    pub fn webhook_events(&self, org: OrgId, webhook: WebhookId) -> String {
        format!("{}.events.webhook.{org}.{webhook}", self.prefix)
    }

    /// `{p}.events.sandbox.>`: every sandbox event of every org (core subscribers: the API's
    /// waiting requests, woken by each event of their sandbox).
    pub fn sandbox_events_all(&self) -> String {
        format!("{}.events.sandbox.>", self.prefix)
    }

    /// `{p}.outbox.wake` (core NATS, empty body): a process committed outbox rows (commands or
    /// events); every relay that hears it runs a round. Published by the control plane only
    /// (hosts' permissions do not name it); a lost one costs a relay's poll interval.
    pub fn outbox_wake(&self) -> String {
        format!("{}.outbox.wake", self.prefix)
    }

    /// `{p}.events.>`: the event stream's subjects.
    pub fn events_all(&self) -> String {
        format!("{}.events.>", self.prefix)
    }

    /// The JetStream stream holding commands (`{P}_CMD`, dots as `_`).
    pub fn cmd_stream(&self) -> String {
        format!("{}_CMD", self.stream_stem())
    }

    /// The JetStream stream holding results (`{P}_RESULT`).
    pub fn result_stream(&self) -> String {
        format!("{}_RESULT", self.stream_stem())
    }

    /// The JetStream stream holding lifecycle events (`{P}_EVENTS`), replayable from any point.
    pub fn events_stream(&self) -> String {
        format!("{}_EVENTS", self.stream_stem())
    }

    /// The durable consumer name of one host on the command stream.
    pub fn host_consumer(&self, host: HostId) -> String {
        format!("hostd-{host}")
    }

    /// The durable consumer name of the reconciler on the result stream.
    pub fn reconciler_consumer(&self) -> String {
        "reconciler".to_owned()
    }

    fn stream_stem(&self) -> String {
        self.prefix.replace('.', "_").to_ascii_uppercase()
    }
}

impl Default for Subjects {
    fn default() -> Self {
        Self::new(DEFAULT_PREFIX).expect("the default prefix is valid")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn subjects_are_built_under_the_prefix() {
        let s = Subjects::new("t1.run-7").unwrap();
        let h = HostId(Uuid::nil());
        assert_eq!(
            s.cmd(h),
            "t1.run-7.cmd.00000000-0000-0000-0000-000000000000"
        );
        assert_eq!(s.result_all(), "t1.run-7.result.>");
        assert_eq!(s.heartbeat_all(), "t1.run-7.hb.*");
        assert_eq!(s.cmd_stream(), "T1_RUN-7_CMD");
        assert_eq!(s.events_stream(), "T1_RUN-7_EVENTS");
        assert_eq!(
            s.sandbox_events(OrgId(Uuid::nil()), SandboxId(Uuid::max())),
            "t1.run-7.events.sandbox.00000000-0000-0000-0000-000000000000.\
             ffffffff-ffff-ffff-ffff-ffffffffffff"
        );
        assert_eq!(s.events_all(), "t1.run-7.events.>");
    }

    #[test]
    fn the_host_of_a_result_subject_is_read_only_from_this_prefix_and_kind() {
        let s = Subjects::new("t1").unwrap();
        let h = HostId(Uuid::new_v4());
        assert_eq!(s.host_of_result(&s.result(h)), Some(h));
        for other in [
            s.heartbeat(h),
            s.cmd(h),
            format!("t2.result.{h}"),
            format!("t1x.result.{h}"),
            format!("t1.result.{h}.extra"),
            "t1.result.not-a-host".to_owned(),
            "t1.result.".to_owned(),
        ] {
            assert_eq!(s.host_of_result(&other), None, "{other}");
        }
    }

    #[test]
    fn stream_replicas_default_to_one_and_stay_within_what_jetstream_allows() {
        let s = Subjects::new("t1").unwrap();
        assert_eq!(s.stream_replicas(), DEFAULT_STREAM_REPLICAS);
        assert_eq!(s.clone().with_stream_replicas(3).stream_replicas(), 3);
        assert_eq!(s.clone().with_stream_replicas(0).stream_replicas(), 1);
        assert_eq!(
            s.with_stream_replicas(9).stream_replicas(),
            MAX_STREAM_REPLICAS
        );
    }

    #[test]
    fn a_prefix_with_wildcards_or_spaces_is_refused() {
        for bad in ["", "a.>", "a b", "a..b", "*"] {
            assert!(Subjects::new(bad).is_err(), "{bad:?}");
        }
    }
}
