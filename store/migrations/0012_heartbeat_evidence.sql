-- Issue 12 item 1: the reconciler judges a sandbox only on an inventory taken after its last
-- change, and holds mass failures behind a circuit breaker.

-- When the host began observing its last applied heartbeat's inventory, on the host's clock
-- (`Heartbeat::sent_at_ms`). NULL until a heartbeat of this build arrives: such a host's
-- inventory is never evidence.
ALTER TABLE hosts ADD COLUMN heartbeat_sent_at timestamptz;

-- The host's heartbeat sequence when it applied the command (`CommandResult::heartbeat_seq`),
-- written with the result: only a heartbeat with a greater `hosts.heartbeat_seq` saw the
-- host after this command. NULL for a command no result completed.
ALTER TABLE commands ADD COLUMN host_seq bigint;

-- Circuit breakers of the reconciler's guest-failure action, one per host that tripped
-- (`scope` = the host id) and one for the fleet (`scope` = 'fleet'). A row exists while the
-- share of running sandboxes the pass would fail stays over the configured share; it acts
-- once `released_at` is set (by an operator, or after the evidence persisted).
CREATE TABLE breaker_trips (
    scope        text PRIMARY KEY,
    tripped_at   timestamptz NOT NULL DEFAULT now(),
    -- Consecutive passes that found the share exceeded on fresh evidence.
    passes       integer NOT NULL,
    -- The host's heartbeat_seq when a pass last counted (a pass on the same heartbeat does not
    -- count again); for the fleet, the newest heartbeat_seq of its failing hosts.
    last_seq     bigint,
    would_fail   bigint NOT NULL,
    running      bigint NOT NULL,
    released_at  timestamptz,
    -- 'operator' or 'persisted'.
    released_by  text
);

-- What the circuit breakers did, for operators (`berth admin breaker-list`): host-scoped
-- events, apart from the sandbox events orgs receive.
CREATE TABLE host_events (
    id         bigserial PRIMARY KEY,
    -- NULL: the fleet.
    host_id    uuid,
    type       text NOT NULL,
    message    text NOT NULL,
    at         timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX host_events_at ON host_events (at);
