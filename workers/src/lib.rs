//! kvroute worker shims.
