//! A sandbox's network policy: where its traffic may go beyond its host.
//!
//! The API spelling (`network: {"egress": "public" | "none" | ["cidr", …]}` in the create
//! body and the sandbox JSON) is read and written only here ([`Network::from_api`],
//! [`Network::to_api`]); the store keeps that JSON, and the wire and hostd records carry the
//! typed [`Network`] (postcard / serde).
//!
//! What each policy means is enforced by hostd's nftables table (`hostd/src/firewall.rs`):
//! - [`Egress::Public`] (the default): any destination except [`BLOCKED_V4`] (private,
//!   link-local, CGNAT, loopback, multicast and reserved ranges); the host's own addresses and
//!   other sandboxes are never reachable, whatever the policy.
//! - [`Egress::None`]: nothing leaves the sandbox (hostd still reaches its agent).
//! - [`Egress::Allow`]: only those IPv4 networks, private ones included when listed.
//!
//! Sandboxes have IPv4 only: an IPv6 network in an allow-list is refused, and hostd drops
//! every IPv6 packet from a sandbox (ULA `fc00::/7`, link-local `fe80::/10` and multicast
//! `ff00::/8` included).

use std::net::IpAddr;

/// An IPv4 network (`10.1.0.0/16`), from the `ipnet` crate.
pub use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

/// The most networks an allow-list may hold.
pub const MAX_ALLOWED_NETWORKS: usize = 64;

/// IPv4 destinations a [`Egress::Public`] sandbox may not reach: "this network"
/// (RFC 1122), RFC 1918 private ranges, CGNAT shared space (RFC 6598), loopback,
/// link-local (RFC 3927, the cloud metadata address 169.254.169.254 among them),
/// IETF protocol assignments (RFC 6890), multicast and reserved space with the limited
/// broadcast address (RFC 1112).
pub const BLOCKED_V4: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// Destinations no allow-list may name, whatever the operator allows: "this network",
/// loopback, link-local (the cloud metadata address 169.254.169.254 among them), IETF protocol
/// assignments, multicast and reserved space.
pub const NEVER_ALLOWED_V4: &[&str] = &[
    "0.0.0.0/8",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "192.0.0.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// Private destinations (RFC 1918, CGNAT) an allow-list may name only where the operator lets
/// tenants reach private networks (`berth api --sandbox-egress-allow-private`).
pub const PRIVATE_V4: &[&str] = &[
    "10.0.0.0/8",
    "100.64.0.0/10",
    "172.16.0.0/12",
    "192.168.0.0/16",
];

/// A sandbox's network policy (the create body's `network` object).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Network {
    /// Where the sandbox's own connections may go.
    pub egress: Egress,
}

/// Where a sandbox's own connections may go (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Egress {
    /// Public addresses only (API `"public"`); the default.
    #[default]
    Public,
    /// Nothing (API `"none"`).
    None,
    /// Only these IPv4 networks, host bits cleared, overlaps merged, sorted (API: a list of
    /// CIDR strings; a bare address is a /32).
    Allow(Vec<Ipv4Net>),
}

/// Why a `network` value was refused; the message names the offending part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidNetwork(pub String);

impl Network {
    /// Parses the API spelling: `{"egress": "public" | "none" | ["10.1.0.0/16", "1.2.3.4", …]}`;
    /// a missing `egress` is `"public"`. An allow-list's networks are normalized (host bits
    /// cleared, overlapping and adjacent ones merged).
    ///
    /// Errors: [`InvalidNetwork`] for anything else: unknown keys, another string, a
    /// malformed CIDR, an IPv6 network, more than [`MAX_ALLOWED_NETWORKS`] entries.
    pub fn from_api(value: &serde_json::Value) -> Result<Self, InvalidNetwork> {
        let invalid = |m: String| InvalidNetwork(m);
        let object = value.as_object().ok_or_else(|| {
            invalid("network must be an object like {\"egress\": \"public\"}".into())
        })?;
        if let Some(key) = object.keys().find(|k| k.as_str() != "egress") {
            return Err(invalid(format!(
                "network has no field {key:?} (only \"egress\")"
            )));
        }
        let egress = match object.get("egress") {
            None => Egress::Public,
            Some(serde_json::Value::String(s)) if s == "public" => Egress::Public,
            Some(serde_json::Value::String(s)) if s == "none" => Egress::None,
            Some(serde_json::Value::Array(items)) => {
                if items.len() > MAX_ALLOWED_NETWORKS {
                    return Err(invalid(format!(
                        "network.egress lists at most {MAX_ALLOWED_NETWORKS} networks, got {}",
                        items.len()
                    )));
                }
                let nets = items
                    .iter()
                    .map(|item| {
                        let s = item.as_str().ok_or_else(|| {
                            invalid(format!(
                                "network.egress entries are CIDR strings, got {item}"
                            ))
                        })?;
                        parse_v4_cidr(s).map_err(invalid)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Egress::Allow(Ipv4Net::aggregate(&nets))
            }
            Some(other) => {
                return Err(invalid(format!(
                    "network.egress must be \"public\", \"none\" or a list of CIDRs, got {other}"
                )))
            }
        };
        Ok(Self { egress })
    }

    /// Checks a tenant's policy against what the operator permits: an allow-list may not
    /// overlap [`NEVER_ALLOWED_V4`], and may overlap [`PRIVATE_V4`] only with
    /// `private_allowed`. `public` and `none` always pass.
    ///
    /// Errors: [`InvalidNetwork`] naming the entry and the range it overlaps.
    pub fn check_tenant(&self, private_allowed: bool) -> Result<(), InvalidNetwork> {
        let Egress::Allow(nets) = &self.egress else {
            return Ok(());
        };
        let overlaps =
            |a: &Ipv4Net, b: &Ipv4Net| a.contains(&b.network()) || b.contains(&a.network());
        for net in nets {
            for never in NEVER_ALLOWED_V4 {
                let never: Ipv4Net = never.parse().expect("a valid constant");
                if overlaps(net, &never) {
                    return Err(InvalidNetwork(format!(
                        "network.egress entry {net} overlaps {never} (loopback, link-local and \
                         cloud metadata, multicast or reserved), which no sandbox may reach"
                    )));
                }
            }
            if !private_allowed {
                for private in PRIVATE_V4 {
                    let private: Ipv4Net = private.parse().expect("a valid constant");
                    if overlaps(net, &private) {
                        return Err(InvalidNetwork(format!(
                            "network.egress entry {net} overlaps the private range {private}; \
                             this deployment does not let sandboxes reach private networks"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// The API spelling, as [`Network::from_api`] reads it.
    pub fn to_api(&self) -> serde_json::Value {
        let egress = match &self.egress {
            Egress::Public => serde_json::Value::from("public"),
            Egress::None => serde_json::Value::from("none"),
            Egress::Allow(nets) => nets.iter().map(|n| n.to_string()).collect(),
        };
        serde_json::json!({ "egress": egress })
    }
}

/// `a.b.c.d/len` or a bare `a.b.c.d` (a /32), host bits cleared.
fn parse_v4_cidr(s: &str) -> Result<Ipv4Net, String> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| format!("network.egress entry {s:?} is not a CIDR like 10.1.0.0/16"))?;
    let IpAddr::V4(addr) = addr else {
        return Err(format!(
            "network.egress entry {s:?} is IPv6; sandboxes have IPv4 only"
        ));
    };
    let len = match len {
        None => 32,
        Some(l) => l.parse::<u8>().ok().filter(|l| *l <= 32).ok_or_else(|| {
            format!("network.egress entry {s:?} has a prefix length outside 0..=32")
        })?,
    };
    let net = Ipv4Net::new(addr, len).map_err(|e| format!("network.egress entry {s:?}: {e}"))?;
    Ok(net.trunc())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_may_never_list_metadata_and_lists_private_ranges_only_when_allowed() {
        let policy = |list: serde_json::Value| {
            Network::from_api(&serde_json::json!({ "egress": list })).unwrap()
        };
        for never in [
            "169.254.169.254",
            "0.0.0.0/0",
            "127.0.0.1",
            "128.0.0.0/1",
            "224.0.0.1",
        ] {
            let p = policy(serde_json::json!([never]));
            assert!(p.check_tenant(true).is_err(), "{never}");
            assert!(p.check_tenant(false).is_err(), "{never}");
        }
        for private in [
            "10.1.0.0/16",
            "192.168.1.1",
            "172.20.0.0/16",
            "100.64.0.1",
            "8.0.0.0/6",
        ] {
            let p = policy(serde_json::json!([private]));
            assert!(p.check_tenant(false).is_err(), "{private}");
            assert!(p.check_tenant(true).is_ok(), "{private}");
        }
        let public = policy(serde_json::json!(["203.0.113.0/24", "8.8.8.8"]));
        assert!(public.check_tenant(false).is_ok());
        assert!(Network::default().check_tenant(false).is_ok());
    }
    use serde_json::json;

    #[test]
    fn the_three_spellings_parse_and_round_trip() {
        for v in [json!({"egress": "public"}), json!({"egress": "none"})] {
            assert_eq!(Network::from_api(&v).unwrap().to_api(), v);
        }
        assert_eq!(Network::from_api(&json!({})).unwrap(), Network::default());
        let listed = Network::from_api(&json!({"egress": ["10.1.2.3/16", "192.0.2.7"]})).unwrap();
        assert_eq!(
            listed.to_api(),
            json!({"egress": ["10.1.0.0/16", "192.0.2.7/32"]})
        );
        assert_eq!(Network::from_api(&listed.to_api()).unwrap(), listed);
    }

    #[test]
    fn overlapping_networks_are_merged() {
        let n = Network::from_api(&json!({"egress": ["10.0.0.0/8", "10.1.0.0/16", "10.0.0.1"]}))
            .unwrap();
        assert_eq!(n.to_api(), json!({"egress": ["10.0.0.0/8"]}));
    }

    #[test]
    fn bad_values_are_refused_with_the_reason() {
        let refused = |v: serde_json::Value| Network::from_api(&v).unwrap_err().0;
        assert!(refused(json!({"egress": ["10.0.0.0/33"]})).contains("prefix length"));
        assert!(refused(json!({"egress": ["not-a-net"]})).contains("not a CIDR"));
        assert!(refused(json!({"egress": ["fd00::/8"]})).contains("IPv6"));
        assert!(refused(json!({"egress": "private"})).contains("\"public\", \"none\""));
        assert!(refused(json!({"egress": [1]})).contains("CIDR strings"));
        assert!(refused(json!({"ingress": "none"})).contains("ingress"));
        assert!(refused(json!("public")).contains("object"));
        let many: Vec<String> = (0..65).map(|i| format!("10.0.{i}.0/24")).collect();
        assert!(refused(json!({ "egress": many })).contains("at most 64"));
    }

    #[test]
    fn every_blocked_range_parses() {
        for r in BLOCKED_V4 {
            assert_eq!(r.parse::<Ipv4Net>().unwrap().trunc().to_string(), *r);
        }
    }
}
