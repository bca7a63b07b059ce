//! libFuzzer target: vLLM `EventBatch` decoding never panics and only yields valid events.
#![no_main]

#[path = "decode_common.rs"]
mod common;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // Vary the block-size hint without spending input bytes on it.
    let hint = [None, Some(1), Some(16)][data.len() % 3];
    if let Ok(batch) = kvroute_proto::decode::decode_vllm_batch(data, hint) {
        common::check_batch(&batch);
    }
});
