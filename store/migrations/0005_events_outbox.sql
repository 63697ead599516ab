-- Lifecycle events through the outbox: the relay publishes each `events` row as a CloudEvent
-- on `{p}.events.sandbox.<org>.<sandbox>` (JetStream, `Nats-Msg-Id` = the event id) and only
-- then marks it published, stamping `seq`: the publish order every reader (SSE, webhooks)
-- follows.
--
-- `seq` is taken from `events_seq` while the relay holds the advisory transaction lock
-- `EVENTS_SEQ_LOCK` (see api/src/event_relay.rs) until it commits, so seq values become
-- visible in increasing order: a reader that has seen seq N will never later find a committed
-- seq below N. That is what makes "everything after N" a gap-free resume point.

ALTER TABLE events ADD COLUMN published_at timestamptz;
ALTER TABLE events ADD COLUMN seq bigint;

CREATE SEQUENCE events_seq AS bigint;

CREATE UNIQUE INDEX events_seq_unique ON events (seq);
CREATE INDEX events_unpublished ON events (at) WHERE published_at IS NULL;
CREATE INDEX events_org_seq ON events (org_id, seq) WHERE seq IS NOT NULL;

-- An event without a command (a result applied by the reconciler) wakes the relay too.
CREATE TRIGGER events_notify AFTER INSERT ON events
    FOR EACH STATEMENT EXECUTE FUNCTION berth_notify_outbox();
