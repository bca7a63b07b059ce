//! The indexers the replay drives, behind one trait: our `KvIndex`, SGLang's
//! `kv_index::ChainIndex` (crates.io `kv-index` 2, public API only) and a naive nested-map
//! baseline. Each converts the corpus into its own types in [`Backend::prepare`], before any
//! clock starts, so a trial times the index and nothing else.

use std::collections::{HashMap, HashSet};

use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash};
use kvroute_epp::index::hash::MixBuild;
use kvroute_epp::index::KvIndex;
use kvroute_proto::events::StoredBlock;
use kvroute_proto::hashing::chain_sequence_hash;
use parking_lot::Mutex;

use super::corpus::{Corpus, OpKind, WorkerKey};

/// A corpus event in backend-neutral, pre-resolved form: `worker` is the dense worker index.
#[derive(Debug, Clone, Copy)]
pub enum Event {
    Stored {
        worker: usize,
        parent: Option<u64>,
        start: usize,
        len: usize,
    },
    Removed {
        worker: usize,
        start: usize,
        len: usize,
    },
    Cleared {
        worker: usize,
    },
}

/// What every backend is given: the dense worker table and the corpus slabs.
pub struct Shared<'c> {
    pub corpus: &'c Corpus,
    /// Dense worker index -> key.
    pub workers: Vec<WorkerKey>,
}

impl<'c> Shared<'c> {
    pub fn new(corpus: &'c Corpus) -> Self {
        let mut workers: Vec<WorkerKey> = corpus.ops.iter().map(|op| op.worker).collect();
        workers.sort_unstable();
        workers.dedup();
        Shared { corpus, workers }
    }

    pub fn worker_index(&self, key: WorkerKey) -> usize {
        // Present by construction (built from the same ops).
        self.workers.binary_search(&key).unwrap_or(0)
    }
}

/// One indexer under test. `Lane` is the state an event lane owns (ChainIndex's per-worker
/// block maps); the index itself is shared by every lane.
pub trait Backend: Sync {
    type Lane: Send;
    fn name(&self) -> &'static str;
    fn new_lane(&self) -> Self::Lane;
    fn apply(&self, lane: &mut Self::Lane, event: &Event) -> bool;
    /// Scores of the lookup into `out` as `(worker index, depth)`.
    fn lookup(&self, hashes: &[u64], out: &mut Vec<(usize, u32)>);
    /// Approximate bytes held by the index and the lanes' maps.
    fn memory_bytes(&self, lanes: &[Self::Lane]) -> usize;
    /// Backend-specific remarks after a trial (ours: segments live and reclaimed).
    fn notes(&self) -> String {
        String::new()
    }
}

// ---------------------------------------------------------------------------------------------
// Ours

pub struct Ours<'c> {
    pub index: KvIndex,
    keys: Vec<WorkerKey>,
    /// Worker key -> dense index, with a multiply-fold hasher: the lookup's result conversion
    /// is inside the timed call, so it should cost about what ChainIndex's (a table index) does.
    slot_of: HashMap<WorkerKey, usize, MixBuild>,
    stored: Vec<StoredBlock>,
    hashes: &'c [u64],
}

impl<'c> Ours<'c> {
    pub fn prepare(shared: &Shared<'c>) -> Self {
        Ours {
            index: KvIndex::new(),
            keys: shared.workers.clone(),
            slot_of: shared
                .workers
                .iter()
                .enumerate()
                .map(|(i, k)| (*k, i))
                .collect(),
            stored: shared
                .corpus
                .stored
                .iter()
                .map(|&(block_hash, tokens_hash)| StoredBlock {
                    block_hash,
                    tokens_hash,
                })
                .collect(),
            hashes: &shared.corpus.hashes,
        }
    }
}

impl Backend for Ours<'_> {
    type Lane = ();
    fn name(&self) -> &'static str {
        "kvroute KvIndex"
    }
    fn new_lane(&self) {}
    fn apply(&self, _lane: &mut (), event: &Event) -> bool {
        match *event {
            Event::Stored {
                worker,
                parent,
                start,
                len,
            } => self
                .index
                .apply_stored(self.keys[worker], parent, &self.stored[start..start + len])
                .is_ok(),
            Event::Removed { worker, start, len } => {
                self.index
                    .apply_removed(self.keys[worker], &self.hashes[start..start + len]);
                true
            }
            Event::Cleared { worker } => {
                self.index.clear_worker_rank(self.keys[worker]);
                true
            }
        }
    }
    fn lookup(&self, hashes: &[u64], out: &mut Vec<(usize, u32)>) {
        // Allocation-free: the key-shaped results go through a per-thread buffer.
        thread_local! {
            static SCRATCH: std::cell::RefCell<Vec<(WorkerKey, u32)>> =
                const { std::cell::RefCell::new(Vec::new()) };
        }
        SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            self.index.find_matches_into(hashes, &mut scratch);
            out.clear();
            out.extend(
                scratch
                    .iter()
                    .filter_map(|(k, d)| self.slot_of.get(k).map(|i| (*i, *d))),
            );
        });
    }
    fn memory_bytes(&self, _lanes: &[()]) -> usize {
        self.index.stats().bytes
    }
    fn notes(&self) -> String {
        let stats = self.index.stats();
        format!(
            "{} segments live, {} reclaimed",
            stats.segments, stats.segments_reclaimed
        )
    }
}

// ---------------------------------------------------------------------------------------------
// kv_index::ChainIndex

pub struct Chain {
    pub index: ChainIndex,
    /// Dense worker index -> interned ChainIndex worker id, and back (ids are small and dense,
    /// so the way back is a table: the conversion is inside the timed lookup).
    ids: Vec<u32>,
    by_id: Vec<Option<usize>>,
    stored: Vec<kv_index::StoredBlock>,
    hashes: Vec<SequenceHash>,
}

impl Chain {
    pub fn prepare(shared: &Shared<'_>) -> anyhow::Result<Self> {
        let index = ChainIndex::with_max_workers(shared.workers.len().max(1));
        let mut ids = Vec::new();
        let mut by_id = Vec::new();
        for (i, (worker, rank)) in shared.workers.iter().enumerate() {
            let id = index
                .intern_worker(&format!("w{worker}r{rank}"))
                .map_err(|e| anyhow::anyhow!("ChainIndex intern_worker: {e}"))?;
            ids.push(id);
            if by_id.len() <= id as usize {
                by_id.resize(id as usize + 1, None);
            }
            by_id[id as usize] = Some(i);
        }
        Ok(Chain {
            index,
            ids,
            by_id,
            stored: shared
                .corpus
                .stored
                .iter()
                .map(|&(b, t)| kv_index::StoredBlock {
                    seq_hash: SequenceHash(b),
                    content_hash: ContentHash(t),
                })
                .collect(),
            hashes: shared
                .corpus
                .hashes
                .iter()
                .map(|&h| SequenceHash(h))
                .collect(),
        })
    }
}

/// ChainIndex's per-worker block maps, owned by the lane that applies the worker's events.
pub struct ChainLane {
    maps: Vec<ChainBlockMap>,
}

impl Backend for Chain {
    type Lane = ChainLane;
    fn name(&self) -> &'static str {
        "kv-index ChainIndex"
    }
    fn new_lane(&self) -> ChainLane {
        ChainLane {
            maps: (0..self.ids.len()).map(|_| ChainBlockMap::new()).collect(),
        }
    }
    fn apply(&self, lane: &mut ChainLane, event: &Event) -> bool {
        match *event {
            Event::Stored {
                worker,
                parent,
                start,
                len,
            } => self
                .index
                .apply_stored(
                    self.ids[worker],
                    &self.stored[start..start + len],
                    parent.map(SequenceHash),
                    &mut lane.maps[worker],
                )
                .is_ok(),
            Event::Removed { worker, start, len } => {
                self.index.apply_removed(
                    self.ids[worker],
                    &self.hashes[start..start + len],
                    &mut lane.maps[worker],
                );
                true
            }
            Event::Cleared { worker } => {
                self.index
                    .apply_cleared(self.ids[worker], &mut lane.maps[worker]);
                true
            }
        }
    }
    fn lookup(&self, hashes: &[u64], out: &mut Vec<(usize, u32)>) {
        out.clear();
        // The allocation-free public entry point (find_matches builds a hash map).
        self.index.score_into(
            hashes,
            |h| *h,
            false,
            |id, depth| {
                if let Some(&Some(i)) = self.by_id.get(id as usize) {
                    out.push((i, depth));
                }
            },
        );
    }
    fn memory_bytes(&self, lanes: &[ChainLane]) -> usize {
        let stats = self.index.stats();
        let maps: usize = lanes
            .iter()
            .flat_map(|lane| lane.maps.iter())
            .map(|m| m.capacity() * 17)
            .sum();
        stats.arena_chunk_bytes + stats.slab_bytes + maps
    }
}

// ---------------------------------------------------------------------------------------------
// Naive nested maps

/// The "Python dict ported to Rust" baseline: per worker, engine hash -> prefix hash and the set
/// of prefix hashes held, each behind the worker's mutex; a lookup walks every worker.
pub struct Naive<'c> {
    workers: Vec<Mutex<NaiveWorker>>,
    stored: &'c [(u64, u64)],
    hashes: &'c [u64],
}

#[derive(Default)]
struct NaiveWorker {
    by_engine: HashMap<u64, u64>,
    held: HashSet<u64>,
}

impl<'c> Naive<'c> {
    pub fn prepare(shared: &Shared<'c>) -> Self {
        Naive {
            workers: (0..shared.workers.len())
                .map(|_| Mutex::new(NaiveWorker::default()))
                .collect(),
            stored: &shared.corpus.stored,
            hashes: &shared.corpus.hashes,
        }
    }
}

fn prefix(parent: Option<u64>, content: u64) -> u64 {
    parent.map_or(content, |p| chain_sequence_hash(p, content))
}

impl Backend for Naive<'_> {
    type Lane = ();
    fn name(&self) -> &'static str {
        "naive nested map"
    }
    fn new_lane(&self) {}
    fn apply(&self, _lane: &mut (), event: &Event) -> bool {
        match *event {
            Event::Stored {
                worker,
                parent,
                start,
                len,
            } => {
                let mut w = self.workers[worker].lock();
                let mut at = match parent {
                    None => None,
                    Some(p) => match w.by_engine.get(&p) {
                        Some(&path) => Some(path),
                        None => return false,
                    },
                };
                for &(block, content) in &self.stored[start..start + len] {
                    let path = prefix(at, content);
                    if let Some(old) = w.by_engine.insert(block, path) {
                        if old != path {
                            w.held.remove(&old);
                        }
                    }
                    w.held.insert(path);
                    at = Some(path);
                }
                true
            }
            Event::Removed { worker, start, len } => {
                let mut w = self.workers[worker].lock();
                for h in &self.hashes[start..start + len] {
                    if let Some(path) = w.by_engine.remove(h) {
                        w.held.remove(&path);
                    }
                }
                true
            }
            Event::Cleared { worker } => {
                let mut w = self.workers[worker].lock();
                w.by_engine.clear();
                w.held.clear();
                true
            }
        }
    }
    fn lookup(&self, hashes: &[u64], out: &mut Vec<(usize, u32)>) {
        out.clear();
        let mut paths = Vec::with_capacity(hashes.len());
        let mut at = None;
        for &c in hashes {
            let p = prefix(at, c);
            paths.push(p);
            at = Some(p);
        }
        for (i, w) in self.workers.iter().enumerate() {
            let w = w.lock();
            let depth = paths.iter().take_while(|p| w.held.contains(p)).count();
            if depth > 0 {
                out.push((i, depth as u32));
            }
        }
    }
    fn memory_bytes(&self, _lanes: &[()]) -> usize {
        self.workers
            .iter()
            .map(|w| {
                let w = w.lock();
                w.by_engine.capacity() * 17 + w.held.capacity() * 9
            })
            .sum()
    }
}

/// The corpus's events in neutral form, by op index (`None` for lookups).
pub fn events(shared: &Shared<'_>) -> Vec<Option<Event>> {
    shared
        .corpus
        .ops
        .iter()
        .map(|op| {
            let worker = shared.worker_index(op.worker);
            match op.kind {
                OpKind::Lookup { .. } => None,
                OpKind::Stored { parent, start, len } => Some(Event::Stored {
                    worker,
                    parent,
                    start,
                    len,
                }),
                OpKind::Removed { start, len } => Some(Event::Removed { worker, start, len }),
                OpKind::Cleared => Some(Event::Cleared { worker }),
            }
        })
        .collect()
}
