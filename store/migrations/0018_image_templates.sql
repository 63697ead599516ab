-- Templates from OCI images (issue 18 item 2). A template row may name an image; its pull is
-- tracked by `state` (schemas::template_state: pulling -> ready | failed; a failed template is
-- pulled again when asked again). Built-in and imported templates are `ready` from the start.
--
-- `image` is the reference as asked (`registry/repo:tag`); `image_pinned` the same pinned to the
-- manifest digest of this machine's platform (`registry/repo@sha256:...`), what hosts pull, so
-- every host boots the same bytes whatever the tag later points to.

ALTER TABLE templates ADD COLUMN image         text;
ALTER TABLE templates ADD COLUMN image_pinned  text;
ALTER TABLE templates ADD COLUMN image_digest  text;
ALTER TABLE templates ADD COLUMN image_bytes   bigint;
ALTER TABLE templates ADD COLUMN entrypoint    jsonb;
ALTER TABLE templates ADD COLUMN state         text NOT NULL DEFAULT 'ready'
                                               CHECK (state IN ('pulling', 'ready', 'failed'));
ALTER TABLE templates ADD COLUMN error_code    text;
ALTER TABLE templates ADD COLUMN error_message text;
ALTER TABLE templates ADD COLUMN updated_at    timestamptz NOT NULL DEFAULT now();

-- A ready image template always knows what to pull.
ALTER TABLE templates ADD CONSTRAINT templates_image_pinned
    CHECK (image IS NULL OR state <> 'ready' OR image_pinned IS NOT NULL);

-- What happened to a template, oldest first: the pull's progress and its outcome. Templates are
-- shared by every org, so these are not sandbox events (not published through the outbox);
-- `GET /v1/templates/{name}` lists them.
CREATE TABLE template_events (
    id        bigserial PRIMARY KEY,
    template  text NOT NULL REFERENCES templates(name) ON DELETE CASCADE,
    at        timestamptz NOT NULL DEFAULT now(),
    type      text NOT NULL,
    message   text NOT NULL
);
CREATE INDEX template_events_by_template ON template_events (template, id);

-- A sandbox keeps the image its template resolved to when it was created (what its host pulls),
-- whatever later pulls of the template's tag resolve to.
ALTER TABLE sandboxes ADD COLUMN image text;
