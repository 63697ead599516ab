-- A revocation names the key it revoked (the hex SHA-256 of `api_keys.key_hash`), one
-- notification per key, so each API and proxy process forgets just that key's cached lookup.
-- The statement-level trigger of 0022 sent an empty payload and every process forgot every
-- cached key: an attacker revoking its own keys in a loop made every other org's requests look
-- their keys up again, and they were refused 429 `key_lookups_per_ip` (22 of 100 in an attack
-- run). Revocations stay rare and outside hot transactions, so a NOTIFY here costs nothing.
CREATE OR REPLACE FUNCTION berth_notify_keys_revoked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('berth_keys_revoked', encode(OLD.key_hash, 'hex'));
    RETURN NULL;
END
$$;

DROP TRIGGER api_keys_revoked ON api_keys;
CREATE TRIGGER api_keys_revoked
    AFTER UPDATE OF revoked_at OR DELETE ON api_keys
    FOR EACH ROW EXECUTE FUNCTION berth_notify_keys_revoked();
