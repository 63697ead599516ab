//! The preview contract shared by the proxy (`berth proxy`, and the API's path route) and each
//! hostd's port forwarder: who may open a forwarded connection, and what a preview token is.
//!
//! Keys: the operator sets one preview secret (`BERTH_PREVIEW_SECRET`) on the API and the
//! proxy. From it, [`token_key`] signs preview tokens and [`forwarder_key`] gives each host
//! its own forwarder key (`berth admin forwarder-key`), so one host's key opens no other
//! host's forwarder and mints no token.
//!
//! The proxy→forwarder hop: the proxy opens a TCP connection to the host's forwarder and
//! writes one [`Preamble`] line, `BERTH-FWD/1 <sandbox> <port> <expires> <mac>\n`, the MAC
//! being HMAC-SHA256 under the host's forwarder key over the first four words. The forwarder
//! answers one [`Reply`] line; after `OK` the connection carries raw bytes to and from the
//! sandbox's port.
//!
//! # Guarantees
//! - A preamble or a token verifies only under the key it was made with, for the sandbox and
//!   port it names, before its expiry; MACs are compared in constant time (`hmac`'s
//!   `verify_slice`).
//!
//! # Assumptions
//! Proxy and hosts keep their clocks within [`PREAMBLE_TTL_SECS`] of each other (NTP).

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::SandboxId;

/// The longest preamble line a forwarder reads, newline included.
pub const MAX_PREAMBLE_LEN: usize = 256;
/// How long a preamble stays valid after the proxy wrote it, in seconds.
pub const PREAMBLE_TTL_SECS: i64 = 30;
/// The first word of a preamble line (the protocol and its version).
pub const PREAMBLE_MAGIC: &str = "BERTH-FWD/1";
/// The version prefix of a preview token.
const TOKEN_VERSION: &str = "v1";

type HmacSha256 = Hmac<Sha256>;

/// A 32-byte HMAC key.
pub type Key = [u8; 32];

fn mac(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
    for p in parts {
        m.update(p);
    }
    m
}

/// The key that signs and checks preview tokens, derived from the operator's preview secret.
pub fn token_key(secret: &[u8]) -> Key {
    mac(secret, &[b"berth-preview-token"])
        .finalize()
        .into_bytes()
        .into()
}

/// Host `host`'s forwarder key, derived from the operator's preview secret.
pub fn forwarder_key(secret: &[u8], host: crate::HostId) -> Key {
    mac(secret, &[b"berth-forwarder:", host.to_string().as_bytes()])
        .finalize()
        .into_bytes()
        .into()
}

/// Why a preamble or a token is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// Not of the expected shape.
    #[error("malformed")]
    Malformed,
    /// The MAC does not match (another key, or altered).
    #[error("bad signature")]
    BadSignature,
    /// Its expiry has passed.
    #[error("expired")]
    Expired,
}

/// The TCP port of Berth's agent inside every sandbox (hostd's exec, files and shell channel,
/// not authenticated). Never a preview port: the API refuses it in preview tokens and
/// `public_ports`, the proxy never forwards to it, and a forwarder refuses a preamble naming it.
pub const AGENT_PORT: u16 = 18047;

/// The line that opens a forwarded connection: which sandbox port, until when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preamble {
    /// The sandbox to reach.
    pub sandbox: SandboxId,
    /// The TCP port inside it.
    pub port: u16,
    /// Unix seconds after which the forwarder refuses the line.
    pub expires: i64,
}

impl Preamble {
    fn signed_part(&self) -> String {
        format!(
            "{PREAMBLE_MAGIC} {} {} {}",
            self.sandbox, self.port, self.expires
        )
    }

    /// The line to write (newline included), signed with the host's forwarder `key`.
    pub fn encode(&self, key: &Key) -> String {
        let signed = self.signed_part();
        let tag = mac(key, &[signed.as_bytes()]).finalize().into_bytes();
        format!("{signed} {}\n", hex::encode(tag))
    }

    /// Parses and checks a line (with or without its newline) under `key` at Unix time `now`.
    ///
    /// Errors: [`VerifyError`].
    pub fn verify(line: &str, key: &Key, now: i64) -> Result<Self, VerifyError> {
        let line = line.trim_end_matches(['\r', '\n']);
        let (signed, tag) = line.rsplit_once(' ').ok_or(VerifyError::Malformed)?;
        let tag = hex::decode(tag).map_err(|_| VerifyError::Malformed)?;
        mac(key, &[signed.as_bytes()])
            .verify_slice(&tag)
            .map_err(|_| VerifyError::BadSignature)?;
        let mut words = signed.split(' ');
        if words.next() != Some(PREAMBLE_MAGIC) {
            return Err(VerifyError::Malformed);
        }
        let parsed = (|| {
            Some(Self {
                sandbox: words.next()?.parse().ok()?,
                port: words.next()?.parse().ok()?,
                expires: words.next()?.parse().ok()?,
            })
        })()
        .filter(|_| words.next().is_none())
        // A forwarder never opens the agent's port, whoever signed the line.
        .filter(|p| p.port != AGENT_PORT)
        .ok_or(VerifyError::Malformed)?;
        if parsed.expires < now {
            return Err(VerifyError::Expired);
        }
        Ok(parsed)
    }
}

/// A forwarder's one-line answer to a preamble.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// Connected: raw bytes follow both ways.
    Ok,
    /// The preamble did not verify.
    Unauthorized,
    /// This host holds no such sandbox.
    NotFound,
    /// The sandbox is here but not running.
    NotRunning,
    /// Nothing listens on the port (connection refused or timed out).
    Refused,
}

impl Reply {
    /// The line (newline included).
    pub fn line(self) -> &'static str {
        match self {
            Reply::Ok => "OK\n",
            Reply::Unauthorized => "ERR unauthorized\n",
            Reply::NotFound => "ERR not-found\n",
            Reply::NotRunning => "ERR not-running\n",
            Reply::Refused => "ERR refused\n",
        }
    }

    /// Parses a line written by [`Reply::line`].
    pub fn parse(line: &str) -> Option<Self> {
        [
            Reply::Ok,
            Reply::Unauthorized,
            Reply::NotFound,
            Reply::NotRunning,
            Reply::Refused,
        ]
        .into_iter()
        .find(|r| r.line().trim_end() == line.trim_end())
    }
}

/// A short-lived grant to one port of one sandbox, for sharing a preview URL without a key:
/// `v1.<sandbox>.<port>.<expires>.<mac>` (URL-safe).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreviewToken {
    /// The sandbox it opens.
    pub sandbox: SandboxId,
    /// The port it opens.
    pub port: u16,
    /// Unix seconds after which it is refused.
    pub expires: i64,
}

impl PreviewToken {
    fn signed_part(&self) -> String {
        format!(
            "{TOKEN_VERSION}.{}.{}.{}",
            self.sandbox, self.port, self.expires
        )
    }

    /// The token string, signed with [`token_key`].
    pub fn sign(&self, key: &Key) -> String {
        let signed = self.signed_part();
        let tag = mac(key, &[signed.as_bytes()]).finalize().into_bytes();
        format!("{signed}.{}", hex::encode(tag))
    }

    /// Checks `token` under `key` at Unix time `now`.
    ///
    /// Errors: [`VerifyError`].
    pub fn verify(token: &str, key: &Key, now: i64) -> Result<Self, VerifyError> {
        let (signed, tag) = token.rsplit_once('.').ok_or(VerifyError::Malformed)?;
        let tag = hex::decode(tag).map_err(|_| VerifyError::Malformed)?;
        mac(key, &[signed.as_bytes()])
            .verify_slice(&tag)
            .map_err(|_| VerifyError::BadSignature)?;
        let mut parts = signed.split('.');
        if parts.next() != Some(TOKEN_VERSION) {
            return Err(VerifyError::Malformed);
        }
        let parsed = (|| {
            Some(Self {
                sandbox: parts.next()?.parse().ok()?,
                port: parts.next()?.parse().ok()?,
                expires: parts.next()?.parse().ok()?,
            })
        })()
        .filter(|_| parts.next().is_none())
        .ok_or(VerifyError::Malformed)?;
        if parsed.expires < now {
            return Err(VerifyError::Expired);
        }
        Ok(parsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostId;

    #[test]
    fn a_preamble_verifies_only_under_its_hosts_key_and_before_expiry() {
        let (a, b) = (HostId::new(), HostId::new());
        let key_a = forwarder_key(b"secret", a);
        let p = Preamble {
            sandbox: SandboxId::new(),
            port: 8000,
            expires: 1_000,
        };
        let line = p.encode(&key_a);
        assert!(line.ends_with('\n') && line.len() <= MAX_PREAMBLE_LEN);
        assert_eq!(Preamble::verify(&line, &key_a, 999), Ok(p));
        assert_eq!(
            Preamble::verify(&line, &forwarder_key(b"secret", b), 999),
            Err(VerifyError::BadSignature)
        );
        assert_eq!(
            Preamble::verify(&line, &forwarder_key(b"other", a), 999),
            Err(VerifyError::BadSignature)
        );
        assert_eq!(
            Preamble::verify(&line, &key_a, 1_001),
            Err(VerifyError::Expired)
        );
        let altered = line.replace(" 8000 ", " 8001 ");
        assert_eq!(
            Preamble::verify(&altered, &key_a, 999),
            Err(VerifyError::BadSignature)
        );
        assert_eq!(
            Preamble::verify("GET / HTTP/1.1", &key_a, 0),
            Err(VerifyError::Malformed)
        );
    }

    #[test]
    fn a_token_opens_its_own_sandbox_port_until_it_expires() {
        let key = token_key(b"secret");
        let t = PreviewToken {
            sandbox: SandboxId::new(),
            port: 3000,
            expires: 50,
        };
        let s = t.sign(&key);
        assert!(s
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'.' || c == b'-'));
        assert_eq!(PreviewToken::verify(&s, &key, 50), Ok(t));
        assert_eq!(
            PreviewToken::verify(&s, &key, 51),
            Err(VerifyError::Expired)
        );
        assert_eq!(
            PreviewToken::verify(&s, &token_key(b"other"), 0),
            Err(VerifyError::BadSignature)
        );
        // A token is not a forwarder preamble and the two keys differ.
        assert_ne!(
            token_key(b"secret"),
            forwarder_key(b"secret", HostId::new())
        );
        assert_eq!(
            PreviewToken::verify("v1.x", &key, 0),
            Err(VerifyError::Malformed)
        );
    }

    #[test]
    fn replies_round_trip() {
        for r in [
            Reply::Ok,
            Reply::Unauthorized,
            Reply::NotFound,
            Reply::NotRunning,
            Reply::Refused,
        ] {
            assert_eq!(Reply::parse(r.line()), Some(r));
        }
        assert_eq!(Reply::parse("HTTP/1.1 200 OK"), None);
    }
}
