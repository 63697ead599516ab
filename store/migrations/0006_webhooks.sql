-- Webhooks: an org's HTTP endpoints that receive its lifecycle events as signed CloudEvents.
-- Fan-out follows `events.seq` (the publish order, see 0005) with a per-webhook cursor;
-- each delivery is retried with exponential backoff and every attempt is logged.

CREATE TABLE webhooks (
    id                    uuid PRIMARY KEY,
    org_id                uuid NOT NULL REFERENCES orgs(id) ON DELETE CASCADE,
    url                   text NOT NULL,
    -- The HMAC-SHA256 key deliveries are signed with. Kept in clear: signing needs it. Never
    -- returned by the API after the create.
    secret                text NOT NULL,
    -- CloudEvent types to deliver (`dev.berth.sandbox.running`, …); empty: every type.
    event_types           text[] NOT NULL DEFAULT '{}',
    -- The last `events.seq` fanned out into deliveries (events up to it are queued or skipped).
    cursor_seq            bigint NOT NULL DEFAULT 0,
    -- Failed attempts since the last success; reaching the configured run disables the webhook.
    consecutive_failures  integer NOT NULL DEFAULT 0,
    created_at            timestamptz NOT NULL DEFAULT now(),
    disabled_at           timestamptz,
    disabled_reason       text,
    -- The `dev.berth.webhook.disabled` CloudEvent: its id, and when the relay published it
    -- (this row is its outbox).
    disabled_event_id     uuid,
    disabled_published_at timestamptz,
    deleted_at            timestamptz
);

CREATE INDEX webhooks_org ON webhooks (org_id, id) WHERE deleted_at IS NULL;
CREATE INDEX webhooks_active ON webhooks (id) WHERE disabled_at IS NULL AND deleted_at IS NULL;
CREATE INDEX webhooks_disabled_unpublished ON webhooks (disabled_at)
    WHERE disabled_event_id IS NOT NULL AND disabled_published_at IS NULL;

-- One event to one webhook. The body is stored as sent, so every attempt signs and sends the
-- same bytes, and a purged sandbox's events stay deliverable.
CREATE TABLE webhook_deliveries (
    id               uuid PRIMARY KEY,
    webhook_id       uuid NOT NULL REFERENCES webhooks(id) ON DELETE CASCADE,
    -- No foreign key: events are purged with their sandbox's tombstone.
    event_id         uuid NOT NULL,
    event_seq        bigint NOT NULL,
    event_type       text NOT NULL,
    body             text NOT NULL,
    state            text NOT NULL DEFAULT 'pending'
                     CHECK (state IN ('pending', 'succeeded', 'abandoned')),
    attempts         integer NOT NULL DEFAULT 0,
    -- Due time of the next attempt; a worker claims a delivery by pushing it out by its
    -- attempt timeout, so a crashed worker's claim expires and the delivery is retried.
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    created_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    UNIQUE (webhook_id, event_id)
);

CREATE INDEX webhook_deliveries_pending ON webhook_deliveries (webhook_id, event_seq)
    WHERE state = 'pending';

-- The delivery log: one row per HTTP attempt.
CREATE TABLE webhook_attempts (
    delivery_id   uuid NOT NULL REFERENCES webhook_deliveries(id) ON DELETE CASCADE,
    attempt       integer NOT NULL,
    at            timestamptz NOT NULL DEFAULT now(),
    -- The receiver's HTTP status, when it answered.
    status_code   integer,
    -- Why the attempt failed (connection error, timeout, non-2xx status).
    error         text,
    duration_ms   integer NOT NULL,
    PRIMARY KEY (delivery_id, attempt)
);
