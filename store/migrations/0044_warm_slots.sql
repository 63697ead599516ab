-- Issue 16 lever 1, warm pools: each host boots a few sandboxes ahead of any create, each under
-- a sandbox id the host drew, and lists them in every heartbeat (`Heartbeat::warm`). A host's
-- rows here are exactly the slots of its newest applied heartbeat (`store::warm::replace`,
-- in the heartbeat batch's transaction); a create of the same shape deletes one of its chosen
-- host's rows and takes its `sandbox_id` as the new sandbox's id (`store::warm::claim`), so the
-- host hands that sandbox over instead of booting one.
--
-- A slot whose id already names a sandbox is never stored (a heartbeat sent before its host saw
-- the create arrives late) and never claimed; `reported_at` (database clock) is when the
-- heartbeat that last listed it was applied, and a claim takes only slots reported within the
-- placement's freshness window.
CREATE TABLE warm_slots (
    sandbox_id  uuid PRIMARY KEY,
    host_id     uuid NOT NULL REFERENCES hosts (id) ON DELETE CASCADE,
    template    text NOT NULL,
    -- The spelling of `sandboxes.runtime`.
    runtime     text NOT NULL CHECK (runtime IN ('runc', 'runsc')),
    -- The types of the same columns of `sandboxes`.
    vcpus       integer NOT NULL,
    memory_mib  integer NOT NULL,
    disk_mib    integer NOT NULL,
    -- The template's pinned image (`templates.image_pinned`); NULL for a built-in or imported
    -- template.
    image       text,
    reported_at timestamptz NOT NULL DEFAULT now()
);

-- The claim looks up one host's slots of a shape (every column an equality) and placement the
-- hosts holding a slot of a shape (the prefix without `host_id`): one index serves both.
-- `reported_at` stays out of it, so a heartbeat's refresh of a slot is a HOT update.
CREATE INDEX warm_slots_shape ON warm_slots (template, runtime, vcpus, memory_mib, disk_mib,
                                             host_id);
-- A heartbeat's replacement finds its host's rows.
CREATE INDEX warm_slots_host ON warm_slots (host_id);
