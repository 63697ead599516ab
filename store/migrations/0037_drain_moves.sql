-- Drain moves sandboxes (issue 14): `POST /v1/hosts/{id}/drain {"live": true}` asks the
-- reconciler's drive to move the host's running sandboxes too, not only its stopped ones.
ALTER TABLE hosts ADD COLUMN drain_live boolean NOT NULL DEFAULT false;

-- One row per sandbox the drive is moving off a draining host, or failed to: `kind` says how
-- (`archive`: a stopped sandbox archived; `live`: a running one stopped, then started
-- elsewhere), `phase` where it is (`stopping`, `moving`, `failed` with its `reason`). A failed
-- move is not retried until the host is drained again (which deletes its failed rows, as
-- uncordon and cordon do); a move in flight finishes either way. The host's progress
-- (`GET /v1/hosts/{id}`: left, moving, failed) is counted from here and from the sandboxes.
CREATE TABLE drain_moves (
    sandbox_id  uuid PRIMARY KEY REFERENCES sandboxes (id) ON DELETE CASCADE,
    host_id     uuid NOT NULL REFERENCES hosts (id) ON DELETE CASCADE,
    kind        text NOT NULL CHECK (kind IN ('archive', 'live')),
    phase       text NOT NULL CHECK (phase IN ('stopping', 'moving', 'failed')),
    reason      text CHECK ((phase = 'failed') = (reason IS NOT NULL)),
    created_at  timestamptz NOT NULL DEFAULT now(),
    -- When it entered its phase (database clock): a live move waits so long for its durable stop.
    phase_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX drain_moves_host ON drain_moves (host_id, phase);
