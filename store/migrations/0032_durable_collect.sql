-- Every delete collects what a sandbox's durable stop stored (issue 14): the API's collector
-- finds, every few seconds, the deleted sandboxes still naming a durable stop snapshot (a delete
-- by the reconciler's auto-delete or expiry, by `berth admin delete-org`, or one whose
-- collection at the request failed) and removes its manifest and unshared chunks. This partial
-- index keeps that look-up to the few rows it concerns.
CREATE INDEX sandboxes_deleted_durable ON sandboxes (deleted_at)
    WHERE deleted_at IS NOT NULL AND durable_snapshot IS NOT NULL;
