-- Preview URLs (issue 15): whether a request to a stopped sandbox's preview starts it, which of
-- its ports anyone may reach without a key, and where each host's port forwarder listens (from
-- its heartbeats; NULL: it runs none).
ALTER TABLE sandboxes
    ADD COLUMN auto_resume  boolean   NOT NULL DEFAULT true,
    ADD COLUMN public_ports integer[] NOT NULL DEFAULT '{}'
        CHECK (1 <= ALL (public_ports) AND 65535 >= ALL (public_ports));
ALTER TABLE hosts ADD COLUMN forwarder text;
