//! The global KV index: which worker (and data-parallel rank) holds which prefix of which
//! prompt, fed by the engines' KV events and asked, per request, how many leading blocks of the
//! request each worker holds.
//!
//! # What it owns
//! - [`KvIndex`]: the concurrent, exact index the EPP scores every request with.
//! - [`reference::ReferenceIndex`]: a small single-threaded model of the same contract, the
//!   oracle for the property tests, the concurrent replay test and the benchmark's cross-check.
//!
//! # Contract
//! A worker *holds* a block position when it stored a block there and has not removed it. A
//! position is the block's whole content path: the content keys (`tokens_hash`) of every block
//! from position 0 to it, so equal chunk hashes at different positions, or under different
//! parents, are different positions. [`KvIndex::find_matches`] scores each worker with the
//! number of leading request blocks it holds *consecutively from block 0*: a worker that evicted
//! a block in the middle of a chain scores up to the hole and no further, and scores past it
//! again once it stores that block again.
//!
//! # Semantics of bad or out-of-order input (the index is never corrupted by it)
//! - `Stored` whose `parent_hash` the worker does not hold (never stored, removed, cleared):
//!   rejected whole with [`IndexError::UnknownParent`], nothing applied, counted in
//!   [`IndexStats::rejected_stores`]. The chain's position cannot be known without the parent.
//! - `Stored` of an engine hash the worker already holds elsewhere: the block *moves* (the old
//!   position is released), as an engine re-using a hash means the old block is gone.
//! - Two engine hashes naming one position ("twins"): the position is held until either name
//!   is removed (the reference index and `kv-index`'s reference behave the same way).
//! - `Removed` of a hash the worker does not hold, or for an unknown worker: ignored, counted in
//!   [`IndexStats::unknown_removals`]. `Cleared` of an unknown worker: no-op.
//!
//! # Design (why it is fast)
//! - One flat open-addressing table of block positions ([`table`]): a slot is matched on its
//!   exact `(parent slot, content hash)` and carries the holder bitset inline (one bit per
//!   worker slot; 64 workers fit the 32-byte slot). A lookup walks the request's blocks with
//!   one probe per block; probe addresses come from a cheap chained locator computed ahead, so
//!   the probes' cache misses overlap (prefetch), and it stops as soon as no worker is left.
//! - Lookups take no lock and write nothing: slots are immutable once published except for
//!   holder bits (atomic or/and), and dead slots stay in place until a rebuild.
//! - Writes are serialized per worker (a mutex per worker slot holding that worker's engine
//!   hash map); writers of different workers run concurrently and only meet on the atomic
//!   holder words and the CAS that claims a new slot.
//! - The table is rebuilt (grown, dead slots dropped, or widened for more than 64 worker slots)
//!   behind a gate that excludes writers only; readers keep reading the old table until the new
//!   one is published through an `ArcSwap`.

pub mod hash;
pub mod reference;
mod table;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use kvroute_proto::events::{KvEventData, StoredBlock};
use parking_lot::{Mutex, RwLock};

use hash::{step, MixBuild, ROOT_LOCATOR};
use table::{Table, ROOT};

/// A worker as the index knows it: `(worker_id, dp_rank)`.
pub type WorkerKey = (u64, u32);

/// Most `(worker, dp rank)` pairs registered at once.
pub const MAX_WORKER_SLOTS: usize = 1024;
const MAX_WIDTH: usize = MAX_WORKER_SLOTS / 64;
/// Initial table capacity (slots); the table grows by rebuilding.
const INITIAL_CAPACITY: usize = 1 << 14;
/// Locators computed (and their slots prefetched) ahead of the probe in a lookup.
const AHEAD: usize = 8;

/// Per-worker matched depth: consecutive blocks from block 0 held, for workers with depth > 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    pub scores: HashMap<WorkerKey, u32>,
}

impl OverlapScores {
    pub fn get(&self, worker: &WorkerKey) -> u32 {
        self.scores.get(worker).copied().unwrap_or(0)
    }
}

/// Matched depth of `worker` in `scores` (0 when it matched nothing).
pub fn overlap_of(scores: &OverlapScores, worker: WorkerKey) -> u32 {
    scores.get(&worker)
}

/// Size and health counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Blocks held, summed over workers (a block two workers hold counts twice).
    pub blocks: usize,
    /// Table slots in use: distinct positions, plus dead ones awaiting the next rebuild.
    pub slots_used: usize,
    pub table_capacity: usize,
    /// Registered `(worker, dp rank)` pairs.
    pub workers: usize,
    /// Approximate heap bytes: the table plus the per-worker engine-hash maps.
    pub bytes: usize,
    /// Stores rejected because the worker did not hold their parent.
    pub rejected_stores: u64,
    /// Removed hashes the worker did not hold (or removals for unknown workers).
    pub unknown_removals: u64,
    /// Table rebuilds so far.
    pub rebuilds: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IndexError {
    #[error(
        "stored event for worker {worker:?} names parent block {parent:#x}, which that worker \
         does not hold; event rejected"
    )]
    UnknownParent { worker: WorkerKey, parent: u64 },
    #[error("every one of the index's {max} worker slots is in use")]
    TooManyWorkers { max: usize },
}

/// One worker slot's private state, behind its mutex: the writer's view of what it holds.
#[derive(Default)]
struct Lane {
    /// Which worker owns this slot now; a writer that resolved the slot before a removal sees
    /// the change here and resolves again instead of writing into a freed slot.
    owner: Option<WorkerKey>,
    /// Engine block hash -> table slot. Removals and parent links resolve through it.
    engine: HashMap<u64, u32, MixBuild>,
    /// Positions whose holder bit this worker has set.
    held: usize,
}

/// Worker registration, published as an immutable snapshot so that lookups and writers resolve
/// keys without taking a lock.
#[derive(Default, Clone)]
struct Registry {
    by_key: HashMap<WorkerKey, u32, MixBuild>,
    by_slot: Vec<Option<WorkerKey>>,
}

#[derive(Default)]
struct Admin {
    /// Freed slots, reused oldest first so a lookup racing a removal is unlikely to attribute
    /// a stale bit to the slot's next owner.
    free: VecDeque<u32>,
    next: u32,
}

/// The concurrent KV index. `Send + Sync`; share it through an `Arc`.
pub struct KvIndex {
    table: ArcSwap<Table>,
    /// Writers hold it shared for one event; a rebuild holds it exclusively.
    gate: RwLock<()>,
    registry: ArcSwap<Registry>,
    admin: Mutex<Admin>,
    lanes: Box<[Mutex<Lane>]>,
    rejected_stores: AtomicU64,
    unknown_removals: AtomicU64,
    rebuilds: AtomicU64,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl KvIndex {
    pub fn new() -> Self {
        KvIndex {
            table: ArcSwap::from_pointee(Table::new(INITIAL_CAPACITY, 1)),
            gate: RwLock::new(()),
            registry: ArcSwap::from_pointee(Registry::default()),
            admin: Mutex::new(Admin::default()),
            lanes: (0..MAX_WORKER_SLOTS)
                .map(|_| Mutex::new(Lane::default()))
                .collect(),
            rejected_stores: AtomicU64::new(0),
            unknown_removals: AtomicU64::new(0),
            rebuilds: AtomicU64::new(0),
        }
    }

    /// Apply one KV event of `worker`. Events of one worker must be applied in order (the
    /// caller serializes them; concurrent calls for one worker are safe but race each other).
    /// `Stored` uses `blocks[i].tokens_hash` as the content key.
    pub fn apply(&self, worker: WorkerKey, event: &KvEventData) -> Result<(), IndexError> {
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

    /// Store `blocks` (a chain, each the next block of the one before) after the worker's block
    /// `parent` (position 0 when `None`).
    pub fn apply_stored(
        &self,
        worker: WorkerKey,
        parent: Option<u64>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        if blocks.is_empty() {
            return Ok(());
        }
        loop {
            let bit = self.register(worker)?;
            let gate = self.gate.read();
            let table = self.table.load();
            let need = blocks.len();
            if (bit as usize) >= table.width() * 64
                || table.reserved.fetch_add(need, Ordering::Relaxed) + need > table.limit
            {
                if (bit as usize) < table.width() * 64 {
                    table.reserved.fetch_sub(need, Ordering::Relaxed);
                }
                drop(table);
                drop(gate);
                self.rebuild(need, bit as usize / 64 + 1);
                continue;
            }
            let mut lane = self.lanes[bit as usize].lock();
            if lane.owner != Some(worker) {
                // The worker was removed (or is being removed) since we resolved its slot.
                drop(lane);
                table.reserved.fetch_sub(need, Ordering::Relaxed);
                drop(table);
                drop(gate);
                std::thread::yield_now();
                continue;
            }
            let mut inserted = 0usize;
            let result = store_locked(&table, &mut lane, bit, parent, blocks, &mut inserted);
            table.reserved.fetch_sub(need - inserted, Ordering::Relaxed);
            return match result {
                Ok(()) => Ok(()),
                Err(parent) => {
                    self.rejected_stores.fetch_add(1, Ordering::Relaxed);
                    Err(IndexError::UnknownParent { worker, parent })
                }
            };
        }
    }

    /// Forget the named blocks of `worker`; hashes it does not hold are ignored and counted.
    pub fn apply_removed(&self, worker: WorkerKey, block_hashes: &[u64]) {
        let Some(bit) = self.slot_of(worker) else {
            self.unknown_removals
                .fetch_add(block_hashes.len() as u64, Ordering::Relaxed);
            return;
        };
        let _gate = self.gate.read();
        let table = self.table.load();
        let mut lane = self.lanes[bit as usize].lock();
        if lane.owner != Some(worker) {
            self.unknown_removals
                .fetch_add(block_hashes.len() as u64, Ordering::Relaxed);
            return;
        }
        let mut unknown = 0u64;
        let mut released = 0usize;
        for hash in block_hashes {
            match lane.engine.remove(hash) {
                Some(slot) => {
                    if table.clear_bit(slot, bit) {
                        released += 1;
                    }
                }
                None => unknown += 1,
            }
        }
        lane.held -= released;
        if unknown > 0 {
            self.unknown_removals.fetch_add(unknown, Ordering::Relaxed);
        }
    }

    /// Forget every block of one `(worker, dp rank)` (the engine cleared its cache). The slot
    /// stays registered.
    pub fn clear_worker_rank(&self, worker: WorkerKey) {
        let Some(bit) = self.slot_of(worker) else {
            return;
        };
        let _gate = self.gate.read();
        let table = self.table.load();
        let mut lane = self.lanes[bit as usize].lock();
        if lane.owner == Some(worker) {
            clear_lane(&table, &mut lane, bit);
        }
    }

    /// Forget every block of every dp rank of `worker_id` and free their slots.
    pub fn remove_worker(&self, worker_id: u64) {
        let registry = self.registry.load_full();
        let ranks: Vec<(WorkerKey, u32)> = registry
            .by_key
            .iter()
            .filter(|(key, _)| key.0 == worker_id)
            .map(|(key, bit)| (*key, *bit))
            .collect();
        for (key, bit) in ranks {
            {
                let _gate = self.gate.read();
                let table = self.table.load();
                let mut lane = self.lanes[bit as usize].lock();
                if lane.owner != Some(key) {
                    continue;
                }
                clear_lane(&table, &mut lane, bit);
                lane.owner = None;
                lane.engine = HashMap::default();
            }
            let mut admin = self.admin.lock();
            let mut next = (*self.registry.load_full()).clone();
            if next.by_key.get(&key) == Some(&bit) {
                next.by_key.remove(&key);
                next.by_slot[bit as usize] = None;
                admin.free.push_back(bit);
                self.registry.store(Arc::new(next));
            }
        }
    }

    /// Per-worker matched depth of the request whose blocks have the content keys
    /// `local_hashes` (consecutive from block 0), for workers with depth > 0.
    pub fn find_matches(&self, local_hashes: &[u64]) -> OverlapScores {
        let mut out = Vec::new();
        self.find_matches_into(local_hashes, &mut out);
        OverlapScores {
            scores: out.into_iter().collect(),
        }
    }

    /// [`find_matches`](Self::find_matches) into a caller's buffer (cleared first), in no
    /// particular order; allocates nothing once the buffer has room.
    pub fn find_matches_into(&self, local_hashes: &[u64], out: &mut Vec<(WorkerKey, u32)>) {
        out.clear();
        let n = local_hashes.len();
        if n == 0 {
            return;
        }
        let table = self.table.load();
        let width = table.width();
        let mut alive = [0u64; MAX_WIDTH];
        alive[..width].fill(u64::MAX);
        let mut registry = None;
        let mut report = |bits: &[u64], depth: u32, out: &mut Vec<(WorkerKey, u32)>| {
            if depth == 0 {
                return;
            }
            let registry = registry.get_or_insert_with(|| self.registry.load());
            for (w, &word) in bits.iter().enumerate() {
                let mut word = word;
                while word != 0 {
                    let bit = w * 64 + word.trailing_zeros() as usize;
                    word &= word - 1;
                    if let Some(Some(key)) = registry.by_slot.get(bit) {
                        out.push((*key, depth));
                    }
                }
            }
        };

        // Locators of the next AHEAD positions, their home slots prefetched.
        let mut ring = [0u64; AHEAD];
        let mut ahead = ROOT_LOCATOR;
        let mut computed = 0usize;
        while computed < n.min(AHEAD) {
            ahead = step(ahead, local_hashes[computed]);
            ring[computed % AHEAD] = ahead;
            table.prefetch(ahead);
            computed += 1;
        }
        let mut parent = ROOT;
        let mut position = 0usize;
        while position < n {
            let locator = ring[position % AHEAD];
            if computed < n {
                ahead = step(ahead, local_hashes[computed]);
                ring[computed % AHEAD] = ahead;
                table.prefetch(ahead);
                computed += 1;
            }
            let Some(slot) = table.find(locator, local_hashes[position], parent) else {
                break;
            };
            let mut dropped = [0u64; MAX_WIDTH];
            let mut any_alive = 0u64;
            let mut any_dropped = 0u64;
            for w in 0..width {
                let held = table.holder_word(slot, w);
                dropped[w] = alive[w] & !held;
                alive[w] &= held;
                any_alive |= alive[w];
                any_dropped |= dropped[w];
            }
            if any_dropped != 0 {
                report(&dropped[..width], position as u32, out);
            }
            if any_alive == 0 {
                return;
            }
            parent = slot;
            position += 1;
        }
        report(&alive[..width], position as u32, out);
    }

    pub fn stats(&self) -> IndexStats {
        let table = self.table.load();
        let registry = self.registry.load();
        let mut blocks = 0usize;
        let mut bytes = table.bytes();
        for &bit in registry.by_key.values() {
            let lane = self.lanes[bit as usize].lock();
            blocks += lane.held;
            // hashbrown: 16-byte entry plus one control byte per bucket.
            bytes += lane.engine.capacity() * 17;
        }
        IndexStats {
            blocks,
            slots_used: table.used(),
            table_capacity: table.capacity(),
            workers: registry.by_key.len(),
            bytes,
            rejected_stores: self.rejected_stores.load(Ordering::Relaxed),
            unknown_removals: self.unknown_removals.load(Ordering::Relaxed),
            rebuilds: self.rebuilds.load(Ordering::Relaxed),
        }
    }

    /// The worker's slot, if registered.
    fn slot_of(&self, worker: WorkerKey) -> Option<u32> {
        self.registry.load().by_key.get(&worker).copied()
    }

    /// The worker's slot, registering it on first use.
    fn register(&self, worker: WorkerKey) -> Result<u32, IndexError> {
        if let Some(bit) = self.slot_of(worker) {
            return Ok(bit);
        }
        let mut admin = self.admin.lock();
        let current = self.registry.load_full();
        if let Some(&bit) = current.by_key.get(&worker) {
            return Ok(bit);
        }
        let bit = match admin.free.pop_front() {
            Some(bit) => bit,
            None if (admin.next as usize) < MAX_WORKER_SLOTS => {
                admin.next += 1;
                admin.next - 1
            }
            None => {
                return Err(IndexError::TooManyWorkers {
                    max: MAX_WORKER_SLOTS,
                })
            }
        };
        {
            let mut lane = self.lanes[bit as usize].lock();
            *lane = Lane {
                owner: Some(worker),
                ..Lane::default()
            };
        }
        let mut next = (*current).clone();
        next.by_key.insert(worker, bit);
        if next.by_slot.len() <= bit as usize {
            next.by_slot.resize(bit as usize + 1, None);
        }
        next.by_slot[bit as usize] = Some(worker);
        self.registry.store(Arc::new(next));
        Ok(bit)
    }

    /// Rebuild the table with room for `extra` more slots and at least `width` holder words:
    /// drop dead slots, remap every worker's engine map. Excludes writers; readers go on.
    fn rebuild(&self, extra: usize, width: usize) {
        let _gate = self.gate.write();
        let old = self.table.load_full();
        let width = width.max(old.width()).min(MAX_WIDTH);
        let room = old.reserved.load(Ordering::Relaxed) + extra <= old.limit;
        if room && width == old.width() {
            // Another writer rebuilt while we waited for the gate.
            return;
        }
        let mut lanes: Vec<_> = self.lanes.iter().map(|lane| lane.lock()).collect();
        let pinned: Vec<u32> = lanes
            .iter()
            .flat_map(|lane| lane.engine.values().copied())
            .collect();
        let (table, remap) = old.rebuild(&pinned, width, extra);
        for lane in lanes.iter_mut() {
            for slot in lane.engine.values_mut() {
                *slot = remap[*slot as usize];
            }
        }
        self.table.store(Arc::new(table));
        self.rebuilds.fetch_add(1, Ordering::Relaxed);
    }
}

/// Store a chain under the lane's lock. Returns the unknown parent hash on rejection.
fn store_locked(
    table: &Table,
    lane: &mut Lane,
    bit: u32,
    parent: Option<u64>,
    blocks: &[StoredBlock],
    inserted: &mut usize,
) -> Result<(), u64> {
    let (mut parent_slot, mut locator) = match parent {
        None => (ROOT, ROOT_LOCATOR),
        Some(hash) => match lane.engine.get(&hash) {
            Some(&slot) => (slot, table.locator(slot)),
            None => return Err(hash),
        },
    };
    for block in blocks {
        locator = step(locator, block.tokens_hash);
        let (slot, new) = table.find_or_insert(locator, block.tokens_hash, parent_slot);
        *inserted += new as usize;
        if table.set_bit(slot, bit) {
            lane.held += 1;
        }
        if let Some(old) = lane.engine.insert(block.block_hash, slot) {
            // The engine re-used a hash at another position: the old block is gone.
            if old != slot && table.clear_bit(old, bit) {
                lane.held -= 1;
            }
        }
        parent_slot = slot;
    }
    Ok(())
}

fn clear_lane(table: &Table, lane: &mut Lane, bit: u32) {
    for (_, slot) in lane.engine.drain() {
        table.clear_bit(slot, bit);
    }
    lane.held = 0;
}
