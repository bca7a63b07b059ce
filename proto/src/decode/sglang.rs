//! SGLang's KV event payload (engine-kv-events.md §3): the same msgspec `EventBatch`
//! `[ts, events, attn_dp_rank?]` framing as vLLM, with SGLang's field set.
//!
//! Array-form `BlockStored` fields after the tag: `block_hashes`, `parent_block_hash`,
//! `token_ids`, `block_size` (the page size), `lora_id`, `medium`, `cache_salt`, `session_id`,
//! `lora_name` (at most 9; later ones ignored). `BlockRemoved`: `block_hashes`, `medium`. Map
//! form uses the same names. Hashes are SGLang's signed int64 (first 8 bytes of a SHA-256),
//! reinterpreted bitwise as `u64`; u64 and `bin` hashes are accepted too. SGLang sends no
//! `extra_keys`, so the salt comes only from `cache_salt`.

use super::msgpack::{decode_batch, Field, Layout};
use super::{DecodeError, DecodedBatch};

const LAYOUT: Layout = Layout {
    stored: &[
        Field::BlockHashes,
        Field::ParentBlockHash,
        Field::TokenIds,
        Field::BlockSize,
        Field::Unused, // lora_id
        Field::Medium,
        Field::CacheSalt,
        Field::Unused, // session_id
        Field::LoraName,
    ],
    removed: &[Field::BlockHashes, Field::Medium],
    salt_in_extra_keys: false,
};

/// Decodes one SGLang `EventBatch` (the third frame of a live ZMQ message). SGLang always
/// sends `block_size`, so there is no hint.
pub fn decode_sglang_batch(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    decode_batch(payload, &LAYOUT, None)
}
