//! Which accepted TCP connections a listener serves: at most a total number open at once, and
//! at most a number of them from one client address. Shared by the API's listener
//! ([`crate::server`]) and `berth proxy`'s ([`crate::preview::server`]), each with its own
//! metric names.
//!
//! # Guarantees
//! - At most `max_connections` admitted connections are open at once (0: no cap), and at most
//!   `max_connections_per_ip` of them come from one client address (0: no cap; IPv6 addresses
//!   count by their /64, [`crate::limits::client_of`]), so a flood of idle connections cannot
//!   hold the process's file descriptors or memory, and one client cannot take every slot.
//! - An [`Admitted`] gives its slots back when dropped, whatever way its connection ended.
//! - A request head carries at most [`MAX_REQUEST_HEADERS`] header fields and
//!   [`MAX_REQUEST_HEAD_BYTES`] bytes, on HTTP/1.1 and on HTTP/2 alike ([`too_many_headers`] for
//!   what HTTP/2's own settings cannot count); beyond either the client gets `431` and nothing
//!   is forwarded. Without the count, an h2c client could push hundreds of small headers
//!   through the preview proxy to a sandbox (HTTP/1.1 parsers cap the count, HTTP/2's only the
//!   bytes).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The most header fields one request may carry (hyper's HTTP/1.1 default, now also applied
/// to HTTP/2).
pub const MAX_REQUEST_HEADERS: usize = 100;
/// The most bytes of request head (HTTP/1.1: hyper's `max_header_size` on the API's listener,
/// and the read buffer the head must fit in on both; HTTP/2: `SETTINGS_MAX_HEADER_LIST_SIZE`). 32 KiB is nginx's default (`large_client_header_buffers`
/// 4 × 8k) and holds any browser's cookies.
pub const MAX_REQUEST_HEAD_BYTES: usize = 32 * 1024;

/// Whether `headers` has more fields than [`MAX_REQUEST_HEADERS`]: such a request is answered
/// `431` (HTTP/2 announces only a byte bound, so its field count is checked here).
pub fn too_many_headers(headers: &axum::http::HeaderMap) -> bool {
    headers.len() > MAX_REQUEST_HEADERS
}

/// The metric names one listener reports under.
#[derive(Clone, Copy, Debug)]
pub struct AdmissionMetrics {
    /// Gauge of the connections open now.
    pub open: &'static str,
    /// Counter of the connections closed at accept, labelled `reason` (`per_ip`, `total`).
    pub refused: &'static str,
}

/// The API listener's metrics: `berth_api_connections`, `berth_api_connections_refused_total`.
pub const API_METRICS: AdmissionMetrics = AdmissionMetrics {
    open: "berth_api_connections",
    refused: "berth_api_connections_refused_total",
};

/// The preview proxy's metrics: `berth_proxy_connections`,
/// `berth_proxy_connections_refused_total`.
pub const PROXY_METRICS: AdmissionMetrics = AdmissionMetrics {
    open: "berth_proxy_connections",
    refused: "berth_proxy_connections_refused_total",
};

/// One listener's connection caps.
#[derive(Debug)]
pub struct Admission {
    slots: Arc<Semaphore>,
    per_ip: Arc<PerIp>,
    max_per_ip: usize,
    metrics: AdmissionMetrics,
}

/// One admitted connection's slots; given back when dropped.
#[derive(Debug)]
pub struct Admitted {
    _slot: OwnedSemaphorePermit,
    _ip: IpSlot,
    open: &'static str,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        metrics::gauge!(self.open).decrement(1.0);
    }
}

impl Admission {
    /// Caps of `max_connections` in all and `max_connections_per_ip` per client address (0:
    /// no cap), reported under `metrics`.
    pub fn new(
        max_connections: usize,
        max_connections_per_ip: usize,
        metrics: AdmissionMetrics,
    ) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(match max_connections {
                0 => Semaphore::MAX_PERMITS,
                n => n.min(Semaphore::MAX_PERMITS),
            })),
            per_ip: Arc::new(PerIp::default()),
            max_per_ip: max_connections_per_ip,
            metrics,
        }
    }

    /// Slots for one more connection from `peer`, or `None` (counted, with its reason) when a
    /// cap is reached: the caller then closes the connection at once.
    pub fn admit(&self, peer: IpAddr) -> Option<Admitted> {
        let Some(ip) = PerIp::take(
            &self.per_ip,
            crate::limits::client_of(peer),
            self.max_per_ip,
        ) else {
            metrics::counter!(self.metrics.refused, "reason" => "per_ip").increment(1);
            return None;
        };
        let Ok(slot) = self.slots.clone().try_acquire_owned() else {
            metrics::counter!(self.metrics.refused, "reason" => "total").increment(1);
            return None;
        };
        metrics::gauge!(self.metrics.open).increment(1.0);
        Some(Admitted {
            _slot: slot,
            _ip: ip,
            open: self.metrics.open,
        })
    }
}

/// Open connections per client address.
#[derive(Debug, Default)]
struct PerIp {
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's place in [`PerIp`]; gives it back when dropped.
#[derive(Debug)]
struct IpSlot {
    table: Arc<PerIp>,
    ip: IpAddr,
}

impl PerIp {
    /// A slot for one more connection from `ip`, or `None` when it holds `cap` already (`cap`
    /// 0: no cap).
    fn take(table: &Arc<PerIp>, ip: IpAddr, cap: usize) -> Option<IpSlot> {
        let mut open = table
            .open
            .lock()
            .expect("the per-address table is never poisoned");
        let count = open.entry(ip).or_insert(0);
        if cap != 0 && *count >= cap {
            return None;
        }
        *count += 1;
        Some(IpSlot {
            table: table.clone(),
            ip,
        })
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut open = self
            .table
            .open
            .lock()
            .expect("the per-address table is never poisoned");
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEST_METRICS: AdmissionMetrics = AdmissionMetrics {
        open: "test_connections",
        refused: "test_connections_refused_total",
    };

    #[test]
    fn one_address_is_capped_and_its_slots_come_back_when_connections_end() {
        let admission = Admission::new(10, 2, TEST_METRICS);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let first = admission.admit(a).expect("first");
        let _second = admission.admit(a).expect("second");
        assert!(
            admission.admit(a).is_none(),
            "a third from one address is refused"
        );
        assert!(
            admission.admit(b).is_some(),
            "another address still gets in"
        );
        drop(first);
        assert!(
            admission.admit(a).is_some(),
            "a closed connection frees its slot"
        );
    }

    #[test]
    fn the_total_cap_holds_across_addresses_and_zero_means_no_cap() {
        let admission = Admission::new(2, 0, TEST_METRICS);
        let held: Vec<_> = (1..=2)
            .map(|i| {
                admission
                    .admit(IpAddr::from([192, 0, 2, i]))
                    .expect("under the cap")
            })
            .collect();
        assert!(admission.admit("192.0.2.9".parse().unwrap()).is_none());
        drop(held);
        let open = Admission::new(0, 0, TEST_METRICS);
        let many: Vec<_> = (0..1000)
            .map(|_| open.admit("192.0.2.1".parse().unwrap()))
            .collect();
        assert!(many.iter().all(Option::is_some));
    }

    #[test]
    fn ipv6_clients_count_by_their_64() {
        let admission = Admission::new(10, 1, TEST_METRICS);
        let _held = admission
            .admit("2001:db8::1".parse().unwrap())
            .expect("first");
        assert!(
            admission.admit("2001:db8::2".parse().unwrap()).is_none(),
            "another address of the same /64 is the same client"
        );
        assert!(admission
            .admit("2001:db8:0:1::1".parse().unwrap())
            .is_some());
    }
}
