//! libFuzzer target: fast tokenizer and prefix reuse vs HF `tokenizers` (see `src/lib.rs`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvroute_fuzz::check(data);
});
