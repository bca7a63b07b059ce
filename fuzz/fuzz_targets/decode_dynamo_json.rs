//! libFuzzer target: Dynamo `RouterEvent` JSON decoding never panics and only yields valid
//! events.
#![no_main]

#[path = "decode_common.rs"]
mod common;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let block_size = (data.len() % 3) as u32 * 8; // 0 (always invalid for stores), 8, 16
    if let Ok(events) = kvroute_proto::decode::decode_dynamo_json(data, block_size) {
        for ev in &events {
            common::check_data(&ev.event.data, false);
        }
    }
});
