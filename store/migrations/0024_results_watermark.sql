-- Issue 12 item 1: a command is timed out only on the control plane's own evidence that its
-- host did not answer in time. Results travel through one JetStream consumer; while it has a
-- backlog, a result the host published before the deadline may still be queued, and failing
-- the sandbox then would be a false failure caused by the control plane's lag.
--
-- `applied_through`: every result published to the results stream before this time (database
-- clock) has been applied (or refused) and acked. The reconciler processes advance it from the
-- stream's last sequence and the consumer's ack floor (`berth_reconciler::watermark`); it only
-- moves forward. No row yet: no result consumer has sampled, and timeouts count to now().
CREATE TABLE results_watermark (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    applied_through timestamptz NOT NULL
);
