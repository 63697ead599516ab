//! Webhooks: their bodies and validation ([`model`]), the SQL on the webhook tables, which only
//! the API owns ([`store`]), the delivery worker ([`delivery`]), where it may deliver
//! ([`target`]) and signing ([`signature`]).
//! The routes are [`crate::http::webhooks`]; the use cases [`crate::service::webhooks`].

pub mod delivery;
pub mod model;
pub mod signature;
pub mod store;
pub mod target;
