-- Issue 14: the bound on a deferred failover (`--failover-retry-for`) counts from the first pass
-- that deferred it, not from its host's last heartbeat: a pass that first reaches the sandbox
-- long after its failover was due (the reconciler was down, or a backlog of larger batches
-- came first) must still try again for that long. `failover_deferred_at` is that first
-- deferral (database clock) and `failover_deferred_on` the host the sandbox was stranded on
-- then. The pair counts only while it names the sandbox's current host and is newer than that
-- host's last heartbeat: a deferral from an earlier silence (the host came back) or from
-- another host counts for nothing, and the next deferral replaces it. No host foreign key: a
-- stale pair is only ever compared, never followed.
ALTER TABLE sandboxes ADD COLUMN failover_deferred_at timestamptz;
ALTER TABLE sandboxes ADD COLUMN failover_deferred_on uuid;
