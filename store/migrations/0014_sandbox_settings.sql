-- Sandbox settings that change after create (issue 15 items 3-5): an expiry with its action,
-- a metadata filter's index, and a notification on every state change so a waiting request
-- wakes without polling.
--
-- `expires_at`: when the reconciler's pass applies `on_expiry` (`stop` or `delete`); NULL:
-- never. Set at create (`expires_at` or `timeout_seconds`), by PATCH and by renew; cleared
-- once the pass applied it.
ALTER TABLE sandboxes ADD COLUMN expires_at timestamptz;
ALTER TABLE sandboxes ADD COLUMN on_expiry text NOT NULL DEFAULT 'stop';
ALTER TABLE sandboxes ADD CONSTRAINT sandboxes_on_expiry CHECK (on_expiry IN ('stop', 'delete'));
CREATE INDEX sandboxes_expiring ON sandboxes (expires_at)
    WHERE expires_at IS NOT NULL AND deleted_at IS NULL;

-- `GET /v1/sandboxes?metadata.KEY=VALUE` is a containment test (`metadata @> {...}`).
CREATE INDEX sandboxes_metadata ON sandboxes USING gin (metadata jsonb_path_ops);

-- `NOTIFY berth_sandbox_changed, '<sandbox id>'` when a row is made or its state or
-- `deleted_at` changes; delivered at commit, so a listener that re-reads the row sees the change.
CREATE OR REPLACE FUNCTION berth_notify_sandbox_changed() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('berth_sandbox_changed', NEW.id::text);
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER sandboxes_notify_insert AFTER INSERT ON sandboxes
    FOR EACH ROW EXECUTE FUNCTION berth_notify_sandbox_changed();
CREATE TRIGGER sandboxes_notify_change AFTER UPDATE OF state, deleted_at ON sandboxes
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state OR OLD.deleted_at IS DISTINCT FROM NEW.deleted_at)
    EXECUTE FUNCTION berth_notify_sandbox_changed();
