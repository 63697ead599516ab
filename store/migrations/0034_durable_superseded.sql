-- Superseded durable stop snapshots (issue 14): a row names only its newest durable stop
-- (`sandboxes.durable_snapshot`), so the one a start (or a migrate or unarchive that ran), a
-- newer durable stop or a delete supersedes is recorded here in the same transaction, with the
-- chunks it references, and the API's collector removes its manifest and the chunks nothing
-- else references. No foreign key: the content outlives a purged tombstone.
CREATE TABLE durable_superseded (
    snapshot_id   uuid PRIMARY KEY,
    sandbox_id    uuid NOT NULL,
    -- Superseded by a delete while a migrate or unarchive may still be fetching it: kept until
    -- the sandbox is `deleted` (its new host answered the delete, so that boot is over).
    until_deleted boolean NOT NULL DEFAULT false,
    superseded_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX durable_superseded_sandbox ON durable_superseded (sandbox_id);

-- The chunks of each superseded snapshot: until it is collected, no chunk removal takes them
-- (`chunk_removals` claims only chunks nothing references).
CREATE TABLE superseded_chunks (
    snapshot_id uuid NOT NULL REFERENCES durable_superseded(snapshot_id) ON DELETE CASCADE,
    sha256      text NOT NULL,
    PRIMARY KEY (snapshot_id, sha256)
);
CREATE INDEX superseded_chunks_sha256 ON superseded_chunks (sha256);
