//! `berth sandbox snapshot|backup|fork|restore|restore-backup` (issues 13 and 14): a snapshot
//! (or a backup: disk only) of a running sandbox, waited until it is `ready` (or `failed`); a
//! fork into new sandboxes, waited until each runs; a restore from one of the sandbox's
//! snapshots, or from its backup on a new placement, waited until it runs again.

use std::io::Write;
use std::time::Duration;

use clap::Args;
use reqwest::Method;
use serde_json::{json, Value};

use super::client::{CliError, Client};
use super::render;
use super::sandbox::{segment, WAIT_TIMEOUT};
use super::ApiArgs;

/// How often a snapshot still `creating` is looked at again.
const SNAPSHOT_POLL: Duration = Duration::from_millis(250);

/// How long `berth sandbox snapshot` waits for the snapshot to settle.
const SNAPSHOT_WAIT: Duration = Duration::from_secs(1800);

/// `berth sandbox snapshot`
#[derive(Args, Debug)]
pub struct SnapshotArgs {
    /// The sandbox's id.
    id: String,
    /// Return once the snapshot is requested (`creating`), without waiting for `ready`.
    #[arg(long)]
    no_wait: bool,
}

/// `berth sandbox fork`
#[derive(Args, Debug)]
pub struct ForkArgs {
    /// The sandbox's id.
    id: String,
    /// How many new sandboxes, 1 to 16.
    #[arg(long, short = 'n', default_value_t = 1)]
    count: u32,
    /// Return once the fork is accepted, without waiting for the new sandboxes to run.
    #[arg(long)]
    no_wait: bool,
}

/// `berth sandbox restore`
#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// The sandbox's id.
    id: String,
    /// One of the sandbox's ready snapshots.
    snapshot_id: String,
    /// Return once the restore is accepted (`resuming`), without waiting until it runs.
    #[arg(long)]
    no_wait: bool,
}

/// `berth sandbox restore-backup`
#[derive(Args, Debug)]
pub struct RestoreBackupArgs {
    /// The sandbox's id.
    id: String,
    /// One of the sandbox's ready backups; its newest when omitted.
    #[arg(long)]
    backup: Option<String>,
    /// Return once the restore is accepted (`restoring`), without waiting until it runs.
    #[arg(long)]
    no_wait: bool,
}

fn print(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

/// `berth sandbox snapshot` (`what`: `snapshot`) and `berth sandbox backup` (`backup`):
/// prints the snapshot's id (the snapshot with `--json`); exits 1 when it failed (its reason
/// on stderr).
pub async fn snapshot(
    client: &Client,
    api: &ApiArgs,
    args: SnapshotArgs,
    what: &str,
) -> Result<i32, CliError> {
    let path = format!("/v1/sandboxes/{}/{what}", segment(&args.id));
    let spinner = render::spinner(format!("taking a {what} of {}", args.id));
    let mut snapshot = client.json(Method::POST, &path, None).await;
    let taken = match (&snapshot, args.no_wait) {
        (Ok(taken), false) => Some(taken["id"].as_str().unwrap_or_default().to_owned()),
        _ => None,
    };
    if let Some(id) = taken {
        snapshot = settle(client, &id).await;
    }
    spinner.finish_and_clear();
    let snapshot = snapshot?;
    if api.json {
        print(&render::json(&snapshot));
    } else {
        print(&format!("{}\n", render::cell(&snapshot["id"])));
    }
    if snapshot["state"] == "failed" {
        eprintln!(
            "berth: the {what} failed: {}",
            render::cell(&snapshot["reason"])
        );
        return Ok(1);
    }
    Ok(0)
}

/// Polls snapshot `id` until it leaves `creating` or [`SNAPSHOT_WAIT`] passes.
async fn settle(client: &Client, id: &str) -> Result<Value, CliError> {
    let deadline = tokio::time::Instant::now() + SNAPSHOT_WAIT;
    loop {
        let snapshot = client
            .json(Method::GET, &format!("/v1/snapshots/{}", segment(id)), None)
            .await?;
        if snapshot["state"] != "creating" || tokio::time::Instant::now() >= deadline {
            return Ok(snapshot);
        }
        tokio::time::sleep(SNAPSHOT_POLL).await;
    }
}

/// `berth sandbox fork`: prints the new sandboxes' ids, one a line (the fork's answer with
/// `--json`: the snapshot and the sandboxes).
pub async fn fork(client: &Client, api: &ApiArgs, args: ForkArgs) -> Result<i32, CliError> {
    let path = format!("/v1/sandboxes/{}/fork", segment(&args.id));
    let spinner = render::spinner(format!("forking {} into {}", args.id, args.count));
    let forked = client
        .json(Method::POST, &path, Some(&json!({ "count": args.count })))
        .await;
    let mut forked = match forked {
        Ok(forked) => forked,
        Err(e) => {
            spinner.finish_and_clear();
            return Err(e);
        }
    };
    if !args.no_wait {
        let ids: Vec<String> = forked["sandboxes"]
            .as_array()
            .map(|all| {
                all.iter()
                    .filter_map(|s| s["id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let mut running = Vec::new();
        for id in ids {
            let waited = client
                .json(
                    Method::GET,
                    &format!(
                        "/v1/sandboxes/{}/wait?state=running&timeout={WAIT_TIMEOUT}",
                        segment(&id)
                    ),
                    None,
                )
                .await;
            match waited {
                Ok(sandbox) => running.push(sandbox),
                Err(e) => {
                    spinner.finish_and_clear();
                    return Err(e);
                }
            }
        }
        forked["sandboxes"] = Value::Array(running);
    }
    spinner.finish_and_clear();
    if api.json {
        print(&render::json(&forked));
    } else if let Some(all) = forked["sandboxes"].as_array() {
        for sandbox in all {
            print(&format!("{}\n", render::cell(&sandbox["id"])));
        }
    }
    Ok(0)
}

/// `berth sandbox restore`: prints `<id> <state>` (the sandbox with `--json`).
pub async fn restore(client: &Client, api: &ApiArgs, args: RestoreArgs) -> Result<i32, CliError> {
    let body = json!({ "snapshot_id": args.snapshot_id });
    restore_with(client, api, &args.id, "restore", body, args.no_wait).await
}

/// `berth sandbox restore-backup`: prints `<id> <state>` (the sandbox with `--json`).
pub async fn restore_backup(
    client: &Client,
    api: &ApiArgs,
    args: RestoreBackupArgs,
) -> Result<i32, CliError> {
    let body = match args.backup {
        Some(backup) => json!({ "backup_id": backup }),
        None => json!({}),
    };
    let id = args.id;
    restore_with(client, api, &id, "restore-from-backup", body, args.no_wait).await
}

/// Posts `body` to the sandbox's `route` and, unless `no_wait`, waits until it runs.
async fn restore_with(
    client: &Client,
    api: &ApiArgs,
    id: &str,
    route: &str,
    body: Value,
    no_wait: bool,
) -> Result<i32, CliError> {
    let mut path = format!("/v1/sandboxes/{}/{route}", segment(id));
    if !no_wait {
        path.push_str(&format!("?wait=running&timeout={WAIT_TIMEOUT}"));
    }
    let spinner = render::spinner(format!("restoring {id}"));
    let restored = client.json(Method::POST, &path, Some(&body)).await;
    spinner.finish_and_clear();
    let sandbox = restored?;
    if api.json {
        print(&render::json(&sandbox));
    } else {
        print(&format!(
            "{} {}\n",
            render::cell(&sandbox["id"]),
            render::cell(&sandbox["state"])
        ));
    }
    Ok(0)
}
