//! The library half of the root package: what `berth` (the binary) and the end-to-end tests
//! share. Today that is the in-process control plane, [`stack`].

pub mod stack;
