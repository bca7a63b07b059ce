//! SGLang `EventBatch` decoding (engine-kv-events.md §3): i64 hashes, page-size blocks,
//! `cache_salt` / `lora_name` positions in the array form, SGLang media.

#[path = "decode_common/mod.rs"]
mod common;

use common::*;
use kvroute_proto::decode::{decode_sglang_batch, DecodeError};
use kvroute_proto::events::{EventError, KvEventData, StorageTier, StoredBlock};
use kvroute_proto::hashing::{local_block_hash, namespace_seed, XXH3_SEED};
use rmpv::Value;

#[test]
fn map_form_with_i64_hashes_and_page_size_one() {
    let ev = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", arr(vec![i(-5), i(7), i(i64::MIN)])),
        ("parent_block_hash", i(-9)),
        ("token_ids", tokens(10..=12)),
        ("block_size", u(1)),
        ("lora_id", Value::Nil),
        ("medium", s("CPU_PINNED")),
        ("cache_salt", s("tenant-a")),
        ("session_id", s("abc")),
        ("lora_name", Value::Nil),
    ]);
    let removed = map(vec![
        ("type", s("BlockRemoved")),
        ("block_hashes", arr(vec![i(-5)])),
        ("medium", s("DISK")),
    ]);
    let b = decode_sglang_batch(&batch(9.5, vec![ev, removed], Some(u(3)))).expect("decodes");
    assert_eq!((b.timestamp, b.dp_rank, b.skipped), (9.5, Some(3), 0));
    let seed = namespace_seed(None, Some("tenant-a"));
    assert_eq!(b.events[0].tier, StorageTier::HostPinned);
    assert_eq!(
        b.events[0].event.data,
        KvEventData::Stored {
            parent_hash: Some((-9i64) as u64),
            blocks: vec![
                StoredBlock {
                    block_hash: (-5i64) as u64,
                    tokens_hash: local_block_hash(&[10], seed)
                },
                StoredBlock {
                    block_hash: 7,
                    tokens_hash: local_block_hash(&[11], seed)
                },
                StoredBlock {
                    block_hash: 1 << 63,
                    tokens_hash: local_block_hash(&[12], seed)
                },
            ],
            token_ids: vec![10, 11, 12],
            block_size: 1,
            lora_name: None,
            cache_salt: Some("tenant-a".into()),
        }
    );
    assert_eq!(b.events[1].tier, StorageTier::Disk);
    assert_eq!(
        b.events[1].event.data,
        KvEventData::Removed {
            block_hashes: vec![u64::MAX - 4]
        }
    );
    assert!(b.events.iter().all(|e| e.event.dp_rank == 3));
}

#[test]
fn array_form_positions() {
    // [tag, block_hashes, parent, token_ids, block_size, lora_id, medium, cache_salt, session_id, lora_name]
    let full = arr(vec![
        s("BlockStored"),
        arr(vec![i(-1), i(2)]),
        Value::Nil,
        tokens(1..=4),
        u(2),
        Value::Nil,
        s("EXTERNAL"),
        s("tenant-a"),
        s("session"),
        s("my-lora"),
        s("a later field"),
    ]);
    let b = decode_sglang_batch(&batch(1.0, vec![full], Some(u(0)))).expect("full array");
    let seed = namespace_seed(Some("my-lora"), Some("tenant-a"));
    assert_eq!(b.events[0].tier, StorageTier::External);
    match &b.events[0].event.data {
        KvEventData::Stored {
            blocks,
            lora_name,
            cache_salt,
            ..
        } => {
            assert_eq!(lora_name.as_deref(), Some("my-lora"));
            assert_eq!(cache_salt.as_deref(), Some("tenant-a"));
            assert_eq!(blocks[0].block_hash, u64::MAX);
            assert_eq!(blocks[0].tokens_hash, local_block_hash(&[1, 2], seed));
            assert_eq!(blocks[1].tokens_hash, local_block_hash(&[3, 4], seed));
        }
        other => panic!("{other:?}"),
    }
    // Older SGLang: five fields, no medium (GPU), no salt.
    let short = arr(vec![
        s("BlockStored"),
        arr(vec![i(4)]),
        i(3),
        tokens(1..=4),
        u(4),
        Value::Nil,
    ]);
    let removed = arr(vec![s("BlockRemoved"), arr(vec![i(4)])]);
    let cleared = arr(vec![s("AllBlocksCleared")]);
    let b = decode_sglang_batch(&batch(1.0, vec![short, removed, cleared], None)).expect("short");
    assert_eq!(b.dp_rank, None);
    assert_eq!(b.events[0].tier, StorageTier::Device);
    match &b.events[0].event.data {
        KvEventData::Stored {
            blocks,
            parent_hash,
            ..
        } => {
            assert_eq!(*parent_hash, Some(3));
            assert_eq!(
                blocks[0].tokens_hash,
                local_block_hash(&[1, 2, 3, 4], XXH3_SEED)
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        b.events[1].event.data,
        KvEventData::Removed {
            block_hashes: vec![4]
        }
    );
    assert_eq!(b.events[2].event.data, KvEventData::Cleared);
}

#[test]
fn malformed_sglang_input_is_an_error() {
    let mismatch = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", arr(vec![i(1), i(2)])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", tokens(1..=3)),
        ("block_size", u(1)),
    ]);
    assert_eq!(
        decode_sglang_batch(&batch(1.0, vec![mismatch], None)).expect_err("mismatch"),
        DecodeError::InvalidEvent {
            path: "events[0]".into(),
            source: EventError::TokenCountMismatch {
                tokens: 3,
                blocks: 2,
                block_size: 1
            }
        }
    );
    // SGLang has no hint: a missing page size is an error.
    let no_size = arr(vec![
        s("BlockStored"),
        arr(vec![i(1)]),
        Value::Nil,
        tokens(1..=1),
    ]);
    assert!(matches!(
        decode_sglang_batch(&batch(1.0, vec![no_size], None)),
        Err(DecodeError::MissingField {
            field: "block_size",
            ..
        })
    ));
    let salt_type = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", arr(vec![])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", arr(vec![])),
        ("block_size", u(1)),
        ("cache_salt", u(5)),
    ]);
    let e = decode_sglang_batch(&batch(1.0, vec![salt_type], None)).expect_err("salt type");
    assert_eq!(
        e.to_string(),
        "events[0].cache_salt: expected a string, found an integer"
    );
    let bytes = batch(
        1.0,
        vec![arr(vec![s("BlockRemoved"), arr(vec![i(-1)])])],
        Some(u(0)),
    );
    for n in 0..bytes.len() {
        assert!(decode_sglang_batch(&bytes[..n]).is_err(), "prefix {n}");
    }
}
