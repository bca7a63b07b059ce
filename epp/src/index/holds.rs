//! One worker's private view of what it holds, behind its lane lock: the engine-hash map, and
//! per segment it names blocks in, a *hold*: which offsets it holds (a bitset), how many of
//! its engine hashes point into the segment, and its consecutive depth from offset 0, which is
//! the only thing published to readers (the segment's holder entry for this worker's slot).
//!
//! The engine map's values are `hold index << 32 | offset`, so a removal goes from the hash
//! straight to the hold with no segment lookup; holds are only freed when an event is settled,
//! so an index stays valid for the whole event.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use crossbeam_epoch::Guard;

use super::engine_map::EngineMap;
use super::hash::MixBuild;
use super::segments::{HolderEntry, Seg, SegCounters};
use super::WorkerKey;

pub(crate) struct Hold {
    seg: *const Seg,
    entry: *const HolderEntry,
    bits: Vec<u64>,
    /// Engine hashes of this worker pointing into the segment (its reference to the segment
    /// lasts while this is above zero at the end of an event).
    refs: u32,
    /// Consecutive held offsets from 0: what readers see.
    depth: u32,
    dirty: bool,
}

impl Hold {
    #[inline(always)]
    pub(crate) fn seg<'g>(&self, _guard: &'g Guard) -> &'g Seg {
        // SAFETY: a hold keeps a reference to its segment until it is freed in `settle`.
        unsafe { &*self.seg }
    }

    /// Set offset `off`; true when it was clear.
    #[inline(always)]
    fn set(&mut self, off: u32) -> bool {
        let (word, mask) = ((off / 64) as usize, 1u64 << (off % 64));
        let Some(cell) = self.bits.get_mut(word) else {
            return false;
        };
        if *cell & mask != 0 {
            return false;
        }
        *cell |= mask;
        if off == self.depth {
            self.depth = first_clear(&self.bits, off);
        }
        true
    }

    /// Clear offset `off`; true when it was set.
    #[inline(always)]
    fn clear(&mut self, off: u32) -> bool {
        let (word, mask) = ((off / 64) as usize, 1u64 << (off % 64));
        let Some(cell) = self.bits.get_mut(word) else {
            return false;
        };
        if *cell & mask == 0 {
            return false;
        }
        *cell &= !mask;
        if off < self.depth {
            self.depth = off;
        }
        true
    }
}

/// First clear bit at or after `from` (the bitset's length in bits when none).
fn first_clear(bits: &[u64], from: u32) -> u32 {
    let mut word = (from / 64) as usize;
    let mut value = match bits.get(word) {
        Some(&w) => !w & (u64::MAX << (from % 64)),
        None => return from,
    };
    loop {
        if value != 0 {
            return word as u32 * 64 + value.trailing_zeros();
        }
        word += 1;
        match bits.get(word) {
            Some(&w) => value = !w,
            None => return word as u32 * 64,
        }
    }
}

#[inline(always)]
pub(crate) fn loc(hold: u32, off: u32) -> u64 {
    ((hold as u64) << 32) | off as u64
}

#[inline(always)]
pub(crate) fn unloc(at: u64) -> (u32, u32) {
    ((at >> 32) as u32, at as u32)
}

/// One worker slot's state, behind its mutex.
#[derive(Default)]
pub(crate) struct Lane {
    /// Which worker owns this slot now; a writer that resolved the slot before a removal sees
    /// the change here and resolves again instead of writing into a freed slot.
    pub(crate) owner: Option<WorkerKey>,
    /// Engine block hash -> `hold << 32 | offset`.
    pub(crate) engine: EngineMap,
    holds: Vec<Hold>,
    free: Vec<u32>,
    by_seg: HashMap<usize, u32, MixBuild>,
    dirty: Vec<u32>,
    /// Positions held, over all holds.
    pub(crate) held: usize,
}

// SAFETY: the raw pointers in `holds` point into segments kept alive by the holds' references;
// the lane is only used under its mutex.
unsafe impl Send for Lane {}

impl Lane {
    pub(crate) fn new(owner: WorkerKey) -> Lane {
        Lane {
            owner: Some(owner),
            ..Lane::default()
        }
    }

    #[inline(always)]
    pub(crate) fn hold(&self, index: u32) -> &Hold {
        &self.holds[index as usize]
    }

    /// The hold for `seg`, given a reference to it that the lane now owns (given back at once
    /// if the lane already holds one).
    pub(crate) fn hold_acquired(&mut self, seg: &Seg, slot: u32, counters: &SegCounters) -> u32 {
        let key = seg as *const Seg as usize;
        if let Some(&index) = self.by_seg.get(&key) {
            seg.release_extra();
            return index;
        }
        let entry = seg.entry_for(slot, counters);
        let hold = Hold {
            seg,
            entry,
            bits: vec![0; seg.cap().div_ceil(64)],
            refs: 0,
            depth: 0,
            dirty: false,
        };
        let index = match self.free.pop() {
            Some(index) => {
                self.holds[index as usize] = hold;
                index
            }
            None => {
                self.holds.push(hold);
                (self.holds.len() - 1) as u32
            }
        };
        self.engine.open_hold(index, seg.cap());
        self.by_seg.insert(key, index);
        index
    }

    #[inline(always)]
    fn touch(&mut self, index: u32) {
        let hold = &mut self.holds[index as usize];
        if !hold.dirty {
            hold.dirty = true;
            self.dirty.push(index);
        }
    }

    /// Name the position `(hold, off)` with `hash` and hold it (the contract's store of one
    /// block): a hash that named another position releases that one.
    #[inline(always)]
    pub(crate) fn name(&mut self, index: u32, off: u32, hash: u64) {
        let at = loc(index, off);
        let old = self.engine.insert(hash, at);
        if old != Some(at) {
            self.holds[index as usize].refs += 1;
        }
        if self.holds[index as usize].set(off) {
            self.held += 1;
        }
        self.touch(index);
        if let Some(old) = old.filter(|&old| old != at) {
            self.unname(old);
        }
    }

    /// Forget `hash` (the contract's removal of one block); false when the worker has no such
    /// hash.
    #[inline(always)]
    pub(crate) fn remove(&mut self, hash: u64) -> bool {
        match self.engine.remove(hash) {
            Some(at) => {
                self.unname(at);
                true
            }
            None => false,
        }
    }

    #[inline(always)]
    fn unname(&mut self, at: u64) {
        let (index, off) = unloc(at);
        let hold = &mut self.holds[index as usize];
        if hold.clear(off) {
            self.held -= 1;
        }
        hold.refs -= 1;
        self.touch(index);
    }

    /// Publish the depths the event changed and free the holds it emptied (releasing their
    /// segments, which may reclaim them).
    pub(crate) fn settle(&mut self, counters: &SegCounters, guard: &Guard) {
        while let Some(index) = self.dirty.pop() {
            let hold = &mut self.holds[index as usize];
            hold.dirty = false;
            // SAFETY: the hold keeps its segment, and so the entry, alive.
            let entry = unsafe { &*hold.entry };
            if entry.depth.load(Ordering::Relaxed) != hold.depth {
                entry.depth.store(hold.depth, Ordering::Release);
            }
            if hold.refs == 0 {
                debug_assert!(hold.bits.iter().all(|&w| w == 0), "held without a name");
                let seg = hold.seg;
                hold.seg = std::ptr::null();
                hold.bits = Vec::new();
                self.by_seg.remove(&(seg as usize));
                self.engine.close_hold(index);
                self.free.push(index);
                // SAFETY: our reference kept it alive until this release.
                unsafe { (*seg).release(counters, guard) };
            }
        }
    }

    /// Drop everything the worker holds (cleared cache or removed worker).
    pub(crate) fn clear(&mut self, counters: &SegCounters, guard: &Guard) {
        self.dirty.clear();
        for hold in self.holds.drain(..) {
            if hold.seg.is_null() {
                continue;
            }
            // SAFETY: the hold keeps its segment alive until the release below.
            unsafe {
                (*hold.entry).depth.store(0, Ordering::Release);
                (*hold.seg).release(counters, guard);
            }
        }
        self.free.clear();
        self.by_seg.clear();
        self.engine = EngineMap::default();
        self.held = 0;
    }

    /// Heap bytes of the lane's private state.
    pub(crate) fn bytes(&self) -> usize {
        self.engine.bytes()
            + self.holds.iter().map(|h| h.bits.len() * 8).sum::<usize>()
            + self.holds.capacity() * std::mem::size_of::<Hold>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_clear_scans_words() {
        assert_eq!(first_clear(&[0], 0), 0);
        assert_eq!(first_clear(&[0b111], 0), 3);
        assert_eq!(first_clear(&[0b111], 5), 5);
        assert_eq!(first_clear(&[u64::MAX, 1], 0), 65);
        assert_eq!(first_clear(&[u64::MAX, u64::MAX], 3), 128);
        assert_eq!(first_clear(&[], 0), 0);
    }
}
