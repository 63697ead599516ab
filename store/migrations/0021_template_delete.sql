-- Image templates can be deleted (DELETE /v1/templates/{name}, issue 18). A deleted sandbox's
-- tombstone keeps the name of its template until it is purged, so the foreign key from
-- sandboxes to templates would refuse every delete for the tombstones' retention. It goes:
-- a create reads its template `FOR SHARE` in its transaction and the delete locks the row
-- `FOR UPDATE` and counts the sandboxes that are not deleted, so no live sandbox can name a
-- template that is gone (store::templates::{get_shared, delete}).
ALTER TABLE sandboxes DROP CONSTRAINT IF EXISTS sandboxes_template_fkey;

-- The reconciler's sweep of pulls that stopped (store::templates::fail_stale_pulls).
CREATE INDEX templates_pulling ON templates (updated_at) WHERE state = 'pulling';
