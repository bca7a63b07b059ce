//! Dynamo's KV events as JSON on its event plane (engine-kv-events.md §5): a serde snake_case
//! `RouterEvent` published on `namespace.{ns}.component.{comp}.kv-events`.
//!
//! ```text
//! {"worker_id": 7, "storage_tier": "device",
//!  "event": {"event_id": 12, "dp_rank": 0,
//!            "data": {"stored": {"parent_hash": null,
//!                                "blocks": [{"block_hash": 1, "tokens_hash": 2}]}}}}
//! data = {"stored": {..}} | {"removed": {"block_hashes": [..]}} | "cleared"
//! ```
//!
//! Unknown fields (`start_position`, `mm_extra_info`, newer additions) are ignored;
//! `storage_tier` and `dp_rank` default to `device` and 0. Hashes may be u64 or i64 (negative
//! values are reinterpreted bitwise). Dynamo already computed `tokens_hash` (the router key,
//! LoRA / namespace seeded, multimodal included) and sends no token ids, so a decoded `Stored`
//! has empty `token_ids`, no lora / salt, and the caller's `block_size` (Dynamo drops blocks
//! whose size differs from its `kv_block_size`, so all blocks have that size).

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use super::DecodeError;
use crate::events::{KvCacheEvent, KvEventData, RouterEvent, StorageTier, StoredBlock};

/// Dynamo's `KV_EVENT_SUBJECT`.
pub const KV_EVENT_SUBJECT: &str = "kv-events";
/// The subject suffix of older Dynamo releases.
pub const LEGACY_KV_EVENT_SUBJECT: &str = "kv_events";

/// The NATS subject a Dynamo component's workers publish KV events on.
pub fn kv_events_subject(namespace: &str, component: &str) -> String {
    format!("namespace.{namespace}.component.{component}.{KV_EVENT_SUBJECT}")
}

/// A u64 hash that may arrive as a negative i64.
struct WireHash(u64);

impl<'de> Deserialize<'de> for WireHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct HashVisitor;
        impl Visitor<'_> for HashVisitor {
            type Value = WireHash;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a 64-bit integer hash")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<WireHash, E> {
                Ok(WireHash(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<WireHash, E> {
                Ok(WireHash(v as u64))
            }
        }
        d.deserialize_any(HashVisitor)
    }
}

#[derive(Deserialize)]
struct WireBlock {
    block_hash: WireHash,
    tokens_hash: WireHash,
}

#[derive(Deserialize)]
struct WireStored {
    parent_hash: Option<WireHash>,
    blocks: Vec<WireBlock>,
}

#[derive(Deserialize)]
struct WireRemoved {
    block_hashes: Vec<WireHash>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum WireData {
    Stored(WireStored),
    Removed(WireRemoved),
    Cleared,
}

#[derive(Deserialize)]
struct WireEvent {
    event_id: u64,
    data: WireData,
    #[serde(default)]
    dp_rank: u32,
}

#[derive(Deserialize)]
struct WireRouterEvent {
    worker_id: u64,
    #[serde(default)]
    storage_tier: StorageTier,
    event: WireEvent,
}

fn convert(w: WireRouterEvent, block_size: u32) -> Result<RouterEvent, DecodeError> {
    let data = match w.event.data {
        WireData::Stored(s) => KvEventData::Stored {
            parent_hash: s.parent_hash.map(|h| h.0),
            blocks: s
                .blocks
                .into_iter()
                .map(|b| StoredBlock {
                    block_hash: b.block_hash.0,
                    tokens_hash: b.tokens_hash.0,
                })
                .collect(),
            token_ids: Vec::new(),
            block_size,
            lora_name: None,
            cache_salt: None,
        },
        WireData::Removed(r) => KvEventData::Removed {
            block_hashes: r.block_hashes.into_iter().map(|h| h.0).collect(),
        },
        WireData::Cleared => KvEventData::Cleared,
    };
    data.validate()
        .map_err(|source| DecodeError::InvalidEvent {
            path: format!("event {}", w.event.event_id),
            source,
        })?;
    Ok(RouterEvent {
        worker_id: w.worker_id,
        storage_tier: w.storage_tier,
        event: KvCacheEvent {
            event_id: w.event.event_id,
            data,
            dp_rank: w.event.dp_rank,
        },
    })
}

/// Decodes one NATS message: a `RouterEvent` object or an array of them. `block_size` is the
/// component's `kv_block_size` (the events do not carry it) and must be positive.
pub fn decode_dynamo_json(
    payload: &[u8],
    block_size: u32,
) -> Result<Vec<RouterEvent>, DecodeError> {
    let json_err = |e: serde_json::Error| DecodeError::Json(e.to_string());
    // Pick the shape from the first byte rather than with an untagged enum, so a malformed
    // event reports its real cause (field, line, column) instead of "no variant matched".
    let is_array = payload
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'[');
    if is_array {
        let ws: Vec<WireRouterEvent> = serde_json::from_slice(payload).map_err(json_err)?;
        ws.into_iter().map(|w| convert(w, block_size)).collect()
    } else {
        let w: WireRouterEvent = serde_json::from_slice(payload).map_err(json_err)?;
        Ok(vec![convert(w, block_size)?])
    }
}
