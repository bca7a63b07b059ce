//! libFuzzer target: SGLang `EventBatch` decoding never panics and only yields valid events.
#![no_main]

#[path = "decode_common.rs"]
mod common;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(batch) = kvroute_proto::decode::decode_sglang_batch(data) {
        common::check_batch(&batch);
    }
});
