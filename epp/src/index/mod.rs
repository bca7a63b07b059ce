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
//! - `Stored` whose `parent_hash` the worker does not name (never stored, removed, cleared):
//!   rejected whole with [`IndexError::UnknownParent`], nothing applied, counted in
//!   [`IndexStats::rejected_stores`]. The chain's position cannot be known without the parent.
//! - `Stored` of an engine hash the worker already holds elsewhere: the block *moves* (the old
//!   position is released), as an engine re-using a hash means the old block is gone.
//! - Two engine hashes naming one position ("twins"): the position is held until either name
//!   is removed (the reference index and `kv-index`'s reference behave the same way).
//! - `Removed` of a hash the worker does not hold, or for an unknown worker: ignored, counted in
//!   [`IndexStats::unknown_removals`]. `Cleared` of an unknown worker: no-op.
//!
//! # Design
//! - Positions are stored as **segments** (module `segments`): a run of consecutive positions
//!   of one chain as one array of content keys, a child table where chains leave it (module
//!   `children`), and one holder entry per worker slot with that worker's consecutive depth in
//!   the segment. A lookup compares a segment's contents as an array, reads its holder entries
//!   once, probes the child table only where the request leaves the segment, and stops as soon
//!   as no worker is left.
//! - Writes are serialized per worker (a mutex per worker slot, module `holds`): the worker's
//!   engine-hash map and its per-segment bitsets are private to it, so a store or removal of a
//!   block is a map operation and a bit flip in memory no other writer touches; the only shared
//!   writes are one depth store per (event, segment) and the reference counts when a worker
//!   starts or stops naming blocks in a segment. A store whose parent is its segment's last
//!   block appends in place under the segment's lock.
//! - Lookups take no lock and write nothing in the index; they pin an epoch (crossbeam-epoch)
//!   for their walk.
//! - Memory is reclaimed as it dies, with no pause: a segment is freed when no worker names a
//!   block in it and it has no live child, after every reader that could see it has unpinned.

mod children;
mod engine_map;
pub mod hash;
mod holds;
pub mod reference;
mod segments;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use kvroute_proto::events::{KvEventData, StoredBlock};
use parking_lot::Mutex;

use hash::MixBuild;
use holds::{unloc, Lane};
use segments::{Seg, SegCounters, HINTED_SLOTS, MIN_CAP};

/// A worker as the index knows it: `(worker_id, dp_rank)`.
pub type WorkerKey = (u64, u32);

/// Most `(worker, dp rank)` pairs registered at once.
pub const MAX_WORKER_SLOTS: usize = 1024;
const MAX_WIDTH: usize = MAX_WORKER_SLOTS / 64;
/// Engine-map keys prefetched ahead of the one being applied in a batch.
const PREFETCH_AHEAD: usize = 8;

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
    /// Block positions allocated in live segments: held, unheld and the room segments keep
    /// for appends.
    pub arena_blocks: usize,
    /// Live segments (runs of consecutive chain positions).
    pub segments: usize,
    /// Segments freed since the index was made (nothing named a block in them any more).
    pub segments_reclaimed: usize,
    /// Registered `(worker, dp rank)` pairs.
    pub workers: usize,
    /// Approximate heap bytes: segments, child tables and the workers' private maps.
    pub bytes: usize,
    /// Stores rejected because the worker did not hold their parent.
    pub rejected_stores: u64,
    /// Removed hashes the worker did not hold (or removals for unknown workers).
    pub unknown_removals: u64,
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

/// Worker registration, published as an immutable snapshot so that lookups and writers resolve
/// keys without taking a lock.
#[derive(Default, Clone)]
struct Registry {
    by_key: HashMap<WorkerKey, u32, MixBuild>,
    by_slot: Vec<Option<WorkerKey>>,
    /// Registered slots as a bitset: where a lookup's set of candidates starts.
    mask: [u64; MAX_WIDTH],
}

impl Registry {
    fn set(&mut self, slot: u32, key: Option<WorkerKey>) {
        let slot = slot as usize;
        if self.by_slot.len() <= slot {
            self.by_slot.resize(slot + 1, None);
        }
        self.by_slot[slot] = key;
        let bit = 1u64 << (slot % 64);
        match key {
            Some(key) => {
                self.by_key.insert(key, slot as u32);
                self.mask[slot / 64] |= bit;
            }
            None => self.mask[slot / 64] &= !bit,
        }
    }
}

#[derive(Default)]
struct Admin {
    /// Freed slots, reused oldest first so a lookup racing a removal is unlikely to attribute
    /// a stale depth to the slot's next owner.
    free: VecDeque<u32>,
    next: u32,
}

/// The concurrent KV index. `Send + Sync`; share it through an `Arc`.
pub struct KvIndex {
    root: Box<Seg>,
    registry: ArcSwap<Registry>,
    admin: Mutex<Admin>,
    lanes: Box<[Mutex<Lane>]>,
    counters: SegCounters,
    rejected_stores: AtomicU64,
    unknown_removals: AtomicU64,
}

// SAFETY: the segment tree is shared under the contract in `segments` (immutable published
// contents, atomics, locks for structural changes, epoch-deferred frees); the raw pointers it
// holds are what makes the auto traits opt out.
unsafe impl Send for KvIndex {}
// SAFETY: as above.
unsafe impl Sync for KvIndex {}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for KvIndex {
    fn drop(&mut self) {
        // No reader or writer remains (`&mut self`); dead segments were unlinked and handed to
        // the collector already.
        self.root.free_descendants();
    }
}

/// Length of the common prefix of `have` and `want`, known to be at least `from` (clamped to
/// both lengths). Compares eight words per step without a branch inside, so long hits go at
/// memory speed.
#[inline]
fn common_prefix(have: &[u64], want: &[u64], from: usize) -> usize {
    let n = have.len().min(want.len());
    let mut m = from.min(n);
    const STEP: usize = 8;
    while m + STEP <= n {
        let diff = have[m..m + STEP]
            .iter()
            .zip(&want[m..m + STEP])
            .fold(0u64, |acc, (a, b)| acc | (a ^ b));
        if diff != 0 {
            break;
        }
        m += STEP;
    }
    while m < n && have[m] == want[m] {
        m += 1;
    }
    m
}

/// Capacity of a new segment for a store with `remaining` blocks still to place: room for a
/// decode tail to append in place, rounded to whole cache lines.
fn cap_for(remaining: usize) -> usize {
    (remaining + 2 * MIN_CAP).next_multiple_of(MIN_CAP)
}

impl KvIndex {
    pub fn new() -> Self {
        KvIndex {
            root: Seg::root(),
            registry: ArcSwap::from_pointee(Registry::default()),
            admin: Mutex::new(Admin::default()),
            lanes: (0..MAX_WORKER_SLOTS)
                .map(|_| Mutex::new(Lane::default()))
                .collect(),
            counters: SegCounters::default(),
            rejected_stores: AtomicU64::new(0),
            unknown_removals: AtomicU64::new(0),
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
            let slot = self.register(worker)?;
            let mut lane = self.lanes[slot as usize].lock();
            if lane.owner != Some(worker) {
                // The worker was removed (or is being removed) since we resolved its slot.
                drop(lane);
                std::thread::yield_now();
                continue;
            }
            let guard = crossbeam_epoch::pin();
            let result = self.store_locked(&mut lane, slot, parent, blocks, &guard);
            lane.settle(&self.counters, &guard);
            return result.map_err(|parent| {
                self.rejected_stores.fetch_add(1, Ordering::Relaxed);
                IndexError::UnknownParent { worker, parent }
            });
        }
    }

    /// Place a chain under the lane's lock. Returns the unknown parent hash on rejection.
    fn store_locked(
        &self,
        lane: &mut Lane,
        slot: u32,
        parent: Option<u64>,
        blocks: &[StoredBlock],
        guard: &crossbeam_epoch::Guard,
    ) -> Result<(), u64> {
        // Where the chain continues from: (hold, offset) of the last placed block.
        let mut cur: Option<(u32, u32)> = match parent {
            None => None,
            Some(hash) => match lane.engine.get(hash) {
                Some(at) => Some(unloc(at)),
                None => return Err(hash),
            },
        };
        let n = blocks.len();
        let mut i = 0;
        while i < n {
            let content = blocks[i].tokens_hash;
            let (parent_seg, k) = match cur {
                None => (&*self.root, 0usize),
                Some((hold, off)) => (lane.hold(hold).seg(guard), off as usize + 1),
            };
            if let Some((hold, _)) = cur {
                let published = parent_seg.published();
                if k < published.len() && published[k].load(Ordering::Relaxed) == content {
                    // The chain follows blocks already in this segment: name them as far as
                    // they match.
                    let mut j = k;
                    while j < published.len()
                        && i < n
                        && published[j].load(Ordering::Relaxed) == blocks[i].tokens_hash
                    {
                        if let Some(ahead) = blocks.get(i + PREFETCH_AHEAD) {
                            lane.engine.prefetch(ahead.block_hash);
                        }
                        lane.name(hold, j as u32, blocks[i].block_hash);
                        j += 1;
                        i += 1;
                    }
                    cur = Some((hold, j as u32 - 1));
                    continue;
                }
                if k == published.len() && k < parent_seg.cap() {
                    // The parent is the segment's last block: append in place.
                    let lock = parent_seg.lock.lock();
                    if parent_seg.len.load(Ordering::Acquire) as usize != k {
                        drop(lock);
                        continue; // someone appended meanwhile: look again
                    }
                    let m = (n - i).min(parent_seg.cap() - k);
                    parent_seg.append_locked(k, blocks[i..i + m].iter().map(|b| b.tokens_hash));
                    drop(lock);
                    for (j, block) in blocks[i..i + m].iter().enumerate() {
                        if let Some(ahead) = blocks.get(i + j + PREFETCH_AHEAD) {
                            lane.engine.prefetch(ahead.block_hash);
                        }
                        lane.name(hold, (k + j) as u32, block.block_hash);
                    }
                    cur = Some((hold, (k + m - 1) as u32));
                    i += m;
                    continue;
                }
            }
            // The chain leaves the segment here (or starts at the root): a child continues it.
            let child =
                parent_seg.acquire_child(k as u32, content, cap_for(n - i), &self.counters, guard);
            let hold = lane.hold_acquired(child, slot, &self.counters);
            lane.name(hold, 0, blocks[i].block_hash);
            cur = Some((hold, 0));
            i += 1;
        }
        Ok(())
    }

    /// Forget the named blocks of `worker`; hashes it does not hold are ignored and counted.
    pub fn apply_removed(&self, worker: WorkerKey, block_hashes: &[u64]) {
        let Some(slot) = self.slot_of(worker) else {
            self.unknown_removals
                .fetch_add(block_hashes.len() as u64, Ordering::Relaxed);
            return;
        };
        let mut lane = self.lanes[slot as usize].lock();
        if lane.owner != Some(worker) {
            self.unknown_removals
                .fetch_add(block_hashes.len() as u64, Ordering::Relaxed);
            return;
        }
        let mut unknown = 0u64;
        for (i, hash) in block_hashes.iter().enumerate() {
            if let Some(ahead) = block_hashes.get(i + PREFETCH_AHEAD) {
                lane.engine.prefetch(*ahead);
            }
            if !lane.remove(*hash) {
                unknown += 1;
            }
        }
        let guard = crossbeam_epoch::pin();
        lane.settle(&self.counters, &guard);
        if unknown > 0 {
            self.unknown_removals.fetch_add(unknown, Ordering::Relaxed);
        }
    }

    /// Forget every block of one `(worker, dp rank)` (the engine cleared its cache). The slot
    /// stays registered.
    pub fn clear_worker_rank(&self, worker: WorkerKey) {
        let Some(slot) = self.slot_of(worker) else {
            return;
        };
        let mut lane = self.lanes[slot as usize].lock();
        if lane.owner == Some(worker) {
            let guard = crossbeam_epoch::pin();
            lane.clear(&self.counters, &guard);
        }
    }

    /// Forget every block of every dp rank of `worker_id` and free their slots.
    pub fn remove_worker(&self, worker_id: u64) {
        let registry = self.registry.load_full();
        let ranks: Vec<(WorkerKey, u32)> = registry
            .by_key
            .iter()
            .filter(|(key, _)| key.0 == worker_id)
            .map(|(key, slot)| (*key, *slot))
            .collect();
        for (key, slot) in ranks {
            {
                let mut lane = self.lanes[slot as usize].lock();
                if lane.owner != Some(key) {
                    continue;
                }
                let guard = crossbeam_epoch::pin();
                lane.clear(&self.counters, &guard);
                lane.owner = None;
            }
            let mut admin = self.admin.lock();
            let mut next = (*self.registry.load_full()).clone();
            if next.by_key.get(&key) == Some(&slot) {
                next.by_key.remove(&key);
                next.set(slot, None);
                admin.free.push_back(slot);
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
        let Some(&first) = local_hashes.first() else {
            return;
        };
        let guard = crossbeam_epoch::pin();
        let Some(mut seg) = self.root.find_child(0, first, &guard) else {
            return;
        };
        let registry = self.registry.load();
        let width = registry.by_slot.len().div_ceil(64).clamp(1, MAX_WIDTH);
        let report = |slot: usize, depth: usize, out: &mut Vec<(WorkerKey, u32)>| {
            if depth > 0 {
                if let Some(Some(key)) = registry.by_slot.get(slot) {
                    out.push((*key, depth as u32));
                }
            }
        };
        let report_word = |w: usize, mut word: u64, depth: usize, out: &mut Vec<_>| {
            while word != 0 {
                report(w * 64 + word.trailing_zeros() as usize, depth, out);
                word &= word - 1;
            }
        };
        let n = local_hashes.len();
        // Registered slots only, so that the first segments test nobody else.
        let mut alive = registry.mask;
        let mut pos = 0usize;
        loop {
            // Block 0 matches by construction (it is the child's key).
            let m = common_prefix(seg.published_words(), &local_hashes[pos..], 1);
            // Workers that hold the whole matched stretch go on; the others stop inside it.
            let mut keep = [0u64; MAX_WIDTH];
            let entries = seg.entry_count();
            // With one slot word every slot ever used is below 64, so a segment has at most 64
            // entries and each has its index in the header (checked, not assumed).
            if width == 1
                && entries <= HINTED_SLOTS
                && (alive[0].count_ones() as usize) * 2 < entries
            {
                // Few workers left among many entries: read theirs through the header's index.
                let mut left = alive[0];
                while left != 0 {
                    let slot = left.trailing_zeros() as usize;
                    let bit = left & left.wrapping_neg();
                    left &= left - 1;
                    let depth = seg
                        .hinted_entry(slot)
                        .map_or(0, |e| e.depth.load(Ordering::Acquire) as usize);
                    if depth >= m {
                        keep[0] |= bit;
                    } else {
                        report(slot, pos + depth, out);
                        alive[0] &= !bit;
                    }
                }
            } else {
                for entry in seg.holders() {
                    let slot = entry.slot.load(Ordering::Relaxed) as usize;
                    let (w, bit) = (slot / 64, 1u64 << (slot % 64));
                    if w >= width || alive[w] & bit == 0 {
                        continue;
                    }
                    let depth = entry.depth.load(Ordering::Acquire) as usize;
                    if depth >= m {
                        keep[w] |= bit;
                    } else {
                        report(slot, pos + depth, out);
                        alive[w] &= !bit;
                    }
                }
            }
            let mut any = 0u64;
            for w in 0..width {
                // Alive but without an entry here: they hold none of this segment.
                if pos > 0 {
                    report_word(w, alive[w] & !keep[w], pos, out);
                }
                alive[w] = keep[w];
                any |= keep[w];
            }
            if any == 0 {
                return;
            }
            pos += m;
            if pos == n {
                break;
            }
            match seg.find_child(m as u32, local_hashes[pos], &guard) {
                Some(child) => seg = child,
                None => break,
            }
        }
        for (w, &word) in alive.iter().enumerate().take(width) {
            report_word(w, word, pos, out);
        }
    }

    pub fn stats(&self) -> IndexStats {
        let registry = self.registry.load();
        let mut blocks = 0usize;
        let mut bytes = self.counters.bytes.load(Ordering::Relaxed);
        for &slot in registry.by_key.values() {
            let lane = self.lanes[slot as usize].lock();
            blocks += lane.held;
            bytes += lane.bytes();
        }
        IndexStats {
            blocks,
            arena_blocks: self.counters.blocks.load(Ordering::Relaxed),
            segments: self.counters.segments.load(Ordering::Relaxed),
            segments_reclaimed: self.counters.reclaimed.load(Ordering::Relaxed),
            workers: registry.by_key.len(),
            bytes,
            rejected_stores: self.rejected_stores.load(Ordering::Relaxed),
            unknown_removals: self.unknown_removals.load(Ordering::Relaxed),
        }
    }

    /// The worker's slot, if registered.
    fn slot_of(&self, worker: WorkerKey) -> Option<u32> {
        self.registry.load().by_key.get(&worker).copied()
    }

    /// The worker's slot, registering it on first use.
    fn register(&self, worker: WorkerKey) -> Result<u32, IndexError> {
        if let Some(slot) = self.slot_of(worker) {
            return Ok(slot);
        }
        let mut admin = self.admin.lock();
        let current = self.registry.load_full();
        if let Some(&slot) = current.by_key.get(&worker) {
            return Ok(slot);
        }
        let slot = match admin.free.pop_front() {
            Some(slot) => slot,
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
        *self.lanes[slot as usize].lock() = Lane::new(worker);
        let mut next = (*current).clone();
        next.set(slot, Some(worker));
        self.registry.store(Arc::new(next));
        Ok(slot)
    }
}
