-- A sandbox's environment and entrypoint (issue 18 item 1, the OpenSandbox SDK's `env` and
-- `entrypoint`): carried to its host in every command's spec; hostd sets `env` for every exec
-- and starts `entrypoint` in the background at each boot from disk. `env` is a JSON object of
-- strings; `entrypoint` an argv (empty: nothing is started).
ALTER TABLE sandboxes
    ADD COLUMN env        jsonb  NOT NULL DEFAULT '{}'::jsonb,
    ADD COLUMN entrypoint text[] NOT NULL DEFAULT '{}',
    ADD CONSTRAINT sandboxes_env_is_an_object CHECK (jsonb_typeof(env) = 'object');

-- The image a sandbox was asked for through the OpenSandbox surface (`image.uri`), shown back
-- by its `GET`; NULL for a sandbox created by template.
ALTER TABLE sandboxes ADD COLUMN image_uri text;

-- The bearer of a sandbox's execd surface under /compat/opensandbox (the token the endpoint
-- lookup hands out in its `headers`); made on the first lookup, NULL until then. It opens that
-- sandbox's exec and files only, never the org's API.
ALTER TABLE sandboxes ADD COLUMN execd_token text;
