//! kvroute worker shims.

pub mod events;
pub mod sim;
