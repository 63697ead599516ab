-- Berth's initial schema: tenants, keys, templates, hosts, sandboxes, the command outbox and
-- lifecycle events. Owned by the `schemas` crate; every component migrates through it.

CREATE TABLE orgs (
    id              uuid PRIMARY KEY,
    name            text NOT NULL UNIQUE,
    -- Quotas; NULL means unlimited.
    max_running     integer,
    max_vcpus       integer,
    max_memory_mib  bigint,
    created_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_keys (
    id          uuid PRIMARY KEY,
    org_id      uuid NOT NULL REFERENCES orgs(id) ON DELETE CASCADE,
    -- SHA-256 of the whole key; the key itself is never stored.
    key_hash    bytea NOT NULL UNIQUE,
    -- The first characters, to tell keys apart in listings.
    prefix      text NOT NULL,
    is_admin    boolean NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

CREATE TABLE templates (
    name        text PRIMARY KEY,
    description text NOT NULL,
    runtime     text NOT NULL DEFAULT 'runc',
    created_at  timestamptz NOT NULL DEFAULT now()
);

INSERT INTO templates (name, description, runtime)
VALUES ('base', 'BusyBox userland (busybox-static) on runc', 'runc');

CREATE TABLE hosts (
    id                   uuid PRIMARY KEY,
    name                 text NOT NULL,
    state                text NOT NULL DEFAULT 'ready'
                         CHECK (state IN ('ready', 'draining', 'cordoned', 'lost')),
    capacity_vcpus       integer NOT NULL,
    capacity_memory_mib  bigint NOT NULL,
    -- What the control plane reserved for sandboxes that hold capacity here (guarantee 4).
    reserved_vcpus       integer NOT NULL DEFAULT 0 CHECK (reserved_vcpus >= 0),
    reserved_memory_mib  bigint NOT NULL DEFAULT 0 CHECK (reserved_memory_mib >= 0),
    runtimes             text[] NOT NULL DEFAULT '{}',
    memory_snapshot      boolean NOT NULL DEFAULT false,
    -- The host's own count of what its sandboxes use (informational).
    used_vcpus           integer NOT NULL DEFAULT 0,
    used_memory_mib      bigint NOT NULL DEFAULT 0,
    heartbeat_seq        bigint NOT NULL DEFAULT 0,
    inventory            jsonb NOT NULL DEFAULT '[]',
    -- Database clock, never a host's.
    last_seen            timestamptz NOT NULL DEFAULT now(),
    registered_at        timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE sandboxes (
    id               uuid PRIMARY KEY,
    org_id           uuid NOT NULL REFERENCES orgs(id),
    template         text NOT NULL REFERENCES templates(name),
    host_id          uuid REFERENCES hosts(id),
    state            text NOT NULL CHECK (state IN (
                         'provisioning', 'starting', 'running', 'stopping', 'stopped',
                         'resuming', 'restoring', 'migrating', 'archiving', 'archived',
                         'unarchiving', 'failed-start', 'deleted')),
    state_reason     text,
    generation       bigint NOT NULL DEFAULT 1,
    vcpus            integer NOT NULL CHECK (vcpus > 0),
    memory_mib       integer NOT NULL CHECK (memory_mib > 0),
    -- Whether this sandbox's resources are counted in hosts.reserved_* (guarantee 4).
    holds_capacity   boolean NOT NULL DEFAULT false,
    metadata         jsonb NOT NULL DEFAULT '{}',
    address          text,
    last_stop        text CHECK (last_stop IN ('memory', 'disk')),
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    last_activity_at timestamptz NOT NULL DEFAULT now(),
    -- Stop after this many minutes without activity (API calls on the sandbox, exec); NULL: never.
    auto_stop_minutes   integer CHECK (auto_stop_minutes > 0),
    -- Delete after this many minutes stopped; NULL: never.
    auto_delete_minutes integer CHECK (auto_delete_minutes > 0),
    deleted_at       timestamptz
);

-- Org-scoped listing, newest first (ids are UUIDv7, so id order is creation order).
CREATE INDEX sandboxes_org_id_id ON sandboxes (org_id, id DESC);
CREATE INDEX sandboxes_host_id ON sandboxes (host_id) WHERE holds_capacity;

-- The transactional outbox: written with the row change, published by the relay.
CREATE TABLE commands (
    id            uuid PRIMARY KEY,
    -- No foreign key: a compensating command may outlive its sandbox's purged tombstone.
    sandbox_id    uuid NOT NULL,
    host_id       uuid NOT NULL REFERENCES hosts(id),
    kind          text NOT NULL,
    generation    bigint NOT NULL,
    -- The postcard envelope exactly as published.
    payload       bytea NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at  timestamptz,
    publish_attempts integer NOT NULL DEFAULT 0,
    completed_at  timestamptz,
    outcome       text
);

CREATE INDEX commands_unpublished ON commands (created_at) WHERE published_at IS NULL;
CREATE INDEX commands_open ON commands (created_at) WHERE completed_at IS NULL;
CREATE INDEX commands_sandbox ON commands (sandbox_id);

CREATE OR REPLACE FUNCTION berth_notify_outbox() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('berth_outbox', '');
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER commands_notify AFTER INSERT ON commands
    FOR EACH STATEMENT EXECUTE FUNCTION berth_notify_outbox();

CREATE TABLE events (
    id          uuid PRIMARY KEY,
    sandbox_id  uuid NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    org_id      uuid NOT NULL REFERENCES orgs(id),
    type        text NOT NULL,
    from_state  text,
    to_state    text NOT NULL,
    reason      text NOT NULL,
    generation  bigint NOT NULL,
    command_id  uuid,
    message     text,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX events_sandbox ON events (sandbox_id, id);
CREATE INDEX events_org ON events (org_id, id);
