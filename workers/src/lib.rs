//! kvroute worker shims.

pub mod events;
pub mod http;
pub mod metrics;
pub mod sim;
