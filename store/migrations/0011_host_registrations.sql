-- Hosts the operator registered (`berth admin add-host`): the scheduler applies heartbeats only
-- from these. `nkey` is the public key of the host's NATS credentials (NULL: registered, but no
-- NATS user issued, e.g. a host of an open NATS); the server's user list is rendered from it.
CREATE TABLE host_registrations (
    host_id       uuid PRIMARY KEY,
    nkey          text UNIQUE,
    registered_at timestamptz NOT NULL DEFAULT now()
);
-- Hosts already heard from were admitted before registration existed: they stay admitted.
INSERT INTO host_registrations (host_id) SELECT id FROM hosts;
