//! A sandbox cannot spoof its source address or configure the host with IPv6 Router
//! Advertisements, on runc and gVisor (issue 11 item 4). The packets busybox cannot craft are
//! sent by the test from the sandbox's own network namespace with every capability (runc) or as
//! hand-built frames on its `eth0` (gVisor), each with a control showing the same packet does
//! its harm where nothing stops it. "Outside" and its listeners are [`crate::egress`]'s.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

use anyhow::{anyhow, ensure, Context as _};
use berth_schemas::network::Egress;
use berth_schemas::wire::ResultOutcome;
use berth_schemas::{CommandKind, SandboxId};

use crate::egress::*;
use crate::harness::*;
use crate::support::env::{eventually, run, run_quietly};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_cannot_spoof_its_source_or_configure_the_host_with_router_advertisements(
) -> anyhow::Result<()> {
    with_harness(|h| Box::pin(spoofing_and_ipv6(h))).await
}

/// A Router Advertisement (RFC 4861 §4.2): hop limit 64, router lifetime 1800 s (a default
/// route), and one Prefix Information option (§4.6.2) for `prefix`/64, on-link and
/// autonomous (an address by SLAAC). The kernel fills in the checksum.
fn router_advertisement(prefix: Ipv6Addr) -> Vec<u8> {
    let mut ra = vec![134, 0, 0, 0, 64, 0, 0x07, 0x08, 0, 0, 0, 0, 0, 0, 0, 0];
    ra.extend([3, 4, 64, 0xc0]);
    ra.extend(86_400u32.to_be_bytes());
    ra.extend(86_400u32.to_be_bytes());
    ra.extend([0, 0, 0, 0]);
    ra.extend(prefix.octets());
    ra
}

/// The index of `interface` in namespace `ns` (`ip -o link show` starts with it).
async fn ifindex(ns: &str, interface: &str) -> anyhow::Result<u32> {
    let out = run("ip", &["-n", ns, "-o", "link", "show", interface]).await?;
    Ok(out.split(':').next().unwrap_or("").trim().parse()?)
}

/// Sends a Router Advertisement for `prefix` to all nodes out of `interface` (index
/// `index`) of the namespace `ns`, from a raw ICMPv6 socket with hop limit 255.
fn send_ra(ns: &str, index: u32, prefix: Ipv6Addr) -> anyhow::Result<()> {
    in_netns(netns_path(ns), move || {
        use socket2::{Domain, Protocol, Socket, Type};
        let sock = Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::ICMPV6))?;
        sock.set_multicast_hops_v6(255)?;
        sock.set_multicast_if_v6(index)?;
        let all_nodes = SocketAddrV6::new(Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1), 0, 0, index);
        sock.send_to(&router_advertisement(prefix), &all_nodes.into())?;
        Ok(())
    })
}

/// Sends `payload` over UDP from `source` to `target`, from the namespace `ns`. The socket is
/// `IP_TRANSPARENT` (which needs `CAP_NET_ADMIN`), so any source address will do: the
/// kernel routes it as it is (`IP_FREEBIND` alone binds, but the route lookup refuses a
/// source that is not local).
fn send_udp_from(
    ns: &str,
    source: Ipv4Addr,
    target: SocketAddrV4,
    payload: &'static str,
) -> anyhow::Result<()> {
    in_netns(netns_path(ns), move || {
        use socket2::{Domain, Protocol, Socket, Type};
        let sock = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
        sock.set_ip_transparent_v4(true)?;
        sock.bind(&SocketAddrV4::new(source, 0).into())?;
        sock.send_to(payload.as_bytes(), &target.into())?;
        Ok(())
    })
}

/// The MAC address of `interface` in namespace `ns` (`ip -o link show`: `link/ether …`).
async fn mac_of(ns: Option<&str>, interface: &str) -> anyhow::Result<[u8; 6]> {
    let out = match ns {
        Some(ns) => run("ip", &["-n", ns, "-o", "link", "show", interface]).await?,
        None => run("ip", &["-o", "link", "show", interface]).await?,
    };
    let text = out
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .context("no link/ether")?;
    let bytes: Vec<u8> = text
        .split(':')
        .map(|x| u8::from_str_radix(x, 16))
        .collect::<Result<_, _>>()?;
    bytes.try_into().map_err(|_| anyhow!("odd MAC {text}"))
}

/// The Internet checksum (RFC 1071) of `data`.
fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An Ethernet frame carrying an IPv4 UDP datagram from `source` to `target` (UDP checksum
/// 0: none, as RFC 768 allows).
fn udp_frame(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    source: Ipv4Addr,
    target: SocketAddrV4,
    payload: &[u8],
) -> Vec<u8> {
    let udp_len = 8 + payload.len() as u16;
    let mut ip = vec![0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, 17, 0, 0];
    ip[2..4].copy_from_slice(&(20 + udp_len).to_be_bytes());
    ip.extend(source.octets());
    ip.extend(target.ip().octets());
    let sum = checksum(&ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut frame = [dst_mac.as_slice(), src_mac.as_slice(), &[0x08, 0x00]].concat();
    frame.extend(ip);
    frame.extend(40_000u16.to_be_bytes());
    frame.extend(target.port().to_be_bytes());
    frame.extend(udp_len.to_be_bytes());
    frame.extend([0, 0]);
    frame.extend(payload);
    frame
}

/// An Ethernet frame carrying [`router_advertisement`] for `prefix` from the EUI-64
/// link-local address of `src_mac` to all nodes, hop limit 255, checksummed (RFC 4443 §2.3).
fn ra_frame(src_mac: [u8; 6], prefix: Ipv6Addr) -> Vec<u8> {
    let b = src_mac;
    let source = Ipv6Addr::new(
        0xfe80,
        0,
        0,
        0,
        u16::from_be_bytes([b[0] ^ 2, b[1]]),
        u16::from_be_bytes([b[2], 0xff]),
        u16::from_be_bytes([0xfe, b[3]]),
        u16::from_be_bytes([b[4], b[5]]),
    );
    let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
    let mut icmp = router_advertisement(prefix);
    let mut pseudo = [source.octets(), all_nodes.octets()].concat();
    pseudo.extend((icmp.len() as u32).to_be_bytes());
    pseudo.extend([0, 0, 0, 58]);
    pseudo.extend(&icmp);
    let sum = checksum(&pseudo);
    icmp[2..4].copy_from_slice(&sum.to_be_bytes());
    let mut frame = [&[0x33, 0x33, 0, 0, 0, 1], src_mac.as_slice(), &[0x86, 0xdd]].concat();
    frame.extend([0x60, 0, 0, 0]);
    frame.extend((icmp.len() as u16).to_be_bytes());
    frame.extend([58, 255]);
    frame.extend(source.octets());
    frame.extend(all_nodes.octets());
    frame.extend(icmp);
    frame
}

/// Writes `frames` as they are out of interface `index` of namespace `ns`, through a packet
/// socket: the way gVisor's netstack puts its packets on the sandbox's `eth0`.
fn send_frames(ns: &str, index: u32, frames: Vec<Vec<u8>>) -> anyhow::Result<()> {
    in_netns(netns_path(ns), move || {
        use socket2::{Domain, SockAddr, Socket, Type};
        let sock = Socket::new(Domain::PACKET, Type::RAW, None)?;
        // SAFETY: `sockaddr_ll` fits in the zeroed storage `try_init` hands over, and every
        // field it reads is set here.
        let ((), addr) = unsafe {
            SockAddr::try_init(|storage, len| {
                let ll = (*storage).view_as::<libc::sockaddr_ll>();
                ll.sll_family = libc::AF_PACKET as u16;
                ll.sll_ifindex = i32::try_from(index).unwrap_or(0);
                ll.sll_halen = 6;
                *len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
                Ok(())
            })?
        };
        for frame in frames {
            sock.send_to(&frame, &addr)?;
        }
        Ok(())
    })
}

async fn spoofing_and_ipv6(h: &mut Harness) -> anyhow::Result<()> {
    let s = h.config.address_pool.octets()[1];
    let public = Ipv4Addr::new(198, 51, 100, s);
    let outside = Outside::new(h, &[public]).await?;
    let to_outside = SocketAddrV4::new(public, outside.listeners().udp_port);
    let (a, b, g) = (SandboxId::new(), SandboxId::new(), SandboxId::new());
    let addr_a = create(h, a, "base", Egress::Public).await?;
    let addr_b = create(h, b, "base", Egress::Public).await?;
    let addr_g = create(h, g, "base-gvisor", Egress::Public).await?;
    let (names, veth) = (h.names(a), h.names(a).veth_host);

    // The host side of the veth speaks no IPv6 and filters by reverse path.
    for (sysctl, want) in berth_hostd::netns::HOST_SIDE_SYSCTLS {
        let path = format!("/proc/sys/net/{}", sysctl.replace("{if}", &veth));
        let got = std::fs::read_to_string(&path)?;
        ensure!(got.trim() == *want, "{path} is {got}, not {want}");
    }
    let v6 = run("ip", &["-6", "-o", "addr", "show", "dev", &veth]).await?;
    ensure!(
        v6.trim().is_empty(),
        "the host side has IPv6 addresses: {v6}"
    );

    // The sandbox's eth0 has a usable link-local address (the source of its RA below).
    let own_link_local = {
        let ns = names.netns.clone();
        let mut found = None;
        eventually("the sandbox's link-local address is usable", || {
            let ns = ns.clone();
            async move {
                run(
                    "ip",
                    &[
                        "-n", &ns, "-6", "-o", "addr", "show", "dev", "eth0", "scope", "link",
                    ],
                )
                .await
                .is_ok_and(|o| o.contains("fe80") && !o.contains("tentative"))
            }
        })
        .await;
        let out = run(
            "ip",
            &[
                "-n",
                &names.netns,
                "-6",
                "-o",
                "addr",
                "show",
                "dev",
                "eth0",
                "scope",
                "link",
            ],
        )
        .await?;
        for word in out.split_whitespace() {
            if let Some(addr) = word
                .strip_prefix("fe80")
                .and_then(|_| word.split('/').next())
            {
                found = Some(addr.to_owned());
            }
        }
        found.context("no link-local address")?
    };
    // IPv6 link-local to a host listener on [::] fails; the control, a listener in the
    // sandbox's own namespace on its own link-local address, is reached the same way.
    let (tcp6, udp6) = Listeners::bind(true)?;
    let host6 = Listeners::spawn(tcp6, udp6)?;
    let (ctl_tcp, ctl_udp) = in_netns(netns_path(&names.netns), || Listeners::bind(true))?;
    let in_sandbox = Listeners::spawn(ctl_tcp, ctl_udp)?;
    let control = format!("[{own_link_local}%eth0]:{}", in_sandbox.tcp_port);
    let to_host = format!("[{}]:{}", link_local_of(&veth)?, host6.tcp_port);
    let got = reached(h, a, &[control.clone(), to_host]).await?;
    ensure!(
        got == BTreeSet::from([control]),
        "link-local probes reached {got:?}"
    );
    ensure!(
        logged(&host6.log).is_empty(),
        "the host got {:?}",
        logged(&host6.log)
    );

    // The control: the same Router Advertisement configures an interface that accepts it.
    let tag = &h.subjects.prefix()[1..9];
    let control = format!("bra-{tag}");
    let prefix_control = Ipv6Addr::new(0x2001, 0xdb8, u16::from(s), 1, 0, 0, 0, 0);
    let control_ok = async {
        run("ip", &["netns", "add", &control]).await?;
        run(
            "ip",
            &[
                "-n", &control, "link", "add", "ra0", "type", "veth", "peer", "name", "ra1",
            ],
        )
        .await?;
        // No duplicate address detection: ra0's link-local is usable as a source at once.
        run(
            "ip",
            &[
                "netns",
                "exec",
                &control,
                "sysctl",
                "-qw",
                "net.ipv6.conf.ra0.accept_dad=0",
            ],
        )
        .await?;
        for dev in ["ra0", "ra1"] {
            run("ip", &["-n", &control, "link", "set", dev, "up"]).await?;
        }
        let index = ifindex(&control, "ra0").await?;
        let prefix = format!("{:x}:{:x}:{:x}:{:x}:", 0x2001, 0xdb8, s, 1);
        eventually("the control interface takes the advertised prefix", || {
            let _ = send_ra(&control, index, prefix_control);
            let control = control.clone();
            let prefix = prefix.clone();
            async move {
                run("ip", &["-n", &control, "-6", "addr", "show", "dev", "ra1"])
                    .await
                    .is_ok_and(|o| o.contains(&prefix))
            }
        })
        .await;
        // The same for the hand-built frame the gVisor sandbox's part sends below.
        let ra0_mac = mac_of(Some(&control), "ra0").await?;
        let prefix_frame = Ipv6Addr::new(0x2001, 0xdb8, u16::from(s), 3, 0, 0, 0, 0);
        let prefix = format!("{:x}:{:x}:{:x}:{:x}:", 0x2001, 0xdb8, s, 3);
        eventually(
            "the control interface takes the prefix of a hand-built RA frame",
            || {
                let _ = send_frames(&control, index, vec![ra_frame(ra0_mac, prefix_frame)]);
                let control = control.clone();
                let prefix = prefix.clone();
                async move {
                    run("ip", &["-n", &control, "-6", "addr", "show", "dev", "ra1"])
                        .await
                        .is_ok_and(|o| o.contains(&prefix))
                }
            },
        )
        .await;
        anyhow::Ok(())
    }
    .await;
    run_quietly("ip", &["netns", "del", &control]);
    control_ok?;

    // From the sandbox: an RA, two spoofed datagrams (another sandbox's source, a public
    // source), then a genuine one. The genuine one arriving means the others were judged.
    let prefix = Ipv6Addr::new(0x2001, 0xdb8, u16::from(s), 2, 0, 0, 0, 0);
    let index = ifindex(&names.netns, "eth0").await?;
    send_ra(&names.netns, index, prefix).context("send an RA from the sandbox")?;
    send_udp_from(&names.netns, addr_b, to_outside, "spoofed-sandbox")
        .context("spoof another sandbox")?;
    send_udp_from(
        &names.netns,
        Ipv4Addr::new(198, 51, 100, 77),
        to_outside,
        "spoofed-public",
    )
    .context("spoof a public source")?;
    // Toward the host too: a spoofed source does not open its input either.
    let (tcp, udp) = Listeners::bind(false)?;
    let host = Listeners::spawn(tcp, udp)?;
    let gateway = Ipv4Addr::from(u32::from(addr_a) - 1);
    send_udp_from(
        &names.netns,
        public,
        SocketAddrV4::new(gateway, host.udp_port),
        "spoofed-to-host",
    )
    .context("spoof toward the host")?;
    send_udp_from(&names.netns, addr_a, to_outside, "genuine").context("send a genuine one")?;
    let log = outside.listeners().log.clone();
    eventually("the genuine datagram arrives", || {
        let log = log.clone();
        async move { logged(&log).iter().any(|(_, _, t)| t == "genuine") }
    })
    .await;
    let got = logged(&log);
    ensure!(
        got.iter().all(|(_, _, t)| !t.starts_with("spoofed")),
        "a spoofed datagram arrived: {got:?}"
    );
    ensure!(
        got.iter()
            .any(|(peer, _, t)| t == "genuine" && *peer == IpAddr::V4(addr_a)),
        "the genuine datagram came from elsewhere: {got:?}"
    );
    ensure!(
        logged(&host.log).is_empty(),
        "the host got {:?}",
        logged(&host.log)
    );

    // gVisor: its netstack writes frames to eth0 with a packet socket; the same frames, built
    // by hand, carry an RA and spoofed sources (another sandbox's, a public one), then a
    // genuine datagram.
    let names_g = h.names(g);
    let veth_g = names_g.veth_host.clone();
    let host_mac = mac_of(None, &veth_g).await?;
    let g_mac = mac_of(Some(&names_g.netns), "eth0").await?;
    let index_g = ifindex(&names_g.netns, "eth0").await?;
    let prefix_g = Ipv6Addr::new(0x2001, 0xdb8, u16::from(s), 4, 0, 0, 0, 0);
    let frame = |source: Ipv4Addr, payload: &str| {
        udp_frame(host_mac, g_mac, source, to_outside, payload.as_bytes())
    };
    send_frames(
        &names_g.netns,
        index_g,
        vec![
            ra_frame(g_mac, prefix_g),
            frame(addr_a, "g-spoofed-sandbox"),
            frame(Ipv4Addr::new(198, 51, 100, 78), "g-spoofed-public"),
            frame(addr_g, "g-genuine"),
        ],
    )
    .context("send frames from the gVisor sandbox's eth0")?;
    eventually("the gVisor sandbox's genuine datagram arrives", || {
        let log = log.clone();
        async move { logged(&log).iter().any(|(_, _, t)| t == "g-genuine") }
    })
    .await;
    let got = logged(&log);
    ensure!(
        got.iter().all(|(_, _, t)| !t.starts_with("g-spoofed")),
        "a spoofed frame arrived: {got:?}"
    );
    ensure!(
        got.iter()
            .any(|(peer, _, t)| t == "g-genuine" && *peer == IpAddr::V4(addr_g)),
        "the genuine frame came from elsewhere: {got:?}"
    );

    // Neither RA changed anything on the host: no address, no route, nothing on the veths.
    let addrs = run("ip", &["-6", "-o", "addr", "show"]).await?;
    let routes = run("ip", &["-6", "route", "show"]).await?;
    for (n, veth) in [(2, &veth), (4, &veth_g)] {
        let prefix_text = format!("{:x}:{:x}:{:x}:{:x}:", 0x2001, 0xdb8, s, n);
        ensure!(
            !addrs.contains(&prefix_text) && !addrs.contains(veth.as_str()),
            "the RA added an address: {addrs}"
        );
        ensure!(
            !routes.contains(&prefix_text) && !routes.contains(veth.as_str()),
            "the RA added a route: {routes}"
        );
    }

    for sandbox in [a, b, g] {
        let deleted = h.send(&h.command(sandbox, 2, CommandKind::Delete)).await?;
        ensure!(matches!(deleted.outcome, ResultOutcome::Succeeded { .. }));
    }
    drop(outside);
    Ok(())
}
