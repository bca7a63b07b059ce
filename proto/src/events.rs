//! The one internal KV event model (DESIGN contract 4), shaped like Dynamo's `RouterEvent`.
//!
//! Every source (our gRPC stream, vLLM / SGLang ZMQ msgpack, Dynamo NATS JSON) decodes into
//! [`RouterEvent`]. Blocks carry two keys: the engine's opaque `block_hash` (used only to resolve
//! removals and parent links) and the router's `tokens_hash`, recomputed from token ids
//! (engine-kv-events.md §7, dual-key design).

use serde::{Deserialize, Serialize};

use crate::pb;

/// Where a block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageTier {
    #[default]
    Device,
    HostPinned,
    Disk,
    External,
}

impl StorageTier {
    /// Maps an engine's `medium` string (vLLM: GPU/CPU/STORAGE; SGLang: GPU/CPU_PINNED/DISK/EXTERNAL).
    pub fn from_medium(medium: Option<&str>) -> StorageTier {
        match medium.map(|m| m.to_ascii_uppercase()) {
            None => StorageTier::Device,
            Some(m) if m == "GPU" => StorageTier::Device,
            Some(m) if m.starts_with("CPU") => StorageTier::HostPinned,
            Some(m) if m == "DISK" || m == "NVME" || m == "STORAGE" => StorageTier::Disk,
            Some(m) if m == "EXTERNAL" => StorageTier::External,
            Some(_) => StorageTier::Device,
        }
    }
}

/// One stored block: the engine's key and the router's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoredBlock {
    pub block_hash: u64,
    pub tokens_hash: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvEventData {
    Stored {
        /// Engine key of the block before the first stored block; `None` at the root.
        parent_hash: Option<u64>,
        blocks: Vec<StoredBlock>,
        /// All tokens of the stored blocks (`blocks.len() * block_size`); may be empty when the
        /// source sends none, in which case `tokens_hash` must already be the router key.
        token_ids: Vec<u32>,
        block_size: u32,
        lora_name: Option<String>,
        cache_salt: Option<String>,
    },
    Removed {
        block_hashes: Vec<u64>,
    },
    Cleared,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheEvent {
    pub event_id: u64,
    pub data: KvEventData,
    #[serde(default)]
    pub dp_rank: u32,
}

/// A KV event attributed to a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterEvent {
    pub worker_id: u64,
    #[serde(default)]
    pub storage_tier: StorageTier,
    pub event: KvCacheEvent,
}

/// An event that cannot be represented (wrong sizes, unknown enum values).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EventError {
    #[error("stored event has {tokens} token ids for {blocks} blocks of {block_size} tokens")]
    TokenCountMismatch {
        tokens: usize,
        blocks: usize,
        block_size: u32,
    },
    #[error("stored event has block_size 0")]
    ZeroBlockSize,
    #[error("event has no data")]
    Empty,
}

impl KvEventData {
    /// Checks the invariants every decoder must guarantee before an event reaches the index.
    pub fn validate(&self) -> Result<(), EventError> {
        if let KvEventData::Stored {
            blocks,
            token_ids,
            block_size,
            ..
        } = self
        {
            if *block_size == 0 {
                return Err(EventError::ZeroBlockSize);
            }
            if !token_ids.is_empty() && token_ids.len() != blocks.len() * *block_size as usize {
                return Err(EventError::TokenCountMismatch {
                    tokens: token_ids.len(),
                    blocks: blocks.len(),
                    block_size: *block_size,
                });
            }
        }
        Ok(())
    }
}

impl From<StorageTier> for pb::StorageTier {
    fn from(t: StorageTier) -> Self {
        match t {
            StorageTier::Device => pb::StorageTier::Device,
            StorageTier::HostPinned => pb::StorageTier::HostPinned,
            StorageTier::Disk => pb::StorageTier::Disk,
            StorageTier::External => pb::StorageTier::External,
        }
    }
}

impl From<pb::StorageTier> for StorageTier {
    fn from(t: pb::StorageTier) -> Self {
        match t {
            pb::StorageTier::Device => StorageTier::Device,
            pb::StorageTier::HostPinned => StorageTier::HostPinned,
            pb::StorageTier::Disk => StorageTier::Disk,
            pb::StorageTier::External => StorageTier::External,
        }
    }
}

impl KvCacheEvent {
    /// Wire form for our gRPC stream.
    pub fn to_pb(&self, tier: StorageTier) -> pb::KvEvent {
        let data = match &self.data {
            KvEventData::Stored {
                parent_hash,
                blocks,
                token_ids,
                block_size,
                lora_name,
                cache_salt,
            } => pb::kv_event::Data::Stored(pb::BlocksStored {
                parent_hash: *parent_hash,
                blocks: blocks
                    .iter()
                    .map(|b| pb::StoredBlock {
                        block_hash: b.block_hash,
                        tokens_hash: b.tokens_hash,
                    })
                    .collect(),
                token_ids: token_ids.clone(),
                block_size: *block_size,
                lora_name: lora_name.clone(),
                cache_salt: cache_salt.clone(),
            }),
            KvEventData::Removed { block_hashes } => {
                pb::kv_event::Data::Removed(pb::BlocksRemoved {
                    block_hashes: block_hashes.clone(),
                })
            }
            KvEventData::Cleared => pb::kv_event::Data::Cleared(pb::AllBlocksCleared {}),
        };
        pb::KvEvent {
            event_id: self.event_id,
            tier: pb::StorageTier::from(tier) as i32,
            data: Some(data),
        }
    }

    /// Decodes our gRPC wire form; unknown tiers fall back to device, missing data is an error.
    pub fn from_pb(
        ev: &pb::KvEvent,
        dp_rank: u32,
    ) -> Result<(KvCacheEvent, StorageTier), EventError> {
        let tier = pb::StorageTier::try_from(ev.tier)
            .map(StorageTier::from)
            .unwrap_or_default();
        let data = match ev.data.as_ref().ok_or(EventError::Empty)? {
            pb::kv_event::Data::Stored(s) => KvEventData::Stored {
                parent_hash: s.parent_hash,
                blocks: s
                    .blocks
                    .iter()
                    .map(|b| StoredBlock {
                        block_hash: b.block_hash,
                        tokens_hash: b.tokens_hash,
                    })
                    .collect(),
                token_ids: s.token_ids.clone(),
                block_size: s.block_size,
                lora_name: s.lora_name.clone(),
                cache_salt: s.cache_salt.clone(),
            },
            pb::kv_event::Data::Removed(r) => KvEventData::Removed {
                block_hashes: r.block_hashes.clone(),
            },
            pb::kv_event::Data::Cleared(_) => KvEventData::Cleared,
        };
        data.validate()?;
        Ok((
            KvCacheEvent {
                event_id: ev.event_id,
                data,
                dp_rank,
            },
            tier,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> KvCacheEvent {
        KvCacheEvent {
            event_id: 7,
            dp_rank: 1,
            data: KvEventData::Stored {
                parent_hash: Some(3),
                blocks: vec![
                    StoredBlock {
                        block_hash: 10,
                        tokens_hash: 11,
                    },
                    StoredBlock {
                        block_hash: 12,
                        tokens_hash: 13,
                    },
                ],
                token_ids: (0..8).collect(),
                block_size: 4,
                lora_name: Some("l".into()),
                cache_salt: None,
            },
        }
    }

    #[test]
    fn pb_round_trip() {
        for ev in [
            stored(),
            KvCacheEvent {
                event_id: 8,
                dp_rank: 1,
                data: KvEventData::Removed {
                    block_hashes: vec![10],
                },
            },
            KvCacheEvent {
                event_id: 9,
                dp_rank: 1,
                data: KvEventData::Cleared,
            },
        ] {
            let wire = ev.to_pb(StorageTier::HostPinned);
            let (back, tier) = KvCacheEvent::from_pb(&wire, 1).expect("decodes");
            assert_eq!(back, ev);
            assert_eq!(tier, StorageTier::HostPinned);
        }
    }

    #[test]
    fn rejects_bad_events() {
        let mut wire = stored().to_pb(StorageTier::Device);
        if let Some(pb::kv_event::Data::Stored(s)) = wire.data.as_mut() {
            s.token_ids.pop();
        }
        assert!(matches!(
            KvCacheEvent::from_pb(&wire, 0),
            Err(EventError::TokenCountMismatch {
                tokens: 7,
                blocks: 2,
                block_size: 4
            })
        ));
        let empty = pb::KvEvent {
            event_id: 1,
            tier: 0,
            data: None,
        };
        assert_eq!(KvCacheEvent::from_pb(&empty, 0), Err(EventError::Empty));
        let mut zero = stored().to_pb(StorageTier::Device);
        if let Some(pb::kv_event::Data::Stored(s)) = zero.data.as_mut() {
            s.block_size = 0;
        }
        assert_eq!(
            KvCacheEvent::from_pb(&zero, 0),
            Err(EventError::ZeroBlockSize)
        );
        let odd_tier = pb::KvEvent {
            tier: 99,
            ..stored().to_pb(StorageTier::Disk)
        };
        assert_eq!(
            KvCacheEvent::from_pb(&odd_tier, 0).map(|x| x.1),
            Ok(StorageTier::Device)
        );
    }

    #[test]
    fn medium_to_tier() {
        assert_eq!(StorageTier::from_medium(Some("GPU")), StorageTier::Device);
        assert_eq!(
            StorageTier::from_medium(Some("CPU_PINNED")),
            StorageTier::HostPinned
        );
        assert_eq!(
            StorageTier::from_medium(Some("cpu")),
            StorageTier::HostPinned
        );
        assert_eq!(StorageTier::from_medium(Some("DISK")), StorageTier::Disk);
        assert_eq!(
            StorageTier::from_medium(Some("EXTERNAL")),
            StorageTier::External
        );
        assert_eq!(StorageTier::from_medium(None), StorageTier::Device);
    }
}
