//! The simulated inference engine (a Dynamo-mocker-compatible engine core).
//!
//! - [`block_manager`]: paged KV cache with prefix caching, refcounts, LRU eviction and the KV
//!   events those changes imply;
//! - [`timing`]: the mocker's analytic prefill / decode step times and a virtual clock;
//! - [`scheduler`]: the continuous-batching scheduler task of one dp rank (chunked prefill,
//!   preemption, cancellation);
//! - [`engine`]: the public [`SimEngine`] API the HTTP layer and the control service use.

pub mod block_manager;
pub mod engine;
pub mod scheduler;
pub mod timing;

pub use engine::{
    EngineError, EngineOutput, EngineRequest, FinishReason, PrefixHold, RankStats, SimConfig,
    SimEngine, TimedOutput,
};
