-- Issue 14: an org's backup policy. `backup_interval_min` is the default a new sandbox takes
-- when its create names none (NULL: no periodic backups); `backups_kept` is how many ready
-- backups of each sandbox are kept: the API's collector deletes older ones (content and row),
-- and every failed backup but the newest, so backups never fill the snapshot quota alone.
ALTER TABLE orgs ADD COLUMN backup_interval_min integer
    CHECK (backup_interval_min IS NULL OR backup_interval_min BETWEEN 1 AND 525600);
ALTER TABLE orgs ADD COLUMN backups_kept integer NOT NULL DEFAULT 7
    CHECK (backups_kept BETWEEN 1 AND 1000);
CREATE INDEX snapshots_backups_of_sandbox ON snapshots (sandbox_id, created_at DESC)
    WHERE kind = 'backup';

-- A restore from backup is a rollback: the backup it booted (`restored_backup`) stays the
-- sandbox's newest (`last_backup_id`) until a backup requested after it (`restored_at`) is
-- ready, so a backup still uploading when the user rolled back never undoes the rollback, and a
-- failover never boots what the user rolled back from.
ALTER TABLE sandboxes ADD COLUMN restored_backup uuid;
ALTER TABLE sandboxes ADD COLUMN restored_at timestamptz;
