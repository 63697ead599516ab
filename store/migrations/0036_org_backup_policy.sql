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
