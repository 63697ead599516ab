-- Key management and org deletion (the attacker's findings: no way to revoke a key or delete
-- an org). A revoked key must stop working at once in every process, whatever cached it: every
-- change of `api_keys.revoked_at` (and every deleted key row) notifies `berth_keys_revoked` at
-- commit, and each API and proxy process forgets its cached keys on it (`berth_api::revocations`).

-- A deleted org: its keys are revoked and its sandboxes deleted; the row stays as a tombstone
-- (its name stays taken, its events keep their org).
ALTER TABLE orgs ADD COLUMN deleted_at timestamptz;

CREATE FUNCTION berth_notify_keys_revoked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('berth_keys_revoked', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER api_keys_revoked
    AFTER UPDATE OF revoked_at OR DELETE ON api_keys
    FOR EACH STATEMENT EXECUTE FUNCTION berth_notify_keys_revoked();

CREATE INDEX api_keys_org ON api_keys (org_id, created_at);
