//! Sandbox networking with iproute2: a network namespace per sandbox and a veth pair whose host
//! side stays in the root namespace (`.1` of the sandbox's /30) and whose peer is the sandbox's
//! `eth0` (`.2`), with `lo` up and a default route via the host side.
//!
//! # Guarantees
//! [`ensure`] converges: whatever part exists is kept, a half-made veth is rebuilt, addresses
//! and routes are `replace`d. [`teardown`] removes what exists and succeeds on what does not.
//!
//! Both the host-side veth and the namespace's `lo` carry the alias `berth:<host>:<sandbox>`
//! ([`owner_alias`]), so a sweep can tell this hostd's leftovers from another's (see `sweep`).
//! Isolation and egress are nftables' business (see `firewall`); the host side of each veth
//! is hardened before it comes up ([`harden_host_side`]): IPv6 off (so no Router
//! Advertisement, autoconfiguration or link-local address on the host side) and strict
//! reverse-path filtering (a packet from the veth whose source routes elsewhere is dropped).

use std::collections::BTreeSet;
use std::path::Path;

use berth_schemas::{HostId, SandboxId};

use crate::address::{parse_ip_addr_output, AddressPool, LinkAddresses, Slot, LINK_PREFIX_LEN};
use crate::error::HostdError;
use crate::layout::SandboxNames;
use crate::tool;

/// The sandbox-side interface name.
pub const GUEST_INTERFACE: &str = "eth0";

/// What [`ensure`] had to build, so a failed start undoes only that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Built {
    /// The namespace was made by this call.
    pub netns: bool,
    /// The veth pair was made by this call.
    pub veth: bool,
}

/// The alias marking a sandbox's interfaces as this host's: `berth:<host>:<sandbox>`.
pub fn owner_alias(host: HostId, sandbox: SandboxId) -> String {
    format!("berth:{host}:{sandbox}")
}

/// The (host, sandbox) of an [`owner_alias`] found in `ip -o link show` output for one link.
pub fn parse_owner_alias(line: &str) -> Option<(HostId, SandboxId)> {
    let alias = line
        .split('\\')
        .map(str::trim)
        .find_map(|part| part.strip_prefix("alias "))?;
    let mut parts = alias.trim().splitn(3, ':');
    (parts.next()? == "berth").then_some(())?;
    let host = parts.next()?.parse().ok()?;
    let sandbox = parts.next()?.parse().ok()?;
    Some((host, sandbox))
}

/// Makes the sandbox's namespace, veth pair, addresses and route exist, marked with
/// `alias` ([`owner_alias`]).
///
/// Errors: [`HostdError::Tool`] from `ip`.
pub async fn ensure(
    names: &SandboxNames,
    link: &LinkAddresses,
    alias: &str,
) -> Result<Built, HostdError> {
    let mut built = Built::default();
    if !names.netns_path().exists() {
        tool::run("ip", &["netns", "add", &names.netns]).await?;
        built.netns = true;
    }
    let ns = names.netns.as_str();
    let host_if = names.veth_host.as_str();
    let guest_ok = tool::run("ip", &["-n", ns, "link", "show", GUEST_INTERFACE])
        .await
        .is_ok();
    if !(guest_ok && host_link_exists(host_if)) {
        // Half a pair (a crash between steps) is rebuilt from scratch.
        let _ = tool::run("ip", &["link", "del", host_if]).await;
        let _ = tool::run("ip", &["-n", ns, "link", "del", GUEST_INTERFACE]).await;
        tool::run(
            "ip",
            &[
                "link",
                "add",
                host_if,
                "type",
                "veth",
                "peer",
                "name",
                GUEST_INTERFACE,
                "netns",
                ns,
            ],
        )
        .await?;
        built.veth = true;
    }
    let host_cidr = format!("{}/{LINK_PREFIX_LEN}", link.host);
    let guest_cidr = format!("{}/{LINK_PREFIX_LEN}", link.sandbox);
    let gateway = link.host.to_string();
    // Before the link comes up, so the sandbox never sees an IPv6-speaking host side.
    harden_host_side(host_if)?;
    let steps: [&[&str]; 8] = [
        &["-n", ns, "link", "set", "lo", "alias", alias],
        &["link", "set", host_if, "alias", alias],
        &["addr", "replace", &host_cidr, "dev", host_if],
        &["link", "set", host_if, "up"],
        &["-n", ns, "link", "set", "lo", "up"],
        &[
            "-n",
            ns,
            "addr",
            "replace",
            &guest_cidr,
            "dev",
            GUEST_INTERFACE,
        ],
        &["-n", ns, "link", "set", GUEST_INTERFACE, "up"],
        &["-n", ns, "route", "replace", "default", "via", &gateway],
    ];
    for args in steps {
        tool::run("ip", args).await?;
    }
    Ok(built)
}

/// The per-interface sysctls [`harden_host_side`] sets, as (path below `/proc/sys/net`, value).
/// `ipv6` ones are skipped on a kernel without IPv6.
pub const HOST_SIDE_SYSCTLS: &[(&str, &str)] = &[
    // Linux ip-sysctl.rst: accept_ra 0 = do not accept Router Advertisements; autoconf 0 =
    // no addresses from RA prefixes; disable_ipv6 1 = no IPv6 on the interface at all (the
    // host side then has no link-local address and drops every IPv6 packet received on it).
    ("ipv6/conf/{if}/accept_ra", "0"),
    ("ipv6/conf/{if}/autoconf", "0"),
    ("ipv6/conf/{if}/disable_ipv6", "1"),
    // rp_filter 1 = strict reverse-path validation (RFC 3704): the source of a packet from
    // the veth must route back through it, i.e. be the sandbox's own address. The effective
    // value is the larger of this and `conf/all/rp_filter`.
    ("ipv4/conf/{if}/rp_filter", "1"),
];

/// Sets [`HOST_SIDE_SYSCTLS`] on the host-side interface `host_if` of the root namespace.
///
/// Errors: [`HostdError::Io`] when a sysctl can't be written (IPv6 ones are skipped when the
/// kernel has no IPv6).
pub fn harden_host_side(host_if: &str) -> Result<(), HostdError> {
    let ipv6 = Path::new("/proc/sys/net/ipv6").exists();
    for (path, value) in HOST_SIDE_SYSCTLS {
        if path.starts_with("ipv6/") && !ipv6 {
            continue;
        }
        let path = Path::new("/proc/sys/net").join(path.replace("{if}", host_if));
        std::fs::write(&path, value).map_err(HostdError::io(format!(
            "write {value} to {}",
            path.display()
        )))?;
    }
    Ok(())
}

/// Removes the veth pair and the namespace; succeeds when they are already gone.
///
/// Errors: [`HostdError::Tool`] when something exists and `ip` cannot remove it.
pub async fn teardown(names: &SandboxNames) -> Result<(), HostdError> {
    remove_veth(names).await?;
    remove_netns(names).await
}

/// Removes the host-side veth (and with it the peer); succeeds when it is gone.
pub async fn remove_veth(names: &SandboxNames) -> Result<(), HostdError> {
    if host_link_exists(&names.veth_host) {
        tool::run("ip", &["link", "del", &names.veth_host]).await?;
    }
    Ok(())
}

/// Removes the network namespace; succeeds when it is gone.
pub async fn remove_netns(names: &SandboxNames) -> Result<(), HostdError> {
    if names.netns_path().exists() {
        tool::run("ip", &["netns", "del", &names.netns]).await?;
    }
    Ok(())
}

/// Slots of `pool` whose addresses are configured on an interface of the root namespace
/// (another hostd's sandbox, a stray interface), so they are not handed out again.
///
/// Errors: [`HostdError::Tool`] from `ip`.
pub async fn foreign_slots(pool: AddressPool) -> Result<BTreeSet<Slot>, HostdError> {
    let out = tool::run("ip", &["-o", "-4", "addr", "show"]).await?;
    Ok(parse_ip_addr_output(&out.stdout)
        .into_iter()
        .filter_map(|a| pool.slot_of(a))
        .collect())
}

/// Whether an interface of that name exists in the root network namespace.
pub fn host_link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_alias_round_trips_through_ip_link_output() {
        let (host, sandbox) = (HostId::new(), SandboxId::new());
        let line = format!(
            "7: bv0123456789@if2: <BROADCAST> mtu 1500 qdisc noqueue\\    link/ether 02:00:00:00:00:01 brd ff:ff:ff:ff:ff:ff link-netns berth-0123456789\\    alias {}",
            owner_alias(host, sandbox)
        );
        assert_eq!(parse_owner_alias(&line), Some((host, sandbox)));
        assert_eq!(parse_owner_alias("1: lo: <LOOPBACK> mtu 65536"), None);
        assert_eq!(parse_owner_alias("1: x\\    alias someone:else:here"), None);
    }
}
