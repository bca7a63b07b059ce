//! libFuzzer target: the ZMQ frame parsers over arbitrary multipart messages, then the payload
//! through the vLLM decoder (the path a subscriber takes).
//!
//! Input layout: byte 0 % 7 = number of frames; then one length byte per frame but the last;
//! the last frame takes the rest (lengths are clamped to what is left).
#![no_main]

#[path = "decode_common.rs"]
mod common;

use kvroute_proto::decode::{
    decode_vllm_batch, parse_live_frames, parse_replay_frames, ZmqMessage,
};

fn frames(data: &[u8]) -> Vec<&[u8]> {
    let Some((&n, mut rest)) = data.split_first() else {
        return Vec::new();
    };
    let n = usize::from(n % 7);
    let mut out = Vec::with_capacity(n);
    for k in 0..n {
        if k + 1 == n {
            out.push(rest);
            break;
        }
        let (len, tail) = match rest.split_first() {
            Some((&len, tail)) => (usize::from(len).min(tail.len()), tail),
            None => (0, rest),
        };
        out.push(&tail[..len]);
        rest = &tail[len..];
    }
    out
}

fn within(outer: &[&[u8]], inner: &[u8]) -> bool {
    inner.is_empty()
        || outer.iter().any(|f| {
            let (s, e) = (f.as_ptr() as usize, f.as_ptr() as usize + f.len());
            let p = inner.as_ptr() as usize;
            p >= s && p + inner.len() <= e
        })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let fs = frames(data);
    if let Ok(msg) = parse_live_frames(&fs) {
        let ZmqMessage::Live {
            topic,
            seq,
            payload,
        } = msg
        else {
            panic!("live parser returned {msg:?}");
        };
        assert_eq!(fs.len(), 3);
        assert_eq!(seq.to_be_bytes().as_slice(), fs[1]);
        assert!(within(&fs, topic) && within(&fs, payload));
        if let Ok(batch) = decode_vllm_batch(payload, Some(16)) {
            common::check_batch(&batch);
        }
    }
    match parse_replay_frames(&fs) {
        Ok(ZmqMessage::Replay {
            topic,
            seq,
            payload,
        }) => {
            assert_ne!(seq, u64::MAX, "the end marker is never a batch");
            assert!(topic.is_none_or(|t| within(&fs, t)) && within(&fs, payload));
        }
        Ok(ZmqMessage::ReplayEnd) => {}
        Ok(other @ ZmqMessage::Live { .. }) => panic!("replay parser returned {other:?}"),
        Err(_) => {}
    }
});
