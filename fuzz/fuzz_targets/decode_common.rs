//! Invariants every decoded KV event must satisfy, shared by the decode_* fuzz targets.
#![allow(dead_code)]

use kvroute_proto::decode::DecodedBatch;
use kvroute_proto::events::KvEventData;
use kvroute_proto::hashing::{local_block_hash, namespace_seed};

/// Panics (a fuzz finding) if a decoded event breaks the contract the index relies on.
pub fn check_data(data: &KvEventData, need_tokens: bool) {
    data.validate().expect("decoders only return valid events");
    if let KvEventData::Stored {
        blocks,
        token_ids,
        block_size,
        lora_name,
        cache_salt,
        ..
    } = data
    {
        if !need_tokens {
            return;
        }
        assert!(
            blocks.is_empty() || !token_ids.is_empty(),
            "stored blocks without tokens"
        );
        let seed = namespace_seed(lora_name.as_deref(), cache_salt.as_deref());
        for (b, toks) in blocks
            .iter()
            .zip(token_ids.chunks_exact(*block_size as usize))
        {
            assert_eq!(b.tokens_hash, local_block_hash(toks, seed), "router key");
        }
    }
}

pub fn check_batch(batch: &DecodedBatch) {
    for (i, ev) in batch.events.iter().enumerate() {
        assert_eq!(ev.event.event_id, i as u64, "event ids are positions");
        assert_eq!(ev.event.dp_rank, batch.dp_rank.unwrap_or(0));
        check_data(&ev.event.data, true);
    }
}
