//! Before a gVisor checkpoint: wait until the host's TCP connections with the sandbox have
//! finished closing, instead of a fixed pause.
//!
//! gVisor refuses to save a connected TCP endpoint, `CLOSE_WAIT` and `LAST_ACK` included
//! (see `runtime::runsc`). The host closes its connections to the agent first, so the
//! agent's side ends in `LAST_ACK` until the host's final ACK arrives. The host side tells
//! how far that got: a connection it holds in `TIME_WAIT` received the sandbox's FIN and
//! acknowledged it at once; one in `ESTABLISHED`, `FIN_WAIT1/2`, `CLOSING`, `CLOSE_WAIT` or
//! `LAST_ACK` has not finished. [`settle`] polls the host's `/proc/net/tcp{,6}` until no
//! connection with the sandbox's address is in such a state (one left waiting for the
//! sandbox's ACK past [`ACK_PATIENCE`] has no live peer, and does not count), then leaves
//! the last ACK [`ACK_GRACE`] to arrive. It replaced a fixed 200 ms pause, most of a memory
//! stop's time after the keeper (issue 16).
//!
//! Source: RFC 9293 §3.3.2 (the state machine); Linux `Documentation/networking/proc_net_tcp.rst`
//! (the `/proc/net/tcp` format: addresses as the `%08X` of the network-order word, `st` in hex).

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

/// The longest [`settle`] waits for the connections to close; past it the checkpoint goes
/// ahead (and fails on a connection still open, falling back to disk: a user's long-lived
/// preview connection, for one).
pub const SETTLE_LIMIT: Duration = Duration::from_millis(500);

/// After the last host-side connection reached `TIME_WAIT`: time for its ACK, sent on the
/// veth as the FIN arrived, to reach the sandbox's network stack.
pub const ACK_GRACE: Duration = Duration::from_millis(10);

/// How often [`settle`] looks.
const POLL: Duration = Duration::from_millis(2);

/// The `/proc/net/tcp` states of a connection that is closed on the host side, or never
/// was one: `TIME_WAIT` (06), `CLOSE` (07), `LISTEN` (0A).
const SETTLED: [u8; 3] = [0x06, 0x07, 0x0A];

/// The states in which the host waits only for the peer to acknowledge its FIN:
/// `FIN_WAIT1` (04), `LAST_ACK` (09), `CLOSING` (0B). A live sandbox acknowledges within a
/// round trip; one such connection that stays so for [`ACK_PATIENCE`] is with no live
/// endpoint, most often with an earlier sandbox that had the same address (a slot is handed
/// out again once its veth is gone, and the kernel retransmits a FIN to a dead peer for
/// minutes), and is not waited for (the bench: every memory stop of a sandbox on a reused
/// address waited the whole limit).
const PEER_ACK_WAITS: [u8; 3] = [0x04, 0x09, 0x0B];

/// How long a connection may wait for the peer's ACK before it counts as with no live peer.
pub const ACK_PATIENCE: Duration = Duration::from_millis(100);

/// One host connection with the sandbox that is not settled: `local remote` (its key in the
/// table) and its state.
type Row = (String, u8);

/// Waits until no host connection with `sandbox` is still closing (or open), at most
/// [`SETTLE_LIMIT`], then [`ACK_GRACE`]. Returns whether it settled within the limit.
pub async fn settle(sandbox: Ipv4Addr) -> bool {
    let started = Instant::now();
    let mut waiting_for_ack = HashMap::new();
    loop {
        let rows = tokio::task::spawn_blocking(move || open_connections(sandbox))
            .await
            .unwrap_or_else(|_| vec![("unreadable".into(), 0)]);
        let open = still_open(&rows, &mut waiting_for_ack, Instant::now());
        if open == 0 {
            tokio::time::sleep(ACK_GRACE).await;
            return true;
        }
        if started.elapsed() >= SETTLE_LIMIT {
            tracing::warn!(open, waited = ?SETTLE_LIMIT, "connections with the sandbox still open; checkpointing anyway");
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// [`settle`] on the sandbox's address; without one (no network known), [`SETTLE_LIMIT`].
pub async fn before_checkpoint(link: Option<crate::address::LinkAddresses>) {
    match link {
        Some(link) => {
            settle(link.sandbox).await;
        }
        None => tokio::time::sleep(SETTLE_LIMIT).await,
    }
}

/// How many of `rows` still count as open at `now`: all but those waiting for the peer's ACK
/// ([`PEER_ACK_WAITS`]) since at least [`ACK_PATIENCE`], by when each was first seen so
/// (`first_seen`, kept between polls).
fn still_open(rows: &[Row], first_seen: &mut HashMap<String, Instant>, now: Instant) -> usize {
    rows.iter()
        .filter(|(key, state)| {
            if !PEER_ACK_WAITS.contains(state) {
                return true;
            }
            let since = *first_seen.entry(key.clone()).or_insert(now);
            now.duration_since(since) < ACK_PATIENCE
        })
        .count()
}

/// The host's TCP sockets (IPv4, and IPv4-mapped IPv6) that have `sandbox` as their remote
/// address in a state not [`SETTLED`]. A table that cannot be read counts as one open row.
fn open_connections(sandbox: Ipv4Addr) -> Vec<Row> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .flat_map(|table| match std::fs::read_to_string(table) {
            Ok(text) => unsettled(&text, sandbox),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(_) => vec![(format!("unreadable {table}"), 0)],
        })
        .collect()
}

/// The rows of one `/proc/net/tcp{,6}` table that are with `sandbox` and not [`SETTLED`].
fn unsettled(table: &str, sandbox: Ipv4Addr) -> Vec<Row> {
    table
        .lines()
        .skip(1)
        .filter_map(|row| {
            let mut fields = row.split_whitespace().skip(1);
            let local = fields.next()?;
            let remote = fields.next()?;
            let state = u8::from_str_radix(fields.next()?, 16).ok()?;
            (remote_v4(remote.split(':').next()?)? == sandbox && !SETTLED.contains(&state))
                .then(|| (format!("{local} {remote}"), state))
        })
        .collect()
}

/// The IPv4 address of a table's hex address column: 8 digits, or 32 for an IPv4-mapped
/// IPv6 address (`::ffff:a.b.c.d`, its last word the IPv4 one); `None` for other IPv6.
fn remote_v4(hex: &str) -> Option<Ipv4Addr> {
    let word = match hex.len() {
        8 => hex,
        32 if hex[..24].eq_ignore_ascii_case("0000000000000000FFFF0000") => &hex[24..],
        _ => return None,
    };
    // The kernel prints the network-order word as a native integer.
    let word = u32::from_str_radix(word, 16).ok()?;
    Some(Ipv4Addr::from(word.to_ne_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On this (little-endian) machine's format.
    const TABLE: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:0CEA 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 01004D0A:A1B2 02004D0A:46AF 06 00000000:00000000 03:00000F9A 00000000     0        0 0 3 0000000000000000
   2: 01004D0A:A1B4 02004D0A:46AF 05 00000000:00000000 00:00000000 00000000     0        0 2 1 0000000000000000 20 4 0 10 -1
   3: 01004D0A:A1B6 06004D0A:46AF 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0000000000000000 20 4 0 10 -1
";

    #[test]
    #[cfg(target_endian = "little")]
    fn only_connections_with_the_sandbox_that_are_still_closing_count() {
        let sandbox: Ipv4Addr = "10.77.0.2".parse().unwrap();
        // Row 1 is in TIME_WAIT, row 2 in FIN_WAIT2 (counted), row 3 another sandbox's.
        assert_eq!(
            unsettled(TABLE, sandbox),
            vec![("01004D0A:A1B4 02004D0A:46AF".to_owned(), 0x05)]
        );
        assert_eq!(unsettled(TABLE, "10.77.0.6".parse().unwrap()).len(), 1);
        assert!(unsettled(TABLE, "10.77.0.10".parse().unwrap()).is_empty());
    }

    #[test]
    fn a_connection_waiting_for_the_peers_ack_counts_only_for_the_patience() {
        let start = Instant::now();
        let mut seen = HashMap::new();
        let rows = vec![
            ("a".to_owned(), 0x04), // FIN_WAIT1: waits for the peer's ACK
            ("b".to_owned(), 0x05), // FIN_WAIT2: waits for the peer's FIN
            ("c".to_owned(), 0x01), // ESTABLISHED
        ];
        assert_eq!(still_open(&rows, &mut seen, start), 3);
        let later = start + ACK_PATIENCE;
        assert_eq!(
            still_open(&rows, &mut seen, later),
            2,
            "a's peer never answered"
        );
        // A connection that comes to wait for an ACK later gets its own patience.
        let rows = vec![("d".to_owned(), 0x09)];
        assert_eq!(still_open(&rows, &mut seen, later), 1);
        assert_eq!(still_open(&rows, &mut seen, later + ACK_PATIENCE), 0);
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn an_ipv4_mapped_address_is_read_and_other_ipv6_is_not() {
        assert_eq!(
            remote_v4("0000000000000000FFFF000002004D0A"),
            Some("10.77.0.2".parse().unwrap())
        );
        assert_eq!(remote_v4("00000000000000000000000001000000"), None);
        assert_eq!(remote_v4("02004D0A"), Some("10.77.0.2".parse().unwrap()));
    }

    #[tokio::test]
    async fn a_connection_held_open_keeps_the_settle_waiting_and_its_close_ends_it() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let loopback = Ipv4Addr::LOCALHOST;
        assert!(
            !open_connections(loopback).is_empty(),
            "an established connection counts"
        );
        // The client closes first, as hostd does: it ends in TIME_WAIT, the server's side
        // (closed after it) is gone; every loopback socket of this test is then settled
        // unless another test of this process holds one open.
        drop(client);
        drop(server);
        let settled = tokio::time::timeout(Duration::from_secs(5), async {
            while unsettled_of_port(listener.local_addr().unwrap().port()) > 0 {
                tokio::time::sleep(POLL).await;
            }
        })
        .await;
        assert!(settled.is_ok(), "the closed connection still counts");
    }

    /// [`open_connections`] for one loopback port (either end), so other tests' loopback
    /// connections do not count.
    fn unsettled_of_port(port: u16) -> usize {
        let text = std::fs::read_to_string("/proc/net/tcp").unwrap();
        let port = format!(":{port:04X}");
        let mine: String = std::iter::once(text.lines().next().unwrap_or(""))
            .chain(text.lines().skip(1).filter(|row| row.contains(&port)))
            .collect::<Vec<_>>()
            .join("\n");
        unsettled(&mine, Ipv4Addr::LOCALHOST).len()
    }
}
