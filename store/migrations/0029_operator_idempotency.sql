-- Idempotency-Key on the operator's routes (`POST /v1/templates`): an operator key has no org,
-- so its stored responses have no org_id and share one scope of their own (NULL). The primary
-- key becomes a unique index over the scope, NULL read as the nil uuid (no org has that id).

ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey;
ALTER TABLE idempotency_keys ALTER COLUMN org_id DROP NOT NULL;
CREATE UNIQUE INDEX idempotency_keys_scope_key ON idempotency_keys
    ((COALESCE(org_id, '00000000-0000-0000-0000-000000000000'::uuid)), key);
