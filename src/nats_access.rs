//! Issuing NATS credentials and the server configuration that admits them: what
//! `berth admin add-host`, `berth admin nats-config`, `berth dev` and the tests share. The
//! permission model itself is `berth_schemas::nats_auth`.
//!
//! # Guarantees
//! - A host's credentials are registered (`store::hosts::register`, with the public key)
//!   before they are written anywhere, so the server config rendered afterwards admits them
//!   and the scheduler accepts the host's heartbeats.
//! - Secrets are written with mode 0600, never over an existing file unless the caller reuses
//!   it ([`load_or_create`]).

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use berth_schemas::nats_auth::{server_auth_config, Creds, HostUser, Role};
use berth_schemas::{HostId, Subjects};
use sqlx::PgPool;

/// Reads a credentials file ([`Creds::render`]'s form).
///
/// Errors: unreadable, or not a credentials file.
pub fn load(path: &Path) -> anyhow::Result<Creds> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("read NATS credentials {}", path.display()))?;
    Creds::parse(&text).with_context(|| format!("NATS credentials {}", path.display()))
}

/// Writes `creds` to a new file `path` with mode 0600.
///
/// Errors: the file exists (credentials are never overwritten silently), or cannot be made.
pub fn write_new(path: &Path, creds: &Creds) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create {} (it must not exist yet)", path.display()))?;
    file.write_all(creds.render().as_bytes())?;
    file.sync_all()?;
    Ok(())
}

/// The credentials in `path` when it holds some for `role`; otherwise new ones written there.
///
/// Errors: the file holds another role's credentials, or cannot be read or written.
pub fn load_or_create(path: &Path, role: Role) -> anyhow::Result<Creds> {
    if path.exists() {
        let creds = load(path)?;
        anyhow::ensure!(
            creds.role == role,
            "{} holds credentials for {:?}, not {role:?}",
            path.display(),
            creds.role
        );
        return Ok(creds);
    }
    let creds = Creds::generate(role);
    write_new(path, &creds)?;
    Ok(creds)
}

/// Issues new credentials for `host` and registers it with their public key (re-issuing
/// rotates the key: the next rendered server config admits only the new one).
///
/// Errors: the database's.
pub async fn issue_host(db: &PgPool, host: HostId) -> anyhow::Result<Creds> {
    let creds = Creds::generate(Role::Host(host));
    berth_store::hosts::register(db, host, Some(&creds.public_key()))
        .await
        .with_context(|| format!("register host {host}"))?;
    Ok(creds)
}

/// Registers `host` with the key of `creds` (which must be that host's), e.g. credentials
/// `berth dev` keeps across restarts.
///
/// Errors: `creds` are another principal's; the database's.
pub async fn register_host(db: &PgPool, creds: &Creds) -> anyhow::Result<HostId> {
    let Role::Host(host) = creds.role else {
        anyhow::bail!("not host credentials");
    };
    berth_store::hosts::register(db, host, Some(&creds.public_key())).await?;
    Ok(host)
}

/// The `authorization` block for the control plane's key and every registered host that has
/// a key ([`server_auth_config`]).
///
/// Errors: the database's.
pub async fn render_auth(
    db: &PgPool,
    subjects: &Subjects,
    control_plane: &Creds,
) -> anyhow::Result<String> {
    let hosts: Vec<HostUser> = berth_store::hosts::registrations(db)
        .await?
        .into_iter()
        .filter_map(|r| {
            r.nkey.map(|public_key| HostUser {
                host_id: r.host_id,
                public_key,
            })
        })
        .collect();
    Ok(server_auth_config(
        subjects,
        &control_plane.public_key(),
        &hosts,
    ))
}

/// TLS files of a NATS server: its certificate chain and key (PEM).
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// The server's certificate (PEM), signed by the CA clients are given.
    pub cert_file: PathBuf,
    /// Its private key (PEM).
    pub key_file: PathBuf,
}

/// A whole nats-server config: listen on `127.0.0.1:<port>`, JetStream in `store_dir`, the
/// `auth` block (none: open) and TLS (none: plain).
pub fn server_config(
    port: u16,
    store_dir: &Path,
    auth: Option<&str>,
    tls: Option<&ServerTls>,
) -> String {
    let mut config = format!(
        "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: \"{}\" }}\n",
        store_dir.display()
    );
    if let Some(tls) = tls {
        config.push_str(&format!(
            "tls {{ cert_file: \"{}\", key_file: \"{}\" }}\n",
            tls.cert_file.display(),
            tls.key_file.display()
        ));
    }
    if let Some(auth) = auth {
        config.push_str(auth);
    }
    config
}
