//! The node table: one slot per distinct block position (a block identified by its exact
//! `(parent slot, content hash)` pair), open addressing with linear probing, and the holder
//! bitset of the position inline in the slot.
//!
//! Concurrency contract (enforced by [`super::KvIndex`]):
//! - Readers (lookups) never lock and never write. A slot, once `LIVE`, never changes its
//!   locator, content or parent while this table is published; only its holder words change,
//!   one bit per worker slot, by atomic or/and.
//! - Writers of different workers insert concurrently: a slot is claimed by CAS from `EMPTY` to
//!   `BUSY`, filled, then published with a release store of `LIVE | parent`.
//! - Slots are never deleted in place (no tombstones, no reuse while readers may hold an index):
//!   a slot whose holder words are all zero is *dead* and simply matches nobody. Dead slots are
//!   dropped when the owner rebuilds the table ([`Table::rebuild`]) with every writer excluded.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::hash::bucket;

/// Parent index of blocks at position 0.
pub(crate) const ROOT: u32 = u32::MAX;

const EMPTY: u64 = 0;
const BUSY: u64 = 1;
const LIVE: u64 = 2;

const META: usize = 0;
const LOCATOR: usize = 1;
const CONTENT: usize = 2;
const HOLDERS: usize = 3;

/// Eight words: slots of stride 4 sit two per cache line and never straddle one.
#[repr(C, align(64))]
struct Line([AtomicU64; 8]);

impl Line {
    fn empty() -> Self {
        Line(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

pub(crate) struct Table {
    lines: Box<[Line]>,
    /// `64 - log2(capacity)`: the locator's top bits pick the home bucket.
    shift: u32,
    mask: usize,
    /// Words per slot: header (3) + holder words, rounded so slots stay cache-line aligned.
    stride: usize,
    /// Holder words per slot (64 worker slots each).
    width: usize,
    /// Slots claimed or reserved by in-flight stores; the owner rebuilds past `limit`.
    pub(crate) reserved: AtomicUsize,
    pub(crate) limit: usize,
}

/// Words per slot for `width` holder words.
fn stride_for(width: usize) -> usize {
    let words = HOLDERS + width;
    if words <= 4 {
        4
    } else {
        words.div_ceil(8) * 8
    }
}

impl Table {
    /// A table of `capacity` slots (a power of two) with `width` holder words per slot.
    pub(crate) fn new(capacity: usize, width: usize) -> Self {
        debug_assert!(capacity.is_power_of_two());
        let stride = stride_for(width);
        let lines = (capacity * stride).div_ceil(8);
        Table {
            lines: (0..lines).map(|_| Line::empty()).collect(),
            shift: 64 - capacity.trailing_zeros(),
            mask: capacity - 1,
            stride,
            width,
            reserved: AtomicUsize::new(0),
            // Linear probing stays short below ~3/4 load.
            limit: capacity / 4 * 3,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.mask + 1
    }

    pub(crate) fn width(&self) -> usize {
        self.width
    }

    pub(crate) fn bytes(&self) -> usize {
        self.lines.len() * std::mem::size_of::<Line>()
    }

    #[inline(always)]
    fn word(&self, slot: usize, offset: usize) -> &AtomicU64 {
        let index = slot * self.stride + offset;
        &self.lines[index >> 3].0[index & 7]
    }

    #[inline(always)]
    pub(crate) fn home(&self, locator: u64) -> usize {
        bucket(locator, self.shift) & self.mask
    }

    /// Hint the CPU to fetch the home slot of `locator`: lookups compute locators ahead of the
    /// probe, so several slots' cache misses overlap instead of serialising.
    #[inline(always)]
    pub(crate) fn prefetch(&self, locator: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let ptr = self.word(self.home(locator), META) as *const AtomicU64 as *const i8;
            // SAFETY: prefetch is a hint; it never faults and reads no memory architecturally.
            // The pointer comes from a live reference into this table.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ptr);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = locator;
    }

    #[inline(always)]
    pub(crate) fn locator(&self, slot: u32) -> u64 {
        self.word(slot as usize, LOCATOR).load(Ordering::Relaxed)
    }

    #[inline(always)]
    pub(crate) fn parent(&self, slot: u32) -> u32 {
        (self.word(slot as usize, META).load(Ordering::Acquire) >> 32) as u32
    }

    #[inline(always)]
    pub(crate) fn holder_word(&self, slot: u32, word: usize) -> u64 {
        self.word(slot as usize, HOLDERS + word)
            .load(Ordering::Acquire)
    }

    /// The slot of the block `content` under `parent`, whose locator is `locator`.
    #[inline(always)]
    pub(crate) fn find(&self, locator: u64, content: u64, parent: u32) -> Option<u32> {
        let mut slot = self.home(locator);
        loop {
            let meta = self.word(slot, META).load(Ordering::Acquire);
            if meta == EMPTY {
                return None;
            }
            // A BUSY slot is being filled by a writer: it is not (yet) this block for a
            // reader, and the probe goes on past it exactly as past any other key.
            if meta & LIVE != 0
                && (meta >> 32) as u32 == parent
                && self.word(slot, LOCATOR).load(Ordering::Relaxed) == locator
                && self.word(slot, CONTENT).load(Ordering::Relaxed) == content
            {
                return Some(slot as u32);
            }
            slot = (slot + 1) & self.mask;
        }
    }

    /// The slot of the block, claimed if absent. Returns `(slot, inserted)`. The caller has
    /// reserved room (`reserved` below `limit`), so an empty slot always exists.
    pub(crate) fn find_or_insert(&self, locator: u64, content: u64, parent: u32) -> (u32, bool) {
        let mut slot = self.home(locator);
        loop {
            let cell = self.word(slot, META);
            let mut meta = cell.load(Ordering::Acquire);
            if meta == EMPTY {
                match cell.compare_exchange(EMPTY, BUSY, Ordering::Acquire, Ordering::Acquire) {
                    Ok(_) => {
                        self.word(slot, LOCATOR).store(locator, Ordering::Relaxed);
                        self.word(slot, CONTENT).store(content, Ordering::Relaxed);
                        cell.store(((parent as u64) << 32) | LIVE, Ordering::Release);
                        return (slot as u32, true);
                    }
                    Err(actual) => meta = actual,
                }
            }
            // Another writer is filling this slot: it may be inserting this very block, so wait
            // for it (a few stores away) rather than insert a duplicate further on.
            while meta == BUSY {
                std::hint::spin_loop();
                meta = cell.load(Ordering::Acquire);
            }
            if (meta >> 32) as u32 == parent
                && self.word(slot, LOCATOR).load(Ordering::Relaxed) == locator
                && self.word(slot, CONTENT).load(Ordering::Relaxed) == content
            {
                return (slot as u32, false);
            }
            slot = (slot + 1) & self.mask;
        }
    }

    /// Set worker slot `bit`'s holder bit; true when it was clear.
    #[inline(always)]
    pub(crate) fn set_bit(&self, slot: u32, bit: u32) -> bool {
        let mask = 1u64 << (bit & 63);
        let word = self.word(slot as usize, HOLDERS + (bit >> 6) as usize);
        word.fetch_or(mask, Ordering::Release) & mask == 0
    }

    /// Clear worker slot `bit`'s holder bit; true when it was set.
    #[inline(always)]
    pub(crate) fn clear_bit(&self, slot: u32, bit: u32) -> bool {
        let mask = 1u64 << (bit & 63);
        let word = self.word(slot as usize, HOLDERS + (bit >> 6) as usize);
        word.fetch_and(!mask, Ordering::Release) & mask != 0
    }

    fn is_live(&self, slot: usize) -> bool {
        self.word(slot, META).load(Ordering::Acquire) & LIVE != 0
    }

    fn has_holders(&self, slot: usize) -> bool {
        (0..self.width).any(|w| self.word(slot, HOLDERS + w).load(Ordering::Acquire) != 0)
    }

    /// Build a new table holding every slot that still matters: slots some worker holds, slots
    /// named in `pinned` (engine hashes a worker may still store under), and every ancestor of
    /// those (a child is matched by its parent's slot, so the parent must survive). Returns the
    /// table, sized for `extra` more slots, and the old-to-new slot map (`ROOT` for dropped slots).
    ///
    /// Must run with every writer excluded; readers may keep using `self` meanwhile.
    pub(crate) fn rebuild(&self, pinned: &[u32], width: usize, extra: usize) -> (Table, Vec<u32>) {
        let capacity = self.capacity();
        let mut keep = vec![false; capacity];
        for (slot, kept) in keep.iter_mut().enumerate() {
            *kept = self.is_live(slot) && self.has_holders(slot);
        }
        for &slot in pinned {
            if let Some(kept) = keep.get_mut(slot as usize) {
                *kept = true;
            }
        }
        // Ancestor closure: a walk stops at a slot already kept, whose own chain is (or will be,
        // when the scan reaches it) walked in turn.
        for slot in 0..capacity {
            if !keep[slot] {
                continue;
            }
            let mut parent = self.parent(slot as u32);
            while parent != ROOT && !keep[parent as usize] {
                keep[parent as usize] = true;
                parent = self.parent(parent);
            }
        }
        let kept = keep.iter().filter(|k| **k).count();
        // Room for `extra` more, and to grow to about twice the kept set before the next
        // rebuild (the limit is 3/4 of the capacity).
        let new_capacity = ((kept + extra) * 8 / 3).max(1024).next_power_of_two();
        let table = Table::new(new_capacity, width);
        let mut remap = vec![ROOT; capacity];
        for slot in 0..capacity {
            if !keep[slot] {
                continue;
            }
            let locator = self.word(slot, LOCATOR).load(Ordering::Relaxed);
            let mut target = table.home(locator);
            while table.word(target, META).load(Ordering::Relaxed) != EMPTY {
                target = (target + 1) & table.mask;
            }
            // Placeholder until parents are remapped below; nobody reads the new table yet.
            table.word(target, META).store(BUSY, Ordering::Relaxed);
            table
                .word(target, LOCATOR)
                .store(locator, Ordering::Relaxed);
            table.word(target, CONTENT).store(
                self.word(slot, CONTENT).load(Ordering::Relaxed),
                Ordering::Relaxed,
            );
            for w in 0..self.width.min(width) {
                table.word(target, HOLDERS + w).store(
                    self.word(slot, HOLDERS + w).load(Ordering::Relaxed),
                    Ordering::Relaxed,
                );
            }
            remap[slot] = target as u32;
        }
        for slot in 0..capacity {
            if !keep[slot] {
                continue;
            }
            let parent = self.parent(slot as u32);
            let parent = if parent == ROOT {
                ROOT
            } else {
                remap[parent as usize]
            };
            table
                .word(remap[slot] as usize, META)
                .store(((parent as u64) << 32) | LIVE, Ordering::Relaxed);
        }
        table.reserved.store(kept, Ordering::Relaxed);
        (table, remap)
    }

    /// Slots in use (live or dead), for stats.
    pub(crate) fn used(&self) -> usize {
        self.reserved.load(Ordering::Relaxed)
    }
}
