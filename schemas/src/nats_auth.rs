//! Who may say what on NATS: the account and permission model of the control plane.
//!
//! nats-server 2.9 has no auth callout, so Berth uses *server-config users identified by
//! nkeys* (an Ed25519 key pair per principal; the server keeps only public keys and checks a
//! signature of its nonce at connect). There are two roles:
//!
//! - the **control plane** (api and its relays, scheduler, reconciler): one key, every subject;
//! - a **host** (one hostd): its own key, allowed exactly what that host needs and nothing of
//!   another host's ([`host_permissions`]): publish `{p}.result.<self>` and `{p}.hb.<self>`,
//!   answer requests it received (`allow_responses`), drive its own JetStream consumer
//!   `hostd-<self>` on `{P}_CMD` (filter `{p}.cmd.<self>`), and subscribe only to
//!   `{p}.agent.<self>` and its own inbox prefix `_INBOX.<self>` ([`Role::inbox_prefix`]), so no
//!   host can read another's replies (exec output, file contents) by subscribing `_INBOX.>`.
//!
//! [`server_auth_config`] renders the `authorization { users = [...] }` block nats-server
//! loads (include it in the server's config; adding a host is a re-render and a config reload,
//! `nats-server --signal reload`). [`Creds`] is the secret file a principal connects with,
//! and [`NatsConnect`] turns URL + credentials + an optional CA file (TLS) into a connection.
//!
//! Why not decentralized JWT auth: it would spare the reload on adding a host, but needs an
//! operator, a system account and account JWTs with JetStream limits that `nsc` normally makes
//! (not in Debian); removing a host needs a reload either way (a revocation list), and here the
//! whole permission model is one file an operator can read.
//!
//! Source: NATS server configuration, "Authorization" (`permissions`, `allow_responses`) and
//! "NKeys"; JetStream wire API subjects (`$JS.API.CONSUMER.CREATE.<stream>.<consumer>.<filter>`,
//! `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`, `$JS.ACK.<stream>.<consumer>.>`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use crate::ids::HostId;
use crate::subjects::Subjects;

/// The inbox prefix of the control plane's connections (the client default).
pub const CONTROL_PLANE_INBOX: &str = "_INBOX";

/// How long a host may keep answering one request (a streamed exec runs at most 10 minutes;
/// a margin for the last chunks): the server forgets the reply permission after this.
pub const RESPONSE_WINDOW: Duration = Duration::from_secs(15 * 60);

/// How many messages a host may send to one request's reply subject (a streamed exec sends
/// its output in many chunks; the window above bounds it in time).
pub const RESPONSE_MAX_MESSAGES: u32 = 1_000_000;

/// Who a set of credentials speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The api, relays, scheduler and reconciler: every subject.
    ControlPlane,
    /// One hostd: only its own subjects.
    Host(HostId),
}

impl Role {
    /// The inbox prefix connections of this role must use: `_INBOX` for the control plane,
    /// `_INBOX.<host_id>` for a host (the only inboxes its permissions let it subscribe to).
    pub fn inbox_prefix(&self) -> String {
        match self {
            Role::ControlPlane => CONTROL_PLANE_INBOX.to_owned(),
            Role::Host(host) => format!("{CONTROL_PLANE_INBOX}.{host}"),
        }
    }
}

/// A principal's NATS credentials: its role and its nkey seed (the secret; `SU…`).
#[derive(Clone, PartialEq, Eq)]
pub struct Creds {
    /// Who these credentials speak for.
    pub role: Role,
    seed: String,
}

impl std::fmt::Debug for Creds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Creds")
            .field("role", &self.role)
            .field("public_key", &self.public_key())
            .finish_non_exhaustive()
    }
}

/// A credentials file that could not be read as one.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CredsError {
    /// A line is not `key = value`, or a key is unknown.
    #[error("line {line}: {message}")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A required key is missing.
    #[error("missing {0}")]
    Missing(&'static str),
    /// The seed is not a user nkey seed.
    #[error("invalid nkey seed: {0}")]
    Seed(String),
}

impl Creds {
    /// New credentials with a fresh user key pair.
    pub fn generate(role: Role) -> Self {
        let pair = nkeys::KeyPair::new_user();
        Self {
            role,
            seed: pair.seed().expect("a generated key pair has a seed"),
        }
    }

    /// Credentials from a seed. Errors: [`CredsError::Seed`] when it is not a user seed.
    pub fn from_seed(role: Role, seed: &str) -> Result<Self, CredsError> {
        let pair = nkeys::KeyPair::from_seed(seed).map_err(|e| CredsError::Seed(e.to_string()))?;
        if pair.key_pair_type() != nkeys::KeyPairType::User {
            return Err(CredsError::Seed("not a user seed (SU…)".into()));
        }
        Ok(Self {
            role,
            seed: seed.to_owned(),
        })
    }

    /// The public nkey (`U…`, 56 characters) the server config names.
    pub fn public_key(&self) -> String {
        nkeys::KeyPair::from_seed(&self.seed)
            .expect("validated at construction")
            .public_key()
    }

    /// The secret seed (what `async_nats::ConnectOptions::nkey` takes).
    pub fn seed(&self) -> &str {
        &self.seed
    }

    /// The file form: comment lines, then `role = control-plane | host`, `host_id = <uuid>`
    /// (hosts only) and `nkey_seed = SU…`.
    pub fn render(&self) -> String {
        let mut out = String::from(
            "# Berth NATS credentials. Secret: keep this file mode 0600.\n\
             # Issued by `berth admin add-host` or `berth admin nats-config`.\n",
        );
        match self.role {
            Role::ControlPlane => out.push_str("role = control-plane\n"),
            Role::Host(host) => {
                let _ = writeln!(out, "role = host\nhost_id = {host}");
            }
        }
        let _ = writeln!(out, "nkey_seed = {}", self.seed);
        out
    }

    /// Parses [`Creds::render`]'s form (`#` comments and blank lines ignored).
    ///
    /// Errors: [`CredsError`].
    pub fn parse(text: &str) -> Result<Self, CredsError> {
        let (mut role, mut host, mut seed) = (None, None, None);
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let syntax = |message: String| CredsError::Syntax {
                line: i + 1,
                message,
            };
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| syntax("expected `key = value`".into()))?;
            let value = value.trim();
            match key.trim() {
                "role" => role = Some(value.to_owned()),
                "host_id" => {
                    host = Some(
                        value
                            .parse::<HostId>()
                            .map_err(|_| syntax(format!("host_id {value:?} is not a UUID")))?,
                    )
                }
                "nkey_seed" => seed = Some(value.to_owned()),
                other => return Err(syntax(format!("unknown key {other:?}"))),
            }
        }
        let role = match role.as_deref() {
            Some("control-plane") => Role::ControlPlane,
            Some("host") => Role::Host(host.ok_or(CredsError::Missing("host_id"))?),
            Some(other) => {
                return Err(CredsError::Syntax {
                    line: 0,
                    message: format!("unknown role {other:?}"),
                })
            }
            None => return Err(CredsError::Missing("role")),
        };
        Self::from_seed(role, &seed.ok_or(CredsError::Missing("nkey_seed"))?)
    }
}

/// What one NATS user may publish and subscribe to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permissions {
    /// Subjects (with wildcards) it may publish to.
    pub publish: Vec<String>,
    /// Subjects (with wildcards) it may subscribe to.
    pub subscribe: Vec<String>,
    /// Whether it may answer requests delivered to it (at most [`RESPONSE_MAX_MESSAGES`] per
    /// request, within [`RESPONSE_WINDOW`]).
    pub allow_responses: bool,
}

/// The JetStream API prefix (the default domain).
const JS_API: &str = "$JS.API";

/// The control plane's permissions: everything.
pub fn control_plane_permissions() -> Permissions {
    Permissions {
        publish: vec![">".into()],
        subscribe: vec![">".into()],
        allow_responses: false,
    }
}

/// One host's permissions, and nothing that names another host:
/// - publish: `{p}.result.<host>`, `{p}.hb.<host>`; on the command stream `{P}_CMD` its stream
///   info, and for its durable consumer `hostd-<host>` info, delete, create (only with the
///   filter `{p}.cmd.<host>` in the subject; the server refuses a body whose filter differs),
///   pulls (`MSG.NEXT`) and acks (`$JS.ACK.{P}_CMD.hostd-<host>.>`);
/// - subscribe: `{p}.agent.<host>` and `_INBOX.<host>.>` (JetStream replies, pulled commands);
/// - replies to the requests it received.
pub fn host_permissions(subjects: &Subjects, host: HostId) -> Permissions {
    let stream = subjects.cmd_stream();
    let consumer = subjects.host_consumer(host);
    Permissions {
        publish: vec![
            subjects.result(host),
            subjects.heartbeat(host),
            format!("{JS_API}.STREAM.INFO.{stream}"),
            format!("{JS_API}.CONSUMER.INFO.{stream}.{consumer}"),
            format!("{JS_API}.CONSUMER.DELETE.{stream}.{consumer}"),
            format!(
                "{JS_API}.CONSUMER.CREATE.{stream}.{consumer}.{}",
                subjects.cmd(host)
            ),
            format!("{JS_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}"),
            format!("$JS.ACK.{stream}.{consumer}.>"),
        ],
        subscribe: vec![
            subjects.agent(host),
            format!("{}.>", Role::Host(host).inbox_prefix()),
        ],
        allow_responses: true,
    }
}

/// A host the server config lets in: its id and public nkey.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostUser {
    /// The host.
    pub host_id: HostId,
    /// Its public nkey (`U…`).
    pub public_key: String,
}

/// The `authorization { users = [...] }` block of a nats-server config: the control plane's
/// key with [`control_plane_permissions`], each host's with [`host_permissions`]. Every other
/// client (no key, or a key not listed) is refused at connect.
pub fn server_auth_config(
    subjects: &Subjects,
    control_plane_key: &str,
    hosts: &[HostUser],
) -> String {
    let mut out = String::from(
        "# Generated by Berth (`berth admin nats-config`): one nkey user per principal.\n\
         authorization {\n  users = [\n",
    );
    user_entry(
        &mut out,
        "control plane",
        control_plane_key,
        &control_plane_permissions(),
    );
    for host in hosts {
        user_entry(
            &mut out,
            &format!("host {}", host.host_id),
            &host.public_key,
            &host_permissions(subjects, host.host_id),
        );
    }
    out.push_str("  ]\n}\n");
    out
}

fn user_entry(out: &mut String, comment: &str, key: &str, p: &Permissions) {
    let list = |items: &[String]| {
        items
            .iter()
            .map(|s| format!("\"{s}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(out, "    # {comment}");
    let _ = writeln!(out, "    {{ nkey: \"{key}\", permissions: {{");
    let _ = writeln!(out, "        publish: {{ allow: [{}] }}", list(&p.publish));
    let _ = writeln!(
        out,
        "        subscribe: {{ allow: [{}] }}",
        list(&p.subscribe)
    );
    if p.allow_responses {
        let _ = writeln!(
            out,
            "        allow_responses: {{ max: {RESPONSE_MAX_MESSAGES}, expires: \"{}s\" }}",
            RESPONSE_WINDOW.as_secs()
        );
    }
    out.push_str("    } }\n");
}

/// How a component reaches NATS: the URL, its credentials (none: an open server) and, for
/// TLS, the CA file that signed the server's certificate.
#[derive(Debug, Clone, Default)]
pub struct NatsConnect {
    /// `nats://host:port` or `tls://host:port`; several servers of one cluster separated by
    /// commas (`nats://a:4222,nats://b:4222`): the client connects to one of them and moves to
    /// another when it goes away (see [`NatsConnect::servers`]).
    pub url: String,
    /// Credentials to authenticate with; `None` connects anonymously.
    pub creds: Option<Creds>,
    /// A PEM file of the CA(s) to trust; when set, TLS is required.
    pub ca_file: Option<PathBuf>,
}

impl NatsConnect {
    /// An anonymous, plain connection to `url`.
    pub fn open(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Default::default()
        }
    }

    /// The client options: the nkey and the role's inbox prefix when there are credentials,
    /// the CA and required TLS when there is a CA file.
    pub fn options(&self) -> async_nats::ConnectOptions {
        let mut options = async_nats::ConnectOptions::new();
        if let Some(creds) = &self.creds {
            options = options
                .nkey(creds.seed().to_owned())
                .custom_inbox_prefix(creds.role.inbox_prefix());
        }
        if let Some(ca) = &self.ca_file {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        options
    }

    /// The server URLs of [`NatsConnect::url`]: split at commas, trimmed, empty parts
    /// dropped (`"nats://a:1, nats://b:2,"` → two).
    pub fn servers(&self) -> Vec<&str> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect()
    }

    /// Connects with [`NatsConnect::options`] to one of [`NatsConnect::servers`] (the client
    /// tries them in random order, and reconnects to any of them, or to a server the cluster
    /// announced, when its server goes away).
    ///
    /// Errors: the client's (none reachable, a malformed URL, authorization violation, TLS
    /// handshake).
    pub async fn connect(&self) -> Result<async_nats::Client, async_nats::ConnectError> {
        self.options().connect(self.servers()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn credentials_survive_their_file_form_and_keep_the_secret_out_of_debug() {
        let host = HostId(Uuid::now_v7());
        for role in [Role::ControlPlane, Role::Host(host)] {
            let creds = Creds::generate(role);
            let parsed = Creds::parse(&creds.render()).unwrap();
            assert_eq!(parsed, creds);
            assert!(creds.public_key().starts_with('U'));
            assert!(!format!("{creds:?}").contains(creds.seed()));
        }
    }

    #[test]
    fn a_credentials_file_missing_a_part_or_with_a_foreign_seed_is_refused() {
        assert_eq!(
            Creds::parse("role = host\nnkey_seed = x"),
            Err(CredsError::Missing("host_id"))
        );
        assert_eq!(
            Creds::parse("role = control-plane"),
            Err(CredsError::Missing("nkey_seed"))
        );
        let account = nkeys::KeyPair::new_account().seed().unwrap();
        assert!(matches!(
            Creds::parse(&format!("role = control-plane\nnkey_seed = {account}")),
            Err(CredsError::Seed(_))
        ));
        assert!(matches!(
            Creds::parse("role: host"),
            Err(CredsError::Syntax { line: 1, .. })
        ));
    }

    #[test]
    fn a_url_list_names_each_server_of_a_cluster() {
        let spec = NatsConnect::open(" nats://10.0.0.1:4301,nats://10.0.0.1:4302 ,,");
        assert_eq!(
            spec.servers(),
            ["nats://10.0.0.1:4301", "nats://10.0.0.1:4302"]
        );
        assert_eq!(
            NatsConnect::open("nats://127.0.0.1:4222").servers(),
            ["nats://127.0.0.1:4222"]
        );
    }

    #[test]
    fn a_hosts_permissions_name_only_itself() {
        let subjects = Subjects::new("t1").unwrap();
        let (a, b) = (HostId(Uuid::now_v7()), HostId(Uuid::now_v7()));
        let p = host_permissions(&subjects, a);
        let all: Vec<&String> = p.publish.iter().chain(&p.subscribe).collect();
        assert!(all.iter().all(|s| !s.contains(&b.to_string())));
        for s in &all {
            assert!(
                s.contains(&a.to_string()) || s.as_str() == "$JS.API.STREAM.INFO.T1_CMD",
                "{s} does not name the host"
            );
            assert!(!s.contains('*'), "{s}");
        }
        assert!(p.publish.contains(&subjects.result(a)));
        assert!(p.subscribe.contains(&format!("_INBOX.{a}.>")));
        assert!(p.allow_responses);
    }

    #[test]
    fn the_server_config_lists_every_principal_with_its_permissions() {
        let subjects = Subjects::new("t1").unwrap();
        let cp = Creds::generate(Role::ControlPlane);
        let host = HostId(Uuid::now_v7());
        let hc = Creds::generate(Role::Host(host));
        let config = server_auth_config(
            &subjects,
            &cp.public_key(),
            &[HostUser {
                host_id: host,
                public_key: hc.public_key(),
            }],
        );
        assert!(config.contains(&format!("nkey: \"{}\"", cp.public_key())));
        assert!(config.contains(&format!("nkey: \"{}\"", hc.public_key())));
        assert!(config.contains(&format!("\"t1.hb.{host}\"")));
        assert!(!config.contains(cp.seed()) && !config.contains(hc.seed()));
        assert_eq!(config.matches("allow_responses").count(), 1);
    }
}
