-- The store-wide sweep of orphans in the object store (issue 14). A manifest nothing names
-- (an archive or stop whose report was lost for good, or that a redelivery replaced) is
-- recorded here, committed, before its object is removed. A stop snapshot's id is made by its
-- host, so the control plane first hears of it in the host's report: a report that comes after
-- the sweep removed its manifest finds this row and is not recorded durable
-- (`store::sweep::manifest_removed`, under the same per-snapshot advisory lock as the sweep's
-- claim, so whichever is second sees the other). Rows stay: a report may come arbitrarily late.
CREATE TABLE manifest_removals (
    snapshot_id uuid PRIMARY KEY,
    removing_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    removed_at  timestamptz
);
