-- Snapshots as resources (issue 13 item 3). A snapshot outlives its sandbox (no foreign key to
-- sandboxes: a tombstone's purge leaves its snapshots) until deleted or expired. Its content
-- lives in the object store (berth-storage: manifests/<id>.json plus content-addressed chunks);
-- `ready` is written only once the host reported the manifest stored (DESIGN.md guarantee 9).
CREATE TABLE snapshots (
    id            uuid PRIMARY KEY,
    org_id        uuid NOT NULL REFERENCES orgs(id),
    sandbox_id    uuid NOT NULL,
    -- The host that took it (its local copy is a cache there).
    host_id       uuid NOT NULL,
    -- The snapshot it is incremental against, while that one exists.
    parent_id     uuid REFERENCES snapshots(id) ON DELETE SET NULL,
    state         text NOT NULL CHECK (state IN ('creating', 'ready', 'failed')),
    reason        text,
    -- What it holds once ready: `disk`, or `disk_and_memory` (gVisor).
    holds         text CHECK (holds IN ('disk', 'disk_and_memory')),
    template      text NOT NULL,
    runtime       text NOT NULL,
    vcpus         integer NOT NULL,
    memory_mib    integer NOT NULL,
    disk_mib      integer NOT NULL,
    -- Bytes of its files; compressed bytes of the chunks it references; of those it added.
    logical_bytes bigint,
    stored_bytes  bigint,
    new_bytes     bigint,
    -- How long the sandbox was frozen to take it, milliseconds.
    paused_ms     integer,
    -- The `sandbox.snapshot` command that takes it.
    command_id    uuid NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    ready_at      timestamptz,
    expires_at    timestamptz,
    CONSTRAINT snapshots_failed_has_reason CHECK ((state = 'failed') = (reason IS NOT NULL)),
    CONSTRAINT snapshots_ready_has_sizes CHECK (state <> 'ready' OR (stored_bytes IS NOT NULL AND holds IS NOT NULL))
);

CREATE INDEX snapshots_sandbox ON snapshots (sandbox_id, id);
CREATE INDEX snapshots_org ON snapshots (org_id, id);
CREATE INDEX snapshots_creating ON snapshots (created_at) WHERE state = 'creating';
CREATE UNIQUE INDEX snapshots_command ON snapshots (command_id);
CREATE INDEX snapshots_expiring ON snapshots (expires_at) WHERE expires_at IS NOT NULL;

-- Which chunks each ready snapshot references, so a delete removes from the object store only
-- the content no other snapshot references.
CREATE TABLE snapshot_chunks (
    sha256      text NOT NULL,
    snapshot_id uuid NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
    stored      bigint NOT NULL,
    PRIMARY KEY (sha256, snapshot_id)
);
CREATE INDEX snapshot_chunks_snapshot ON snapshot_chunks (snapshot_id);

-- Org quotas on snapshots: how many, and how many stored bytes; NULL = unlimited.
ALTER TABLE orgs
    ADD COLUMN max_snapshots      integer,
    ADD COLUMN max_snapshot_bytes bigint;

-- Snapshot events (`snapshot.created`, `.ready`, `.failed`) ride the sandbox event stream:
-- they name the snapshot.
ALTER TABLE events ADD COLUMN snapshot_id uuid;
