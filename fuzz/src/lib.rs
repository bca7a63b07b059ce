//! The property both fuzz drivers check: for any input, kvroute's fast tokenizer and its
//! prefix-reuse encoder give exactly HF `tokenizers`' ids on the real Qwen3 `tokenizer.json`
//! (`KVROUTE_MODEL_DIR`, else `../.cache/models/qwen3` from this crate; run `./dev setup`).
//!
//! Input layout: byte 0 picks the mode; the rest is read as UTF-8 (lossily, like a client's
//! bytes after JSON decoding).
//! - mode % 4 == 0..=1: cold encode of the text, with and without special tokens;
//! - mode % 4 == 2: the text is remembered, then re-encoded cut at a byte position taken from
//!   byte 1 and continued with the text's own tail (exercises the reuse boundaries);
//! - mode % 4 == 3: a chat-framed version of the text (`<|im_start|>user\n..<|im_end|>`)
//!   grown by one turn and encoded through the reuse encoder.

#[path = "../../proto/src/tokenizer/mod.rs"]
pub mod tokenizer;

use std::path::PathBuf;
use std::sync::OnceLock;

use tokenizer::{FastTokenizer, PrefixReuseEncoder};

pub struct Harness {
    pub hf: tokenizers::Tokenizer,
    pub fast: FastTokenizer,
    pub reuse: PrefixReuseEncoder,
}

fn model_path() -> PathBuf {
    let dir = std::env::var_os("KVROUTE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/models/qwen3")
        });
    dir.join("tokenizer.json")
}

pub fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        let path = model_path();
        assert!(
            path.is_file(),
            "{} missing: run ./dev setup",
            path.display()
        );
        let hf = tokenizers::Tokenizer::from_file(&path).expect("HF loads tokenizer.json");
        let load = || {
            FastTokenizer::from_file(&path)
                .expect("fast tokenizer loads")
                .expect("Qwen3 is supported")
        };
        Harness {
            hf,
            fast: load(),
            reuse: PrefixReuseEncoder::new(load(), 32),
        }
    })
}

fn hf_ids(h: &Harness, text: &str, add_special: bool) -> Vec<u32> {
    h.hf.encode(text, add_special)
        .expect("HF encodes")
        .get_ids()
        .to_vec()
}

/// Panics (a fuzz finding) when any encoder disagrees with HF.
pub fn check(data: &[u8]) {
    let h = harness();
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    match mode % 4 {
        0 | 1 => {
            let add = mode % 4 == 1;
            assert_eq!(
                h.fast.encode(&text, add),
                hf_ids(h, &text, add),
                "cold {text:?}"
            );
        }
        2 => {
            let got = h.reuse.encode(&text, false).expect("fast path");
            assert_eq!(got, hf_ids(h, &text, false), "reuse base {text:?}");
            let cut_from = rest.first().copied().unwrap_or(0) as usize;
            let mut cut = text.len() * cut_from / 255;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            let tail_start = text.len() / 2;
            let mut t = tail_start;
            while !text.is_char_boundary(t) {
                t -= 1;
            }
            let grown = format!("{}{}{}", &text[..cut], &text[t..], &text[..cut]);
            let got = h.reuse.encode(&grown, false).expect("fast path");
            assert_eq!(got, hf_ids(h, &grown, false), "reuse grown {grown:?}");
        }
        _ => {
            let first = format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n");
            let got = h.reuse.encode(&first, false).expect("fast path");
            assert_eq!(got, hf_ids(h, &first, false), "chat {first:?}");
            let second = format!("{first}{text}<|im_end|>\n<|im_start|>user\n{text}{text}<|im_end|>\n<|im_start|>assistant\n");
            let got = h.reuse.encode(&second, false).expect("fast path");
            assert_eq!(got, hf_ids(h, &second, false), "chat turn 2 {second:?}");
        }
    }
}
