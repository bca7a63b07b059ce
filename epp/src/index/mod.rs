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
//! # Design
//! - Positions are stored as **segments** (module `segments`): a segment is a run of consecutive
//!   positions of one chain, kept as two parallel words per block (content key, holder bitset
//!   with one bit per worker slot; 64 slots per word). A chain that diverges becomes a child
//!   segment keyed by `(segment, offset, content)` in a lock-free child table. A lookup walks a
//!   segment with one compare and one AND per block, probes the child table only where the
//!   request leaves a segment, and stops as soon as no worker is left.
//! - Lookups take no lock and write nothing: blocks are written before a segment's length is
//!   published (release/acquire), holder bits change by atomic or/and, and nothing is freed or
//!   reused while the generation is published.
//! - Writes are serialized per worker (a mutex per worker slot holding that worker's engine-hash
//!   map, module `engine_map`); writers of different workers run concurrently and meet only on holder
//!   words, a segment's append lock and the child table's CAS. A store whose parent is its
//!   segment's last block appends in place (holder bit preset, no atomic).
//! - Dead blocks (no holder) are dropped by a **compaction** that builds the next generation
//!   behind a gate excluding writers only (readers finish on the old generation, swapped through
//!   an `ArcSwap`). It is stop-the-world for writers: see docs/BENCHMARKS.md, "KV index replay",
//!   for what that costs and how incremental reclamation would remove it.

mod engine_map;
pub mod hash;
pub mod reference;
mod segments;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use kvroute_proto::events::{KvEventData, StoredBlock};
use parking_lot::{Mutex, RwLock};

use engine_map::EngineMap;
use hash::MixBuild;
use segments::{Gen, Seg, GONE, MIN_CAP, ROOT_SEG};

/// A worker as the index knows it: `(worker_id, dp_rank)`.
pub type WorkerKey = (u64, u32);

/// Most `(worker, dp rank)` pairs registered at once.
pub const MAX_WORKER_SLOTS: usize = 1024;
const MAX_WIDTH: usize = MAX_WORKER_SLOTS / 64;
/// Initial child-table capacity; it grows at compactions.
const INITIAL_CHILDREN: usize = 1 << 12;
/// Engine-map keys prefetched ahead of the one being applied in a batch.
const PREFETCH_AHEAD: usize = 16;
/// Arena slack before the first compaction, and added to twice the kept size after each.
const COMPACT_SLACK: usize = 1 << 20;

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
    /// Block positions allocated in the arena: live, dead (awaiting compaction) and the room
    /// segments keep for appends.
    pub arena_blocks: usize,
    /// Segments (runs of consecutive chain positions) allocated.
    pub segments: usize,
    /// Registered `(worker, dp rank)` pairs.
    pub workers: usize,
    /// Approximate heap bytes: the table plus the per-worker engine-hash maps.
    pub bytes: usize,
    /// Stores rejected because the worker did not hold their parent.
    pub rejected_stores: u64,
    /// Removed hashes the worker did not hold (or removals for unknown workers).
    pub unknown_removals: u64,
    /// Compactions (dead blocks dropped, child table grown, holder words widened) so far.
    pub compactions: u64,
    /// Writers' total pause in compactions (gate held exclusively), nanoseconds.
    pub compaction_nanos: u64,
    /// Longest single compaction pause, nanoseconds.
    pub max_compaction_nanos: u64,
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
    /// Engine block hash -> block location (`segment << 32 | offset`). Removals and parent
    /// links resolve through it.
    engine: EngineMap,
    /// Positions whose holder bit this worker has set.
    held: usize,
}

fn loc(seg: u32, off: u32) -> u64 {
    ((seg as u64) << 32) | off as u64
}

fn unloc(at: u64) -> (u32, u32) {
    ((at >> 32) as u32, at as u32)
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
    gen: ArcSwap<Gen>,
    /// Writers hold it shared for one event; a compaction holds it exclusively.
    gate: RwLock<()>,
    /// Arena size past which the next store compacts.
    compact_at: AtomicUsize,
    /// Arena blocks allowed past twice the kept size before compacting again.
    slack: usize,
    registry: ArcSwap<Registry>,
    admin: Mutex<Admin>,
    lanes: Box<[Mutex<Lane>]>,
    rejected_stores: AtomicU64,
    unknown_removals: AtomicU64,
    compactions: AtomicU64,
    compaction_nanos: AtomicU64,
    max_compaction_nanos: AtomicU64,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new()
    }
}

/// Why a store must leave the gate and compact first.
enum NeedCompaction {
    Width(usize),
    Room,
}

impl KvIndex {
    pub fn new() -> Self {
        Self::with_compaction_slack(COMPACT_SLACK)
    }

    /// An index that compacts once its arena passes twice the blocks kept at the last
    /// compaction plus `slack` blocks (default 1 Mi blocks, 16 MiB at 64 workers). Small values
    /// trade CPU for memory; tests use them to compact often.
    pub fn with_compaction_slack(slack: usize) -> Self {
        KvIndex {
            gen: ArcSwap::from_pointee(Gen::new(1, INITIAL_CHILDREN)),
            gate: RwLock::new(()),
            compact_at: AtomicUsize::new(slack),
            slack,
            registry: ArcSwap::from_pointee(Registry::default()),
            admin: Mutex::new(Admin::default()),
            lanes: (0..MAX_WORKER_SLOTS)
                .map(|_| Mutex::new(Lane::default()))
                .collect(),
            rejected_stores: AtomicU64::new(0),
            unknown_removals: AtomicU64::new(0),
            compactions: AtomicU64::new(0),
            compaction_nanos: AtomicU64::new(0),
            max_compaction_nanos: AtomicU64::new(0),
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
        let need = blocks.len();
        loop {
            let bit = self.register(worker)?;
            let gate = self.gate.read();
            let gen = self.gen.load();
            let need_compaction = if (bit as usize) >= gen.width * 64 {
                Some(NeedCompaction::Width(bit as usize / 64 + 1))
            } else if gen.arena_blocks() + need + MIN_CAP > self.compact_at.load(Ordering::Relaxed)
                || gen.segments() + need >= segments::MAX_SEGMENTS
            {
                Some(NeedCompaction::Room)
            } else if gen.children.reserved.fetch_add(need, Ordering::Relaxed) + need
                > gen.children.limit
            {
                gen.children.reserved.fetch_sub(need, Ordering::Relaxed);
                Some(NeedCompaction::Room)
            } else {
                None
            };
            if let Some(why) = need_compaction {
                drop(gen);
                drop(gate);
                let width = match why {
                    NeedCompaction::Width(width) => width,
                    NeedCompaction::Room => 0,
                };
                self.compact(need, width);
                continue;
            }
            let mut lane = self.lanes[bit as usize].lock();
            if lane.owner != Some(worker) {
                // The worker was removed (or is being removed) since we resolved its slot.
                drop(lane);
                gen.children.reserved.fetch_sub(need, Ordering::Relaxed);
                drop(gen);
                drop(gate);
                std::thread::yield_now();
                continue;
            }
            let mut children = 0usize;
            let result = store_locked(&gen, &mut lane, bit, parent, blocks, &mut children);
            gen.children
                .reserved
                .fetch_sub(need - children, Ordering::Relaxed);
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
        let gen = self.gen.load();
        let mut lane = self.lanes[bit as usize].lock();
        if lane.owner != Some(worker) {
            self.unknown_removals
                .fetch_add(block_hashes.len() as u64, Ordering::Relaxed);
            return;
        }
        let mut unknown = 0u64;
        let mut released = 0usize;
        let stride = gen.stride();
        let word = 1 + (bit >> 6) as usize;
        let mask = 1u64 << (bit & 63);
        // An eviction burst is mostly consecutive blocks of one segment: resolve the segment's
        // words once per run of them.
        let mut cached: (u32, &[std::sync::atomic::AtomicU64]) = (u32::MAX, &[]);
        for (i, hash) in block_hashes.iter().enumerate() {
            // Two-stage pipeline: the map slot of a key far ahead, then the holder word of a
            // key half as far ahead (its map slot is in cache by now), so both misses overlap.
            if let Some(ahead) = block_hashes.get(i + PREFETCH_AHEAD) {
                lane.engine.prefetch(*ahead);
            }
            if let Some(near) = block_hashes.get(i + PREFETCH_AHEAD / 2) {
                if let Some(at) = lane.engine.get(*near) {
                    let (seg, off) = unloc(at);
                    if let Some(cell) = gen.words(gen.seg(seg)).get(off as usize * stride + word) {
                        prefetch_word(cell);
                    }
                }
            }
            match lane.engine.remove(*hash) {
                Some(at) => {
                    let (seg, off) = unloc(at);
                    if cached.0 != seg {
                        cached = (seg, gen.words(gen.seg(seg)));
                    }
                    if let Some(cell) = cached.1.get(off as usize * stride + word) {
                        // Only this worker's writer (we hold its lane) changes this bit, so a
                        // plain read tells whether it is set, and the clear need not return
                        // the old word (one `lock and`, not a compare-exchange loop).
                        if cell.load(Ordering::Relaxed) & mask != 0 {
                            cell.fetch_and(!mask, Ordering::Release);
                            released += 1;
                        }
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
        let gen = self.gen.load();
        let mut lane = self.lanes[bit as usize].lock();
        if lane.owner == Some(worker) {
            clear_lane(&gen, &mut lane, bit);
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
                let gen = self.gen.load();
                let mut lane = self.lanes[bit as usize].lock();
                if lane.owner != Some(key) {
                    continue;
                }
                clear_lane(&gen, &mut lane, bit);
                lane.owner = None;
                lane.engine = EngineMap::default();
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
        let Some(&first) = local_hashes.first() else {
            return;
        };
        let gen = self.gen.load();
        let Some(mut seg_id) = gen.children.find(ROOT_SEG, 0, first) else {
            return;
        };
        let width = gen.width;
        let stride = gen.stride();
        let n = local_hashes.len();
        let mut alive = [0u64; MAX_WIDTH];
        alive[..width].fill(u64::MAX);
        let mut registry = None;
        let mut report = |bits: &[u64], depth: usize, out: &mut Vec<(WorkerKey, u32)>| {
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
                        out.push((*key, depth as u32));
                    }
                }
            }
        };
        let mut pos = 0usize;
        let mut off = 0usize;
        loop {
            let seg: &Seg = gen.seg(seg_id);
            let len = seg.len.load(Ordering::Acquire) as usize;
            let words = gen.words(seg);
            // Clamp against a torn view; never index past the segment.
            let len = len.min(words.len() / stride);
            if width == 1 {
                // The common case (up to 64 worker slots): two words per block, read in order.
                let mut alive0 = alive[0];
                while off < len && pos < n {
                    let at = off * 2;
                    if words[at].load(Ordering::Relaxed) != local_hashes[pos] {
                        break;
                    }
                    let held = words[at + 1].load(Ordering::Acquire);
                    let dropped = alive0 & !held;
                    if dropped != 0 {
                        report(&[dropped], pos, out);
                        alive0 &= held;
                        if alive0 == 0 {
                            return;
                        }
                    }
                    off += 1;
                    pos += 1;
                }
                alive[0] = alive0;
            } else {
                while off < len && pos < n {
                    let at = off * stride;
                    if words[at].load(Ordering::Relaxed) != local_hashes[pos] {
                        break;
                    }
                    let mut dropped = [0u64; MAX_WIDTH];
                    let mut any_dropped = 0;
                    let mut any_alive = 0;
                    for w in 0..width {
                        let held = words[at + 1 + w].load(Ordering::Acquire);
                        dropped[w] = alive[w] & !held;
                        alive[w] &= held;
                        any_dropped |= dropped[w];
                        any_alive |= alive[w];
                    }
                    if any_dropped != 0 {
                        report(&dropped[..width], pos, out);
                    }
                    if any_alive == 0 {
                        return;
                    }
                    off += 1;
                    pos += 1;
                }
            }
            if pos == n {
                break;
            }
            // The request leaves this segment here: a child continues it or nothing does.
            match gen.children.find(seg_id, off as u32, local_hashes[pos]) {
                Some(child) => {
                    seg_id = child;
                    off = 0;
                }
                None => break,
            }
        }
        report(&alive[..width], pos, out);
    }

    pub fn stats(&self) -> IndexStats {
        let gen = self.gen.load();
        let registry = self.registry.load();
        let mut blocks = 0usize;
        let mut bytes = gen.bytes();
        for &bit in registry.by_key.values() {
            let lane = self.lanes[bit as usize].lock();
            blocks += lane.held;
            bytes += lane.engine.capacity() * 16;
        }
        IndexStats {
            blocks,
            arena_blocks: gen.arena_blocks(),
            segments: gen.segments(),
            workers: registry.by_key.len(),
            bytes,
            rejected_stores: self.rejected_stores.load(Ordering::Relaxed),
            unknown_removals: self.unknown_removals.load(Ordering::Relaxed),
            compactions: self.compactions.load(Ordering::Relaxed),
            compaction_nanos: self.compaction_nanos.load(Ordering::Relaxed),
            max_compaction_nanos: self.max_compaction_nanos.load(Ordering::Relaxed),
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

    /// Build the next generation (dead blocks dropped, room for a store of `extra` blocks, at
    /// least `width` holder words) and remap every worker's engine map. Excludes writers;
    /// readers go on with the old generation until the new one is published.
    fn compact(&self, extra: usize, width: usize) {
        let _gate = self.gate.write();
        let old = self.gen.load_full();
        let width = width.max(old.width).min(MAX_WIDTH);
        let room = old.arena_blocks() + extra + MIN_CAP <= self.compact_at.load(Ordering::Relaxed)
            && old.segments() + extra < segments::MAX_SEGMENTS
            && old.children.reserved.load(Ordering::Relaxed) + extra <= old.children.limit;
        if room && width == old.width {
            // Another writer compacted while we waited for the gate.
            return;
        }
        let started = std::time::Instant::now();
        let mut lanes: Vec<_> = self.lanes.iter().map(|lane| lane.lock()).collect();
        let pinned = lanes
            .iter()
            .flat_map(|lane| lane.engine.values().map(unloc))
            .collect::<Vec<_>>();
        let (gen, remap) = old.compact(pinned.into_iter(), width, extra);
        for lane in lanes.iter_mut() {
            for at in lane.engine.values_mut() {
                let (seg, off) = unloc(*at);
                let seg = remap.get(seg as usize).copied().unwrap_or(GONE);
                // Every pinned location survives by construction.
                debug_assert_ne!(seg, GONE);
                *at = loc(seg, off);
            }
        }
        self.compact_at.store(
            gen.arena_blocks() * 2 + 2 * (extra + MIN_CAP) + self.slack,
            Ordering::Relaxed,
        );
        self.gen.store(Arc::new(gen));
        self.compactions.fetch_add(1, Ordering::Relaxed);
        let pause = started.elapsed().as_nanos() as u64;
        self.compaction_nanos.fetch_add(pause, Ordering::Relaxed);
        self.max_compaction_nanos
            .fetch_max(pause, Ordering::Relaxed);
    }
}

/// Hint the CPU to fetch the cache line holding `word` for writing soon.
#[inline(always)]
fn prefetch_word(word: &std::sync::atomic::AtomicU64) {
    #[cfg(target_arch = "x86_64")]
    {
        let ptr = word as *const std::sync::atomic::AtomicU64 as *const i8;
        // SAFETY: a prefetch is a hint that never faults; the pointer comes from a reference.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ptr);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = word;
}

/// Clear worker slot `bit` at a block; true when it was set.
#[inline]
fn clear_bit(gen: &Gen, at: u64, bit: u32) -> bool {
    let (seg, off) = unloc(at);
    let words = gen.words(gen.seg(seg));
    let index = off as usize * gen.stride() + 1 + (bit >> 6) as usize;
    let mask = 1u64 << (bit & 63);
    // The caller holds the worker's lane: nobody else changes this bit (see apply_removed).
    words.get(index).is_some_and(|word| {
        let set = word.load(Ordering::Relaxed) & mask != 0;
        if set {
            word.fetch_and(!mask, Ordering::Release);
        }
        set
    })
}

/// Set worker slot `bit` at a block; true when it was clear.
#[inline]
fn set_bit(gen: &Gen, at: u64, bit: u32) -> bool {
    let (seg, off) = unloc(at);
    let words = gen.words(gen.seg(seg));
    let index = off as usize * gen.stride() + 1 + (bit >> 6) as usize;
    let mask = 1u64 << (bit & 63);
    // The caller holds the worker's lane: nobody else changes this bit.
    words.get(index).is_some_and(|word| {
        let clear = word.load(Ordering::Relaxed) & mask == 0;
        if clear {
            word.fetch_or(mask, Ordering::Release);
        }
        clear
    })
}

/// Record `engine -> at` for the worker; a hash re-used at another position releases the old.
#[inline]
fn bind(gen: &Gen, lane: &mut Lane, bit: u32, engine: u64, at: u64) {
    if let Some(old) = lane.engine.insert(engine, at) {
        if old != at && clear_bit(gen, old, bit) {
            lane.held -= 1;
        }
    }
}

/// Capacity of a new segment for a store with `remaining` blocks still to place: room for a
/// decode tail to append in place, rounded to whole cache lines, not to a power of two (which
/// wastes a quarter of the arena on average).
fn cap_for(remaining: usize) -> usize {
    (remaining + 2 * MIN_CAP).next_multiple_of(MIN_CAP)
}

/// The child segment continuing `(seg, k)` with `content`, created if absent (block 0 written,
/// no holder yet). Counts creations in `children`.
fn child(gen: &Gen, seg: u32, k: u32, content: u64, remaining: usize, children: &mut usize) -> u32 {
    if let Some(child) = gen.children.find(seg, k, content) {
        return child;
    }
    let parent_off = k.saturating_sub(1);
    let Some(id) = gen.alloc_seg(seg, parent_off, cap_for(remaining)) else {
        // Arena address space exhausted (compaction keeps this from happening): fall back to
        // waiting for whoever holds the slot, which find_or_insert does.
        return gen.children.find_or_insert(seg, k, content, || ROOT_SEG).0;
    };
    let target = gen.seg(id);
    let words = gen.words(target);
    if let Some(word) = words.first() {
        word.store(content, Ordering::Relaxed);
    }
    target.len.store(1, Ordering::Release);
    let (child, created) = gen.children.find_or_insert(seg, k, content, || id);
    // A lost race leaves `id` unreachable and unheld; the next compaction drops it.
    *children += created as usize;
    child
}

/// Store a chain under the lane's lock. Returns the unknown parent hash on rejection.
fn store_locked(
    gen: &Gen,
    lane: &mut Lane,
    bit: u32,
    parent: Option<u64>,
    blocks: &[StoredBlock],
    children: &mut usize,
) -> Result<(), u64> {
    let mut cur: Option<(u32, u32)> = match parent {
        None => None,
        Some(hash) => match lane.engine.get(hash) {
            Some(at) => Some(unloc(at)),
            None => return Err(hash),
        },
    };
    let stride = gen.stride();
    let word = 1 + (bit >> 6) as usize;
    let mask = 1u64 << (bit & 63);
    let mut i = 0;
    while i < blocks.len() {
        let block = &blocks[i];
        if let Some(ahead) = blocks.get(i + PREFETCH_AHEAD) {
            lane.engine.prefetch(ahead.block_hash);
        }
        let remaining = blocks.len() - i;
        let next = match cur {
            None => (
                child(gen, ROOT_SEG, 0, block.tokens_hash, remaining, children),
                0,
            ),
            Some((seg_id, off)) => {
                let seg = gen.seg(seg_id);
                let k = off as usize + 1;
                let len = seg.len.load(Ordering::Acquire) as usize;
                let words = gen.words(seg);
                if k < len {
                    if words[k * stride].load(Ordering::Relaxed) == block.tokens_hash {
                        (seg_id, k as u32)
                    } else {
                        (
                            child(
                                gen,
                                seg_id,
                                k as u32,
                                block.tokens_hash,
                                remaining,
                                children,
                            ),
                            0,
                        )
                    }
                } else if k == len && k < seg.cap() {
                    // The parent is the segment's last block: append in place, as many blocks
                    // as fit, holder bit preset (nobody can see them before `len` moves).
                    let guard = seg.lock.lock();
                    if seg.len.load(Ordering::Acquire) as usize != k {
                        drop(guard);
                        continue; // someone appended meanwhile: look again
                    }
                    let m = remaining.min(seg.cap() - k);
                    for (j, b) in blocks[i..i + m].iter().enumerate() {
                        let at = (k + j) * stride;
                        words[at].store(b.tokens_hash, Ordering::Relaxed);
                        for w in 1..stride {
                            words[at + w]
                                .store(if w == word { mask } else { 0 }, Ordering::Relaxed);
                        }
                    }
                    seg.len.store((k + m) as u32, Ordering::Release);
                    drop(guard);
                    for (j, b) in blocks[i..i + m].iter().enumerate() {
                        if let Some(ahead) = blocks.get(i + j + PREFETCH_AHEAD) {
                            lane.engine.prefetch(ahead.block_hash);
                        }
                        lane.held += 1;
                        bind(gen, lane, bit, b.block_hash, loc(seg_id, (k + j) as u32));
                    }
                    cur = Some((seg_id, (k + m - 1) as u32));
                    i += m;
                    continue;
                } else {
                    (
                        child(
                            gen,
                            seg_id,
                            k as u32,
                            block.tokens_hash,
                            remaining,
                            children,
                        ),
                        0,
                    )
                }
            }
        };
        let at = loc(next.0, next.1);
        if set_bit(gen, at, bit) {
            lane.held += 1;
        }
        bind(gen, lane, bit, block.block_hash, at);
        cur = Some(next);
        i += 1;
    }
    Ok(())
}

fn clear_lane(gen: &Gen, lane: &mut Lane, bit: u32) {
    for at in lane.engine.take_values() {
        clear_bit(gen, at, bit);
    }
    lane.held = 0;
}
