//! One generation of the index's shared structure: block positions stored as contiguous
//! *segments* (runs of consecutive chain positions), the table of child segments where chains
//! diverge, and the per-block holder bitsets.
//!
//! A position (a block identified by its whole content path) lives in exactly one place: the
//! next offset of its parent's segment, or offset 0 of a child segment keyed by
//! `(parent segment, offset, content)`. Lookups walk a segment as two parallel arrays read in
//! order (content, holder words) and probe the child table only where the request leaves a
//! segment; stores append to the segment of their parent when the parent is its last block.
//!
//! Concurrency contract (enforced by [`super::KvIndex`]):
//! - Nothing a reader can reach is ever freed or reused within a generation: segments only
//!   grow (`len` is published with a release store after the blocks are written), child-table
//!   slots are claimed by CAS and published with a release store, holder words change by atomic
//!   or/and only. A block no worker holds is *dead* and matches nobody.
//! - Appending to a segment and creating a child take the segment's lock; writers of different
//!   workers otherwise meet only on holder words.
//! - Dead blocks are dropped by [`Gen::compact`], which builds the next generation while every
//!   writer is excluded; readers finish on the old one.
//!
//! Invariant that makes appends safe without a child-table probe: a child at offset `k` of a
//! segment exists only if, when it was created, the segment already had a block at `k` (the
//! chain diverged there) or was full (`k == cap`). `len` never shrinks and `cap` is fixed, so a
//! segment with `len == k < cap` has no child at `k`, and appending there cannot duplicate one.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use parking_lot::Mutex;

use super::hash::{bucket, step};

/// The virtual root segment: no blocks; chains start as its children at offset 0.
pub(crate) const ROOT_SEG: u32 = 0;
/// A dropped segment in a compaction's remap.
pub(crate) const GONE: u32 = u32::MAX;

/// Arena chunks grow geometrically: chunk `c` holds `2^(c + BASE_BITS)` elements, so a small
/// index allocates little and a large one few chunks; a directory of 32 never moves, so readers
/// index it without a lock.
const CHUNKS: usize = 32;
const BLOCK_BASE_BITS: u32 = 10;
const SEG_BASE_BITS: u32 = 8;
/// Segments one generation can hold (ids are u32); a store that could pass it compacts first.
pub(crate) const MAX_SEGMENTS: usize = u32::MAX as usize / 2;
/// Blocks one generation can hold (block indices are u32).
const MAX_BLOCKS: u64 = u32::MAX as u64 / 2;
/// Smallest and largest segment capacity (blocks). Room past a store's length lets decode
/// blocks and the next turn of a conversation append in place.
pub(crate) const MIN_CAP: usize = 16;
pub(crate) const MAX_CAP: usize = 1 << 14;

/// Zeroed atomic words straight from the allocator: `vec![0; n]` is a calloc, so the OS hands
/// out zero pages lazily and only the pages actually used are ever faulted in (building the
/// slice with `AtomicU64::new(0)` one by one touches every page of a chunk up front).
pub(crate) fn zeroed_words(n: usize) -> Box<[AtomicU64]> {
    const _: () = assert!(
        std::mem::size_of::<AtomicU64>() == std::mem::size_of::<u64>()
            && std::mem::align_of::<AtomicU64>() == std::mem::align_of::<u64>()
    );
    let words: Box<[u64]> = vec![0u64; n].into_boxed_slice();
    // SAFETY: `AtomicU64` has the same size, alignment (asserted above) and bit validity as
    // `u64`, so a boxed slice of one is a valid boxed slice of the other, freed with the same
    // layout.
    unsafe { Box::from_raw(Box::into_raw(words) as *mut [AtomicU64]) }
}

/// `(chunk, offset)` of element `index` in a geometric arena with first chunk `2^base_bits`.
#[inline(always)]
fn locate(index: usize, base_bits: u32) -> (usize, usize) {
    let q = (index >> base_bits) + 1;
    let chunk = (usize::BITS - 1 - q.leading_zeros()) as usize;
    (chunk, index - (((1usize << chunk) - 1) << base_bits))
}

#[inline(always)]
fn chunk_len(chunk: usize, base_bits: u32) -> usize {
    1usize << (chunk as u32 + base_bits)
}

#[inline(always)]
fn chunk_start(chunk: usize, base_bits: u32) -> usize {
    ((1usize << chunk) - 1) << base_bits
}

/// Segment header. Written once before the segment is published (except `len`).
#[derive(Default)]
pub(crate) struct Seg {
    base: AtomicU32,
    cap: AtomicU32,
    pub(crate) len: AtomicU32,
    parent: AtomicU32,
    parent_off: AtomicU32,
    pub(crate) lock: Mutex<()>,
}

static EMPTY_SEG: Seg = Seg {
    base: AtomicU32::new(0),
    cap: AtomicU32::new(0),
    len: AtomicU32::new(0),
    parent: AtomicU32::new(ROOT_SEG),
    parent_off: AtomicU32::new(0),
    lock: Mutex::new(()),
};

impl Seg {
    pub(crate) fn cap(&self) -> usize {
        self.cap.load(Ordering::Relaxed) as usize
    }
}

/// The child table: `(segment, offset, content) -> child segment`, open addressing, slots of
/// four words `[meta, segment << 32 | offset, content, -]`, claimed by CAS, never deleted.
pub(crate) struct ChildTable {
    slots: Box<[AtomicU64]>,
    shift: u32,
    mask: usize,
    pub(crate) reserved: AtomicUsize,
    pub(crate) limit: usize,
}

const EMPTY: u64 = 0;
const BUSY: u64 = 1;
const LIVE: u64 = 2;

fn child_key(seg: u32, off: u32) -> u64 {
    ((seg as u64) << 32) | off as u64
}

impl ChildTable {
    fn new(capacity: usize) -> Self {
        let capacity = capacity.next_power_of_two().max(64);
        ChildTable {
            slots: zeroed_words(capacity * 4),
            shift: 64 - capacity.trailing_zeros(),
            mask: capacity - 1,
            reserved: AtomicUsize::new(0),
            limit: capacity / 4 * 3,
        }
    }

    fn capacity(&self) -> usize {
        self.mask + 1
    }

    #[inline(always)]
    fn home(&self, key: u64, content: u64) -> usize {
        bucket(step(key, content), self.shift) & self.mask
    }

    #[inline(always)]
    pub(crate) fn find(&self, seg: u32, off: u32, content: u64) -> Option<u32> {
        let key = child_key(seg, off);
        let mut slot = self.home(key, content);
        loop {
            let base = slot * 4;
            let meta = self.slots[base].load(Ordering::Acquire);
            if meta == EMPTY {
                return None;
            }
            if meta & LIVE != 0
                && self.slots[base + 1].load(Ordering::Relaxed) == key
                && self.slots[base + 2].load(Ordering::Relaxed) == content
            {
                return Some((meta >> 32) as u32);
            }
            slot = (slot + 1) & self.mask;
        }
    }

    /// The child, created by `make` if absent (then `true`). The caller reserved room.
    pub(crate) fn find_or_insert(
        &self,
        seg: u32,
        off: u32,
        content: u64,
        make: impl FnOnce() -> u32,
    ) -> (u32, bool) {
        let key = child_key(seg, off);
        let mut slot = self.home(key, content);
        loop {
            let base = slot * 4;
            let cell = &self.slots[base];
            let mut meta = cell.load(Ordering::Acquire);
            if meta == EMPTY {
                match cell.compare_exchange(EMPTY, BUSY, Ordering::Acquire, Ordering::Acquire) {
                    Ok(_) => {
                        self.slots[base + 1].store(key, Ordering::Relaxed);
                        self.slots[base + 2].store(content, Ordering::Relaxed);
                        let child = make();
                        cell.store(((child as u64) << 32) | LIVE, Ordering::Release);
                        return (child, true);
                    }
                    Err(actual) => meta = actual,
                }
            }
            // Another writer is creating a child here, possibly this very one: wait for it.
            while meta == BUSY {
                std::hint::spin_loop();
                meta = cell.load(Ordering::Acquire);
            }
            if self.slots[base + 1].load(Ordering::Relaxed) == key
                && self.slots[base + 2].load(Ordering::Relaxed) == content
            {
                return ((meta >> 32) as u32, false);
            }
            slot = (slot + 1) & self.mask;
        }
    }

    fn entries(&self) -> impl Iterator<Item = (u32, u32, u64, u32)> + '_ {
        (0..self.capacity()).filter_map(move |slot| {
            let base = slot * 4;
            let meta = self.slots[base].load(Ordering::Acquire);
            (meta & LIVE != 0).then(|| {
                let key = self.slots[base + 1].load(Ordering::Relaxed);
                (
                    (key >> 32) as u32,
                    key as u32,
                    self.slots[base + 2].load(Ordering::Relaxed),
                    (meta >> 32) as u32,
                )
            })
        })
    }

    fn bytes(&self) -> usize {
        self.slots.len() * 8
    }
}

/// One generation: block arena, segment slab, child table.
pub(crate) struct Gen {
    /// Holder words per block (64 worker slots each).
    pub(crate) width: usize,
    /// Words per block: content + holder words.
    stride: usize,
    block_dir: Box<[OnceLock<Box<[AtomicU64]>>]>,
    block_next: AtomicU64,
    seg_dir: Box<[OnceLock<Box<[Seg]>>]>,
    seg_next: AtomicU32,
    pub(crate) children: ChildTable,
}

impl Gen {
    pub(crate) fn new(width: usize, children: usize) -> Self {
        let gen = Gen {
            width,
            stride: 1 + width,
            block_dir: (0..CHUNKS).map(|_| OnceLock::new()).collect(),
            block_next: AtomicU64::new(0),
            seg_dir: (0..CHUNKS).map(|_| OnceLock::new()).collect(),
            seg_next: AtomicU32::new(0),
            children: ChildTable::new(children),
        };
        // Segment 0 is the root: no blocks, never appended to (cap 0).
        let root = gen.alloc_seg(ROOT_SEG, 0, 0);
        debug_assert_eq!(root, Some(ROOT_SEG));
        gen
    }

    #[inline(always)]
    pub(crate) fn seg(&self, id: u32) -> &Seg {
        let (chunk, offset) = locate(id as usize, SEG_BASE_BITS);
        match self.seg_dir.get(chunk).and_then(OnceLock::get) {
            Some(segs) => &segs[offset],
            None => &EMPTY_SEG,
        }
    }

    /// The words of a segment's blocks (`cap * stride`), all in one chunk.
    #[inline(always)]
    pub(crate) fn words(&self, seg: &Seg) -> &[AtomicU64] {
        let base = seg.base.load(Ordering::Relaxed) as usize;
        let cap = seg.cap.load(Ordering::Relaxed) as usize;
        let (chunk, offset) = locate(base, BLOCK_BASE_BITS);
        match self.block_dir.get(chunk).and_then(OnceLock::get) {
            Some(words) => {
                let start = offset * self.stride;
                words.get(start..start + cap * self.stride).unwrap_or(&[])
            }
            None => &[],
        }
    }

    #[inline(always)]
    pub(crate) fn stride(&self) -> usize {
        self.stride
    }

    /// A new segment under `(parent, parent_off)` with room for `cap` blocks; `None` when the
    /// arena's address space is exhausted.
    pub(crate) fn alloc_seg(&self, parent: u32, parent_off: u32, cap: usize) -> Option<u32> {
        let cap = cap.min(MAX_CAP);
        let id = self.seg_next.fetch_add(1, Ordering::Relaxed);
        if id as usize >= MAX_SEGMENTS {
            return None;
        }
        let (chunk, offset) = locate(id as usize, SEG_BASE_BITS);
        let segs = self.seg_dir.get(chunk)?.get_or_init(|| {
            (0..chunk_len(chunk, SEG_BASE_BITS))
                .map(|_| Seg::default())
                .collect()
        });
        // A block range that does not straddle a chunk.
        let mut next = self.block_next.load(Ordering::Relaxed);
        let base = loop {
            let mut start = next as usize;
            loop {
                let (chunk, offset) = locate(start, BLOCK_BASE_BITS);
                if offset + cap <= chunk_len(chunk, BLOCK_BASE_BITS) {
                    break;
                }
                start = chunk_start(chunk + 1, BLOCK_BASE_BITS);
            }
            let end = (start + cap) as u64;
            if end > MAX_BLOCKS {
                return None;
            }
            match self.block_next.compare_exchange_weak(
                next,
                end,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break start,
                Err(actual) => next = actual,
            }
        };
        let stride = self.stride;
        let (block_chunk, _) = locate(base, BLOCK_BASE_BITS);
        self.block_dir
            .get(block_chunk)?
            .get_or_init(|| zeroed_words(chunk_len(block_chunk, BLOCK_BASE_BITS) * stride));
        let seg = &segs[offset];
        seg.base.store(base as u32, Ordering::Relaxed);
        seg.cap.store(cap as u32, Ordering::Relaxed);
        seg.len.store(0, Ordering::Relaxed);
        seg.parent.store(parent, Ordering::Relaxed);
        seg.parent_off.store(parent_off, Ordering::Relaxed);
        Some(id)
    }

    /// Blocks handed out so far (live, dead and slack).
    pub(crate) fn arena_blocks(&self) -> usize {
        self.block_next.load(Ordering::Relaxed) as usize
    }

    pub(crate) fn segments(&self) -> usize {
        self.seg_next.load(Ordering::Relaxed) as usize
    }

    pub(crate) fn bytes(&self) -> usize {
        let blocks: usize = self
            .block_dir
            .iter()
            .filter_map(OnceLock::get)
            .map(|words| words.len() * 8)
            .sum();
        let segs: usize = self
            .seg_dir
            .iter()
            .filter_map(OnceLock::get)
            .map(|segs| segs.len() * std::mem::size_of::<Seg>())
            .sum();
        blocks + segs + self.children.bytes()
    }

    /// The next generation: only blocks some worker holds, blocks `pinned` by a worker's
    /// engine map (`(segment, offset)` pairs), and their ancestors, with `width` holder words
    /// and a child table with room for `extra_children` more. Returns the old-to-new segment
    /// map (`GONE` for dropped segments); offsets within kept segments do not change.
    ///
    /// Must run with every writer excluded; readers may keep using `self`.
    pub(crate) fn compact(
        &self,
        pinned: impl Iterator<Item = (u32, u32)>,
        width: usize,
        extra_children: usize,
    ) -> (Gen, Vec<u32>) {
        let segs = self.segments();
        // keep[s]: how many leading blocks of segment s survive.
        let mut keep = vec![0u32; segs];
        for (s, kept) in keep.iter_mut().enumerate().skip(1) {
            let seg = self.seg(s as u32);
            let len = seg.len.load(Ordering::Acquire) as usize;
            let words = self.words(seg);
            for off in (0..len).rev() {
                let at = off * self.stride;
                if (1..self.stride).any(|w| words[at + w].load(Ordering::Relaxed) != 0) {
                    *kept = off as u32 + 1;
                    break;
                }
            }
        }
        for (s, off) in pinned {
            if let Some(kept) = keep.get_mut(s as usize) {
                *kept = (*kept).max(off + 1);
            }
        }
        // Ancestor closure: a child segment is created after its parent, so one pass from the
        // newest segment down carries every requirement to the root.
        for s in (1..segs).rev() {
            if keep[s] == 0 {
                continue;
            }
            let seg = self.seg(s as u32);
            let parent = seg.parent.load(Ordering::Relaxed) as usize;
            if parent != ROOT_SEG as usize {
                let need = seg.parent_off.load(Ordering::Relaxed) + 1;
                keep[parent] = keep[parent].max(need);
            }
        }
        // A segment cut right where a kept child hangs must not be appended to (see the module
        // invariant): it keeps exactly its length as capacity.
        let mut sealed = vec![false; segs];
        let mut live_children = 0usize;
        for (parent, off, _, child) in self.children.entries() {
            if (child as usize) < segs && keep[child as usize] > 0 {
                live_children += 1;
                if keep.get(parent as usize) == Some(&off) {
                    sealed[parent as usize] = true;
                }
            }
        }
        let next = Gen::new(width, (live_children + extra_children) * 8 / 3 + 64);
        let mut remap = vec![GONE; segs];
        remap[ROOT_SEG as usize] = ROOT_SEG;
        for s in 1..segs {
            let len = keep[s] as usize;
            if len == 0 {
                continue;
            }
            let seg = self.seg(s as u32);
            let old_cap = seg.cap();
            let cap = if sealed[s] {
                len
            } else if len < old_cap && seg.len.load(Ordering::Relaxed) as usize == len {
                // Still growing at its end: keep the room it had.
                old_cap
            } else {
                (len + MIN_CAP)
                    .next_multiple_of(MIN_CAP)
                    .min(MAX_CAP)
                    .max(len)
            };
            let parent = remap[seg.parent.load(Ordering::Relaxed) as usize];
            let Some(id) = next.alloc_seg(parent, seg.parent_off.load(Ordering::Relaxed), cap)
            else {
                continue;
            };
            remap[s] = id;
            let from = self.words(seg);
            let target = next.seg(id);
            let to = next.words(target);
            let words = width.min(self.width);
            for off in 0..len {
                let (a, b) = (off * self.stride, off * next.stride);
                to[b].store(from[a].load(Ordering::Relaxed), Ordering::Relaxed);
                for w in 0..words {
                    to[b + 1 + w].store(from[a + 1 + w].load(Ordering::Relaxed), Ordering::Relaxed);
                }
            }
            target.len.store(len as u32, Ordering::Relaxed);
        }
        for (parent, off, content, child) in self.children.entries() {
            let (Some(&p), Some(&c)) = (remap.get(parent as usize), remap.get(child as usize))
            else {
                continue;
            };
            if p != GONE && c != GONE {
                next.children.find_or_insert(p, off, content, || c);
                next.children.reserved.fetch_add(1, Ordering::Relaxed);
            }
        }
        (next, remap)
    }
}
