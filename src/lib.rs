//! The library half of the root package: what `berth` (the binary) and the end-to-end tests
//! share: the in-process control plane, [`stack`], and issuing NATS credentials and server
//! configs, [`nats_access`]; the operator's circuit breaker commands, [`breaker_admin`]; the
//! removal of what a `berth hostd` child process left on the machine, [`host_leftovers`].

pub mod breaker_admin;
pub mod host_leftovers;
pub mod hostd_child;
pub mod image_puller;
pub mod nats_access;
pub mod org_admin;
pub mod stack;
pub mod timing_args;
