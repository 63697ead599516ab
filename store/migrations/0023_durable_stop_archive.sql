-- Durable stops and archives (issue 14, first slice). After a stop, hostd uploads the stop
-- snapshot (the overlay upper dir, and the memory image a gVisor memory stop kept) to the
-- object store in the background; `durable_at` is written only once that upload is confirmed
-- (its manifest stored, DESIGN.md guarantee 9), fenced on the stop's generation, and cleared
-- by the next transition that changes the disk (a start). `durable_snapshot` names the
-- manifest: an unarchive fetches it.
ALTER TABLE sandboxes
    ADD COLUMN durable_at       timestamptz,
    ADD COLUMN durable_snapshot uuid,
    -- Days a `stopped` sandbox waits before the reconciler's pass archives it; NULL: never.
    ADD COLUMN auto_archive_days integer CHECK (auto_archive_days > 0),
    -- Seconds, overriding `auto_archive_days` (tests; not on the API).
    ADD COLUMN auto_archive_seconds integer CHECK (auto_archive_seconds > 0),
    ADD CONSTRAINT sandboxes_durable_names_its_snapshot
        CHECK ((durable_at IS NULL) = (durable_snapshot IS NULL));

-- The chunks each durable stop snapshot references, so a snapshot delete never removes from
-- the object store a chunk a stopped or archived sandbox still needs (`chunk_removals`).
CREATE TABLE durable_chunks (
    sha256     text NOT NULL,
    sandbox_id uuid NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    stored     bigint NOT NULL,
    PRIMARY KEY (sha256, sandbox_id)
);
CREATE INDEX durable_chunks_sandbox ON durable_chunks (sandbox_id);
