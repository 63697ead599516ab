//! Sandbox isolation and egress with nftables: one table per hostd (`inet berth_<tag>`, the
//! tag derived from the host id like every other kernel-visible name, see `layout`). Every
//! rule is scoped to this hostd's own sandboxes through the table's sets, so the tables of
//! several hostd on one machine (`berth dev`) never judge each other's sandboxes:
//!
//! - sets: `sandboxes` (each sandbox's /30, for the masquerade), `veths` (each host-side
//!   veth), `guests` (veth . the sandbox's own address), `public` (veths whose egress is
//!   public), `allowed` (veth . an allow-listed IPv4 network), the constant `blocked`
//!   ([`BLOCKED_V4`]) and `operator` (what the operator lets every public sandbox reach
//!   although it is blocked, `--sandbox-egress-allow`).
//! - `prerouting` (priority raw, before conntrack): from a sandbox's veth, every IPv6 packet
//!   is dropped (sandboxes have IPv4 only: no IPv6 egress, no link-local access to the host,
//!   no Router Advertisement or neighbour discovery reaching it), and so is every IPv4 packet
//!   whose source is not that sandbox's own address (anti-spoofing; `rp_filter=1` on the veth,
//!   set by `netns::ensure`, is the second wall).
//! - `input`: a sandbox opens no connection to the host, on any of the host's addresses (all
//!   of them: whatever the destination, a packet the host delivers locally passes here); only
//!   replies to hostd's own connections to its agent come back in. The rest is rejected
//!   (ICMP administratively prohibited, the same for every port), so the sandbox's
//!   connection fails at once instead of hanging.
//! - `forward`: into a sandbox only replies (so neither another sandbox nor the outside opens a
//!   connection to it); out of a sandbox, its egress policy (chain `egress`): an allow-listed
//!   network is accepted, a public sandbox reaches `operator` and anything outside
//!   `blocked`, the rest is
//!   rejected like on `input` — a `none` sandbox is in neither set, so nothing of it leaves.
//!   Into a sandbox, packets are dropped silently.
//! - `postrouting`: egress is masqueraded out of the host's default-route interface.
//!
//! Egress needs IPv4 forwarding, which [`Firewall::install`] turns on (it is machine-wide).
//!
//! # Guarantees
//! - [`Firewall::install`] replaces this hostd's table in one `nft` transaction, with exactly
//!   the sandboxes its records hold (and their policies): stale elements of a previous run are
//!   swept, and no other table is touched.
//! - [`Firewall::admit`] adds a sandbox's elements in one transaction (the sandbox's veth is
//!   judged by its policy from the first packet on); [`Firewall::remove`] removes them in one
//!   transaction. Both are idempotent.

use std::fmt::Write as _;

use berth_schemas::network::{Egress, Ipv4Net, BLOCKED_V4};

use crate::address::{LinkAddresses, LINK_PREFIX_LEN};
use crate::error::HostdError;
use crate::tool;

/// Where IPv4 forwarding is switched on.
const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// The prefix every berth host-side veth has (see `layout::SandboxNames`).
pub const VETH_PREFIX: &str = "bv";

/// The set of this host's sandbox links (/30s).
const SANDBOX_SET: &str = "sandboxes";
/// The set of this host's sandbox veths.
const VETH_SET: &str = "veths";
/// The set of (veth . sandbox address): the only source each veth may send from.
const GUEST_SET: &str = "guests";
/// The set of veths whose egress is public.
const PUBLIC_SET: &str = "public";
/// The set of (veth . allowed IPv4 network) of allow-listed egress.
const ALLOWED_SET: &str = "allowed";
/// The set of IPv4 ranges public egress never reaches.
const BLOCKED_SET: &str = "blocked";
/// The set of IPv4 networks the operator lets public egress reach (`--sandbox-egress-allow`).
const OPERATOR_SET: &str = "operator";

/// One hostd's nftables table.
#[derive(Debug, Clone)]
pub struct Firewall {
    table: String,
    /// Networks every public sandbox may reach although they are in `blocked`.
    operator_allowed: Vec<Ipv4Net>,
}

/// What the firewall knows of one sandbox: its host-side veth, its link addresses and its
/// egress policy (all from its record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// The host-side veth (`bv…`).
    pub veth: String,
    /// Its /30: the host side and the sandbox's own address.
    pub link: LinkAddresses,
    /// Where its own connections may go.
    pub egress: Egress,
}

impl Admission {
    /// The table's elements of this sandbox, as `(set, element)` pairs in nft syntax.
    fn elements(&self) -> Vec<(&'static str, String)> {
        let veth = format!("\"{}\"", self.veth);
        let mut e = vec![
            (SANDBOX_SET, cidr(&self.link)),
            (VETH_SET, veth.clone()),
            (GUEST_SET, format!("{veth} . {}", self.link.sandbox)),
        ];
        match &self.egress {
            Egress::Public => e.push((PUBLIC_SET, veth)),
            Egress::None => {}
            Egress::Allow(nets) => {
                e.extend(nets.iter().map(|n| (ALLOWED_SET, format!("{veth} . {n}"))));
            }
        }
        e
    }
}

impl Firewall {
    /// The firewall of the table called `table` (`berth_<tag>`), letting every sandbox with
    /// public egress reach `operator_allowed` too (the operator's `--sandbox-egress-allow`).
    pub fn new(table: String, operator_allowed: &[Ipv4Net]) -> Self {
        Self {
            table,
            operator_allowed: Ipv4Net::aggregate(&operator_allowed.to_vec()),
        }
    }

    /// The nftables table's name (in family `inet`).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Replaces this hostd's table with one admitting exactly `sandboxes`, masquerading out
    /// of the default-route interface (when there is one), and turns IPv4 forwarding on.
    ///
    /// Errors: [`HostdError::Nft`]; [`HostdError::Tool`] / [`HostdError::Io`].
    pub async fn install(&self, sandboxes: &[Admission]) -> Result<(), HostdError> {
        let egress = default_route_interface().await?;
        let ruleset = ruleset(
            &self.table,
            egress.as_deref(),
            &self.operator_allowed,
            sandboxes,
        );
        nft(&ruleset).await?;
        if egress.is_some() {
            let on = std::fs::read_to_string(IP_FORWARD).is_ok_and(|v| v.trim() == "1");
            if !on {
                std::fs::write(IP_FORWARD, "1")
                    .map_err(HostdError::io(format!("write {IP_FORWARD}")))?;
                tracing::info!("IPv4 forwarding turned on for sandbox egress");
            }
        }
        tracing::info!(table = %self.table, sandboxes = sandboxes.len(), egress = ?egress, "firewall installed");
        Ok(())
    }

    /// Admits a sandbox: its elements in every set, in one transaction.
    ///
    /// Errors: [`HostdError::Nft`].
    pub async fn admit(&self, sandbox: &Admission) -> Result<(), HostdError> {
        let mut r = String::new();
        for (set, element) in sandbox.elements() {
            let _ = writeln!(r, "add element inet {} {set} {{ {element} }}", self.table);
        }
        nft(&r).await
    }

    /// Removes a sandbox's elements, in one transaction; succeeds when they are not there.
    ///
    /// Errors: [`HostdError::Nft`].
    pub async fn remove(&self, sandbox: &Admission) -> Result<(), HostdError> {
        // Adding first makes each delete succeed whether or not the element existed; all of
        // it is one transaction.
        let mut r = String::new();
        for (set, element) in sandbox.elements() {
            let element = format!("inet {} {set} {{ {element} }}", self.table);
            let _ = writeln!(r, "add element {element}\ndelete element {element}");
        }
        nft(&r).await
    }

    /// Deletes the table; succeeds when it does not exist.
    ///
    /// Errors: [`HostdError::Nft`].
    pub async fn uninstall(&self) -> Result<(), HostdError> {
        nft(&format!(
            "table inet {t}\ndelete table inet {t}\n",
            t = self.table
        ))
        .await
    }
}

/// `10.200.0.0/30`: the network of a sandbox's link.
fn cidr(link: &LinkAddresses) -> String {
    let network = u32::from(link.host) & (u32::MAX << (32 - LINK_PREFIX_LEN));
    format!("{}/{LINK_PREFIX_LEN}", std::net::Ipv4Addr::from(network))
}

/// The whole table, as one `nft -f` transaction that replaces any previous version:
/// masquerading out of `egress` (when there is a default route), letting public sandboxes
/// reach `operator_allowed` too, admitting `sandboxes`.
pub fn ruleset(
    table: &str,
    egress: Option<&str>,
    operator_allowed: &[Ipv4Net],
    sandboxes: &[Admission],
) -> String {
    let mut r = String::new();
    // Declaring the table first makes the delete succeed when it does not exist yet.
    let _ = writeln!(r, "table inet {table}");
    let _ = writeln!(r, "delete table inet {table}");
    let _ = writeln!(r, "table inet {table} {{");
    let elements: Vec<(&str, String)> = sandboxes.iter().flat_map(Admission::elements).collect();
    let set = |r: &mut String, name: &str, kind: &str, interval: bool, fixed: &[String]| {
        let _ = writeln!(r, "  set {name} {{");
        let _ = writeln!(r, "    type {kind}");
        if interval {
            let _ = writeln!(r, "    flags interval");
        }
        let mut members: Vec<&str> = fixed.iter().map(String::as_str).collect();
        members.extend(
            elements
                .iter()
                .filter(|(s, _)| *s == name)
                .map(|(_, e)| e.as_str()),
        );
        if !members.is_empty() {
            let _ = writeln!(r, "    elements = {{ {} }}", members.join(", "));
        }
        let _ = writeln!(r, "  }}");
    };
    set(&mut r, SANDBOX_SET, "ipv4_addr", true, &[]);
    set(&mut r, VETH_SET, "ifname", false, &[]);
    set(&mut r, GUEST_SET, "ifname . ipv4_addr", false, &[]);
    set(&mut r, PUBLIC_SET, "ifname", false, &[]);
    set(&mut r, ALLOWED_SET, "ifname . ipv4_addr", true, &[]);
    let blocked: Vec<String> = BLOCKED_V4.iter().map(|s| (*s).to_owned()).collect();
    set(&mut r, BLOCKED_SET, "ipv4_addr", true, &blocked);
    let operator: Vec<String> = operator_allowed.iter().map(|n| n.to_string()).collect();
    set(&mut r, OPERATOR_SET, "ipv4_addr", true, &operator);
    let lines: &[&str] = &[
        "  chain prerouting {",
        "    type filter hook prerouting priority raw; policy accept;",
        "    iifname @veths meta nfproto ipv6 drop",
        "    iifname @veths iifname . ip saddr != @guests drop",
        "  }",
        "  chain input {",
        "    type filter hook input priority filter; policy accept;",
        "    iifname @veths ct state established,related accept",
        "    iifname @veths reject with icmpx type admin-prohibited",
        "  }",
        "  chain forward {",
        "    type filter hook forward priority filter; policy accept;",
        "    oifname @veths ct state established,related accept",
        "    oifname @veths drop",
        "    iifname @veths jump egress",
        "  }",
        "  chain egress {",
        "    iifname . ip daddr @allowed accept",
        "    iifname @public ip daddr @operator accept",
        "    iifname @public ip daddr != @blocked accept",
        "    reject with icmpx type admin-prohibited",
        "  }",
    ];
    for line in lines {
        let _ = writeln!(r, "{line}");
    }
    if let Some(egress) = egress {
        let _ = writeln!(r, "  chain postrouting {{");
        let _ = writeln!(
            r,
            "    type nat hook postrouting priority srcnat; policy accept;"
        );
        let _ = writeln!(
            r,
            "    ip saddr @{SANDBOX_SET} oifname \"{egress}\" masquerade"
        );
        let _ = writeln!(r, "  }}");
    }
    let _ = writeln!(r, "}}");
    r
}

/// The interface of the IPv4 default route, if there is one.
///
/// Errors: [`HostdError::Tool`] from `ip`.
pub async fn default_route_interface() -> Result<Option<String>, HostdError> {
    let out = tool::run("ip", &["-4", "route", "show", "default"]).await?;
    Ok(parse_default_dev(&out.stdout))
}

/// The `dev` of the first line of `ip route show default` output.
fn parse_default_dev(output: &str) -> Option<String> {
    let line = output.lines().next()?;
    let mut words = line.split_whitespace();
    words.find(|w| *w == "dev")?;
    words.next().map(str::to_owned)
}

/// Names of the nftables tables of the machine in family `inet` (`nft list tables`).
///
/// Errors: [`HostdError::Tool`].
pub async fn inet_tables() -> Result<Vec<String>, HostdError> {
    let out = tool::run("nft", &["list", "tables", "inet"]).await?;
    Ok(out
        .stdout
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table inet "))
        .map(|t| t.trim().to_owned())
        .collect())
}

/// Applies `ruleset` with `nft -f -` (one atomic transaction).
async fn nft(ruleset: &str) -> Result<(), HostdError> {
    match tool::run_input("nft", &["-f", "-"], Some(ruleset)).await {
        Ok(_) => Ok(()),
        Err(HostdError::Tool { stderr, .. }) => Err(HostdError::Nft {
            stderr,
            ruleset: ruleset.to_owned(),
        }),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::address::{AddressPool, Slot};
    use std::net::Ipv4Addr;

    fn admission(pool: AddressPool, slot: u32, egress: Egress) -> Admission {
        Admission {
            veth: format!("bv{slot:010}"),
            link: pool.link(Slot(slot)),
            egress,
        }
    }

    #[test]
    fn the_ruleset_replaces_the_table_and_lists_each_sandbox_with_its_policy() {
        let pool = AddressPool::new(Ipv4Addr::new(10, 200, 0, 0));
        let allowed = vec!["10.1.0.0/16".parse().unwrap()];
        let sandboxes = [
            admission(pool, 0, Egress::Public),
            admission(pool, 3, Egress::Allow(allowed)),
            admission(pool, 4, Egress::None),
        ];
        let resolver: Ipv4Net = "10.0.0.2/32".parse().unwrap();
        let r = ruleset("berth_abc", Some("eth0"), &[resolver], &sandboxes);
        assert!(r.starts_with("table inet berth_abc\ndelete table inet berth_abc\n"));
        assert!(
            r.contains("elements = { 10.200.0.0/30, 10.200.0.12/30, 10.200.0.16/30 }"),
            "{r}"
        );
        assert!(r.contains(
            "elements = { \"bv0000000000\" . 10.200.0.2, \"bv0000000003\" . 10.200.0.14, \"bv0000000004\" . 10.200.0.18 }"
        ), "{r}");
        // Only the public one is public; only the listed one has an allowed network.
        assert!(
            r.contains("set public {\n    type ifname\n    elements = { \"bv0000000000\" }\n"),
            "{r}"
        );
        assert!(
            r.contains("elements = { \"bv0000000003\" . 10.1.0.0/16 }"),
            "{r}"
        );
        assert!(
            r.contains("elements = { 0.0.0.0/8, 10.0.0.0/8, 100.64.0.0/10"),
            "{r}"
        );
        assert!(r.contains("iifname @veths meta nfproto ipv6 drop"));
        assert!(r.contains("iifname @veths iifname . ip saddr != @guests drop"));
        assert!(r.contains("oifname \"eth0\" masquerade"));
        assert!(r.contains("set operator {\n    type ipv4_addr\n    flags interval\n    elements = { 10.0.0.2/32 }"), "{r}");
        assert!(r.contains("iifname @public ip daddr @operator accept"));
        let no_egress = ruleset("berth_abc", None, &[], &[]);
        assert!(!no_egress.contains("masquerade") && !no_egress.contains("bv"));
    }

    #[test]
    fn a_none_sandbox_has_no_egress_element_and_a_listed_one_one_per_network() {
        let pool = AddressPool::new(Ipv4Addr::new(10, 200, 0, 0));
        let none = admission(pool, 1, Egress::None).elements();
        assert!(none
            .iter()
            .all(|(s, _)| *s != PUBLIC_SET && *s != ALLOWED_SET));
        let nets = vec![
            "10.1.0.0/16".parse().unwrap(),
            "192.0.2.7/32".parse().unwrap(),
        ];
        let listed = admission(pool, 1, Egress::Allow(nets)).elements();
        assert_eq!(listed.iter().filter(|(s, _)| *s == ALLOWED_SET).count(), 2);
    }

    #[test]
    fn the_default_route_device_is_parsed() {
        assert_eq!(
            parse_default_dev("default via 192.0.2.1 dev eth0 proto dhcp\n").as_deref(),
            Some("eth0")
        );
        assert_eq!(parse_default_dev(""), None);
    }
}
