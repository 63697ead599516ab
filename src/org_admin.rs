//! `berth admin revoke-key`, `berth admin list-keys` and `berth admin delete-org`: an
//! operator's word on keys and orgs, whatever org they belong to (an org key manages its own
//! org's keys through `/v1/keys`).

use std::fmt::Write;

use anyhow::bail;
use berth_schemas::ApiKeyId;
use clap::Subcommand;
use sqlx::PgPool;

/// The key and org commands of `berth admin` (flattened into its subcommands).
#[derive(Subcommand, Debug)]
pub enum OrgAdminCmd {
    /// Revoke an API key (an org's or an operator's) by its id: every API and proxy process
    /// refuses it at once.
    RevokeKey {
        /// The key's id (`GET /v1/keys`, `berth admin list-keys`).
        key_id: ApiKeyId,
    },
    /// List an org's keys (ids, prefixes, when made and revoked; never a secret).
    ListKeys {
        /// The org's name.
        org: String,
    },
    /// Delete an org: revoke its keys, delete each of its sandboxes as its owner's delete
    /// would, then mark the org deleted (its name stays taken). Re-running it finishes an
    /// interrupted run.
    DeleteOrg {
        /// The org's name.
        org: String,
    },
}

/// Runs `command`; what it prints.
///
/// Errors: an unknown key or org; the database's.
pub async fn run(db: &PgPool, command: OrgAdminCmd) -> anyhow::Result<String> {
    let mut out = String::new();
    match command {
        OrgAdminCmd::RevokeKey { key_id } => {
            let Some(revoked) = berth_store::api_keys::revoke(db, None, key_id).await? else {
                bail!("no key {key_id}");
            };
            let row = revoked.row;
            let at = row.revoked_at.map(|t| t.to_rfc3339()).unwrap_or_default();
            writeln!(out, "key {key_id} ({}…) revoked at {at}", row.prefix)?;
        }
        OrgAdminCmd::ListKeys { org } => {
            let Some((id, _)) = berth_store::orgs::find_by_name(db, &org).await? else {
                bail!("no org named {org:?}");
            };
            for key in berth_store::api_keys::list(db, id).await? {
                let state = match key.revoked_at {
                    Some(at) => format!("revoked {}", at.to_rfc3339()),
                    None => "active".to_owned(),
                };
                writeln!(
                    out,
                    "{}  {}…  created {}  {state}",
                    key.id,
                    key.prefix,
                    key.created_at.to_rfc3339()
                )?;
            }
        }
        OrgAdminCmd::DeleteOrg { org } => {
            let deleted = berth_api::service::orgs::delete(db, &org)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            writeln!(
                out,
                "org {org} ({}): {} keys revoked, {} sandboxes being deleted, {}",
                deleted.org,
                deleted.keys_revoked,
                deleted.sandboxes_deleted,
                if deleted.tombstoned {
                    "marked deleted"
                } else {
                    "already marked deleted"
                }
            )?;
        }
    }
    Ok(out)
}
