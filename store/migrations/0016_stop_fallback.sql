-- Why a stop that wanted memory kept the disk only (issue 12 item 4): on the sandbox (set by a
-- stop's result, cleared by the next stop that reports none) and on the event of that stop.
-- The code is berth_schemas' StopFallbackCode spelling (`checkpoint_failed`); the reason is the
-- runtime's error, bounded by the host (STOP_FALLBACK_DETAIL_MAX_CHARS).
ALTER TABLE sandboxes
    ADD COLUMN last_stop_code   text,
    ADD COLUMN last_stop_reason text,
    ADD CONSTRAINT sandboxes_last_stop_reason_has_code
        CHECK ((last_stop_code IS NULL) = (last_stop_reason IS NULL));

-- How the stop an event records kept the sandbox (`memory`, `disk`), and why it kept the disk
-- only; NULL on every event but a stop's.
ALTER TABLE events
    ADD COLUMN last_stop        text,
    ADD COLUMN last_stop_code   text,
    ADD COLUMN last_stop_reason text;
