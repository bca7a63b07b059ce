//! One segment's child table: `(offset, content) -> child segment`, where a chain leaves the
//! segment after `offset` blocks with a block of content `content`.
//!
//! Open addressing with linear probing. Readers probe without a lock; every change is made
//! under the owning segment's lock. A slot is written once (content and child first, then its
//! tag with a release store) and only ever changes afterwards to a tombstone, so a reader that
//! saw a live tag reads that slot's own content and child. Tombstoned slots are never reused in
//! place: when live entries and tombstones fill three quarters of the table, the owner builds a
//! new table and retires the old one through the epoch collector (readers may still be in it).

use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use super::hash::{bucket, step};
use super::segments::Seg;

const EMPTY: u64 = 0;
const TOMB: u64 = u64::MAX;
/// Smallest table: most segments have one or two children.
const MIN_SLOTS: usize = 4;

struct Slot {
    /// `EMPTY`, `TOMB`, or `offset + 1`.
    tag: AtomicU64,
    content: AtomicU64,
    child: AtomicPtr<Seg>,
}

pub(crate) struct ChildTable {
    slots: Box<[Slot]>,
    shift: u32,
    /// Slots ever filled (live entries and tombstones).
    used: AtomicUsize,
    live: AtomicUsize,
}

#[inline(always)]
fn tag_of(off: u32) -> u64 {
    off as u64 + 1
}

impl ChildTable {
    /// A table with room for `live` entries at under half load.
    pub(crate) fn with_room(live: usize) -> Box<ChildTable> {
        let slots = (live * 2 + 1).next_power_of_two().max(MIN_SLOTS);
        Box::new(ChildTable {
            slots: (0..slots)
                .map(|_| Slot {
                    tag: AtomicU64::new(EMPTY),
                    content: AtomicU64::new(0),
                    child: AtomicPtr::new(std::ptr::null_mut()),
                })
                .collect(),
            shift: 64 - slots.trailing_zeros(),
            used: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
        })
    }

    #[inline(always)]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline(always)]
    fn home(&self, off: u32, content: u64) -> usize {
        bucket(step(off as u64, content), self.shift) & self.mask()
    }

    /// The child continuing after `off` blocks with `content`, if any (possibly a child that is
    /// being reclaimed: callers that write check [`Seg::try_acquire`]).
    #[inline]
    pub(crate) fn find(&self, off: u32, content: u64) -> *mut Seg {
        let want = tag_of(off);
        let mask = self.mask();
        let mut i = self.home(off, content);
        loop {
            let slot = &self.slots[i];
            let tag = slot.tag.load(Ordering::Acquire);
            if tag == EMPTY {
                return std::ptr::null_mut();
            }
            if tag == want && slot.content.load(Ordering::Relaxed) == content {
                return slot.child.load(Ordering::Relaxed);
            }
            i = (i + 1) & mask;
        }
    }

    /// Whether one more insert needs a rebuilt table first.
    pub(crate) fn full(&self) -> bool {
        (self.used.load(Ordering::Relaxed) + 1) * 4 > self.slots.len() * 3
    }

    /// Insert an entry known to be absent. Caller holds the owner's lock and checked `full`.
    pub(crate) fn insert(&self, off: u32, content: u64, child: *mut Seg) {
        let mask = self.mask();
        let mut i = self.home(off, content);
        while self.slots[i].tag.load(Ordering::Relaxed) != EMPTY {
            i = (i + 1) & mask;
        }
        let slot = &self.slots[i];
        slot.content.store(content, Ordering::Relaxed);
        slot.child.store(child, Ordering::Relaxed);
        slot.tag.store(tag_of(off), Ordering::Release);
        self.used.fetch_add(1, Ordering::Relaxed);
        self.live.fetch_add(1, Ordering::Relaxed);
    }

    /// Tombstone the entry `(off, content)` if it still names `child`. Caller holds the lock.
    pub(crate) fn remove(&self, off: u32, content: u64, child: *const Seg) -> bool {
        let want = tag_of(off);
        let mask = self.mask();
        let mut i = self.home(off, content);
        loop {
            let slot = &self.slots[i];
            let tag = slot.tag.load(Ordering::Relaxed);
            if tag == EMPTY {
                return false;
            }
            if tag == want
                && slot.content.load(Ordering::Relaxed) == content
                && std::ptr::eq(slot.child.load(Ordering::Relaxed), child)
            {
                slot.tag.store(TOMB, Ordering::Release);
                self.live.fetch_sub(1, Ordering::Relaxed);
                return true;
            }
            i = (i + 1) & mask;
        }
    }

    /// A fresh table with this one's live entries and room for more.
    pub(crate) fn rebuilt(&self) -> Box<ChildTable> {
        let live = self.live.load(Ordering::Relaxed);
        let next = ChildTable::with_room(live + 1);
        for (off, content, child) in self.entries() {
            next.insert(off, content, child);
        }
        next
    }

    /// Live entries `(offset, content, child)`.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u32, u64, *mut Seg)> + '_ {
        self.slots.iter().filter_map(|slot| {
            let tag = slot.tag.load(Ordering::Acquire);
            (tag != EMPTY && tag != TOMB).then(|| {
                (
                    (tag - 1) as u32,
                    slot.content.load(Ordering::Relaxed),
                    slot.child.load(Ordering::Relaxed),
                )
            })
        })
    }

    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of::<ChildTable>() + self.slots.len() * std::mem::size_of::<Slot>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(n: usize) -> *mut Seg {
        // Never dereferenced: the table only stores and compares the pointers.
        (n * 64) as *mut Seg
    }

    #[test]
    fn finds_inserts_and_tombstones_and_rebuilds() {
        let mut table = ChildTable::with_room(1);
        let mut live = std::collections::HashMap::new();
        for n in 1..200usize {
            if table.full() {
                table = table.rebuilt();
            }
            let (off, content) = ((n % 7) as u32, (n / 7) as u64);
            assert!(table.find(off, content).is_null());
            table.insert(off, content, fake(n));
            live.insert((off, content), n);
            if n % 3 == 0 {
                let (off, content) = (((n - 1) % 7) as u32, ((n - 1) / 7) as u64);
                // A stale child pointer does not remove a newer entry.
                assert!(!table.remove(off, content, fake(n + 1000)));
                assert!(table.remove(off, content, fake(n - 1)));
                live.remove(&(off, content));
            }
        }
        for (&(off, content), &n) in &live {
            assert_eq!(table.find(off, content), fake(n));
        }
        assert_eq!(table.entries().count(), live.len());
    }
}
