//! The operator's `berth admin …` subcommands (flags only; `main.rs` runs them).

use std::path::PathBuf;

use berth_schemas::HostId;
use clap::Subcommand;

use crate::limits_args;

/// `berth admin …`: administrative tasks against the database (and NATS's user list).
#[derive(Subcommand)]
pub(crate) enum AdminCmd {
    /// Create an org with the default quota and print its first API key (shown once).
    CreateOrg {
        /// The org's name.
        name: String,
        #[command(flatten)]
        quota: limits_args::DefaultQuotaArgs,
    },
    /// Create an operator key for the `/v1/hosts` routes and print it (shown once).
    CreateAdminKey,
    #[command(flatten)]
    Orgs(berth::org_admin::OrgAdminCmd),
    /// Set an org's quotas; an omitted limit becomes unlimited.
    SetQuota {
        /// The org's name.
        org: String,
        /// Most capacity-holding (provisioning, starting, running, stopping) sandboxes.
        #[arg(long)]
        max_running: Option<i32>,
        /// Most vCPUs across them.
        #[arg(long)]
        max_vcpus: Option<i32>,
        /// Most memory across them, in MiB.
        #[arg(long)]
        max_memory_mib: Option<i64>,
    },
    /// Register a host and issue its NATS credentials (printed: the host id; written: the
    /// credentials file for `berth hostd --nats-creds`). Re-running it for a host rotates its
    /// key. Then re-render the server's user list (`nats-config`) and reload nats-server.
    AddHost {
        /// The host's id (a UUID; the `host-id` file of an existing hostd state dir). Omitted:
        /// a new id.
        host_id: Option<HostId>,
        /// Where to write the credentials (mode 0600; must not exist).
        #[arg(long)]
        creds_out: PathBuf,
    },
    /// Print a host's preview forwarder key (hex), derived from the preview secret: give it
    /// to that host's `berth hostd --forwarder-key`.
    ForwarderKey {
        /// The host's id.
        host_id: HostId,
        /// The preview secret the API and the proxy use.
        #[arg(long, env = "BERTH_PREVIEW_SECRET", hide_env_values = true)]
        preview_secret: String,
    },
    /// Forget a host's registration: the scheduler drops its heartbeats from now on, and the
    /// next `nats-config` leaves its key out (reload nats-server to shut it out of NATS).
    RemoveHost {
        /// The host's id.
        host_id: HostId,
    },
    /// Show the reconciler's tripped circuit breakers (per host and for the fleet) and the
    /// newest host events.
    BreakerList,
    /// Release a tripped circuit breaker: the next reconciler pass fails the guests its
    /// evidence shows failed there (README, "Operations").
    BreakerRelease {
        /// The host whose breaker to release.
        #[arg(long, conflicts_with = "fleet", required_unless_present = "fleet")]
        host: Option<HostId>,
        /// Release the fleet's breaker (which lets every host act).
        #[arg(long)]
        fleet: bool,
    },
    /// Render nats-server's `authorization` block: the control plane's key and every
    /// registered host's, each with its permissions. Include it in the server's config and
    /// reload the server (`nats-server --signal reload`) after each `add-host`.
    NatsConfig {
        /// The control plane's credentials: read, or created (mode 0600) when missing. Give
        /// the same file to api, scheduler and reconciler (`--nats-creds`).
        #[arg(long)]
        control_plane_creds: PathBuf,
        /// Prefix of every NATS subject (the permissions name subjects).
        #[arg(long, env = "BERTH_SUBJECT_PREFIX", default_value = berth_schemas::subjects::DEFAULT_PREFIX)]
        subject_prefix: String,
        /// Where to write the block (replaced); omitted: standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}
