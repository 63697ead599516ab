-- The snapshot a restore or clone boots from, on its command (also in the payload, which SQL
-- cannot read): a snapshot is not deleted while a sandbox is still `resuming` from it (an
-- attacker deleted a snapshot while three clones of it were booting; one failed on a missing
-- chunk, one waited two minutes for a manifest that was gone).
ALTER TABLE commands ADD COLUMN snapshot_id uuid;
CREATE INDEX commands_open_snapshot ON commands (snapshot_id)
    WHERE snapshot_id IS NOT NULL AND completed_at IS NULL;
