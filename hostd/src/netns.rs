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
/// A fresh sandbox costs four `ip` processes (the namespace, the pair, then one batch in the
/// root namespace and one in the sandbox's, at once) where one per step cost thirteen, most of
/// the create's network time (issue 16's profile).
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
    // A namespace made just now has no eth0.
    let guest_ok = !built.netns
        && tool::run("ip", &["-n", ns, "link", "show", GUEST_INTERFACE])
            .await
            .is_ok();
    if !(guest_ok && host_link_exists(host_if)) {
        // Half a pair (a crash between steps) is rebuilt from scratch.
        if host_link_exists(host_if) {
            let _ = tool::run("ip", &["link", "del", host_if]).await;
        }
        if !built.netns {
            let _ = tool::run("ip", &["-n", ns, "link", "del", GUEST_INTERFACE]).await;
        }
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
    // Before the link comes up, so the sandbox never sees an IPv6-speaking host side.
    harden_host_side(host_if)?;
    let (root, guest) = configuration(host_if, link, alias);
    let guest_args = ["-n", ns, "-batch", "-"];
    let (root, guest) = tokio::join!(
        tool::run_input("ip", &["-batch", "-"], Some(&root)),
        tool::run_input("ip", &guest_args, Some(&guest)),
    );
    root?;
    guest?;
    Ok(built)
}

/// The `ip -batch` lines that configure the pair: those run in the root namespace (the host
/// side: alias, address, up) and those run in the sandbox's (`lo` with the alias and up,
/// `eth0`'s address and up, the default route via the host side). Each line is idempotent.
fn configuration(host_if: &str, link: &LinkAddresses, alias: &str) -> (String, String) {
    let (host, sandbox) = (link.host, link.sandbox);
    let root = format!(
        "link set {host_if} alias {alias}\n\
         addr replace {host}/{LINK_PREFIX_LEN} dev {host_if}\n\
         link set {host_if} up\n"
    );
    let guest = format!(
        "link set lo alias {alias}\n\
         link set lo up\n\
         addr replace {sandbox}/{LINK_PREFIX_LEN} dev {GUEST_INTERFACE}\n\
         link set {GUEST_INTERFACE} up\n\
         route replace default via {host}\n"
    );
    (root, guest)
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

/// Removes the veth pair and the namespace (one `ip -batch` for both); succeeds when they are
/// already gone.
///
/// Errors: [`HostdError::Tool`] when something exists and `ip` cannot remove it.
pub async fn teardown(names: &SandboxNames) -> Result<(), HostdError> {
    let mut batch = String::new();
    if host_link_exists(&names.veth_host) {
        batch.push_str(&format!("link del {}\n", names.veth_host));
    }
    if names.netns_path().exists() {
        batch.push_str(&format!("netns del {}\n", names.netns));
    }
    if !batch.is_empty() {
        tool::run_input("ip", &["-batch", "-"], Some(&batch)).await?;
    }
    Ok(())
}

/// Removes the sandbox's namespace (`ip netns del`) and leaves its veth pair to the kernel,
/// which destroys the pair with the namespace once nothing holds it: after this returns
/// ([`veth_gone`] waits for that). An explicit `ip link del` waits for the kernel's RCU grace
/// period, 23 ms here, most of a delete's teardown (issue 16). A host side without a
/// namespace (a half-made pair) is removed at once.
///
/// Errors: [`HostdError::Tool`] from `ip`.
pub async fn remove_namespace(names: &SandboxNames) -> Result<(), HostdError> {
    if names.netns_path().exists() {
        tool::run("ip", &["netns", "del", &names.netns]).await?;
    } else if host_link_exists(&names.veth_host) {
        tool::run("ip", &["link", "del", &names.veth_host]).await?;
    }
    Ok(())
}

/// How long [`veth_gone`] waits for the kernel to remove a deleted namespace's veth before it
/// removes it itself (something still holds the namespace: a process left in it).
pub const VETH_GONE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Resolves once the sandbox's host-side veth is gone: removed by the kernel with its
/// namespace, or by `ip link del` after [`VETH_GONE_WAIT`].
pub async fn veth_gone(names: &SandboxNames) {
    let deadline = tokio::time::Instant::now() + VETH_GONE_WAIT;
    while host_link_exists(&names.veth_host) {
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(veth = %names.veth_host, waited = ?VETH_GONE_WAIT, "a deleted namespace's veth outlived it; removing it");
            if let Err(e) = tool::run("ip", &["link", "del", &names.veth_host]).await {
                if host_link_exists(&names.veth_host) {
                    tracing::warn!(veth = %names.veth_host, error = %e.report(), "veth not removed; its address stays taken");
                    return std::future::pending().await;
                }
            }
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
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

    #[test]
    fn the_configuration_is_one_batch_per_namespace() {
        let link = AddressPool::new("10.77.0.0".parse().unwrap()).link(Slot(0));
        let (root, guest) = configuration("bv0123456789", &link, "berth:h:s");
        assert_eq!(
            root,
            "link set bv0123456789 alias berth:h:s\n\
             addr replace 10.77.0.1/30 dev bv0123456789\n\
             link set bv0123456789 up\n"
        );
        assert_eq!(
            guest,
            "link set lo alias berth:h:s\n\
             link set lo up\n\
             addr replace 10.77.0.2/30 dev eth0\n\
             link set eth0 up\n\
             route replace default via 10.77.0.1\n"
        );
    }
}
