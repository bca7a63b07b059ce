//! The worker's KV event stream: the per-rank event log with replay history and snapshots
//! ([`log`]) and the `WorkerControl` gRPC service that serves it, load and metadata
//! ([`service`]).

pub mod log;
pub mod service;

pub use log::{EventLog, EventLogConfig, Snapshot, SubscribeError, Subscription};
pub use service::{service, WorkerControlService};
