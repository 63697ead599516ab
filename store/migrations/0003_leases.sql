-- Leader leases on the database clock. `term` is bumped on every takeover; each write of a
-- leader's pass re-checks (holder, term) in its own transaction, so a deposed leader cannot
-- commit.
CREATE TABLE leases (
    name        text PRIMARY KEY,
    holder      uuid NOT NULL,
    term        bigint NOT NULL,
    expires_at  timestamptz NOT NULL
);
