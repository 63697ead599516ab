-- No `NOTIFY` in a hot transaction (issue 16; the 1,000-host sim, tests/bench/RESULTS.md run 4).
-- Postgres serializes the commits of every transaction that notified: each takes one
-- database-wide lock before its commit record and keeps it through the WAL flush, so commits
-- cannot be grouped, and with a create (three triggers) and every result apply (two) notifying,
-- the whole control plane committed one transaction at a time.
--
-- The relays are woken instead after the commit: in process by the API that committed
-- (`berth_api::outbox::wake`), and over core NATS (`{p}.outbox.wake`) by the reconciler; a lost
-- wake costs a relay's poll interval. Waiting requests are woken by their sandbox's events as
-- the relay publishes them (`{p}.events.sandbox.<org>.<sandbox>`, `berth_api::watch`).
-- `berth_keys_revoked` stays: a revocation is rare, and must reach every process at once.
DROP TRIGGER commands_notify ON commands;
DROP TRIGGER events_notify ON events;
DROP FUNCTION berth_notify_outbox();
DROP TRIGGER sandboxes_notify_insert ON sandboxes;
DROP TRIGGER sandboxes_notify_change ON sandboxes;
DROP FUNCTION berth_notify_sandbox_changed();
