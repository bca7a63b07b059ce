//! kvroute worker shims.

pub mod disagg;
pub mod events;
pub mod http;
pub mod metrics;
pub mod sim;
pub mod transfer;
