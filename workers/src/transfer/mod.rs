//! The worker's KV transfer agent (NIXL-shaped), used by disaggregated prefill/decode.
//!
//! - [`agent`]: [`Agent`] — memory registration, metadata exchange, descriptor-list reads
//!   with completion handles, notifications; the TCP server and client;
//! - [`frame`]: the length-prefixed wire frames and their panic-free decoder;
//! - [`cuda`]: the CUDA backend (device buffers, host staging) through cudarc, detected at run
//!   time.

pub mod agent;
pub mod cuda;
pub mod frame;

pub use agent::{
    coalesce, Agent, AgentConfig, AgentMetadata, AgentStats, Backend, Descriptor, Memory,
    Notification, PagedRegion, ReadOutcome, RegionHandle, RegionInfo, Transfer,
};
pub use frame::FrameError;

/// Why a transfer operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("cannot connect to KV agent at {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("KV transfer I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("KV transfer frame error: {0}")]
    Frame(#[from] FrameError),
    #[error("unknown remote agent {0}")]
    UnknownRemote(String),
    #[error("bad descriptor: {0}")]
    BadDescriptor(String),
    #[error("remote agent refused: {0}")]
    Remote(String),
    #[error("KV transfer protocol error: {0}")]
    Protocol(String),
    #[error("KV transfer timed out after {0:?}")]
    Timeout(std::time::Duration),
    #[error("the remote agent closed the connection")]
    Closed,
    #[error("destination holds {got} bytes, descriptors total {expected}")]
    DestinationSize { expected: u64, got: u64 },
    #[error("transfer backend unavailable: {0}")]
    BackendUnavailable(String),
    #[error("CUDA error: {0}")]
    Cuda(String),
}
