//! The reference index: the most literal statement of [`super::KvIndex`]'s contract, kept
//! single-threaded and slow on purpose. It is the oracle of the property tests, the concurrent
//! replay test and the replay benchmark's exactness cross-check.
//!
//! Per worker it keeps, for every engine hash it holds, the block's position as the *whole
//! content path* from block 0 (identified by `kvroute_proto::hashing::chain_sequence_hash` over
//! the content keys — a different hash function from the index's locator, so agreement is not
//! an artefact of sharing one), and per position the set of engine hashes naming it. A lookup
//! walks the request's path position by position and scores each worker with how far it holds
//! every position.

use std::collections::{BTreeMap, HashMap, HashSet};

use kvroute_proto::events::{KvEventData, StoredBlock};
use kvroute_proto::hashing::chain_sequence_hash;

use super::{IndexError, WorkerKey};

/// Identity of a position: the chain hash of the content keys of the path to it.
type PathId = u64;

fn path_id(parent: Option<PathId>, content: u64) -> PathId {
    match parent {
        None => content,
        Some(parent) => chain_sequence_hash(parent, content),
    }
}

#[derive(Default, Clone, Debug)]
struct Held {
    /// engine hash -> position
    by_engine: HashMap<u64, PathId>,
    /// positions held (a position is held while some engine hash names it and no name of it
    /// was removed or moved since it was last stored: the contract's twin rule).
    positions: HashSet<PathId>,
}

/// The reference index.
#[derive(Default, Clone, Debug)]
pub struct ReferenceIndex {
    workers: BTreeMap<WorkerKey, Held>,
}

impl ReferenceIndex {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn apply(&mut self, worker: WorkerKey, event: &KvEventData) -> Result<(), IndexError> {
        match event {
            KvEventData::Stored {
                parent_hash,
                blocks,
                ..
            } => self.apply_stored(worker, *parent_hash, blocks),
            KvEventData::Removed { block_hashes } => {
                self.apply_removed(worker, block_hashes);
                Ok(())
            }
            KvEventData::Cleared => {
                self.clear_worker_rank(worker);
                Ok(())
            }
        }
    }

    pub fn apply_stored(
        &mut self,
        worker: WorkerKey,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        if blocks.is_empty() {
            return Ok(());
        }
        let held = self.workers.entry(worker).or_default();
        let mut at = match parent {
            None => None,
            Some(hash) => match held.by_engine.get(&hash) {
                Some(&path) => Some(path),
                None => {
                    return Err(IndexError::UnknownParent {
                        worker,
                        parent: hash,
                    })
                }
            },
        };
        for block in blocks {
            let path = path_id(at, block.tokens_hash);
            if let Some(old) = held.by_engine.insert(block.block_hash, path) {
                if old != path {
                    held.positions.remove(&old);
                }
            }
            held.positions.insert(path);
            at = Some(path);
        }
        Ok(())
    }

    pub fn apply_removed(&mut self, worker: WorkerKey, block_hashes: &[u64]) {
        if let Some(held) = self.workers.get_mut(&worker) {
            for hash in block_hashes {
                if let Some(path) = held.by_engine.remove(hash) {
                    held.positions.remove(&path);
                }
            }
        }
    }

    pub fn clear_worker_rank(&mut self, worker: WorkerKey) {
        if let Some(held) = self.workers.get_mut(&worker) {
            *held = Held::default();
        }
    }

    pub fn remove_worker(&mut self, worker_id: u64) {
        self.workers.retain(|key, _| key.0 != worker_id);
    }

    /// Per-worker matched depth, workers with depth > 0 only.
    pub fn find_matches(&self, local_hashes: &[u64]) -> BTreeMap<WorkerKey, u32> {
        let mut paths = Vec::with_capacity(local_hashes.len());
        let mut at = None;
        for &content in local_hashes {
            let path = path_id(at, content);
            paths.push(path);
            at = Some(path);
        }
        let mut scores = BTreeMap::new();
        for (key, held) in &self.workers {
            let depth = paths
                .iter()
                .take_while(|path| held.positions.contains(path))
                .count();
            if depth > 0 {
                scores.insert(*key, depth as u32);
            }
        }
        scores
    }

    /// Blocks held, summed over workers.
    pub fn blocks(&self) -> usize {
        self.workers.values().map(|held| held.positions.len()).sum()
    }
}
