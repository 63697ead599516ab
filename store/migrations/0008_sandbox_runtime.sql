-- A sandbox keeps the runtime its template named when it was created, and every command carries
-- it to the host (the host no longer derives it from a template list of its own).
ALTER TABLE sandboxes ADD COLUMN runtime text;
UPDATE sandboxes s SET runtime = t.runtime FROM templates t WHERE t.name = s.template;
UPDATE sandboxes SET runtime = 'runc' WHERE runtime IS NULL;
ALTER TABLE sandboxes ALTER COLUMN runtime SET NOT NULL;
ALTER TABLE sandboxes ADD CONSTRAINT sandboxes_runtime CHECK (runtime IN ('runc', 'runsc'));
ALTER TABLE templates ADD CONSTRAINT templates_runtime CHECK (runtime IN ('runc', 'runsc'));
