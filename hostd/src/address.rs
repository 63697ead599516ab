//! Sandbox addresses: each sandbox gets a /30 out of the host's /16 pool; the host side of its
//! veth is `.1` of that /30 and the sandbox's `eth0` is `.2`.
//!
//! # Guarantees
//! - [`Allocator::reserve`] never hands one slot to two sandboxes of this hostd (one lock,
//!   held only for the in-memory table, never across I/O).
//! - A slot whose addresses are already configured on the machine (another hostd with an
//!   overlapping pool, a stray interface) is skipped when the caller passes it as `foreign`.
//! - A deleted sandbox's slot stays taken until its network is gone
//!   ([`Allocator::release_later`]): the kernel removes a deleted namespace's veth pair after
//!   the delete answered, and its host side holds the slot's address until then.
//!
//! The assignment is persisted in the sandbox record (as addresses, not only as a slot) so a
//! restart with a different pool keeps existing sandboxes reachable.

use std::collections::{BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use berth_schemas::SandboxId;
use serde::{Deserialize, Serialize};

use crate::error::HostdError;

/// The prefix length of the pool: a /16.
pub const POOL_PREFIX_LEN: u8 = 16;

/// The prefix length of one sandbox's link: a /30 (network, host side, sandbox, broadcast).
pub const LINK_PREFIX_LEN: u8 = 30;

/// Addresses per /30.
const ADDRESSES_PER_SLOT: u32 = 4;

/// How many /30s fit in the /16 pool.
pub const SLOTS_PER_POOL: u32 = (1 << (32 - POOL_PREFIX_LEN)) / ADDRESSES_PER_SLOT;

/// The index of one /30 in the pool, `0..SLOTS_PER_POOL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Slot(pub u32);

/// A sandbox's link addresses, as stored in its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkAddresses {
    /// Which /30 of the pool.
    pub slot: Slot,
    /// `.1` of the /30: the host-side veth, the sandbox's default gateway.
    pub host: Ipv4Addr,
    /// `.2` of the /30: the sandbox's `eth0`, where its agent listens.
    pub sandbox: Ipv4Addr,
}

/// A /16 pool of /30 links.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressPool {
    base: u32,
}

impl AddressPool {
    /// The pool containing `base`; host bits below the /16 are ignored.
    pub fn new(base: Ipv4Addr) -> Self {
        let mask = u32::MAX << (32 - POOL_PREFIX_LEN);
        Self {
            base: u32::from(base) & mask,
        }
    }

    /// The network address of the pool.
    pub fn base(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.base)
    }

    /// The addresses of `slot`. Panics if `slot` is outside the pool (a programming error).
    pub fn link(&self, slot: Slot) -> LinkAddresses {
        assert!(slot.0 < SLOTS_PER_POOL, "slot {} outside the pool", slot.0);
        let network = self.base + slot.0 * ADDRESSES_PER_SLOT;
        LinkAddresses {
            slot,
            host: Ipv4Addr::from(network + 1),
            sandbox: Ipv4Addr::from(network + 2),
        }
    }

    /// The slot `addr` falls in, if it is inside the pool.
    pub fn slot_of(&self, addr: Ipv4Addr) -> Option<Slot> {
        let offset = u32::from(addr).checked_sub(self.base)?;
        let slot = offset / ADDRESSES_PER_SLOT;
        (slot < SLOTS_PER_POOL).then_some(Slot(slot))
    }

    /// The lowest slot in neither `taken` nor `foreign`.
    pub fn first_free(&self, taken: &BTreeSet<Slot>, foreign: &BTreeSet<Slot>) -> Option<Slot> {
        (0..SLOTS_PER_POOL)
            .map(Slot)
            .find(|s| !taken.contains(s) && !foreign.contains(s))
    }
}

/// The table of this hostd's slot assignments.
#[derive(Debug)]
pub struct Allocator {
    pool: AddressPool,
    assigned: Mutex<HashMap<SandboxId, Assignment>>,
    tickets: AtomicU64,
}

/// One sandbox's slot, and the ticket of the release it waits for, if any.
#[derive(Debug, Clone, Copy)]
struct Assignment {
    link: LinkAddresses,
    releasing: Option<u64>,
}

/// A release waiting for a deleted sandbox's network to go ([`Allocator::release_later`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReleaseTicket {
    sandbox: SandboxId,
    ticket: u64,
}

impl Allocator {
    /// An allocator over `pool`, holding nothing yet.
    pub fn new(pool: AddressPool) -> Self {
        Self {
            pool,
            assigned: Mutex::new(HashMap::new()),
            tickets: AtomicU64::new(0),
        }
    }

    /// The pool it hands out from.
    pub fn pool(&self) -> AddressPool {
        self.pool
    }

    /// Records an assignment read back from a sandbox record (adoption after a restart).
    pub fn restore(&self, sandbox: SandboxId, link: LinkAddresses) {
        self.table().insert(
            sandbox,
            Assignment {
                link,
                releasing: None,
            },
        );
    }

    /// The sandbox's existing assignment (a release it was waiting for is called off), or a
    /// new one: the lowest slot no other sandbox of this hostd holds or waits to release and
    /// not in `foreign` (addresses already in use on the machine).
    ///
    /// Errors: [`HostdError::AddressPoolExhausted`].
    pub fn reserve(
        &self,
        sandbox: SandboxId,
        foreign: &BTreeSet<Slot>,
    ) -> Result<LinkAddresses, HostdError> {
        let mut table = self.table();
        if let Some(held) = table.get_mut(&sandbox) {
            held.releasing = None;
            return Ok(held.link);
        }
        // Slots of sandboxes restored from records of another pool can't collide with this
        // pool's slots by number; compare by address instead.
        let taken: BTreeSet<Slot> = table
            .values()
            .filter_map(|a| self.pool.slot_of(a.link.host))
            .collect();
        let slot =
            self.pool
                .first_free(&taken, foreign)
                .ok_or(HostdError::AddressPoolExhausted {
                    pool: self.pool.base(),
                })?;
        let link = self.pool.link(slot);
        table.insert(
            sandbox,
            Assignment {
                link,
                releasing: None,
            },
        );
        Ok(link)
    }

    /// Returns the sandbox's slot to the pool; a no-op when it holds none.
    pub fn release(&self, sandbox: SandboxId) {
        self.table().remove(&sandbox);
    }

    /// Marks the sandbox's slot to be returned once its network is gone; the slot stays taken
    /// until [`Allocator::finish_release`] with the ticket, unless the sandbox claims it again
    /// first ([`Allocator::reserve`], [`Allocator::restore`]), which calls the release off.
    /// `None` when it holds no slot.
    pub fn release_later(&self, sandbox: SandboxId) -> Option<ReleaseTicket> {
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let mut table = self.table();
        let held = table.get_mut(&sandbox)?;
        held.releasing = Some(ticket);
        Some(ReleaseTicket { sandbox, ticket })
    }

    /// Returns the slot of a [`Allocator::release_later`] that was not called off since.
    pub fn finish_release(&self, release: ReleaseTicket) {
        let mut table = self.table();
        if table
            .get(&release.sandbox)
            .is_some_and(|held| held.releasing == Some(release.ticket))
        {
            table.remove(&release.sandbox);
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Assignment>> {
        // A panic while holding this lock cannot leave the map half-updated (single inserts
        // and removes), so a poisoned lock is still consistent.
        self.assigned.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The IPv4 addresses in `ip -o -4 addr show` output (`... inet 10.0.0.1/24 brd ...`).
pub fn parse_ip_addr_output(output: &str) -> Vec<Ipv4Addr> {
    output
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            words.find(|w| *w == "inet")?;
            let cidr = words.next()?;
            cidr.split('/').next()?.parse().ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> AddressPool {
        AddressPool::new(Ipv4Addr::new(10, 200, 0, 0))
    }

    #[test]
    fn slot_n_is_the_nth_slash_30_with_host_dot_1_and_sandbox_dot_2() {
        let link = pool().link(Slot(3));
        assert_eq!(link.host, Ipv4Addr::new(10, 200, 0, 13));
        assert_eq!(link.sandbox, Ipv4Addr::new(10, 200, 0, 14));
        let last = pool().link(Slot(SLOTS_PER_POOL - 1));
        assert_eq!(last.sandbox, Ipv4Addr::new(10, 200, 255, 254));
    }

    #[test]
    fn a_pool_base_with_host_bits_is_masked_to_the_slash_16() {
        assert_eq!(
            AddressPool::new(Ipv4Addr::new(10, 9, 8, 7)).base(),
            Ipv4Addr::new(10, 9, 0, 0)
        );
    }

    #[test]
    fn slot_of_maps_every_address_of_a_link_back_to_its_slot() {
        let p = pool();
        for a in 0..4 {
            assert_eq!(p.slot_of(Ipv4Addr::new(10, 200, 0, 8 + a)), Some(Slot(2)));
        }
        assert_eq!(p.slot_of(Ipv4Addr::new(10, 201, 0, 1)), None);
        assert_eq!(p.slot_of(Ipv4Addr::new(10, 199, 255, 255)), None);
    }

    #[test]
    fn each_sandbox_gets_a_distinct_slot_and_keeps_it() {
        let alloc = Allocator::new(pool());
        let (a, b) = (SandboxId::new(), SandboxId::new());
        let la = alloc.reserve(a, &BTreeSet::new()).unwrap();
        let lb = alloc.reserve(b, &BTreeSet::new()).unwrap();
        assert_ne!(la.slot, lb.slot);
        assert_eq!(alloc.reserve(a, &BTreeSet::new()).unwrap(), la);
    }

    #[test]
    fn a_slot_released_later_stays_taken_until_the_release_finishes() {
        let alloc = Allocator::new(pool());
        let a = SandboxId::new();
        let first = alloc.reserve(a, &BTreeSet::new()).unwrap();
        let release = alloc.release_later(a).unwrap();
        let other = alloc.reserve(SandboxId::new(), &BTreeSet::new()).unwrap();
        assert_ne!(other.slot, first.slot, "taken while the network goes");
        alloc.finish_release(release);
        let again = alloc.reserve(SandboxId::new(), &BTreeSet::new()).unwrap();
        assert_eq!(again.slot, first.slot);
    }

    #[test]
    fn a_sandbox_claiming_its_slot_again_calls_its_pending_release_off() {
        let alloc = Allocator::new(pool());
        let a = SandboxId::new();
        let first = alloc.reserve(a, &BTreeSet::new()).unwrap();
        let stale = alloc.release_later(a).unwrap();
        // Created here again (a migration back) before the old network went.
        assert_eq!(alloc.reserve(a, &BTreeSet::new()).unwrap(), first);
        alloc.finish_release(stale);
        assert_eq!(
            alloc.reserve(a, &BTreeSet::new()).unwrap(),
            first,
            "still its"
        );
        let other = alloc.reserve(SandboxId::new(), &BTreeSet::new()).unwrap();
        assert_ne!(other.slot, first.slot);
        // A second delete's release is its own: the first one's ticket does not finish it.
        let second = alloc.release_later(a).unwrap();
        alloc.finish_release(stale);
        assert_ne!(
            alloc
                .reserve(SandboxId::new(), &BTreeSet::new())
                .unwrap()
                .slot,
            first.slot
        );
        alloc.finish_release(second);
        assert_eq!(
            alloc
                .reserve(SandboxId::new(), &BTreeSet::new())
                .unwrap()
                .slot,
            first.slot
        );
    }

    #[test]
    fn a_released_slot_is_reused() {
        let alloc = Allocator::new(pool());
        let a = SandboxId::new();
        let first = alloc.reserve(a, &BTreeSet::new()).unwrap();
        alloc.release(a);
        let again = alloc.reserve(SandboxId::new(), &BTreeSet::new()).unwrap();
        assert_eq!(first.slot, again.slot);
    }

    #[test]
    fn foreign_and_restored_slots_are_skipped() {
        let alloc = Allocator::new(pool());
        alloc.restore(SandboxId::new(), pool().link(Slot(0)));
        let foreign = BTreeSet::from([Slot(1)]);
        assert_eq!(
            alloc.reserve(SandboxId::new(), &foreign).unwrap().slot,
            Slot(2)
        );
    }

    #[test]
    fn an_exhausted_pool_is_an_error() {
        let p = pool();
        let taken: BTreeSet<Slot> = (0..SLOTS_PER_POOL).map(Slot).collect();
        assert_eq!(p.first_free(&taken, &BTreeSet::new()), None);
        let alloc = Allocator::new(p);
        assert!(matches!(
            alloc.reserve(SandboxId::new(), &taken),
            Err(HostdError::AddressPoolExhausted { .. })
        ));
    }

    #[test]
    fn ip_addr_output_is_parsed_into_addresses() {
        let out = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n\
                   4: eth0    inet 172.16.0.2/24 brd 172.16.0.255 scope global eth0\n";
        assert_eq!(
            parse_ip_addr_output(out),
            vec![Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(172, 16, 0, 2)]
        );
    }
}
