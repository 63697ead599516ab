-- Start elsewhere (issue 14, `migrating`): a stopped sandbox whose own host cannot take it
-- back moves, from its durable stop snapshot, to the host placement picks. While it is
-- `migrating`, `migrated_from` names the host it came from, which still holds its last stop's
-- disk: a migration that fails or times out moves the row back there `stopped`; one that
-- succeeds (or a delete) sends that host a `sandbox.delete` of its stale copy and clears it.
ALTER TABLE sandboxes
    ADD COLUMN migrated_from uuid,
    ADD CONSTRAINT sandboxes_migrated_from_only_while_migrating
        CHECK (migrated_from IS NULL OR state = 'migrating');
