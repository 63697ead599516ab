//! A slow and lossy link for one host of a [`Topology`]: [`DELAY`] ± [`JITTER`] (normal) and
//! [`LOSS_PERCENT`] % loss, each way. Two ways to make it, picked by [`SlowLink::apply`]:
//!
//! - **netem**, where the kernel has `sch_netem`: `tc qdisc add … netem` on both ends of the
//!   host's veth (the bridge side delays what reaches the host, `eth0` what it sends).
//! - **emulated**, where it has not (no netem, no `fq`/EDT, no NFQUEUE: no way to delay a
//!   packet at L3), with what such a kernel has:
//!   - loss at L3, on the link itself: an nftables `netdev` table on each end's ingress drops
//!     a packet when `numgen random mod 100 < LOSS_PERCENT` — the bridge side of the veth, in
//!     this machine's namespace, for what the host sends; `eth0`, in the host's namespace, for
//!     what it receives. Every packet of the link (ARP too) is a candidate, as with netem, and
//!     the sender is not told (an ingress drop is a loss on the wire, not a local one);
//!   - delay at L4: the host's link carries only its NATS client connections (hostd to the
//!     three nats-server; the topology's firewall lets nothing else through), so a
//!     [`DelayRelay`] on the bridge address, one listener per NATS server, delays both
//!     directions of each, and a DNAT rule (`type nat hook output`) in the host's namespace
//!     sends the host's connections to the NATS servers' addresses to the relay instead. The
//!     host and its NATS URLs are unchanged. The relay's module says what this delay is and
//!     is not (per chunk, not per packet; order kept; handshake not delayed). The host's
//!     packets to the relay cross the lossy link, so TCP's retransmissions add their own
//!     delays on top, as under netem.
//!
//! `BERTH_TOPOLOGY_SLOW_LINK=netem|emulated` forces one (e.g. to run the emulation on a kernel
//! with netem); unset, netem when `tc` can add it, else the emulation. Dropping the
//! [`SlowLink`] removes what it added outside the host's namespace (the qdisc, the netdev table,
//! the firewall's accept rule) and stops the relay; what is inside goes with the namespace.

use std::net::IpAddr;
use std::process::Command;
use std::time::Duration;

use super::kit::Topology;
use super::relay::{Carried, DelayRelay, Jitter};

/// The mean one-way delay the link adds.
pub const DELAY: Duration = Duration::from_millis(100);
/// Its standard deviation (netem's jitter with `distribution normal`).
pub const JITTER: Duration = Duration::from_millis(50);
/// The share of packets lost, each way.
pub const LOSS_PERCENT: u32 = 5;
/// Forces the method: `netem` or `emulated`.
pub const METHOD_ENV: &str = "BERTH_TOPOLOGY_SLOW_LINK";
/// The nftables tables the emulation adds (in the host's namespace: `ip` for the DNAT,
/// `netdev` for the loss on `eth0`; in this machine's: `netdev <prefix>_slow<N>`).
const TABLE: &str = "topology_slow_link";

/// One host's slow link, as long as it lives.
pub struct SlowLink {
    veth: String,
    how: How,
}

enum How {
    Netem,
    Emulated {
        /// Why not netem (`tc`'s answer, or the variable).
        why: String,
        relay: DelayRelay,
        netns: String,
        /// The netdev table on the bridge side of the veth.
        root_table: String,
        /// The firewall's table and the handle of the rule that lets the host reach the relay.
        firewall: (String, u64),
    },
}

impl SlowLink {
    /// Makes host `n`'s link (1-based) slow and lossy. The emulation restarts the host
    /// (`deploy/topology stop`/`start`) so that its NATS connections are made through the
    /// relay (a DNAT rule only acts on new connections), and returns once the relay carries
    /// them both ways; call it before the load.
    pub async fn apply(topo: &Topology, n: usize) -> SlowLink {
        let veth = topo.veth(n);
        let forced = std::env::var(METHOD_ENV).ok();
        let why = match forced.as_deref() {
            Some("emulated") => format!("{METHOD_ENV}=emulated"),
            None | Some("netem") => match netem(&veth, None) {
                Ok(()) => {
                    let link = SlowLink {
                        veth,
                        how: How::Netem,
                    };
                    netem(&link.veth, Some(&topo.netns(n))).expect("netem on the host's eth0");
                    return link;
                }
                Err(e) if forced.is_some() => panic!("{METHOD_ENV}=netem: {e}"),
                Err(e) => format!("no netem: {e}"),
            },
            Some(other) => panic!("{METHOD_ENV}={other}: netem or emulated"),
        };
        let relay = DelayRelay::start(
            IpAddr::V4(topo.bridge_ip()),
            &topo.nats_addrs,
            Jitter {
                mean: DELAY,
                jitter: JITTER,
            },
        )
        .await;
        let netns = topo.netns(n);
        // The first counter sees every packet, the second the ones dropped.
        let drop = format!("counter\n    numgen random mod 100 < {LOSS_PERCENT} counter drop");
        let dnat: String = relay
            .routes
            .iter()
            .map(|(nats, to)| {
                format!(
                    "    ip daddr {} tcp dport {} counter dnat to {to}\n",
                    nats.ip(),
                    nats.port()
                )
            })
            .collect();
        let root_table = format!("{}_slow{n}", topo.prefix);
        let ports: Vec<String> = relay
            .routes
            .iter()
            .map(|(_, to)| to.port().to_string())
            .collect();
        // Each addition is recorded before the next, so a failure drops what was made.
        let mut link = SlowLink {
            veth: veth.clone(),
            how: How::Emulated {
                why,
                relay,
                netns: netns.clone(),
                root_table: root_table.clone(),
                firewall: (topo.prefix.clone(), 0),
            },
        };
        nft(
            None,
            &format!(
                "table netdev {root_table} {{\n  chain ingress {{\n    type filter hook ingress device \"{veth}\" priority 0; policy accept;\n    {drop}\n  }}\n}}\n"
            ),
        );
        nft(
            Some(&netns),
            &format!(
                "table netdev {TABLE} {{\n  chain ingress {{\n    type filter hook ingress device \"eth0\" priority 0; policy accept;\n    {drop}\n  }}\n}}\ntable ip {TABLE} {{\n  chain output {{\n    type nat hook output priority -100; policy accept;\n{dnat}  }}\n}}\n"
            ),
        );
        // The topology's firewall lets the hosts reach the NATS ports only: let this host
        // reach the relay's too.
        let out = Command::new("nft")
            .args(["-e", "-a", "insert", "rule", "inet", &topo.prefix, "input"])
            .args(["iifname", &format!("{}br", topo.prefix)])
            .args(["ip", "saddr", &topo.host_ip(n).to_string()])
            .args([
                "tcp",
                "dport",
                &format!("{{ {} }}", ports.join(", ")),
                "accept",
            ])
            .output()
            .unwrap();
        let echoed = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "nft insert: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let handle = echoed
            .split("# handle ")
            .nth(1)
            .and_then(|h| h.split_whitespace().next())
            .and_then(|h| h.parse().ok())
            .unwrap_or_else(|| panic!("no handle in nft's echo: {echoed}"));
        if let How::Emulated { firewall, .. } = &mut link.how {
            firewall.1 = handle;
        }
        let host = format!("host{n}");
        topo.part("stop", &host);
        topo.part("start", &host);
        crate::support::eventually("the restarted host talks to NATS through the relay", || {
            let carried = link.carried();
            async move { carried.is_some_and(|c| c.chunks[0] > 0 && c.chunks[1] > 0) }
        })
        .await;
        crate::support::eventually("the restarted host is ready", || async {
            let ready: bool = sqlx::query_scalar(
                "SELECT state = 'ready' AND last_seen > now() - interval '5 seconds' FROM hosts WHERE id = $1",
            )
            .bind(topo.host_id(n))
            .fetch_one(&topo.db)
            .await
            .unwrap();
            ready
        })
        .await;
        link
    }

    /// What the relay carried so far (`None` under netem).
    pub fn carried(&self) -> Option<Carried> {
        match &self.how {
            How::Netem => None,
            How::Emulated { relay, .. } => Some(relay.carried()),
        }
    }

    /// The packets the emulation dropped so far and the packets it saw, `[from the host, to
    /// the host]` (`None` under netem).
    pub fn dropped(&self) -> Option<[(u64, u64); 2]> {
        let How::Emulated {
            netns, root_table, ..
        } = &self.how
        else {
            return None;
        };
        Some([counted(None, root_table), counted(Some(netns), TABLE)])
    }

    /// Panics unless the emulation did its work: the relay carried chunks both ways and each
    /// direction lost packets. Nothing to check under netem (`tc` accepted it).
    pub fn assert_applied(&self) {
        if let (Some(carried), Some(dropped)) = (self.carried(), self.dropped()) {
            assert!(
                carried.chunks[0] > 0 && carried.chunks[1] > 0,
                "the relay carried nothing one way: {carried}"
            );
            assert!(
                dropped[0].0 > 0 && dropped[1].0 > 0,
                "no loss one way: dropped {dropped:?} (from, to the host)"
            );
        }
    }

    /// How the link was made and what it did, for the report line.
    pub fn describe(&self) -> String {
        let shape = format!(
            "{} ms ± {} ms, {LOSS_PERCENT} % loss each way",
            DELAY.as_millis(),
            JITTER.as_millis()
        );
        match (&self.how, self.carried(), self.dropped()) {
            (How::Emulated { why, .. }, Some(carried), Some(dropped)) => format!(
                "emulated ({why}): {shape}; nft dropped {} of {} packets from the host, {} of {} to it; L4 relay: {carried}",
                dropped[0].0, dropped[0].1, dropped[1].0, dropped[1].1
            ),
            _ => format!("tc netem: {shape}"),
        }
    }
}

impl Drop for SlowLink {
    fn drop(&mut self) {
        match &self.how {
            How::Netem => {
                let _ = Command::new("tc")
                    .args(["qdisc", "del", "dev", &self.veth, "root"])
                    .output();
            }
            How::Emulated {
                root_table,
                firewall: (table, handle),
                ..
            } => {
                let _ = Command::new("nft")
                    .args(["delete", "table", "netdev", root_table])
                    .output();
                if *handle != 0 {
                    let _ = Command::new("nft")
                        .args(["delete", "rule", "inet", table, "input", "handle"])
                        .arg(handle.to_string())
                        .output();
                }
            }
        }
    }
}

/// `tc qdisc add dev <dev> root netem …` on `veth` (`netns`: `eth0` in that namespace);
/// `tc`'s stderr when it fails.
fn netem(veth: &str, netns: Option<&str>) -> Result<(), String> {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0"]);
            c
        }
        None => {
            let mut c = Command::new("tc");
            c.args(["qdisc", "add", "dev", veth]);
            c
        }
    };
    let delay = format!("{}ms", DELAY.as_millis());
    let jitter = format!("{}ms", JITTER.as_millis());
    let loss = format!("{LOSS_PERCENT}%");
    let out = cmd
        .args([
            "root",
            "netem",
            "delay",
            &delay,
            &jitter,
            "distribution",
            "normal",
        ])
        .args(["loss", &loss])
        .output()
        .map_err(|e| format!("run tc: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

/// Runs `nft -f -` with `script`, in `netns` when given; panics when it fails.
fn nft(netns: Option<&str>, script: &str) {
    use std::io::Write;
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "nft", "-f", "-"]);
            c
        }
        None => {
            let mut c = Command::new("nft");
            c.args(["-f", "-"]);
            c
        }
    };
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "nft -f:\n{script}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The packets the `netdev` table `table` dropped and the packets it saw, from its two
/// counters (`netns`: in that namespace); 0 for a counter that cannot be read.
fn counted(netns: Option<&str>, table: &str) -> (u64, u64) {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "nft"]);
            c
        }
        None => Command::new("nft"),
    };
    let out = cmd
        .args(["list", "table", "netdev", table])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let nth = |i: usize| -> u64 {
        text.split("counter packets ")
            .nth(i)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    (nth(2), nth(1))
}

/// `samples` round trips of the NATS protocol from host `n`'s namespace to `nats` (an INFO
/// read, then `CONNECT`+`PING` sent; the time until the server's answer — `-ERR` for a
/// connection without credentials — is one round trip), sorted. A sample whose connection
/// or answer fails is left out. Async: the relay runs on the caller's runtime, which must
/// not block while the probe waits for it.
pub async fn nats_round_trips(topo: &Topology, n: usize, samples: usize) -> Vec<Duration> {
    let nats = topo.nats_addrs[0];
    let script = format!(
        r#"for _ in $(seq 1 {samples}); do
  exec 3<>/dev/tcp/{ip}/{port} || continue
  if read -r -t 10 _info <&3; then
    t0=${{EPOCHREALTIME/./}}
    printf 'CONNECT {{"verbose":false}}\r\nPING\r\n' >&3
    read -r -t 10 _reply <&3 && echo $(( ${{EPOCHREALTIME/./}} - t0 ))
  fi
  exec 3<&- 3>&-
done"#,
        ip = nats.ip(),
        port = nats.port()
    );
    let out = tokio::process::Command::new("ip")
        .args(["netns", "exec", &topo.netns(n), "bash", "-c", &script])
        .output()
        .await
        .unwrap();
    let mut rtts: Vec<Duration> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .map(Duration::from_micros)
        .collect();
    rtts.sort();
    rtts
}
