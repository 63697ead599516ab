//! The two implementations of [`crate::host::Backend`], everything a real host and a sim host
//! do differently: [`oci`] (runc/runsc, netns, overlay, nftables, cgroups, the in-sandbox
//! agent) and [`sim`] (control-plane load only). The trait itself lives beside the `Host` it
//! extends, so the host depends on neither.

pub mod oci;
pub mod sim;
