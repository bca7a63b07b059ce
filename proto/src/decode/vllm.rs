//! vLLM's KV event payload (engine-kv-events.md §2): a msgspec `EventBatch`
//! `[ts, events, data_parallel_rank?]` whose events are tagged maps (vLLM ≥ 0.26) or tagged
//! positional arrays (≤ 0.23).
//!
//! Array-form `BlockStored` fields, in declaration order after the tag: `block_hashes`,
//! `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`,
//! `extra_keys`, `group_idx`, `kv_cache_spec_kind`, then fields we ignore
//! (`kv_cache_spec_sliding_window`, `locality`, `ownership`, `session_id`,
//! `lookahead_token_ids`, and anything newer). Older releases stop after 5 or 6 fields;
//! `omit_defaults` drops trailing defaults, so any prefix holding the three required lists is
//! accepted (a missing `block_size` falls back to the caller's hint).
//! `BlockRemoved`: `block_hashes`, `medium`, `group_idx`, then ignored fields.
//!
//! The cache salt comes from a map-form `cache_salt` field when present; otherwise, for a root
//! event (`parent_block_hash` nil), from `extra_keys[0]`: vLLM puts the salt there as a bare
//! string next to the LoRA name (also a string, told apart by `lora_name`) and multimodal
//! `(id, offset)` tuples. If that leaves anything but exactly one string, no salt is assumed.
//! Continuation events (non-nil parent) carry no salt on the wire, so their router keys use the
//! LoRA-only seed unless the publisher sends `cache_salt`; the ingest can carry the namespace
//! along the parent chain if salted routing matters for long prompts.

use super::msgpack::{decode_batch, Field, Layout};
use super::{DecodeError, DecodedBatch};

const LAYOUT: Layout = Layout {
    stored: &[
        Field::BlockHashes,
        Field::ParentBlockHash,
        Field::TokenIds,
        Field::BlockSize,
        Field::Unused, // lora_id: deprecated, superseded by lora_name
        Field::Medium,
        Field::LoraName,
        Field::ExtraKeys,
        Field::GroupIdx,
        Field::SpecKind,
    ],
    removed: &[Field::BlockHashes, Field::Medium, Field::GroupIdx],
    salt_in_extra_keys: true,
};

/// Decodes one vLLM `EventBatch` (the third frame of a live ZMQ message).
///
/// `block_size_hint` (the router's configured block size) is used only when an event's
/// `block_size` is nil or absent; an event's own `block_size` always wins, so the ingest can compare it
/// with its configuration and refuse mismatched engines.
pub fn decode_vllm_batch(
    payload: &[u8],
    block_size_hint: Option<u32>,
) -> Result<DecodedBatch, DecodeError> {
    decode_batch(payload, &LAYOUT, block_size_hint)
}
