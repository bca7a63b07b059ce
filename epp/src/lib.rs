//! kvroute endpoint picker (EPP): a GAIE `ext_proc` server that routes each inference request to
//! the worker with the lowest KV-aware cost, from an exact index of the workers' KV cache events.
//!
//! Layout: `extproc` speaks the gateway protocol; `picker` makes one decision from `policy`,
//! `index` (KV blocks), `load` (bookings + reports) and `pool` (workers); `ingest` keeps those in
//! step with what `discovery` lists; `health` and `metrics` face the operator; the binary wires it up.

pub mod discovery;
pub mod extproc;
pub mod health;
pub mod index;
pub mod ingest;
pub mod load;
pub mod metrics;
pub mod picker;
pub mod policy;
pub mod pool;
