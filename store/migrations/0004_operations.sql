-- Operator controls: admin keys may belong to no org; hosts remember who changed their state.
ALTER TABLE api_keys ALTER COLUMN org_id DROP NOT NULL;
ALTER TABLE api_keys ADD CONSTRAINT api_keys_org_or_admin CHECK (org_id IS NOT NULL OR is_admin);
ALTER TABLE hosts ADD COLUMN state_changed_at timestamptz NOT NULL DEFAULT now();

-- Quota checks count an org's capacity-holding, not-deleting sandboxes.
CREATE INDEX sandboxes_org_holding ON sandboxes (org_id) WHERE holds_capacity AND deleted_at IS NULL;
