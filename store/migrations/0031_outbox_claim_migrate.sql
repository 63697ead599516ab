-- A migration (`sandbox.migrate`, 0030) boots its sandbox on the new host like a create: it
-- counts under the relay's per-host cap of in-flight boots. The claim's partial indexes
-- (0027) are made again with the longer kind list (store::commands::BOOTS_SQL, word for word).
DROP INDEX commands_unpublished_boots;
DROP INDEX commands_unpublished_other;
DROP INDEX commands_boots_in_flight;
CREATE INDEX commands_unpublished_boots ON commands (host_id, created_at)
    WHERE published_at IS NULL
      AND kind IN ('sandbox.create', 'sandbox.start', 'sandbox.restore', 'sandbox.clone', 'sandbox.unarchive', 'sandbox.migrate');
CREATE INDEX commands_unpublished_other ON commands (created_at)
    WHERE published_at IS NULL
      AND kind NOT IN ('sandbox.create', 'sandbox.start', 'sandbox.restore', 'sandbox.clone', 'sandbox.unarchive', 'sandbox.migrate');
CREATE INDEX commands_boots_in_flight ON commands (host_id)
    WHERE published_at IS NOT NULL AND completed_at IS NULL
      AND kind IN ('sandbox.create', 'sandbox.start', 'sandbox.restore', 'sandbox.clone', 'sandbox.unarchive', 'sandbox.migrate');
