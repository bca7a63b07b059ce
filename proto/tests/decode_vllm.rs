//! vLLM `EventBatch` decoding (engine-kv-events.md §2): the reference example, both event forms,
//! every hash encoding, Dynamo's group rule, medium → tier, cache salts, and malformed input.

#[path = "decode_common/mod.rs"]
mod common;

use common::*;
use kvroute_proto::decode::{decode_vllm_batch, normalize_hash_bytes, DecodeError, DecodedBatch};
use kvroute_proto::events::{EventError, KvEventData, StorageTier};
use kvroute_proto::hashing::{local_block_hash, namespace_seed, XXH3_SEED};
use rmpv::Value;

const H1: u64 = 9561501211280363793;
const H2: u64 = 15292913576410714033;
/// Router keys of tokens [1,2,3,4] and [5,6,7,8] under the default seed (§6 vectors).
const L1: u64 = 14643705804678351452;
const L2: u64 = 16777012769546811212;

fn raw_str(out: &mut Vec<u8>, s: &str) {
    assert!(s.len() < 32);
    out.push(0xa0 | s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

fn raw_u64(out: &mut Vec<u8>, x: u64) {
    out.push(0xcf);
    out.extend_from_slice(&x.to_be_bytes());
}

/// The §2 example, byte by byte the way msgspec writes it: the batch as a fixarray, each event
/// struct as a map16 (`de 000a` ..), hashes ≥ 2^63 as uint64.
fn reference_bytes() -> Vec<u8> {
    let mut b = vec![0x93, 0xcb];
    b.extend_from_slice(&1.5f64.to_be_bytes());
    b.push(0x93);
    // BlockStored
    b.extend_from_slice(&[0xde, 0x00, 0x0a]);
    raw_str(&mut b, "type");
    raw_str(&mut b, "BlockStored");
    raw_str(&mut b, "block_hashes");
    b.push(0x92);
    raw_u64(&mut b, H1);
    raw_u64(&mut b, H2);
    raw_str(&mut b, "parent_block_hash");
    b.push(0xc0);
    raw_str(&mut b, "token_ids");
    b.push(0x98);
    b.extend(1u8..=8);
    raw_str(&mut b, "block_size");
    b.push(4);
    raw_str(&mut b, "lora_id");
    b.push(0xc0);
    raw_str(&mut b, "medium");
    raw_str(&mut b, "GPU");
    raw_str(&mut b, "lora_name");
    b.push(0xc0);
    raw_str(&mut b, "group_idx");
    b.push(0);
    // The spec elides the tenth field ("…"); a full-attention spec kind is what vLLM sends.
    raw_str(&mut b, "kv_cache_spec_kind");
    raw_str(&mut b, "full_attention");
    // BlockRemoved
    b.extend_from_slice(&[0xde, 0x00, 0x03]);
    raw_str(&mut b, "type");
    raw_str(&mut b, "BlockRemoved");
    raw_str(&mut b, "block_hashes");
    b.push(0x92);
    raw_u64(&mut b, H1);
    raw_u64(&mut b, H2);
    raw_str(&mut b, "medium");
    raw_str(&mut b, "GPU");
    // AllBlocksCleared
    b.extend_from_slice(&[0xde, 0x00, 0x01]);
    raw_str(&mut b, "type");
    raw_str(&mut b, "AllBlocksCleared");
    b.push(0); // dp rank 0
    b
}

fn stored_of(batch: &DecodedBatch, i: usize) -> (&KvEventData, StorageTier) {
    (&batch.events[i].event.data, batch.events[i].tier)
}

fn block_keys(data: &KvEventData) -> (Vec<u64>, Vec<u64>) {
    match data {
        KvEventData::Stored { blocks, .. } => (
            blocks.iter().map(|b| b.block_hash).collect(),
            blocks.iter().map(|b| b.tokens_hash).collect(),
        ),
        other => panic!("expected a stored event, got {other:?}"),
    }
}

#[test]
fn reference_example_decodes() {
    let bytes = reference_bytes();
    let mut prefix = hex("93cb3ff800000000000093de000aa4");
    prefix.extend_from_slice(b"type");
    assert!(bytes.starts_with(&prefix), "same opening bytes as the spec");

    let batch = decode_vllm_batch(&bytes, None).expect("reference example decodes");
    assert_eq!(batch.timestamp, 1.5);
    assert_eq!(batch.dp_rank, Some(0));
    assert_eq!(batch.skipped, 0);
    assert_eq!(batch.events.len(), 3);
    let ids: Vec<u64> = batch.events.iter().map(|e| e.event.event_id).collect();
    assert_eq!(ids, vec![0, 1, 2], "event ids are positions in the batch");

    let (data, tier) = stored_of(&batch, 0);
    assert_eq!(tier, StorageTier::Device);
    assert_eq!(
        data,
        &KvEventData::Stored {
            parent_hash: None,
            blocks: vec![
                kvroute_proto::events::StoredBlock {
                    block_hash: 9561501211280363793,
                    tokens_hash: L1,
                },
                kvroute_proto::events::StoredBlock {
                    block_hash: 15292913576410714033,
                    tokens_hash: L2,
                },
            ],
            token_ids: (1..=8).collect(),
            block_size: 4,
            lora_name: None,
            cache_salt: None,
        }
    );
    assert_eq!(
        batch.events[1].event.data,
        KvEventData::Removed {
            block_hashes: vec![H1, H2]
        }
    );
    assert_eq!(batch.events[2].event.data, KvEventData::Cleared);
    assert!(batch.events.iter().all(|e| e.event.dp_rank == 0));
}

#[test]
fn published_hashes_are_the_last_eight_digest_bytes() {
    // §4's sha256_cbor digests of the two blocks reduce to the published u64 values.
    let d1 = hex("58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111");
    let d2 = hex("e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1");
    assert_eq!(normalize_hash_bytes(&d1), Some(H1));
    assert_eq!(normalize_hash_bytes(&d2), Some(H2));
    assert_eq!(local_block_hash(&[1, 2, 3, 4], XXH3_SEED), L1);
}

/// A tagged-array BlockStored with the first `n` fields after the tag (then `extra` more).
fn array_stored(n: usize, extra: Vec<Value>) -> Value {
    let all = vec![
        arr(vec![u(H1), u(H2)]),           // block_hashes
        Value::Nil,                        // parent_block_hash
        tokens(1..=8),                     // token_ids
        u(4),                              // block_size
        u(7),                              // lora_id (ignored)
        s("CPU"),                          // medium
        s("my-lora"),                      // lora_name
        arr(vec![Value::Nil, Value::Nil]), // extra_keys
        u(0),                              // group_idx
    ];
    let mut items = vec![s("BlockStored")];
    items.extend(all.into_iter().take(n));
    items.extend(extra);
    arr(items)
}

#[test]
fn array_form_with_5_6_9_and_trailing_fields() {
    let lora_seed = namespace_seed(Some("my-lora"), None);
    let lora_keys = vec![
        local_block_hash(&[1, 2, 3, 4], lora_seed),
        local_block_hash(&[5, 6, 7, 8], lora_seed),
    ];
    let cases: Vec<(usize, Vec<Value>, StorageTier, Vec<u64>)> = vec![
        (5, vec![], StorageTier::Device, vec![L1, L2]),
        (6, vec![], StorageTier::HostPinned, vec![L1, L2]),
        (7, vec![], StorageTier::HostPinned, lora_keys.clone()),
        (9, vec![], StorageTier::HostPinned, lora_keys.clone()),
        (
            9,
            // kv_cache_spec_kind, sliding window, locality, ownership, session_id,
            // lookahead_token_ids, then fields no release has yet
            vec![
                s("full_attention"),
                Value::Nil,
                s("LOCAL"),
                s("framework"),
                s("sess"),
                arr(vec![u(9)]),
                Value::Map(vec![]),
                Value::Boolean(true),
            ],
            StorageTier::HostPinned,
            lora_keys.clone(),
        ),
    ];
    for (n, extra, tier, keys) in cases {
        let payload = batch(2.0, vec![array_stored(n, extra)], Some(u(1)));
        let b = decode_vllm_batch(&payload, None).unwrap_or_else(|e| panic!("{n} fields: {e}"));
        assert_eq!(b.dp_rank, Some(1));
        assert_eq!(b.events.len(), 1, "{n} fields");
        let (data, got_tier) = stored_of(&b, 0);
        assert_eq!(got_tier, tier, "{n} fields");
        assert_eq!(block_keys(data), (vec![H1, H2], keys), "{n} fields");
        assert_eq!(b.events[0].event.dp_rank, 1);
    }
    // Array-form removal with group and trailing fields; array-form clear.
    let payload = batch(
        2.0,
        vec![
            arr(vec![
                s("BlockRemoved"),
                arr(vec![u(H1)]),
                s("GPU"),
                u(0),
                s("LOCAL"),
                s("x"),
            ]),
            arr(vec![s("AllBlocksCleared")]),
        ],
        Some(u(0)),
    );
    let b = decode_vllm_batch(&payload, None).expect("array removal decodes");
    assert_eq!(
        b.events[0].event.data,
        KvEventData::Removed {
            block_hashes: vec![H1]
        }
    );
    assert_eq!(b.events[1].event.data, KvEventData::Cleared);
}

#[test]
fn batch_with_two_or_extra_elements_and_unknown_map_fields() {
    let ev = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", arr(vec![u(1)])),
        ("parent_block_hash", u(0)),
        ("token_ids", tokens(1..=4)),
        ("block_size", u(4)),
        ("brand_new_field", arr(vec![map(vec![("x", u(1))])])),
        ("medium", Value::Nil),
    ]);
    let two = batch(3.25, vec![ev.clone()], None);
    let b = decode_vllm_batch(&two, None).expect("2-element batch");
    assert_eq!(b.dp_rank, None);
    assert_eq!(b.events[0].event.dp_rank, 0);
    assert_eq!(b.timestamp, 3.25);
    match &b.events[0].event.data {
        KvEventData::Stored { parent_hash, .. } => assert_eq!(*parent_hash, Some(0)),
        other => panic!("{other:?}"),
    }
    let four = encode(&arr(vec![
        Value::F64(1.0),
        arr(vec![ev]),
        u(2),
        s("future"),
    ]));
    assert_eq!(
        decode_vllm_batch(&four, None)
            .expect("4-element batch")
            .dp_rank,
        Some(2)
    );
    // Integer and f32 timestamps are accepted too.
    let int_ts = encode(&arr(vec![u(5), arr(vec![]), Value::Nil]));
    let b = decode_vllm_batch(&int_ts, None).expect("int ts");
    assert_eq!((b.timestamp, b.dp_rank, b.events.len()), (5.0, None, 0));
}

fn one_stored_hashes(block_hashes: Vec<Value>, parent: Value) -> Result<DecodedBatch, DecodeError> {
    let n = block_hashes.len() as u64;
    let ev = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", arr(block_hashes)),
        ("parent_block_hash", parent),
        ("token_ids", arr((0..n).map(u).collect())),
        ("block_size", u(1)),
        ("lora_id", Value::Nil),
        ("medium", s("GPU")),
        ("lora_name", Value::Nil),
    ]);
    decode_vllm_batch(&batch(0.0, vec![ev], Some(u(0))), None)
}

#[test]
fn hash_encodings_normalize_to_u64() {
    let mut digest = [0u8; 32];
    digest[..24].fill(0xaa);
    digest[24..].copy_from_slice(&0x0102030405060708u64.to_be_bytes());
    let b = one_stored_hashes(
        vec![
            u(5),       // positive fixint
            u(1 << 63), // uint64 ≥ 2^63
            u(u64::MAX),
            i(-1), // negative i64, bitwise
            i(i64::MIN),
            Value::Binary(digest.to_vec()), // sha256: last 8 bytes BE
            Value::Binary(hex("00112233445566778899aabbccddeeff")), // 16 bytes (xxh3_128)
            Value::Binary(hex("0000000000000009")), // exactly 8
        ],
        Value::Binary(digest.to_vec()),
    )
    .expect("all hash encodings decode");
    let (data, _) = stored_of(&b, 0);
    assert_eq!(
        block_keys(data).0,
        vec![
            5,
            1 << 63,
            u64::MAX,
            u64::MAX,
            1 << 63,
            0x0102030405060708,
            0x8899aabbccddeeff,
            9
        ]
    );
    match data {
        KvEventData::Stored { parent_hash, .. } => {
            assert_eq!(*parent_hash, Some(0x0102030405060708))
        }
        other => panic!("{other:?}"),
    }
    for len in [0usize, 1, 7, 65, 100] {
        let err = one_stored_hashes(vec![Value::Binary(vec![1; len])], Value::Nil)
            .expect_err("odd hash width");
        assert_eq!(
            err,
            DecodeError::HashWidth {
                path: "events[0].block_hashes[0]".into(),
                len
            }
        );
        assert!(err.to_string().contains("8 to 64 bytes"), "{err}");
    }
    let err = one_stored_hashes(vec![u(1)], Value::Binary(vec![1; 4])).expect_err("short parent");
    assert!(
        matches!(err, DecodeError::HashWidth { ref path, len: 4 } if path == "events[0].parent_block_hash")
    );
    for bad in [s("0x12"), Value::F64(1.0), arr(vec![])] {
        let err = one_stored_hashes(vec![bad], Value::Nil).expect_err("non-hash");
        assert!(matches!(err, DecodeError::WrongType { .. }), "{err}");
    }
}

fn stored_with(extra: Vec<(&str, Value)>) -> Value {
    let mut fields = vec![
        ("type", s("BlockStored")),
        ("block_hashes", arr(vec![u(11)])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", tokens(1..=4)),
        ("block_size", u(4)),
        ("lora_id", Value::Nil),
        ("medium", s("GPU")),
        ("lora_name", Value::Nil),
    ];
    for (k, v) in extra {
        if let Some(slot) = fields.iter_mut().find(|(name, _)| *name == k) {
            slot.1 = v;
        } else {
            fields.push((k, v));
        }
    }
    map(fields)
}

fn removed_with(extra: Vec<(&str, Value)>) -> Value {
    let mut fields = vec![
        ("type", s("BlockRemoved")),
        ("block_hashes", arr(vec![u(11)])),
        ("medium", s("GPU")),
    ];
    fields.extend(extra);
    map(fields)
}

#[test]
fn non_full_attention_groups_are_skipped() {
    let events = vec![
        stored_with(vec![("group_idx", u(1))]),
        stored_with(vec![
            ("group_idx", u(0)),
            ("kv_cache_spec_kind", s("full_attention")),
        ]),
        stored_with(vec![("kv_cache_spec_kind", s("sliding_window"))]),
        stored_with(vec![("kv_cache_spec_kind", s("mamba"))]),
        stored_with(vec![("kv_cache_spec_kind", s("mla_attention"))]),
        removed_with(vec![("group_idx", u(2))]),
        removed_with(vec![("group_idx", u(0))]),
        map(vec![("type", s("AllBlocksCleared"))]),
    ];
    let b = decode_vllm_batch(&batch(1.0, events, Some(u(0))), None).expect("decodes");
    assert_eq!(b.skipped, 4);
    assert_eq!(b.events.len(), 4);
    let ids: Vec<u64> = b.events.iter().map(|e| e.event.event_id).collect();
    assert_eq!(
        ids,
        vec![0, 1, 2, 3],
        "ids stay contiguous across skipped events"
    );
    assert!(matches!(
        b.events[2].event.data,
        KvEventData::Removed { .. }
    ));
    // A skipped group must still be well-typed where we look.
    let bad = stored_with(vec![("group_idx", s("one"))]);
    assert!(matches!(
        decode_vllm_batch(&batch(1.0, vec![bad], None), None),
        Err(DecodeError::WrongType { .. })
    ));
    let neg = stored_with(vec![("group_idx", i(-1))]);
    assert!(matches!(
        decode_vllm_batch(&batch(1.0, vec![neg], None), None),
        Err(DecodeError::OutOfRange { .. })
    ));
}

#[test]
fn medium_maps_to_tier() {
    let cases = [
        (Value::Nil, StorageTier::Device),
        (s("GPU"), StorageTier::Device),
        (s("CPU"), StorageTier::HostPinned),
        (s("CPU_PINNED"), StorageTier::HostPinned),
        (s("STORAGE"), StorageTier::Disk),
        (s("DISK"), StorageTier::Disk),
        (s("EXTERNAL"), StorageTier::External),
        (s("something-new"), StorageTier::Device),
    ];
    for (medium, tier) in cases {
        let events = vec![
            stored_with(vec![("medium", medium.clone())]),
            removed_with(vec![]).clone(),
        ];
        let mut events = events;
        if let Value::Map(fields) = &mut events[1] {
            fields[2].1 = medium.clone();
        }
        let b = decode_vllm_batch(&batch(1.0, events, None), None).expect("decodes");
        assert_eq!(b.events[0].tier, tier, "{medium:?}");
        assert_eq!(b.events[1].tier, tier, "{medium:?}");
    }
    let bad = stored_with(vec![("medium", u(1))]);
    assert!(matches!(
        decode_vllm_batch(&batch(1.0, vec![bad], None), None),
        Err(DecodeError::WrongType { ref path, .. }) if path == "events[0].medium"
    ));
}

fn salt_of(ev: Value) -> (Option<String>, Option<String>, u64) {
    let b = decode_vllm_batch(&batch(1.0, vec![ev], None), None).expect("decodes");
    match &b.events[0].event.data {
        KvEventData::Stored {
            lora_name,
            cache_salt,
            blocks,
            ..
        } => (lora_name.clone(), cache_salt.clone(), blocks[0].tokens_hash),
        other => panic!("{other:?}"),
    }
}

#[test]
fn cache_salt_and_lora_enter_the_router_key() {
    const SALTED: u64 = 6157910915076630503; // §6: lora "my-lora" + salt "tenant-a", [1,2,3,4]
    let lora = ("lora_name", s("my-lora"));
    // Map-form cache_salt.
    let got = salt_of(stored_with(vec![
        lora.clone(),
        ("cache_salt", s("tenant-a")),
    ]));
    assert_eq!(
        got,
        (Some("my-lora".into()), Some("tenant-a".into()), SALTED)
    );
    // Salt inside extra_keys[0], next to the LoRA name and a multimodal tuple.
    let extra = arr(vec![arr(vec![
        s("my-lora"),
        arr(vec![s("mmhash"), u(0)]),
        s("tenant-a"),
    ])]);
    let got = salt_of(stored_with(vec![
        lora.clone(),
        ("extra_keys", extra.clone()),
    ]));
    assert_eq!(got.1.as_deref(), Some("tenant-a"));
    assert_eq!(got.2, SALTED);
    // Without a LoRA the one string is the salt.
    let only_salt = arr(vec![arr(vec![s("tenant-a")]), Value::Nil]);
    let got = salt_of(stored_with(vec![("extra_keys", only_salt)]));
    assert_eq!(
        got.2,
        local_block_hash(&[1, 2, 3, 4], namespace_seed(None, Some("tenant-a")))
    );
    // Two unexplained strings: ambiguous, no salt assumed.
    let ambiguous = arr(vec![arr(vec![s("a"), s("b")])]);
    assert_eq!(
        salt_of(stored_with(vec![("extra_keys", ambiguous)])).1,
        None
    );
    // Only the LoRA name: no salt.
    let lora_only = arr(vec![arr(vec![s("my-lora")])]);
    let got = salt_of(stored_with(vec![lora.clone(), ("extra_keys", lora_only)]));
    assert_eq!(got.1, None);
    assert_eq!(
        got.2,
        local_block_hash(&[1, 2, 3, 4], namespace_seed(Some("my-lora"), None))
    );
    // A continuation event (parent set) does not start at token 0: extra_keys carry no salt.
    let got = salt_of(stored_with(vec![
        ("parent_block_hash", u(3)),
        ("extra_keys", extra),
    ]));
    assert_eq!(got.1, None);
    // Empty strings count as absent.
    let got = salt_of(stored_with(vec![
        ("lora_name", s("")),
        ("cache_salt", s("")),
    ]));
    assert_eq!(got, (None, None, L1));
}

#[test]
fn block_size_hint_fills_a_nil_block_size() {
    let ev = stored_with(vec![("block_size", Value::Nil)]);
    let payload = batch(1.0, vec![ev], None);
    let b = decode_vllm_batch(&payload, Some(4)).expect("hint used");
    assert!(matches!(
        b.events[0].event.data,
        KvEventData::Stored { block_size: 4, .. }
    ));
    assert_eq!(
        decode_vllm_batch(&payload, None).expect_err("no block size"),
        DecodeError::MissingField {
            path: "events[0]".into(),
            field: "block_size"
        }
    );
    // The event's own size wins over the hint.
    let payload = batch(1.0, vec![stored_with(vec![])], None);
    let b = decode_vllm_batch(&payload, Some(16)).expect("decodes");
    assert!(matches!(
        b.events[0].event.data,
        KvEventData::Stored { block_size: 4, .. }
    ));
}

#[test]
fn event_ids_and_router_events() {
    let mut b = decode_vllm_batch(&reference_bytes(), None).expect("decodes");
    assert_eq!(b.assign_event_ids(41), 44);
    let evs = b.into_router_events(9);
    assert_eq!(
        evs.iter().map(|e| e.event.event_id).collect::<Vec<_>>(),
        vec![41, 42, 43]
    );
    assert!(evs
        .iter()
        .all(|e| e.worker_id == 9 && e.storage_tier == StorageTier::Device));
}

fn err_of(payload: &[u8]) -> DecodeError {
    match decode_vllm_batch(payload, Some(4)) {
        Ok(b) => panic!("expected an error, decoded {b:?}"),
        Err(e) => e,
    }
}

#[test]
fn truncated_input_is_an_error_at_every_length() {
    let bytes = reference_bytes();
    for n in 0..bytes.len() {
        let e = err_of(&bytes[..n]);
        assert!(matches!(e, DecodeError::Msgpack { .. }), "prefix {n}: {e}");
    }
    let e = err_of(&bytes[..40]);
    assert!(e.to_string().contains("truncated"), "{e}");
    let mut long = bytes.clone();
    long.push(0xc0);
    assert_eq!(
        err_of(&long),
        DecodeError::TrailingBytes {
            end: bytes.len(),
            trailing: 1
        }
    );
}

#[test]
fn wrong_types_are_errors_naming_the_field() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            encode(&map(vec![("ts", u(1))])),
            "EventBatch: expected an array, found a map",
        ),
        (
            encode(&arr(vec![Value::F64(1.0)])),
            "EventBatch: has 1 elements",
        ),
        (
            encode(&arr(vec![s("now"), arr(vec![])])),
            "EventBatch[0] (ts): expected a float",
        ),
        (
            encode(&arr(vec![Value::F64(1.0), u(3)])),
            "EventBatch[1] (events): expected an array",
        ),
        (
            batch(1.0, vec![], Some(i(-1))),
            "EventBatch[2] (dp_rank): -1 is out of range",
        ),
        (
            batch(1.0, vec![], Some(u(1 << 40))),
            "is out of range (a u32 data-parallel rank)",
        ),
        (
            batch(1.0, vec![], Some(s("0"))),
            "EventBatch[2] (dp_rank): expected an integer",
        ),
        (
            batch(1.0, vec![u(1)], None),
            "events[0]: expected a tagged map or array, found an integer",
        ),
        (
            batch(1.0, vec![arr(vec![])], None),
            "events[0]: has 0 elements",
        ),
        (
            batch(1.0, vec![arr(vec![u(1), u(2)])], None),
            "events[0].type: expected a string",
        ),
        (
            batch(
                1.0,
                vec![stored_with(vec![("block_hashes", s("abc"))])],
                None,
            ),
            "events[0].block_hashes: expected an array, found a string",
        ),
        (
            batch(
                1.0,
                vec![stored_with(vec![(
                    "token_ids",
                    arr(vec![u(1), u(2), i(-3), u(4)]),
                )])],
                None,
            ),
            "events[0].token_ids[2]: -3 is out of range (a u32 token id)",
        ),
        (
            batch(
                1.0,
                vec![stored_with(vec![(
                    "token_ids",
                    arr(vec![u(1), u(2), u(3), u(1 << 32)]),
                )])],
                None,
            ),
            "events[0].token_ids[3]: 4294967296 is out of range",
        ),
        (
            batch(
                1.0,
                vec![stored_with(vec![(
                    "token_ids",
                    arr(vec![u(1), u(2), u(3), Value::F64(4.0)]),
                )])],
                None,
            ),
            "events[0].token_ids[3]: expected an integer, found a float",
        ),
        (
            batch(1.0, vec![stored_with(vec![("block_size", i(-4))])], None),
            "events[0].block_size: -4 is out of range",
        ),
        (
            batch(
                1.0,
                vec![stored_with(vec![("lora_name", Value::Binary(vec![1]))])],
                None,
            ),
            "events[0].lora_name: expected a string, found binary",
        ),
        (
            batch(1.0, vec![stored_with(vec![("extra_keys", s("x"))])], None),
            "events[0].extra_keys: expected an array",
        ),
        (
            batch(
                1.0,
                vec![map(vec![
                    ("type", s("BlockStored")),
                    ("token_ids", tokens(1..=4)),
                ])],
                None,
            ),
            "events[0]: missing required field `block_hashes`",
        ),
        (
            batch(1.0, vec![map(vec![("type", s("BlockRemoved"))])], None),
            "events[0]: missing required field `block_hashes`",
        ),
        (
            batch(
                1.0,
                vec![arr(vec![s("BlockStored"), arr(vec![u(1)]), Value::Nil])],
                None,
            ),
            "events[0]: missing required field `token_ids`",
        ),
        (
            batch(1.0, vec![map(vec![("block_hashes", arr(vec![]))])], None),
            "events[0]: missing required field `type`",
        ),
        (
            batch(
                1.0,
                vec![stored_with(vec![]), map(vec![("type", s("BlockUpdated"))])],
                None,
            ),
            "events[1]: unknown event type \"BlockUpdated\"",
        ),
        (
            batch(1.0, vec![arr(vec![s("Heartbeat"), u(1)])], None),
            "events[0]: unknown event type \"Heartbeat\"",
        ),
    ];
    for (payload, want) in cases {
        let e = err_of(&payload);
        assert!(e.to_string().contains(want), "got `{e}`, want `{want}`");
    }
    // Invalid UTF-8 in a string field.
    let mut bad_utf8 = Vec::new();
    bad_utf8.extend_from_slice(&[0x92, 0x00, 0x91, 0x81]);
    bad_utf8.extend_from_slice(&[0xa4, b't', b'y', b'p', b'e', 0xa2, 0xff, 0xfe]);
    let e = err_of(&bad_utf8);
    assert!(e.to_string().contains("expected a UTF-8 string"), "{e}");
}

#[test]
fn token_count_must_match_blocks_times_block_size() {
    let short = stored_with(vec![("token_ids", tokens(1..=3))]);
    assert_eq!(
        err_of(&batch(1.0, vec![short], None)),
        DecodeError::InvalidEvent {
            path: "events[0]".into(),
            source: EventError::TokenCountMismatch {
                tokens: 3,
                blocks: 1,
                block_size: 4
            }
        }
    );
    let zero = stored_with(vec![("block_size", u(0))]);
    assert_eq!(
        err_of(&batch(1.0, vec![zero], None)),
        DecodeError::InvalidEvent {
            path: "events[0]".into(),
            source: EventError::ZeroBlockSize
        }
    );
    let none = stored_with(vec![("token_ids", arr(vec![]))]);
    assert_eq!(
        err_of(&batch(1.0, vec![none], None)),
        DecodeError::MissingTokens {
            path: "events[0]".into(),
            blocks: 1
        }
    );
    // A huge block size with few tokens is a mismatch, not an overflow.
    let huge = stored_with(vec![("block_size", u(u64::from(u32::MAX)))]);
    assert!(matches!(
        err_of(&batch(1.0, vec![huge], None)),
        DecodeError::InvalidEvent { .. }
    ));
    // Nothing stored at all is a valid (empty) event.
    let empty = stored_with(vec![
        ("block_hashes", arr(vec![])),
        ("token_ids", arr(vec![])),
    ]);
    let b = decode_vllm_batch(&batch(1.0, vec![empty], None), None).expect("empty store");
    assert_eq!(b.events.len(), 1);
}

#[test]
fn huge_declared_lengths_and_deep_nesting_are_errors() {
    let cases: Vec<Vec<u8>> = vec![
        vec![0xdd, 0xff, 0xff, 0xff, 0xff], // array32 of 4G elements, no data
        vec![
            0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
        ],
        vec![0xdf, 0xff, 0xff, 0xff, 0xff, 0xc0], // map32
        vec![0xdb, 0xff, 0xff, 0xff, 0xff, b'a'], // str32
        vec![0xc6, 0xff, 0xff, 0xff, 0xff, 1, 2], // bin32
        vec![0xc9, 0xff, 0xff, 0xff, 0xff, 1, 2], // ext32
        vec![],
    ];
    for payload in cases {
        let e = err_of(&payload);
        assert!(
            matches!(e, DecodeError::Msgpack { .. }),
            "{payload:02x?}: {e}"
        );
    }
    // rmpv reads the reserved marker 0xc1 as nil; at the top it is still no EventBatch.
    assert!(matches!(err_of(&[0xc1]), DecodeError::WrongType { .. }));
    let deep = vec![0x91; 100_000];
    let e = err_of(&deep);
    assert!(e.to_string().contains("nested deeper"), "{e}");
}
