-- Stored responses of POST requests that carried an Idempotency-Key, per org.
CREATE TABLE idempotency_keys (
    org_id       uuid NOT NULL REFERENCES orgs(id) ON DELETE CASCADE,
    key          text NOT NULL,
    -- SHA-256 of method, path and body: the same key with another request is refused.
    fingerprint  bytea NOT NULL,
    status       integer NOT NULL,
    response     jsonb NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, key)
);

CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at);
