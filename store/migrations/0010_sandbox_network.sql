-- A sandbox's network policy, in the API's spelling ({"egress": "public" | "none" | [cidrs]}),
-- carried to its host in every command's spec and enforced there by nftables. Sandboxes made
-- before it had unrestricted egress; they read as the default, public egress.
ALTER TABLE sandboxes ADD COLUMN network jsonb NOT NULL DEFAULT '{"egress": "public"}'::jsonb;
ALTER TABLE sandboxes ADD CONSTRAINT sandboxes_network CHECK (jsonb_typeof(network) = 'object');
