//! Sandbox isolation and egress with nftables: one table per hostd (`inet berth_<tag>`, the
//! tag derived from the host id like every other kernel-visible name, see `layout`), holding
//! a set of this host's sandbox /30s and three base chains:
//!
//! - `forward`: no traffic between sandboxes (a packet from one of this host's sandboxes to
//!   any berth veth `bv…` is dropped); into a sandbox only replies (`ct state
//!   established,related`), so nothing but the host itself opens a connection to it.
//! - `input`: a sandbox may not open connections to the host (only replies to hostd's own
//!   connections to its agent come back in).
//! - `postrouting`: egress is masqueraded out of the host's default-route interface.
//!
//! Egress needs IPv4 forwarding, which [`Firewall::install`] turns on (it is machine-wide).
//!
//! # Guarantees
//! - [`Firewall::install`] replaces this hostd's table in one `nft` transaction, with exactly
//!   the sandboxes its records hold: stale elements of a previous run are swept, and no other
//!   table is touched.
//! - [`Firewall::admit`] and [`Firewall::remove`] are idempotent.

use std::fmt::Write as _;
use std::process::Stdio;

use tokio::io::AsyncWriteExt;

use crate::address::{LinkAddresses, LINK_PREFIX_LEN};
use crate::error::HostdError;
use crate::tool;

/// Where IPv4 forwarding is switched on.
const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// The prefix every berth host-side veth has (see `layout::SandboxNames`).
pub const VETH_PREFIX: &str = "bv";

/// The set of this host's sandbox links.
const SANDBOX_SET: &str = "sandboxes";

/// One hostd's nftables table.
#[derive(Debug, Clone)]
pub struct Firewall {
    table: String,
}

impl Firewall {
    /// The firewall of the table called `table` (`berth_<tag>`).
    pub fn new(table: String) -> Self {
        Self { table }
    }

    /// The nftables table's name (in family `inet`).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Replaces this hostd's table with one admitting exactly `links`, masquerading out of
    /// the default-route interface (when there is one), and turns IPv4 forwarding on.
    ///
    /// Errors: [`HostdError::Nft`]; [`HostdError::Tool`] / [`HostdError::Io`].
    pub async fn install(&self, links: &[LinkAddresses]) -> Result<(), HostdError> {
        let egress = default_route_interface().await?;
        let ruleset = ruleset(&self.table, egress.as_deref(), links);
        nft(&ruleset).await?;
        if egress.is_some() {
            let on = std::fs::read_to_string(IP_FORWARD).is_ok_and(|v| v.trim() == "1");
            if !on {
                std::fs::write(IP_FORWARD, "1")
                    .map_err(HostdError::io(format!("write {IP_FORWARD}")))?;
                tracing::info!("IPv4 forwarding turned on for sandbox egress");
            }
        }
        tracing::info!(table = %self.table, sandboxes = links.len(), egress = ?egress, "firewall installed");
        Ok(())
    }

    /// Admits a sandbox's link into the table's set.
    ///
    /// Errors: [`HostdError::Nft`].
    pub async fn admit(&self, link: &LinkAddresses) -> Result<(), HostdError> {
        nft(&format!(
            "add element inet {} {SANDBOX_SET} {{ {} }}\n",
            self.table,
            cidr(link)
        ))
        .await
    }

    /// Removes a sandbox's link from the set; succeeds when it is not there.
    ///
    /// Errors: [`HostdError::Nft`].
    pub async fn remove(&self, link: &LinkAddresses) -> Result<(), HostdError> {
        // Adding first makes the delete succeed whether or not the element existed; both
        // happen in one transaction.
        let element = format!("inet {} {SANDBOX_SET} {{ {} }}", self.table, cidr(link));
        nft(&format!(
            "add element {element}\ndelete element {element}\n"
        ))
        .await
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

/// The whole table, as one `nft -f` transaction that replaces any previous version.
pub fn ruleset(table: &str, egress: Option<&str>, links: &[LinkAddresses]) -> String {
    let mut r = String::new();
    // Declaring the table first makes the delete succeed when it does not exist yet.
    let _ = writeln!(r, "table inet {table}");
    let _ = writeln!(r, "delete table inet {table}");
    let _ = writeln!(r, "table inet {table} {{");
    let _ = writeln!(r, "  set {SANDBOX_SET} {{");
    let _ = writeln!(r, "    type ipv4_addr");
    let _ = writeln!(r, "    flags interval");
    if !links.is_empty() {
        let elements: Vec<String> = links.iter().map(cidr).collect();
        let _ = writeln!(r, "    elements = {{ {} }}", elements.join(", "));
    }
    let _ = writeln!(r, "  }}");
    let veths = format!("\"{VETH_PREFIX}*\"");
    let _ = writeln!(r, "  chain forward {{");
    let _ = writeln!(
        r,
        "    type filter hook forward priority filter; policy accept;"
    );
    let _ = writeln!(
        r,
        "    iifname {veths} oifname {veths} ip saddr @{SANDBOX_SET} drop"
    );
    let _ = writeln!(
        r,
        "    oifname {veths} ip daddr @{SANDBOX_SET} ct state established,related accept"
    );
    let _ = writeln!(r, "    oifname {veths} ip daddr @{SANDBOX_SET} drop");
    let _ = writeln!(r, "  }}");
    let _ = writeln!(r, "  chain input {{");
    let _ = writeln!(
        r,
        "    type filter hook input priority filter; policy accept;"
    );
    let _ = writeln!(
        r,
        "    iifname {veths} ip saddr @{SANDBOX_SET} ct state established,related accept"
    );
    let _ = writeln!(r, "    iifname {veths} ip saddr @{SANDBOX_SET} drop");
    let _ = writeln!(r, "  }}");
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
    let mut child = tokio::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(HostdError::io("spawn nft (apt-get install nftables)"))?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    stdin
        .write_all(ruleset.as_bytes())
        .await
        .map_err(HostdError::io("write to nft"))?;
    drop(stdin);
    let out = tokio::time::timeout(tool::TOOL_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| HostdError::Io {
            context: "nft timed out".into(),
            source: std::io::ErrorKind::TimedOut.into(),
        })?
        .map_err(HostdError::io("wait for nft"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(HostdError::Nft {
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            ruleset: ruleset.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::address::{AddressPool, Slot};
    use std::net::Ipv4Addr;

    #[test]
    fn the_ruleset_replaces_the_table_and_lists_each_sandbox_link() {
        let pool = AddressPool::new(Ipv4Addr::new(10, 200, 0, 0));
        let links = [pool.link(Slot(0)), pool.link(Slot(3))];
        let r = ruleset("berth_abc", Some("eth0"), &links);
        assert!(r.starts_with("table inet berth_abc\ndelete table inet berth_abc\n"));
        assert!(
            r.contains("elements = { 10.200.0.0/30, 10.200.0.12/30 }"),
            "{r}"
        );
        assert!(r.contains("iifname \"bv*\" oifname \"bv*\" ip saddr @sandboxes drop"));
        assert!(r.contains("oifname \"eth0\" masquerade"));
        let no_egress = ruleset("berth_abc", None, &[]);
        assert!(!no_egress.contains("masquerade") && !no_egress.contains("elements"));
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
