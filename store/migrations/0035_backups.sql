-- Backups (issue 14): a backup is a snapshot of kind `backup` (a running sandbox's disk in the
-- object store, memory not kept), taken on request or every `backup_interval_min` by the
-- reconciler. The sandbox row names its newest `ready` backup (`last_backup_id`,
-- `last_backup_at`): written in the transaction that settles the backup ready (never before its
-- upload is confirmed) and recomputed when that backup is deleted, so a restore-from-backup or a
-- host-loss failover finds it with one read of the row.
ALTER TABLE snapshots ADD COLUMN kind text NOT NULL DEFAULT 'snapshot'
    CHECK (kind IN ('snapshot', 'backup'));
ALTER TABLE sandboxes ADD COLUMN last_backup_id uuid;
ALTER TABLE sandboxes ADD COLUMN last_backup_at timestamptz;
ALTER TABLE sandboxes ADD COLUMN backup_interval_min integer
    CHECK (backup_interval_min IS NULL OR backup_interval_min > 0);
-- The reconciler's backup pass: running sandboxes with an interval whose newest backup is older.
CREATE INDEX sandboxes_backup_due ON sandboxes (last_backup_at NULLS FIRST)
    WHERE backup_interval_min IS NOT NULL AND state = 'running' AND deleted_at IS NULL;
