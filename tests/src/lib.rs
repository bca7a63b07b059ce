//! The kvroute test harness: starts real processes (Envoy, the EPP, sim workers) on free loopback
//! ports, waits until each is ready, and kills them when dropped. Used by the end-to-end tests in
//! `tests/tests/` and by `kvroute-stack`, the process behind `./dev up`.

pub mod harness;
pub mod index_bench;
