-- A host's health, judged from the outcomes of its boots (issue 12 item 2): beside its state
-- (which operators and heartbeats decide). Written only through berth_schemas'
-- HostHealth::on (store::host_health).
ALTER TABLE hosts
    ADD COLUMN health            text NOT NULL DEFAULT 'healthy'
                                 CHECK (health IN ('healthy', 'degraded', 'probing')),
    -- Bad boots (failed by the host, timed out, slow) in a row since the last good one.
    ADD COLUMN health_failures   integer NOT NULL DEFAULT 0 CHECK (health_failures >= 0),
    -- The back-off in force while not healthy, in milliseconds.
    ADD COLUMN health_backoff_ms bigint NOT NULL DEFAULT 0 CHECK (health_backoff_ms >= 0),
    -- When placement may send the next probe (database clock); NULL while healthy.
    ADD COLUMN probe_at          timestamptz,
    ADD COLUMN health_changed_at timestamptz NOT NULL DEFAULT now(),
    -- The last bad boot's reason, for operators.
    ADD COLUMN health_reason     text;
