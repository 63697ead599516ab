-- A late durability report (`store::sandboxes::supersede_unnamed`) records the stop snapshot it
-- names as superseded only when no sandbox names it as its durable stop; without an index that
-- look scans every row of `sandboxes` once per late report (a sequential scan of 100k rows:
-- about 30 ms and 2,800 buffers). Only rows with a durable stop are indexed: the equality the
-- query filters on implies `IS NOT NULL`, so the planner uses this partial index.
-- Not CONCURRENTLY: the migrator runs each migration in a transaction, as every other index
-- here was created; on a table of a few hundred thousand rows the build takes well under a
-- second.
CREATE INDEX sandboxes_durable_snapshot ON sandboxes (durable_snapshot)
    WHERE durable_snapshot IS NOT NULL;
