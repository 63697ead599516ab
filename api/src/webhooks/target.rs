//! Where a webhook may be delivered: never to this machine or the private networks around it
//! unless the operator allows it (`allow_private_targets`), however the address is spelled.
//!
//! A delivery is the control plane making an HTTP request to a URL a tenant chose, so an
//! unguarded one lets any org reach loopback services, cloud metadata (`169.254.169.254`) and
//! internal networks, and read their answers' timing and errors (a port scanner). The guard
//! runs at delivery time, on the addresses the name resolves to then (so a name that resolved
//! to a public address at create time and to a private one later is refused too), and on
//! IP-literal hosts, which reqwest connects to without resolving.
//!
//! Source: issue 11 item 6; the refused ranges are the IANA special-purpose registries'
//! non-global ones (RFC 6890) that a receiver could sit behind.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// What an attempt records when the guard refused its target (never which address or why, so
/// the log cannot be used to map internal networks).
pub const REFUSED_TARGET: &str = "target refused: a local, private or special-use address";

/// Whether `ip` is one a webhook must not reach without `allow_private_targets`: unspecified,
/// loopback, link-local, private (RFC 1918), shared (CGNAT, RFC 6598), ULA (`fc00::/7`),
/// multicast, broadcast, `0.0.0.0/8`, benchmarking (`198.18.0.0/15`), IETF assignments
/// (`192.0.0.0/24`, `2001::/23` with Teredo), documentation (`192.0.2.0/24`, `198.51.100.0/24`,
/// `203.0.113.0/24`, `2001:db8::/32`), discard-only (`100::/64`), reserved (`240.0.0.0/4`), and
/// the IPv4 addresses embedded in IPv4-mapped, -compatible, -translated, NAT64 and 6to4 IPv6
/// ones.
pub fn is_refused(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => refused_v6(v6),
    }
}

fn refused_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_multicast()
        || ip.is_broadcast()
        || a == 0
        || (a == 100 && (64..128).contains(&b))
        || (a == 198 && (18..20).contains(&b))
        // IETF protocol assignments (RFC 6890) and documentation (TEST-NET-1..3, RFC 5737).
        || (a == 192 && b == 0 && matches!(ip.octets()[2], 0 | 2))
        || (a == 198 && b == 51 && ip.octets()[2] == 100)
        || (a == 203 && b == 0 && ip.octets()[2] == 113)
        || a >= 240
}

fn refused_v6(ip: Ipv6Addr) -> bool {
    let segments = ip.segments();
    if let Some(v4) = embedded_v4(ip) {
        return refused_v4(v4);
    }
    ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        // Documentation (RFC 3849), discard-only (RFC 6666), Teredo (RFC 4380: it tunnels to
        // an IPv4 address the guard cannot judge), ORCHIDv2 and other IETF assignments in
        // 2001::/23 (RFC 6890).
        || (segments[0] == 0x2001 && segments[1] == 0x0db8)
        || segments[..4] == [0x0100, 0, 0, 0]
        || (segments[0] == 0x2001 && segments[1] < 0x0200)
        || (segments[0] & 0xfe00) == 0xfc00
        || (segments[0] & 0xffc0) == 0xfe80
        || (segments[0] & 0xffc0) == 0xfec0
}

/// The IPv4 address an IPv6 one carries: mapped (`::ffff:a.b.c.d`), compatible
/// (`::a.b.c.d`), translated (`::ffff:0:a.b.c.d`), NAT64 (`64:ff9b::/96`, `64:ff9b:1::/48`) or
/// 6to4 (`2002:AABB:CCDD::/48`).
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let tail = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if let Some(v4) = ip.to_ipv4_mapped() {
        return Some(v4);
    }
    if s[..6] == [0, 0, 0, 0, 0, 0] && !ip.is_loopback() && !ip.is_unspecified() {
        return Some(tail);
    }
    // IPv4-translated (`::ffff:0:a.b.c.d`, RFC 2765 SIIT) and NAT64 (`64:ff9b::/96`, RFC 6052;
    // `64:ff9b:1::/48`, RFC 8215, local use).
    if s[..6] == [0, 0, 0, 0, 0xffff, 0]
        || s[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
        || s[..3] == [0x64, 0xff9b, 1]
    {
        return Some(tail);
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(
            (s[1] >> 8) as u8,
            s[1] as u8,
            (s[2] >> 8) as u8,
            s[2] as u8,
        ));
    }
    None
}

/// Whether the URL's host is an IP literal the guard refuses (`http://2130706433/` and
/// `http://0x7f.1/` parse to `127.0.0.1`). A name is checked when it resolves
/// ([`GuardedResolver`]).
pub fn literal_is_refused(url: &reqwest::Url) -> bool {
    match url.host() {
        Some(url::Host::Ipv4(ip)) => refused_v4(ip),
        Some(url::Host::Ipv6(ip)) => refused_v6(ip),
        Some(url::Host::Domain(_)) | None => false,
    }
}

/// Whether `name` is loopback by name, whatever a resolver says: `localhost` or a name under
/// it (`foo.localhost`), in any case, with or without the root's trailing dot (RFC 6761 §6.3).
pub fn is_loopback_name(name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    name == "localhost" || name.ends_with(".localhost")
}

/// Whether a new webhook's URL may be refused at once: its host is a refused literal (a
/// trailing dot included: the URL parser reads `127.0.0.1.` as `127.0.0.1`), a loopback name
/// ([`is_loopback_name`]), or a name every address of which is refused as it resolves now
/// (`127.0.0.1.nip.io`). A name that does not resolve now passes: deliveries resolve again
/// each time through [`GuardedResolver`], which stays the authority (a name may point
/// elsewhere later).
pub async fn refused_at_create(url: &reqwest::Url) -> bool {
    if literal_is_refused(url) {
        return true;
    }
    let Some(url::Host::Domain(name)) = url.host() else {
        return false;
    };
    if is_loopback_name(name) {
        return true;
    }
    match tokio::net::lookup_host((name, 0)).await {
        Ok(addrs) => {
            let addrs: Vec<SocketAddr> = addrs.collect();
            !addrs.is_empty() && addrs.iter().all(|a| is_refused(a.ip()))
        }
        Err(_) => false,
    }
}

/// A DNS resolver for the delivery client that drops every refused address a name resolves
/// to, and fails the lookup when none is left.
#[derive(Debug, Clone, Copy, Default)]
pub struct GuardedResolver;

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        Box::pin(async move {
            let host = name.as_str().to_owned();
            if is_loopback_name(&host) {
                return Err(REFUSED_TARGET.into());
            }
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|addr| !is_refused(addr.ip()))
                .collect();
            if found.is_empty() {
                return Err(REFUSED_TARGET.into());
            }
            Ok(Box::new(found.into_iter()) as Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_private_and_special_addresses_are_refused_in_every_spelling() {
        for url in [
            "http://127.0.0.1/",
            "http://2130706433/",
            "http://0x7f.1/",
            "http://0177.0.0.1/",
            "http://0.0.0.0/",
            "http://10.1.2.3/",
            "http://172.16.0.1/",
            "http://192.168.1.1/",
            "http://169.254.169.254/latest/meta-data",
            "http://100.64.0.1/",
            "http://[::1]/",
            "http://[::]/",
            "http://[::ffff:127.0.0.1]/",
            "http://[::ffff:169.254.169.254]/",
            "http://[::127.0.0.1]/",
            "http://[64:ff9b::a00:1]/",
            "http://[::ffff:0:127.0.0.1]/",
            "http://198.51.100.7:8000/",
            "http://[::ffff:198.51.100.7]/",
            "http://192.0.2.1/",
            "http://203.0.113.5/",
            "http://192.0.0.8/",
            "http://[2001:db8::1]/",
            "http://[100::1]/",
            "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/",
            "http://[::ffff:0:a9fe:a9fe]/",
            "http://[64:ff9b:1::7f00:1]/",
            "http://[2002:7f00:1::]/",
            "http://[fd00::1]/",
            "http://[fe80::1]/",
            "http://[ff02::1]/",
        ] {
            let parsed = reqwest::Url::parse(url).unwrap();
            assert!(literal_is_refused(&parsed), "{url} ({:?})", parsed.host());
        }
    }

    #[test]
    fn public_addresses_and_names_pass_the_literal_check() {
        for url in [
            "http://93.184.215.14/",
            "http://[2606:2800:21f:cb07:6820:80da:af6b:8b2c]/",
            "https://example.com/hook",
        ] {
            assert!(
                !literal_is_refused(&reqwest::Url::parse(url).unwrap()),
                "{url}"
            );
        }
    }

    #[test]
    fn localhost_and_names_under_it_are_loopback_in_any_spelling() {
        for name in ["localhost", "LocalHost.", "foo.localhost", "a.b.LOCALHOST."] {
            assert!(is_loopback_name(name), "{name}");
        }
        for name in [
            "localhost.example",
            "notlocalhost",
            "example.com.",
            "localhostx",
        ] {
            assert!(!is_loopback_name(name), "{name}");
        }
    }

    #[tokio::test]
    async fn a_name_that_resolves_only_to_loopback_is_refused_by_the_resolver() {
        let resolved = GuardedResolver.resolve("localhost".parse().unwrap()).await;
        let error = resolved.err().expect("localhost is refused");
        assert_eq!(error.to_string(), REFUSED_TARGET);
    }
}
