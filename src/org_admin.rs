//! `berth admin revoke-key`, `berth admin list-keys`, `berth admin set-backups` and
//! `berth admin delete-org`: an operator's word on keys and orgs, whatever org they belong to (an org key manages its own
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
    /// Set an org's backup policy (issue 14): the `backup_interval_min` its new sandboxes
    /// take when their create names none, and how many ready backups of each sandbox are kept
    /// (older ones, and every failed backup but the newest, are deleted by the API). What is
    /// not given stays as it is.
    SetBackups {
        /// The org's name.
        org: String,
        /// Minutes between periodic backups of its new sandboxes (1 to 525600).
        #[arg(long, conflicts_with = "no_interval")]
        interval_min: Option<i32>,
        /// No periodic backups for its new sandboxes unless their create asks.
        #[arg(long)]
        no_interval: bool,
        /// Ready backups kept per sandbox (1 to 1000; 7 for a new org).
        #[arg(long)]
        keep: Option<i32>,
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
        OrgAdminCmd::SetBackups {
            org,
            interval_min,
            no_interval,
            keep,
        } => {
            if interval_min.is_some_and(|m| !(1..=525_600).contains(&m)) {
                bail!("--interval-min must be 1 to 525600 minutes");
            }
            if keep.is_some_and(|k| !(1..=1000).contains(&k)) {
                bail!("--keep must be 1 to 1000");
            }
            let interval = match (interval_min, no_interval) {
                (Some(m), _) => Some(Some(m)),
                (None, true) => Some(None),
                (None, false) => None,
            };
            if !berth_store::orgs::set_backup_policy(db, &org, interval, keep).await? {
                bail!("no org named {org:?}");
            }
            let Some((id, _)) = berth_store::orgs::find_by_name(db, &org).await? else {
                bail!("no org named {org:?}");
            };
            let policy = berth_store::orgs::backup_policy(db, id)
                .await?
                .unwrap_or_default();
            let every = policy
                .interval_min
                .map_or("none".to_owned(), |m| format!("every {m} min"));
            writeln!(
                out,
                "backups of {org}: new sandboxes {every}; {} kept per sandbox",
                policy.kept
            )?;
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
