//! Decoders for the KV event wire formats that engines and Dynamo publish, all producing the
//! internal model in [`crate::events`] (DESIGN contract 4; spec: engine-kv-events.md §1–§5, §9).
//!
//! | Decoder | Accepts |
//! |---|---|
//! | [`decode_vllm_batch`] | vLLM's msgpack `EventBatch` `[ts, events, dp_rank?]` (2 or 3 elements, more are ignored); events as tagged **maps** (`{"type": "BlockStored", ..}`, vLLM ≥ 0.26) or tagged **arrays** (`["BlockStored", ..]`, ≤ 0.23, 5 to 15+ positional fields); unknown map keys and trailing array fields ignored |
//! | [`decode_sglang_batch`] | SGLang's `EventBatch` `[ts, events, attn_dp_rank?]`, same framing, SGLang's field set (`cache_salt`, `session_id`, no `extra_keys`), i64 hashes |
//! | [`parse_live_frames`] / [`parse_replay_frames`] | the ZMQ multipart layer: live `[topic, seq (8 B BE), payload]`, replay replies `["", topic, seq, payload]` (vLLM ≥ 0.26) and `["", seq, payload]` (older), with or without the DEALER's empty delimiter, and both end markers (seq = `u64::MAX`) |
//! | [`decode_dynamo_json`] | Dynamo's `RouterEvent` JSON (serde snake_case) as published on [`kv_events_subject`], one object or an array of them |
//!
//! # Hashes
//! Engine block hashes are normalized to `u64` ([`StoredBlock::block_hash`], removal keys,
//! parent links): msgpack positive ints as-is, negative ints (SGLang's i64) reinterpreted
//! bitwise, and `bin` values of 8 to 64 bytes reduced to their **last 8 bytes, big-endian**,
//! which is exactly vLLM's own `int.from_bytes(h, "big") & (2**64 - 1)` (so a bytes-mode
//! publisher and an int-mode publisher give the same keys). Shorter or longer `bin` values are
//! rejected with [`DecodeError::HashWidth`]: no engine emits them, and a 1–7 byte "hash" would
//! collide constantly.
//!
//! The router key ([`StoredBlock::tokens_hash`]) is recomputed from `token_ids` in `block_size`
//! chunks with [`crate::hashing::local_block_hash`] under
//! [`crate::hashing::namespace_seed`]`(lora_name, cache_salt)` (dual-key design, §7).
//!
//! # Event ids
//! The engines number *batches* (the ZMQ `seq`), not events. Decoders set
//! `event_id` to the event's position among the batch's kept events (0, 1, ..); a caller that
//! needs per-worker monotonic ids calls [`DecodedBatch::assign_event_ids`] with its own counter.
//! Gap and restart detection belongs to the frame `seq` ([`ZmqMessage`]), not to event ids.
//!
//! # Skipped events
//! Like Dynamo, events of a KV cache group other than 0 (`group_idx != 0`) or of a
//! `kv_cache_spec_kind` other than full / MLA attention (hybrid models' sliding-window or mamba
//! groups) are dropped and counted in [`DecodedBatch::skipped`]: the router indexes only the
//! full-attention group, whose blocks are what a prefix hit saves.
//!
//! # Robustness
//! Every decoder returns a [`DecodeError`] for any malformed input and never panics; allocations
//! are bounded by the input length (msgpack is parsed into a borrowed tree whose arrays grow as
//! elements are actually read, never from a declared length) and nesting is capped at
//! [`MAX_NESTING`].

mod dynamo_json;
mod msgpack;
mod sglang;
mod vllm;
mod zmq_frames;

pub use dynamo_json::{
    decode_dynamo_json, kv_events_subject, KV_EVENT_SUBJECT, LEGACY_KV_EVENT_SUBJECT,
};
pub use msgpack::normalize_hash_bytes;
pub use sglang::decode_sglang_batch;
pub use vllm::decode_vllm_batch;
pub use zmq_frames::{
    parse_live_frames, parse_replay_frames, replay_request_seq, ZmqMessage, REPLAY_END_SEQ,
};

use crate::events::{EventError, KvCacheEvent, RouterEvent, StorageTier};

/// Deepest msgpack nesting accepted (rmpv counts about two levels per container). Real batches
/// need about 12 (`extra_keys` tuples inside per-block lists inside an event inside the batch);
/// the cap keeps hostile input from recursing deep.
pub const MAX_NESTING: usize = 64;

/// One decoded event and the storage tier its `medium` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TieredEvent {
    pub tier: StorageTier,
    pub event: KvCacheEvent,
}

/// One engine `EventBatch`, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    /// The publisher's wall-clock timestamp (seconds since the epoch, as the engine sent it).
    pub timestamp: f64,
    /// The batch's data-parallel rank; `None` when the engine omitted it (each event's
    /// `dp_rank` is then 0, and the caller may know the rank from the endpoint's port instead).
    pub dp_rank: Option<u32>,
    /// Kept events in wire order; `event.event_id` is the position in this list.
    pub events: Vec<TieredEvent>,
    /// Events dropped by the group / attention-kind rule (see the module docs).
    pub skipped: usize,
}

impl DecodedBatch {
    /// Renumbers the events `first_id, first_id + 1, ..` and returns the next free id, so a
    /// caller can keep one monotonic counter per worker across batches.
    pub fn assign_event_ids(&mut self, first_id: u64) -> u64 {
        let mut next = first_id;
        for ev in &mut self.events {
            ev.event.event_id = next;
            next = next.wrapping_add(1);
        }
        next
    }

    /// The events attributed to `worker_id`.
    pub fn into_router_events(self, worker_id: u64) -> Vec<RouterEvent> {
        self.events
            .into_iter()
            .map(|e| RouterEvent {
                worker_id,
                storage_tier: e.tier,
                event: e.event,
            })
            .collect()
    }
}

/// Why a payload or message could not be decoded. Paths name the offending element the way a
/// person would look for it in a dump (`events[3].block_hashes[1]`).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("invalid msgpack at byte {offset}: {reason}")]
    Msgpack { offset: usize, reason: String },
    #[error("{trailing} unexpected bytes after the EventBatch (which ends at byte {end})")]
    TrailingBytes { end: usize, trailing: usize },
    #[error("{path}: expected {expected}, found {found}")]
    WrongType {
        path: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("{path}: has {len} elements, expected {expected}")]
    BadLength {
        path: String,
        len: usize,
        expected: &'static str,
    },
    #[error("{path}: missing required field `{field}` (absent or nil)")]
    MissingField { path: String, field: &'static str },
    #[error("{path}: unknown event type {tag:?} (expected BlockStored, BlockRemoved or AllBlocksCleared)")]
    UnknownEventType { path: String, tag: String },
    #[error("{path}: {value} is out of range ({expected})")]
    OutOfRange {
        path: String,
        value: String,
        expected: &'static str,
    },
    #[error("{path}: bytes hash of {len} bytes; expected 8 to 64 bytes (reduced to the last 8, big-endian)")]
    HashWidth { path: String, len: usize },
    #[error(
        "{path}: {blocks} blocks stored without token_ids, so the router key cannot be computed"
    )]
    MissingTokens { path: String, blocks: usize },
    #[error("{path}: {source}")]
    InvalidEvent {
        path: String,
        #[source]
        source: EventError,
    },
    #[error("multipart message has {got} frames; expected {expected}")]
    FrameCount { got: usize, expected: &'static str },
    #[error("frame {index} should be the 8-byte big-endian sequence number but has {len} bytes")]
    SeqFrame { index: usize, len: usize },
    #[error("frame {index} should be the empty delimiter frame but has {len} bytes")]
    Delimiter { index: usize, len: usize },
    #[error("Dynamo event JSON: {0}")]
    Json(String),
}
