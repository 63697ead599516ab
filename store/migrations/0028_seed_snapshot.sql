-- The snapshot a clone boots from, kept until the sandbox first runs (a clone, a fork's child,
-- `POST /v1/sandboxes {snapshot_id}`). A clone whose boot failed has no disk of its own on its
-- host; a start of it in `failed-start` boots from this snapshot again (`sandbox.clone`)
-- instead of the bare template (an attacker started a failed clone and got the template with
-- none of the snapshot's files). Rows written before this column are not backfilled.
ALTER TABLE sandboxes ADD COLUMN seed_snapshot uuid;
