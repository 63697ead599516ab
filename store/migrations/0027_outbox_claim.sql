-- The relay's claim (store::commands::claim_publishable) without ranking the whole backlog: it
-- ranked every unpublished command per host with row_number() for the per-host boot cap, 117 ms
-- per batch at 11,000 unpublished in the 1,000-host sim (RESULTS.md, run 5), slower than
-- creates arrived. Now it asks each host with queued boots for at most its free boot slots,
-- and the other kinds for the oldest few. The kind lists here and in commands.rs (BOOTS_SQL)
-- are the same text, so the planner can use these partial indexes.
CREATE INDEX commands_unpublished_boots ON commands (host_id, created_at)
    WHERE published_at IS NULL
      AND kind IN ('sandbox.create', 'sandbox.start', 'sandbox.restore', 'sandbox.clone', 'sandbox.unarchive');
CREATE INDEX commands_unpublished_other ON commands (created_at)
    WHERE published_at IS NULL
      AND kind NOT IN ('sandbox.create', 'sandbox.start', 'sandbox.restore', 'sandbox.clone', 'sandbox.unarchive');
CREATE INDEX commands_boots_in_flight ON commands (host_id)
    WHERE published_at IS NOT NULL AND completed_at IS NULL
      AND kind IN ('sandbox.create', 'sandbox.start', 'sandbox.restore', 'sandbox.clone', 'sandbox.unarchive');
