//! The ZMQ multipart layer (engine-kv-events.md §1): live messages and both replay shapes.

use kvroute_proto::decode::{
    parse_live_frames, parse_replay_frames, replay_request_seq, DecodeError, ZmqMessage,
    REPLAY_END_SEQ,
};

const SEQ7: [u8; 8] = [0, 0, 0, 0, 0, 0, 0, 7];
const END: [u8; 8] = [0xff; 8];

#[test]
fn live_message() {
    let frames: [&[u8]; 3] = [b"kv-events", &SEQ7, b"\x93payload"];
    assert_eq!(
        parse_live_frames(&frames),
        Ok(ZmqMessage::Live {
            topic: b"kv-events",
            seq: 7,
            payload: b"\x93payload"
        })
    );
    // An empty topic is still a frame; the largest seq is just a seq on the live socket.
    let frames: [&[u8]; 3] = [b"", &END, b""];
    assert_eq!(
        parse_live_frames(&frames),
        Ok(ZmqMessage::Live {
            topic: b"",
            seq: u64::MAX,
            payload: b""
        })
    );
}

#[test]
fn live_message_errors() {
    for n in [0usize, 1, 2, 4, 5] {
        let frames: Vec<&[u8]> = vec![b"x"; n];
        assert!(matches!(
            parse_live_frames(&frames),
            Err(DecodeError::FrameCount { got, .. }) if got == n
        ));
    }
    let frames: [&[u8]; 3] = [b"t", b"\x00\x07", b"p"];
    let e = parse_live_frames(&frames).expect_err("short seq");
    assert_eq!(e, DecodeError::SeqFrame { index: 1, len: 2 });
    assert!(e.to_string().contains("frame 1"), "{e}");
    let frames: [&[u8]; 3] = [b"t", &[0; 9], b"p"];
    assert_eq!(
        parse_live_frames(&frames),
        Err(DecodeError::SeqFrame { index: 1, len: 9 })
    );
}

#[test]
fn replay_with_topic_frame() {
    let frames: [&[u8]; 4] = [b"", b"kv@pod@model", &SEQ7, b"data"];
    assert_eq!(
        parse_replay_frames(&frames),
        Ok(ZmqMessage::Replay {
            topic: Some(b"kv@pod@model"),
            seq: 7,
            payload: b"data"
        })
    );
    let end: [&[u8]; 4] = [b"", b"", &END, b""];
    assert_eq!(parse_replay_frames(&end), Ok(ZmqMessage::ReplayEnd));
    // REQ sockets strip the delimiter.
    let frames: [&[u8]; 3] = [b"topic", &SEQ7, b"data"];
    assert_eq!(
        parse_replay_frames(&frames),
        Ok(ZmqMessage::Replay {
            topic: Some(b"topic"),
            seq: 7,
            payload: b"data"
        })
    );
}

#[test]
fn replay_old_shape() {
    let frames: [&[u8]; 3] = [b"", &SEQ7, b"data"];
    assert_eq!(
        parse_replay_frames(&frames),
        Ok(ZmqMessage::Replay {
            topic: None,
            seq: 7,
            payload: b"data"
        })
    );
    let end: [&[u8]; 3] = [b"", &END, b""];
    assert_eq!(parse_replay_frames(&end), Ok(ZmqMessage::ReplayEnd));
    let frames: [&[u8]; 2] = [&SEQ7, b"data"];
    assert_eq!(
        parse_replay_frames(&frames),
        Ok(ZmqMessage::Replay {
            topic: None,
            seq: 7,
            payload: b"data"
        })
    );
    let end: [&[u8]; 2] = [&END, b""];
    assert_eq!(parse_replay_frames(&end), Ok(ZmqMessage::ReplayEnd));
    assert_eq!(REPLAY_END_SEQ, (-1i64) as u64);
    assert_eq!(replay_request_seq(7), SEQ7);
}

#[test]
fn replay_errors() {
    for n in [0usize, 1, 5, 6] {
        let frames: Vec<&[u8]> = vec![b""; n];
        assert!(matches!(
            parse_replay_frames(&frames),
            Err(DecodeError::FrameCount { got, .. }) if got == n
        ));
    }
    let frames: [&[u8]; 4] = [b"id", b"t", &SEQ7, b"p"];
    assert_eq!(
        parse_replay_frames(&frames),
        Err(DecodeError::Delimiter { index: 0, len: 2 })
    );
    let frames: [&[u8]; 4] = [b"", b"t", b"seq", b"p"];
    assert_eq!(
        parse_replay_frames(&frames),
        Err(DecodeError::SeqFrame { index: 2, len: 3 })
    );
    let frames: [&[u8]; 3] = [b"", b"", b""];
    assert_eq!(
        parse_replay_frames(&frames),
        Err(DecodeError::SeqFrame { index: 1, len: 0 })
    );
    let frames: [&[u8]; 2] = [b"1234567", b""];
    assert_eq!(
        parse_replay_frames(&frames),
        Err(DecodeError::SeqFrame { index: 0, len: 7 })
    );
}
