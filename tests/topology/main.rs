//! Berth spread over a network, on the multi-host topology of `deploy/topology` (three
//! clustered nats-server with R3 streams, two APIs, two reconcilers, hostd in their own network
//! namespaces): it comes up and runs sandboxes (`smoke.rs`), and it loses nothing when its
//! parts fail under load (`faults.rs`). One topology at a time: each test holds [`SERIAL`].
//!
//! The faults that run on every push are plain tests; the long ones are `#[ignore]`d and run
//! by `deploy/test-faults` (tests/README.md says which and why).

#[path = "../support/mod.rs"]
mod support;

mod faults;
mod faults_long;
mod impair;
mod kit;
mod load;
mod relay;
mod smoke;

/// Held by every test of this binary for its whole run: a topology is eleven processes and
/// its load runs real containers; two at once would only measure the machine.
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The API limits of a topology under test: the load polls both APIs from one address much
/// faster than a client should, and a 429 would be counted as a refusal the fault caused.
pub const NO_RATE_LIMITS: [(&str, &str); 4] = [
    ("BERTH_RATE_PER_IP", "100000"),
    ("BERTH_RATE_PER_IP_BURST", "100000"),
    ("BERTH_RATE_PER_KEY", "100000"),
    ("BERTH_RATE_PER_KEY_BURST", "100000"),
];
