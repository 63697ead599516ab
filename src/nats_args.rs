//! The NATS and Postgres flags every component shares: where NATS is (one server or the
//! servers of a cluster), the component's credentials and CA, the subject prefix, and how many
//! replicas the streams get when this component is the one that creates them.

use std::path::PathBuf;

use berth_schemas::nats_auth::NatsConnect;
use berth_schemas::Subjects;
use clap::Args;

use crate::connect_with;

/// Default NATS server.
const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// How a component reaches NATS.
#[derive(Args, Clone)]
pub(crate) struct NatsArgs {
    /// NATS server URL (`nats://…`, or `tls://…` with `--nats-ca`). For a cluster, give every
    /// server, comma-separated (`nats://10.0.0.1:4222,nats://10.0.0.2:4222,…`): the client
    /// connects to one and moves to another when it goes away.
    #[arg(long, env = "NATS_URL", default_value = DEFAULT_NATS_URL)]
    pub(crate) nats_url: String,
    /// This component's NATS credentials file (`berth admin add-host` for a host, `berth admin
    /// nats-config` for the control plane); unset: connect anonymously (an open NATS).
    #[arg(long, env = "BERTH_NATS_CREDS")]
    pub(crate) nats_creds: Option<PathBuf>,
    /// CA file (PEM) that signed the NATS server's certificate; set: TLS is required.
    #[arg(long, env = "BERTH_NATS_CA")]
    pub(crate) nats_ca: Option<PathBuf>,
    /// Prefix of every NATS subject.
    #[arg(long, env = "BERTH_SUBJECT_PREFIX", default_value = berth_schemas::subjects::DEFAULT_PREFIX)]
    pub(crate) subject_prefix: String,
    /// Replicas of the command, result and event streams when this component creates them
    /// (1 to 5; 3 on a three-node JetStream cluster, so losing one node loses nothing). Give
    /// every control-plane component the same value; an existing stream keeps its own.
    #[arg(long, env = "BERTH_STREAM_REPLICAS",
          default_value_t = berth_schemas::subjects::DEFAULT_STREAM_REPLICAS as u64,
          value_parser = clap::value_parser!(u64).range(1..=berth_schemas::subjects::MAX_STREAM_REPLICAS as u64))]
    pub(crate) stream_replicas: u64,
}

impl NatsArgs {
    /// The connection these flags describe (reads the credentials file).
    pub(crate) fn connect_spec(&self) -> anyhow::Result<NatsConnect> {
        Ok(NatsConnect {
            url: self.nats_url.clone(),
            creds: self
                .nats_creds
                .as_deref()
                .map(berth::nats_access::load)
                .transpose()?,
            ca_file: self.nats_ca.clone(),
        })
    }

    /// Connects with [`NatsArgs::connect_spec`].
    pub(crate) async fn connect(&self) -> anyhow::Result<async_nats::Client> {
        connect_with(&self.connect_spec()?).await
    }

    /// The subjects of `--subject-prefix`, whose streams get `--stream-replicas`.
    pub(crate) fn subjects(&self) -> anyhow::Result<Subjects> {
        Ok(
            Subjects::new(&self.subject_prefix)?
                .with_stream_replicas(self.stream_replicas as usize),
        )
    }
}

/// Postgres and NATS, for the control-plane components.
#[derive(Args, Clone)]
pub(crate) struct Conn {
    #[arg(long, env = "DATABASE_URL")]
    pub(crate) database_url: String,
    #[command(flatten)]
    pub(crate) nats: NatsArgs,
}
