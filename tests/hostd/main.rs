//! The host daemon against the real runc/runsc, overlayfs, network namespaces, nftables and
//! NATS: a sandbox's runtime life, gVisor memory stops, the sandbox boundary (seccomp, user
//! namespace, raw sockets, masked paths, the agent's memory), network isolation and egress,
//! agent requests, and files and exec through the API into a real sandbox.

#[path = "../support/mod.rs"]
mod support;

mod agent;
mod boundary;
mod bounds;
mod crash;
mod disk;
mod egress;
mod gvisor;
mod harness;
mod images;
mod io;
mod keeper;
mod kept;
mod migrate;
mod network;
mod runc;
mod spoofing;
mod statefile;
mod tools;
mod warm;
