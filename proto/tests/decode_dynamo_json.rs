//! Dynamo `RouterEvent` JSON as published on `namespace.{ns}.component.{comp}.kv-events`
//! (engine-kv-events.md §5).

use kvroute_proto::decode::{decode_dynamo_json, kv_events_subject, DecodeError, KV_EVENT_SUBJECT};
use kvroute_proto::events::{
    EventError, KvCacheEvent, KvEventData, RouterEvent, StorageTier, StoredBlock,
};

#[test]
fn subject() {
    assert_eq!(
        kv_events_subject("dynamo", "backend"),
        "namespace.dynamo.component.backend.kv-events"
    );
    assert_eq!(KV_EVENT_SUBJECT, "kv-events");
}

#[test]
fn stored_removed_cleared() {
    let stored = br#"{"worker_id": 7, "storage_tier": "host_pinned",
        "event": {"event_id": 12, "dp_rank": 1,
          "data": {"stored": {"parent_hash": 18446744073709551615, "start_position": 3,
            "blocks": [{"block_hash": 1, "tokens_hash": 14643705804678351452,
                        "mm_extra_info": null},
                       {"block_hash": -2, "tokens_hash": 5}]}}}}"#;
    let evs = decode_dynamo_json(stored, 4).expect("stored decodes");
    assert_eq!(
        evs,
        vec![RouterEvent {
            worker_id: 7,
            storage_tier: StorageTier::HostPinned,
            event: KvCacheEvent {
                event_id: 12,
                dp_rank: 1,
                data: KvEventData::Stored {
                    parent_hash: Some(u64::MAX),
                    blocks: vec![
                        StoredBlock {
                            block_hash: 1,
                            tokens_hash: 14643705804678351452
                        },
                        StoredBlock {
                            block_hash: u64::MAX - 1,
                            tokens_hash: 5
                        },
                    ],
                    token_ids: vec![],
                    block_size: 4,
                    lora_name: None,
                    cache_salt: None,
                }
            }
        }]
    );
    // Defaults (tier, dp rank), an array of events, unknown fields.
    let many = br#"[
        {"worker_id": 1, "event": {"event_id": 1, "data": {"removed": {"block_hashes": [3, -1]}}}},
        {"worker_id": 1, "event": {"event_id": 2, "data": "cleared"}, "extra": true}]"#;
    let evs = decode_dynamo_json(many, 16).expect("array decodes");
    assert_eq!(evs.len(), 2);
    assert_eq!(evs[0].storage_tier, StorageTier::Device);
    assert_eq!(evs[0].event.dp_rank, 0);
    assert_eq!(
        evs[0].event.data,
        KvEventData::Removed {
            block_hashes: vec![3, u64::MAX]
        }
    );
    assert_eq!(evs[1].event.data, KvEventData::Cleared);
    // Our own serde form of RouterEvent is Dynamo's: round trip through serde_json.
    let ours = serde_json::to_vec(&evs[0]).expect("serializes");
    assert_eq!(
        decode_dynamo_json(&ours, 16).expect("round trip")[0],
        evs[0]
    );
}

#[test]
fn malformed_json_is_an_error() {
    let cases: [&[u8]; 9] = [
        b"",
        b"{",
        b"null",
        b"[1]",
        br#"{"event": {"event_id": 1, "data": "cleared"}}"#,
        br#"{"worker_id": 1, "storage_tier": "tape", "event": {"event_id": 1, "data": "cleared"}}"#,
        br#"{"worker_id": 1, "event": {"event_id": 1, "data": "exploded"}}"#,
        br#"{"worker_id": 1, "event": {"event_id": 1, "data": {"removed": {"block_hashes": [1.5]}}}}"#,
        br#"{"worker_id": -1, "event": {"event_id": 1, "data": "cleared"}}"#,
    ];
    for c in cases {
        let e = decode_dynamo_json(c, 16).expect_err("malformed");
        assert!(matches!(e, DecodeError::Json(_)), "{e}");
    }
    let e = decode_dynamo_json(br#"{"event": {"event_id": 1, "data": "cleared"}}"#, 16)
        .expect_err("no worker");
    assert!(e.to_string().contains("worker_id"), "{e}");
    let stored = br#"{"worker_id": 1, "event": {"event_id": 1,
        "data": {"stored": {"parent_hash": null, "blocks": []}}}}"#;
    assert_eq!(
        decode_dynamo_json(stored, 0),
        Err(DecodeError::InvalidEvent {
            path: "event 1".into(),
            source: EventError::ZeroBlockSize
        })
    );
}
