//! The ZMQ multipart layer of vLLM / SGLang KV event publishers (engine-kv-events.md §1, §3),
//! as a pure parser over received frames: no ZMQ dependency, nothing copied.
//!
//! - Live (SUB socket): `[topic, seq, payload]`, `seq` an 8-byte big-endian `u64` starting at 0
//!   per publisher process. The topic may be empty but its frame is always sent.
//! - Replay (reply on the ROUTER `replay_endpoint`), as a DEALER receives it:
//!   `["", topic, seq, payload]` (vLLM ≥ 0.26, SGLang) or `["", seq, payload]` (older), then the
//!   end marker with `seq = 0xFFFF_FFFF_FFFF_FFFF` (−1 signed) and an empty payload. A REQ socket
//!   strips the empty delimiter, so `[topic, seq, payload]` and `[seq, payload]` are accepted too.
//!   The one ambiguous case, three frames starting with an empty one, reads as the old shape
//!   with delimiter; the other reading (an empty topic without delimiter) yields the same seq
//!   and payload.

use super::DecodeError;

/// The replay end marker's sequence number (−1 as a signed 64-bit integer).
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// One received multipart message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZmqMessage<'a> {
    /// A batch from the PUB socket.
    Live {
        topic: &'a [u8],
        seq: u64,
        payload: &'a [u8],
    },
    /// A buffered batch replayed on request; `topic` is `None` for publishers older than the
    /// topic frame.
    Replay {
        topic: Option<&'a [u8]>,
        seq: u64,
        payload: &'a [u8],
    },
    /// The end of a replay: every buffered batch at or after the requested seq was sent.
    ReplayEnd,
}

fn seq_of(frames: &[&[u8]], index: usize) -> Result<u64, DecodeError> {
    let frame = frames.get(index).copied().unwrap_or_default();
    let bytes: [u8; 8] = frame.try_into().map_err(|_| DecodeError::SeqFrame {
        index,
        len: frame.len(),
    })?;
    Ok(u64::from_be_bytes(bytes))
}

/// Parses a live message `[topic, seq, payload]`.
pub fn parse_live_frames<'a>(frames: &[&'a [u8]]) -> Result<ZmqMessage<'a>, DecodeError> {
    let [topic, _, payload] = frames else {
        return Err(DecodeError::FrameCount {
            got: frames.len(),
            expected: "3 ([topic, seq, payload])",
        });
    };
    Ok(ZmqMessage::Live {
        topic,
        seq: seq_of(frames, 1)?,
        payload,
    })
}

/// Parses one replay reply in any of the shapes in the module docs.
pub fn parse_replay_frames<'a>(frames: &[&'a [u8]]) -> Result<ZmqMessage<'a>, DecodeError> {
    // (index of the topic frame if any, index of the seq frame)
    let (topic_at, seq_at) = match frames {
        [delim, _, _, _] => {
            if !delim.is_empty() {
                return Err(DecodeError::Delimiter {
                    index: 0,
                    len: delim.len(),
                });
            }
            (Some(1), 2)
        }
        [[], _, _] => (None, 1),
        [_, _, _] => (Some(0), 1),
        [_, _] => (None, 0),
        _ => {
            return Err(DecodeError::FrameCount {
                got: frames.len(),
                expected: "2 to 4 ([\"\", topic, seq, payload] or [\"\", seq, payload])",
            })
        }
    };
    let seq = seq_of(frames, seq_at)?;
    if seq == REPLAY_END_SEQ {
        return Ok(ZmqMessage::ReplayEnd);
    }
    Ok(ZmqMessage::Replay {
        topic: topic_at.and_then(|i| frames.get(i).copied()),
        seq,
        payload: frames.get(seq_at + 1).copied().unwrap_or_default(),
    })
}

/// The second frame of a replay request (`[b"", start_seq]` from a DEALER): every buffered
/// batch with `seq >= start_seq` is sent back, then [`ZmqMessage::ReplayEnd`].
pub fn replay_request_seq(start_seq: u64) -> [u8; 8] {
    start_seq.to_be_bytes()
}
