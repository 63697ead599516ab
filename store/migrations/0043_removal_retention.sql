-- Finished removals are forgotten after `store::chunks::REMOVAL_RETENTION` (7 days): the
-- object store sweep deletes the `chunk_removals` and `manifest_removals` rows whose
-- `removed_at` is older (`chunks::prune_finished`, `sweep::prune_removed`), never a claimed,
-- unfinished one, and `chunks::check_for_ready` refuses every snapshot or durability report
-- requested longer ago than that, so no check needs a forgotten row. This replaces 0040's
-- "rows stay". Only finished rows are indexed: the prune's `removed_at < …` implies
-- `IS NOT NULL`, so the planner uses these partial indexes instead of scanning every queued
-- and claimed row each look. Not CONCURRENTLY, as every index here (the migrator runs each
-- migration in a transaction).
CREATE INDEX chunk_removals_removed_at ON chunk_removals (removed_at)
    WHERE removed_at IS NOT NULL;
CREATE INDEX manifest_removals_removed_at ON manifest_removals (removed_at)
    WHERE removed_at IS NOT NULL;
