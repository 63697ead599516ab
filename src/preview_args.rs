//! Operator flags (with env fallbacks) of preview URLs: the proxy's (`berth proxy`, and the
//! API's path route and token route: `berth api`, `berth dev`) and a host's forwarder
//! (`berth hostd`). README "Configuration" lists them.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use berth_api::preview::{
    PreviewConfig, DEFAULT_PREVIEW_DOMAIN, DEFAULT_TOKEN_TTL, DEFAULT_WAKE_TIMEOUT,
};
use clap::Args;

/// The preview settings of the API and the proxy.
#[derive(Args, Clone, Debug)]
pub struct PreviewArgs {
    /// Preview URLs are `{port}-{sandbox_id}.{domain}` (a wildcard DNS record points at the
    /// proxy).
    #[arg(long, env = "BERTH_PREVIEW_DOMAIN", default_value = DEFAULT_PREVIEW_DOMAIN)]
    pub preview_domain: String,
    /// The scheme of the preview URLs the token route hands out (`https` behind TLS).
    #[arg(long, env = "BERTH_PREVIEW_SCHEME", default_value = "http")]
    pub preview_scheme: String,
    /// The preview secret (at least 32 characters): signs preview tokens, and each host's
    /// forwarder key is derived from it (`berth admin forwarder-key`). Unset: previews are
    /// off (`berth dev` makes one).
    #[arg(long, env = "BERTH_PREVIEW_SECRET", hide_env_values = true)]
    pub preview_secret: Option<String>,
    /// How long a request to a stopped sandbox is held while it starts, before 503.
    #[arg(long, env = "BERTH_PREVIEW_WAKE_TIMEOUT", default_value_t = DEFAULT_WAKE_TIMEOUT.into())]
    pub preview_wake_timeout: humantime::Duration,
    /// The lifetime of a preview token whose request names none.
    #[arg(long, env = "BERTH_PREVIEW_TOKEN_TTL", default_value_t = DEFAULT_TOKEN_TTL.into())]
    pub preview_token_ttl: humantime::Duration,
}

/// The shortest preview secret accepted.
pub const MIN_SECRET_LEN: usize = 32;

impl PreviewArgs {
    /// The configuration these flags describe.
    ///
    /// Errors: a secret shorter than [`MIN_SECRET_LEN`].
    pub fn config(&self) -> anyhow::Result<PreviewConfig> {
        if let Some(s) = &self.preview_secret {
            anyhow::ensure!(
                s.len() >= MIN_SECRET_LEN,
                "--preview-secret must be at least {MIN_SECRET_LEN} characters"
            );
        }
        Ok(PreviewConfig {
            domain: self.preview_domain.clone(),
            scheme: self.preview_scheme.clone(),
            secret: self
                .preview_secret
                .as_ref()
                .map(|s| Arc::new(s.as_bytes().to_vec())),
            wake_timeout: self.preview_wake_timeout.into(),
            token_ttl: self.preview_token_ttl.into(),
            ..PreviewConfig::default()
        })
    }
}

/// A host's port forwarder (`berth hostd`).
#[derive(Args, Clone, Debug)]
pub struct ForwarderArgs {
    /// Where the preview port forwarder listens: an address the proxy reaches.
    #[arg(long, env = "BERTH_FORWARDER_LISTEN", default_value = berth_hostd::forwarder::DEFAULT_FORWARDER_LISTEN)]
    pub forwarder_listen: SocketAddr,
    /// The address heartbeats tell the proxy (when the listen address is not the one it
    /// reaches, e.g. behind NAT); unset: the listen address, or the default-route interface's
    /// address when listening on 0.0.0.0.
    #[arg(long, env = "BERTH_FORWARDER_ADVERTISE")]
    pub forwarder_advertise: Option<SocketAddr>,
    /// This host's forwarder key, hex (`berth admin forwarder-key <host-id>`). Unset: no
    /// forwarder, and no previews of this host's sandboxes.
    #[arg(long, env = "BERTH_FORWARDER_KEY", hide_env_values = true)]
    pub forwarder_key: Option<String>,
}

impl ForwarderArgs {
    /// The forwarder's configuration, `None` without a key.
    ///
    /// Errors: a key that is not 64 hex digits.
    pub fn config(&self) -> anyhow::Result<Option<berth_hostd::forwarder::ForwarderConfig>> {
        let Some(hex_key) = &self.forwarder_key else {
            return Ok(None);
        };
        let bytes = hex_decode(hex_key).context("--forwarder-key must be 64 hex digits")?;
        let key: [u8; 32] = bytes
            .try_into()
            .map_err(|_| anyhow::anyhow!("--forwarder-key must be 64 hex digits"))?;
        Ok(Some(berth_hostd::forwarder::ForwarderConfig {
            listen: self.forwarder_listen,
            advertise: self.forwarder_advertise,
            key,
        }))
    }
}

fn hex_decode(s: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(s.len().is_multiple_of(2), "odd length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(Into::into))
        .collect()
}

/// The hex forwarder key of `host` under `secret` (`berth admin forwarder-key`).
pub fn forwarder_key_hex(secret: &str, host: berth_schemas::HostId) -> String {
    berth_schemas::preview::forwarder_key(secret.as_bytes(), host)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
