//! The user's CLI: `berth sandbox …`, `berth template ls|pull`, `berth login`. Every command speaks
//! only the public HTTP API (`/v1/…`) with an org's key, from `BERTH_API_KEY` or the config
//! file `berth login` writes (mode 0600); the API's URL from `--api-url`, `BERTH_API_URL`,
//! the config file, or [`client::DEFAULT_API_URL`]. Output is a table (or one value) for
//! people, JSON with `--json`; progress goes to stderr, and only when it is a terminal.
//!
//! `exec` and `shell` exit with the command's own exit code; errors of the CLI exit with the
//! codes of [`client::exit`].
//!
//! The operator's commands (`berth template build|import`, `berth admin …`) are elsewhere: they
//! work on the machine and the database, not through the API.

pub mod client;
mod cp;
mod exec;
mod render;
mod sandbox;
mod shell;
mod snapshots;
mod template;

pub use template::PullArgs as TemplatePullArgs;

use std::path::PathBuf;

use clap::{Args, Subcommand};

use client::{CliError, Client, Config};

/// Where the API is and how to print, shared by every user command.
#[derive(Args, Clone, Debug)]
pub struct ApiArgs {
    /// The API's base URL (default: the config file's, else http://127.0.0.1:8080).
    #[arg(long, env = "BERTH_API_URL", global = true)]
    pub api_url: Option<String>,
    /// The config file `berth login` writes (default: $XDG_CONFIG_HOME/berth/config.json,
    /// else ~/.config/berth/config.json). The key comes from BERTH_API_KEY first.
    #[arg(long, env = "BERTH_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Print JSON (the API's own shapes) instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

/// `berth sandbox …`
#[derive(Args, Debug)]
pub struct SandboxArgs {
    #[command(flatten)]
    api: ApiArgs,
    #[command(subcommand)]
    command: SandboxCmd,
}

/// The sandbox commands.
#[derive(Subcommand, Debug)]
enum SandboxCmd {
    /// Create a sandbox, wait until it runs, and print its id.
    Create(sandbox::CreateArgs),
    /// List the org's sandboxes (every page).
    #[command(alias = "list")]
    Ls(sandbox::ListArgs),
    /// Show one sandbox.
    Get {
        /// The sandbox's id.
        id: String,
    },
    /// Run a command and stream its output; exits with the command's exit code.
    Exec(exec::ExecArgs),
    /// Open an interactive terminal in the sandbox (a shell unless a command is given).
    Shell(shell::ShellArgs),
    /// Copy a file into or out of a sandbox: `berth sandbox cp ./f ID:/root/f`,
    /// `berth sandbox cp ID:/root/f ./f` (`-` for stdout).
    Cp(cp::CpArgs),
    /// Stop sandboxes (gVisor keeps memory, runc the disk) and wait until stopped.
    Stop(sandbox::LifecycleArgs),
    /// Start stopped (or archived) sandboxes and wait until they run.
    Start(sandbox::LifecycleArgs),
    /// Archive stopped sandboxes (their stop snapshot stored in the object store, their disk
    /// freed on the host) and wait until archived; `start` brings them back.
    Archive(sandbox::LifecycleArgs),
    /// Delete sandboxes and wait until deleted.
    #[command(alias = "delete")]
    Rm(sandbox::LifecycleArgs),
    /// A sandbox's lifecycle events; `--follow` streams new ones.
    Events(sandbox::EventsArgs),
    /// A preview URL and token for a port of the sandbox.
    Preview(sandbox::PreviewArgs),
    /// Snapshot a running sandbox (disk; memory too on gVisor), wait until it is stored, and
    /// print its id.
    Snapshot(snapshots::SnapshotArgs),
    /// Snapshot a running sandbox and start N new sandboxes from it; print their ids.
    Fork(snapshots::ForkArgs),
    /// Rebuild a sandbox from one of its snapshots and wait until it runs again.
    Restore(snapshots::RestoreArgs),
    /// Back up a running sandbox (its disk, never its memory) and print the backup's id once
    /// it is ready.
    Backup(snapshots::SnapshotArgs),
    /// Rebuild a sandbox from its newest (or the named) backup on a new placement and wait
    /// until it runs (memory is not restored).
    RestoreBackup(snapshots::RestoreBackupArgs),
}

/// `berth login`
#[derive(Args, Debug)]
pub struct LoginArgs {
    #[command(flatten)]
    api: ApiArgs,
}

/// Runs a user command to its end; returns the process's exit code.
pub fn run(command: UserCmd) -> i32 {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("berth: {e}");
            return client::exit::SOFTWARE;
        }
    };
    let code = match runtime.block_on(dispatch(command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("berth: {e}");
            e.exit_code()
        }
    };
    // A stdin reader may still block in its thread (a shell): do not wait for it.
    runtime.shutdown_background();
    code
}

/// A command of the user's CLI.
pub enum UserCmd {
    /// `berth sandbox …`
    Sandbox(SandboxArgs),
    /// `berth template ls`
    TemplateLs(ApiArgs),
    /// `berth template pull`
    TemplatePull(TemplatePullArgs),
    /// `berth login`
    Login(LoginArgs),
}

async fn dispatch(command: UserCmd) -> Result<i32, CliError> {
    match command {
        UserCmd::Login(args) => login(&args.api).await,
        UserCmd::TemplateLs(api) => {
            let client = connect(&api)?;
            sandbox::templates(&client, &api).await
        }
        UserCmd::TemplatePull(args) => {
            let client = connect(args.api())?;
            template::pull(&client, args).await
        }
        UserCmd::Sandbox(SandboxArgs { api, command }) => {
            let client = connect(&api)?;
            match command {
                SandboxCmd::Create(args) => sandbox::create(&client, &api, args).await,
                SandboxCmd::Ls(args) => sandbox::list(&client, &api, args).await,
                SandboxCmd::Get { id } => sandbox::get(&client, &api, &id).await,
                SandboxCmd::Exec(args) => exec::exec(&client, args).await,
                SandboxCmd::Shell(args) => shell::shell(&client, args).await,
                SandboxCmd::Cp(args) => cp::cp(&client, &api, args).await,
                SandboxCmd::Stop(args) => {
                    sandbox::lifecycle(&client, &api, sandbox::Action::Stop, args).await
                }
                SandboxCmd::Start(args) => {
                    sandbox::lifecycle(&client, &api, sandbox::Action::Start, args).await
                }
                SandboxCmd::Archive(args) => {
                    sandbox::lifecycle(&client, &api, sandbox::Action::Archive, args).await
                }
                SandboxCmd::Rm(args) => {
                    sandbox::lifecycle(&client, &api, sandbox::Action::Delete, args).await
                }
                SandboxCmd::Events(args) => sandbox::events(&client, &api, args).await,
                SandboxCmd::Preview(args) => sandbox::preview(&client, &api, args).await,
                SandboxCmd::Snapshot(args) => {
                    snapshots::snapshot(&client, &api, args, "snapshot").await
                }
                SandboxCmd::Fork(args) => snapshots::fork(&client, &api, args).await,
                SandboxCmd::Restore(args) => snapshots::restore(&client, &api, args).await,
                SandboxCmd::Backup(args) => {
                    snapshots::snapshot(&client, &api, args, "backup").await
                }
                SandboxCmd::RestoreBackup(args) => {
                    snapshots::restore_backup(&client, &api, args).await
                }
            }
        }
    }
}

/// The API's URL: the flag or `BERTH_API_URL`, else the config file's, else the default.
fn api_url(api: &ApiArgs, config: &Config) -> String {
    api.api_url
        .clone()
        .or_else(|| config.api_url.clone())
        .unwrap_or_else(|| client::DEFAULT_API_URL.to_owned())
}

/// A client with the key of `BERTH_API_KEY`, else of the config file.
///
/// Errors: [`CliError::NoKey`], [`CliError::Config`].
fn connect(api: &ApiArgs) -> Result<Client, CliError> {
    let path = client::config_path(api.config.as_deref());
    let config = Config::load(path.as_deref())?;
    let key = std::env::var("BERTH_API_KEY")
        .ok()
        .filter(|k| !k.is_empty())
        .or(config.api_key.clone())
        .ok_or(CliError::NoKey)?;
    Client::new(&api_url(api, &config), &key)
}

/// `berth login`: reads the key (from `BERTH_API_KEY`, else a line of stdin), checks it
/// against the API, and writes the config file (mode 0600).
async fn login(api: &ApiArgs) -> Result<i32, CliError> {
    use std::io::IsTerminal;
    let path = client::config_path(api.config.as_deref())
        .ok_or_else(|| CliError::Other("no config path: set HOME or --config".into()))?;
    let mut config = Config::load(Some(&path))?;
    let key = match std::env::var("BERTH_API_KEY")
        .ok()
        .filter(|k| !k.is_empty())
    {
        Some(key) => key,
        None => {
            if std::io::stdin().is_terminal() {
                eprint!("API key: ");
            }
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .map_err(|e| CliError::other("read the key from stdin", e))?;
            line.trim().to_owned()
        }
    };
    if key.is_empty() {
        return Err(CliError::NoKey);
    }
    let url = api_url(api, &config);
    let client = Client::new(&url, &key)?;
    // Any authenticated read proves the key.
    client
        .json(reqwest::Method::GET, "/v1/sandboxes?limit=1", None)
        .await?;
    config.api_url = Some(url.clone());
    config.api_key = Some(key);
    config.save(&path)?;
    eprintln!(
        "logged in to {url}; the key is in {} (mode 0600)",
        path.display()
    );
    Ok(0)
}
