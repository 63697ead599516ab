-- Chunks no snapshot references any more, on their way out of the object store (issue 13
-- item 8: the delete-vs-upload race). A snapshot delete queues its orphaned chunks here in its
-- transaction; a remover claims one (`removing_at`) only while no snapshot references it, then
-- deletes the object and stamps `removed_at`. A snapshot settling `ready` locks the rows of its
-- chunks: one queued but not claimed is taken back (the row goes: it is referenced again); one
-- claimed whose removal had not finished before the snapshot was requested may be gone from
-- the store although the snapshot's upload found it there, so that snapshot fails instead of
-- becoming ready with a missing chunk (DESIGN.md guarantee 9).
CREATE TABLE chunk_removals (
    sha256      text PRIMARY KEY,
    queued_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    removing_at timestamptz,
    removed_at  timestamptz,
    CONSTRAINT chunk_removals_removed_after_claim CHECK (removed_at IS NULL OR removing_at IS NOT NULL)
);
