//! A sandbox's network boundary through hostd (issue 11 item 4): its egress policy
//! (`public`, `none`, an allow-list) on runc and gVisor and the host's own addresses; IPv6
//! (link-local to the host, Router Advertisements) and spoofed sources are `spoofing`'s, which
//! uses the namespaces and listeners defined here.
//!
//! "Outside" is a network namespace each test makes ([`Outside`]), behind a veth that is not
//! a sandbox's, holding every target address on its `lo`; the root namespace routes each
//! target (/32) to it before any packet is sent, so nothing leaves the machine, whichever
//! way a rule goes. Its listeners log who reached which address.
//!
//! Packets busybox can't craft (a Router Advertisement, a datagram from a spoofed source)
//! are sent by the test from the sandbox's own network namespace, as root with every
//! capability: for runc through the namespace's kernel stack (the strongest a runc sandbox's
//! root could be), for gVisor as hand-built frames written to `eth0` with a packet socket
//! (the way gVisor's netstack sends its packets). So the host-side defences are shown
//! without relying on what the sandbox may not do inside (item 2 drops `CAP_NET_RAW`; runsc
//! runs without `--net-raw`). Each has a control showing the same packet does its harm where
//! nothing stops it.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, ensure, Context as _};
use berth_hostd::address::{AddressPool, LinkAddresses, Slot, SLOTS_PER_POOL};
use berth_hostd::layout::NETNS_DIR;
use berth_schemas::network::{Egress, Network};
use berth_schemas::wire::ResultOutcome;
use berth_schemas::{CommandKind, SandboxId};

use crate::harness::*;
use crate::support::env::{eventually, run, run_quietly};

/// The sandbox's `nc` gives up on a connection after this many seconds. Only a silently
/// dropped probe waits for it (refused egress and the host answer with an ICMP error at
/// once); it is generous so a reachable target is never missed on a loaded machine.
pub(crate) const PROBE_TIMEOUT_S: u32 = 8;

/// Runs `f` on a thread of its own that has joined the network namespace at `path`: a socket
/// it makes belongs to that namespace for good.
pub(crate) fn in_netns<T: Send + 'static>(
    path: PathBuf,
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).with_context(|| format!("open {path:?}"))?;
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
        f()
    })
    .join()
    .map_err(|_| anyhow!("the netns thread panicked"))?
}

pub(crate) fn netns_path(name: &str) -> PathBuf {
    PathBuf::from(NETNS_DIR).join(name)
}

/// Who reached what: (peer, local address, what it was: `tcp` or a datagram's text).
pub(crate) type Log = Arc<Mutex<Vec<(IpAddr, IpAddr, String)>>>;

pub(crate) fn logged(log: &Log) -> Vec<(IpAddr, IpAddr, String)> {
    log.lock().expect("not poisoned").clone()
}

/// A TCP listener answering each connection with the address it was made to, and a UDP
/// socket, both logging into one [`Log`]. Made in the current thread's namespace.
pub(crate) struct Listeners {
    pub(crate) tcp_port: u16,
    pub(crate) udp_port: u16,
    pub(crate) log: Log,
    pub(crate) tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Listeners {
    pub(crate) fn spawn(
        tcp: std::net::TcpListener,
        udp: std::net::UdpSocket,
    ) -> anyhow::Result<Self> {
        tcp.set_nonblocking(true)?;
        udp.set_nonblocking(true)?;
        let (tcp_port, udp_port) = (tcp.local_addr()?.port(), udp.local_addr()?.port());
        let log: Log = Arc::default();
        let tcp = tokio::net::TcpListener::from_std(tcp)?;
        let udp = tokio::net::UdpSocket::from_std(udp)?;
        let tcp_log = log.clone();
        let tcp_task = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt as _;
            while let Ok((mut conn, peer)) = tcp.accept().await {
                let Ok(local) = conn.local_addr() else {
                    continue;
                };
                tcp_log
                    .lock()
                    .expect("not poisoned")
                    .push((peer.ip(), local.ip(), "tcp".into()));
                let _ = conn.write_all(format!("{}\n", local.ip()).as_bytes()).await;
                let _ = conn.shutdown().await;
            }
        });
        let udp_log = log.clone();
        let udp_task = tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((n, peer)) = udp.recv_from(&mut buf).await {
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                let local = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
                udp_log
                    .lock()
                    .expect("not poisoned")
                    .push((peer.ip(), local, text));
            }
        });
        Ok(Self {
            tcp_port,
            udp_port,
            log,
            tasks: vec![tcp_task, udp_task],
        })
    }

    /// Listeners on every address (`0.0.0.0`, or `[::]` with `v6`) of the current namespace.
    pub(crate) fn bind(v6: bool) -> anyhow::Result<(std::net::TcpListener, std::net::UdpSocket)> {
        let any: IpAddr = if v6 {
            Ipv6Addr::UNSPECIFIED.into()
        } else {
            Ipv4Addr::UNSPECIFIED.into()
        };
        Ok((
            std::net::TcpListener::bind(SocketAddr::new(any, 0))?,
            std::net::UdpSocket::bind(SocketAddr::new(any, 0))?,
        ))
    }
}

impl Drop for Listeners {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The test's "outside": a namespace behind the veth `bn<tag>` (host side `link.host`,
/// namespace side `link.sandbox`, the pool's last /30, which no sandbox of the test gets),
/// every target on its `lo`, a /32 route to each target in the root namespace, and
/// listeners. Removed on drop (the routes go with the veth).
pub(crate) struct Outside {
    pub(crate) ns: String,
    pub(crate) veth: String,
    pub(crate) link: LinkAddresses,
    pub(crate) listeners: Option<Listeners>,
}

impl Outside {
    pub(crate) async fn new(h: &Harness, targets: &[Ipv4Addr]) -> anyhow::Result<Self> {
        let pool = AddressPool::new(h.config.address_pool);
        let link = pool.link(Slot(SLOTS_PER_POOL - 1));
        let tag = &h.subjects.prefix()[1..9];
        let mut outside = Self {
            ns: format!("bnet-{tag}"),
            veth: format!("bn{tag}"),
            link,
            listeners: None,
        };
        let (ns, veth) = (outside.ns.clone(), outside.veth.clone());
        run("ip", &["netns", "add", &ns]).await?;
        run(
            "ip",
            &[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ],
        )
        .await?;
        let host_cidr = format!("{}/30", link.host);
        let ns_cidr = format!("{}/30", link.sandbox);
        let gateway = link.host.to_string();
        let steps: [&[&str]; 6] = [
            &["addr", "add", &host_cidr, "dev", &veth],
            &["link", "set", &veth, "up"],
            &["-n", &ns, "addr", "add", &ns_cidr, "dev", "eth0"],
            &["-n", &ns, "link", "set", "eth0", "up"],
            &["-n", &ns, "link", "set", "lo", "up"],
            &["-n", &ns, "route", "add", "default", "via", &gateway],
        ];
        for args in steps {
            run("ip", args).await?;
        }
        let via = link.sandbox.to_string();
        for target in targets {
            let t = format!("{target}/32");
            run("ip", &["-n", &ns, "addr", "add", &t, "dev", "lo"]).await?;
            // `add`, not `replace`: a route someone else holds fails the test before any
            // packet goes out.
            run("ip", &["route", "add", &t, "via", &via, "dev", &veth])
                .await
                .with_context(|| format!("route {t} to the test's outside"))?;
        }
        let (tcp, udp) = in_netns(netns_path(&ns), || Listeners::bind(false))?;
        outside.listeners = Some(Listeners::spawn(tcp, udp)?);
        Ok(outside)
    }

    pub(crate) fn listeners(&self) -> &Listeners {
        self.listeners.as_ref().expect("made in new")
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        self.listeners.take();
        run_quietly("ip", &["link", "del", &self.veth]);
        run_quietly("ip", &["netns", "del", &self.ns]);
    }
}

/// Creates a sandbox from `template` with `egress`; its address.
pub(crate) async fn create(
    h: &mut Harness,
    sandbox: SandboxId,
    template: &str,
    egress: Egress,
) -> anyhow::Result<Ipv4Addr> {
    let mut cmd = h.command_with_template(sandbox, 1, CommandKind::Create, template);
    cmd.spec.as_mut().expect("a create has a spec").network = Network { egress };
    Ok(succeeded_address(&h.send(&cmd).await?)?.parse()?)
}

/// Which of `targets` (`ip:port`, IPv4 or `[v6%eth0]:port`) the sandbox reaches with `nc`,
/// all at once: a target is reached when it answers with its own address.
pub(crate) async fn reached(
    h: &Harness,
    sandbox: SandboxId,
    targets: &[String],
) -> anyhow::Result<BTreeSet<String>> {
    let mut script = String::new();
    for (i, t) in targets.iter().enumerate() {
        let (host, port) = t.rsplit_once(':').context("target without a port")?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        script.push_str(&format!(
            "(echo \"{i}=$(nc -w {PROBE_TIMEOUT_S} {host} {port} </dev/null 2>/dev/null)\") & "
        ));
    }
    script.push_str("wait");
    let timeout_ms = u64::from(PROBE_TIMEOUT_S) * 1000 * 4;
    let (code, out, timed_out) =
        finished(&h.exec(sandbox, &["sh", "-c", &script], timeout_ms).await?)?;
    ensure!(
        code == 0 && !timed_out,
        "probe script failed ({code}): {out}"
    );
    let mut got = BTreeSet::new();
    for line in out.lines() {
        let Some((i, answer)) = line.split_once('=') else {
            continue;
        };
        let target = &targets[i.parse::<usize>()?];
        let (host, _) = target.rsplit_once(':').expect("checked above");
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let host = host.split('%').next().unwrap_or(host);
        if !answer.is_empty() && answer.trim() == host {
            got.insert(target.clone());
        }
    }
    Ok(got)
}

/// The IPv4 addresses of the interface of the default route: the host's "real" addresses.
pub(crate) async fn default_route_addresses() -> anyhow::Result<Vec<Ipv4Addr>> {
    let route = run("ip", &["-4", "route", "show", "default"]).await?;
    let Some(dev) = route.split_whitespace().skip_while(|w| *w != "dev").nth(1) else {
        return Ok(Vec::new());
    };
    let addrs = run("ip", &["-o", "-4", "addr", "show", "dev", dev]).await?;
    Ok(berth_hostd::address::parse_ip_addr_output(&addrs))
}

/// The link-local address the kernel would give `veth` (EUI-64 from its MAC, RFC 4291
/// appendix A), with the sandbox's interface as its zone.
pub(crate) fn link_local_of(veth: &str) -> anyhow::Result<String> {
    let mac = std::fs::read_to_string(format!("/sys/class/net/{veth}/address"))?;
    let b: Vec<u8> = mac
        .trim()
        .split(':')
        .map(|x| u8::from_str_radix(x, 16))
        .collect::<Result<_, _>>()?;
    ensure!(b.len() == 6, "odd MAC {mac}");
    let ll = Ipv6Addr::new(
        0xfe80,
        0,
        0,
        0,
        u16::from_be_bytes([b[0] ^ 2, b[1]]),
        u16::from_be_bytes([b[2], 0xff]),
        u16::from_be_bytes([0xfe, b[3]]),
        u16::from_be_bytes([b[4], b[5]]),
    );
    Ok(format!("{ll}%eth0"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn each_egress_policy_reaches_only_what_it_allows_on_runc_and_gvisor_and_survives_a_restart(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(egress_policies(h))).await
}

pub(crate) async fn egress_policies(h: &mut Harness) -> anyhow::Result<()> {
    let s = h.config.address_pool.octets()[1];
    let public = Ipv4Addr::new(198, 51, 100, s);
    let public_other = Ipv4Addr::new(203, 0, 113, s);
    let metadata = Ipv4Addr::new(169, 254, 169, 254);
    let ten = Ipv4Addr::new(10, s, 254, 1);
    let one_nine_two = Ipv4Addr::new(192, 168, s, 1);
    let one_seven_two = Ipv4Addr::new(172, 20, s, 1);
    let cgnat = Ipv4Addr::new(100, 64, s, 1);
    let targets = [
        public,
        public_other,
        metadata,
        ten,
        one_nine_two,
        one_seven_two,
        cgnat,
    ];
    // The operator lets public sandboxes reach one private address (a resolver, say).
    h.stop_hostd().await?;
    h.config.sandbox_egress_allow = vec![format!("{one_nine_two}/32").parse()?];
    h.start_hostd();
    let outside = Outside::new(h, &targets).await?;
    let port = outside.listeners().tcp_port;
    let at = |ip: Ipv4Addr| format!("{ip}:{port}");

    // A listener of the host, on every IPv4 and IPv6 address.
    let (tcp4, udp4) = Listeners::bind(false)?;
    let host4 = Listeners::spawn(tcp4, udp4)?;
    let (tcp6, udp6) = Listeners::bind(true)?;
    let host6 = Listeners::spawn(tcp6, udp6)?;
    let mut host_addresses = default_route_addresses().await?;
    host_addresses.push(outside.link.host);

    let (runc_public, gvisor_public, runc_none, runc_listed, gvisor_listed) = (
        SandboxId::new(),
        SandboxId::new(),
        SandboxId::new(),
        SandboxId::new(),
        SandboxId::new(),
    );
    let allow = || {
        Egress::Allow(vec![
            format!("{one_seven_two}/24").parse().expect("a CIDR"),
            format!("{public}/32").parse().expect("a CIDR"),
        ])
    };
    let cases = [
        (
            runc_public,
            "base",
            Egress::Public,
            vec![public, public_other, one_nine_two],
        ),
        (
            gvisor_public,
            "base-gvisor",
            Egress::Public,
            vec![public, public_other, one_nine_two],
        ),
        (runc_none, "base", Egress::None, vec![]),
        (runc_listed, "base", allow(), vec![one_seven_two, public]),
        (
            gvisor_listed,
            "base-gvisor",
            allow(),
            vec![one_seven_two, public],
        ),
    ];
    let mut addresses = Vec::new();
    for (sandbox, template, egress, _) in &cases {
        addresses.push(create(h, *sandbox, template, egress.clone()).await?);
    }

    let veths: Vec<String> = cases.iter().map(|c| h.names(c.0).veth_host).collect();
    // Every target, and the host on each of its addresses (its gateway too).
    let probe = |address: Ipv4Addr| {
        let mut all: Vec<String> = targets.iter().map(|t| at(*t)).collect();
        let gateway = Ipv4Addr::from(u32::from(address) - 1);
        for host in host_addresses.iter().chain([&gateway]) {
            all.push(format!("{host}:{}", host4.tcp_port));
        }
        all
    };
    for (((sandbox, template, egress, expected), address), veth) in
        cases.iter().zip(&addresses).zip(&veths)
    {
        let mut all = probe(*address);
        all.push(format!("[{}]:{}", link_local_of(veth)?, host6.tcp_port));
        let got = reached(h, *sandbox, &all).await?;
        let want: BTreeSet<String> = expected.iter().map(|t| at(*t)).collect();
        ensure!(
            got == want,
            "{template} sandbox with {egress:?} reached {got:?}, expected {want:?}"
        );
        // The listeners agree: what they saw from this sandbox is exactly what it reached.
        let seen: BTreeSet<String> = logged(&outside.listeners().log)
            .into_iter()
            .filter(|(peer, _, _)| *peer == IpAddr::V4(*address))
            .map(|(_, local, _)| format!("{local}:{port}"))
            .collect();
        ensure!(
            seen == want,
            "the outside saw {seen:?} from {template} {egress:?}"
        );
    }
    // Nothing of a sandbox reached the host: no IPv4 peer of theirs, no IPv6 link-local.
    let from_sandbox = |peer: &IpAddr| match peer {
        IpAddr::V4(v4) => addresses.contains(v4),
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map_or(v6.is_unicast_link_local(), |v4| addresses.contains(&v4)),
    };
    let at_host: Vec<_> = logged(&host4.log)
        .into_iter()
        .chain(logged(&host6.log))
        .filter(|(peer, _, _)| from_sandbox(peer))
        .collect();
    ensure!(
        at_host.is_empty(),
        "a sandbox reached the host: {at_host:?}"
    );

    // A restart rebuilds the table from the records: the policies hold as before.
    let table = berth_hostd::layout::firewall_table(h.host_id);
    h.stop_hostd().await?;
    run_quietly("nft", &["delete", "table", "inet", &table]);
    h.start_hostd();
    let listed = format!("\"{}\" . {}/24", veths[3], Ipv4Addr::new(172, 20, s, 0));
    eventually(
        "the restarted hostd rebuilds its table with every sandbox",
        || {
            let (table, veths, listed) = (table.clone(), veths.clone(), listed.clone());
            async move {
                run("nft", &["list", "table", "inet", &table])
                    .await
                    .is_ok_and(|t| {
                        veths.iter().all(|v| t.contains(v.as_str())) && t.contains(&listed)
                    })
            }
        },
    )
    .await;
    // Its agent requests are served once its subscription is in (which the table does not
    // wait for).
    let hostd = &*h;
    eventually(
        "the restarted hostd answers agent requests",
        || async move {
            hostd
                .exec(runc_none, &["true"], EXEC_TIMEOUT_MS)
                .await
                .is_ok_and(|r| finished(&r).is_ok_and(|(code, _, _)| code == 0))
        },
    )
    .await;
    for (i, sandbox) in [(2, runc_none), (3, runc_listed), (1, gvisor_public)] {
        let got = reached(h, sandbox, &probe(addresses[i])).await?;
        let want: BTreeSet<String> = cases[i].3.iter().map(|t| at(*t)).collect();
        ensure!(
            got == want,
            "after a restart {:?} reached {got:?}",
            cases[i].2
        );
    }

    // A delete removes every element of the sandbox.
    for (sandbox, ..) in &cases {
        let deleted = h.send(&h.command(*sandbox, 2, CommandKind::Delete)).await?;
        ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    }
    let rules = run("nft", &["list", "table", "inet", &table]).await?;
    ensure!(
        !rules.contains("\"bv") && !rules.contains(&format!("{}/24", Ipv4Addr::new(172, 20, s, 0))),
        "elements of deleted sandboxes remain: {rules}"
    );
    drop(outside);
    Ok(())
}
