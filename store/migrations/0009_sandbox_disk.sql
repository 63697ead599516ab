-- Each sandbox's writable disk has a size, in MiB, chosen at create (the API applies its
-- configured default and maximum) and carried to its host in every command's spec. Rows created
-- before this migration read 0: no limit (their hosts made their disks without one).
ALTER TABLE sandboxes ADD COLUMN disk_mib integer NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD CONSTRAINT sandboxes_disk_mib CHECK (disk_mib >= 0);
