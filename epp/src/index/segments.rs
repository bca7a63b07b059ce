//! The index's shared structure: block positions stored as *segments* (runs of consecutive
//! positions of one chain), each with its child table and its holder entries, and the
//! reference counting that frees a segment as soon as nothing names a block in it.
//!
//! A position (a block identified by its whole content path) lives in exactly one place: the
//! next offset of its parent's segment, or offset 0 of a child segment hanging off the parent
//! segment at `(offset, content)`. Lookups compare a segment's contents as one array, read its
//! holder entries once, and probe its child table only where the request leaves it.
//!
//! Holders: a segment keeps one entry per worker slot that ever held a block in it, with the
//! worker's *depth* there: how many blocks from offset 0 it holds consecutively. Only that
//! worker's writer stores the depth (a plain release store, no read-modify-write), so writers
//! of different workers never contend on a word; the per-block holdings behind the depth are
//! private to the worker's lane (module `holds`).
//!
//! Lifetime: `live` counts the lanes holding a reference (a lane references a segment while it
//! names any block in it) plus the segment's live children. The writer that drops it to zero
//! marks the segment dead (unless someone re-acquired it meanwhile), unlinks it from its
//! parent's child table under the parent's lock, releases the parent's child reference (which
//! may cascade) and retires the memory to the epoch collector: readers pin an epoch for a whole
//! lookup, so nothing they can reach is freed under them. No pause, no copying.
//!
//! Concurrency contract:
//! - `contents[..len]` never change once published (`len` grows by release stores, under the
//!   segment's lock); `contents[0]` is the key of the segment in its parent's table.
//! - A child is created, and a dead child replaced, only under the parent's lock.
//! - A segment's `live` never goes up from zero after it was marked dead ([`Seg::try_acquire`]).

use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};

use crossbeam_epoch::Guard;
use parking_lot::Mutex;

use super::children::ChildTable;

/// `live` of a segment that was reclaimed.
const DEAD: u32 = u32::MAX;
/// Smallest and largest segment capacity (blocks). Room past a store's length lets decode
/// blocks and the next turn of a conversation append in place.
pub(crate) const MIN_CAP: usize = 16;
pub(crate) const MAX_CAP: usize = 1 << 14;
const INLINE_ENTRIES: usize = 4;
/// Slots with a direct entry index in the segment header.
pub(crate) const HINTED_SLOTS: usize = 64;
const NO_ENTRY: u8 = u8::MAX;
const CHUNK_ENTRIES: usize = 28;

/// A worker slot's depth in one segment. `slot` is written once, before the entry is
/// published; `depth` only by the slot's writer.
pub(crate) struct HolderEntry {
    pub(crate) slot: AtomicU32,
    pub(crate) depth: AtomicU32,
}

impl HolderEntry {
    const fn new() -> Self {
        HolderEntry {
            slot: AtomicU32::new(0),
            depth: AtomicU32::new(0),
        }
    }
}

struct EntryChunk {
    entries: [HolderEntry; CHUNK_ENTRIES],
    next: AtomicPtr<EntryChunk>,
}

/// Counters the segments keep up to date for [`super::IndexStats`].
#[derive(Default)]
pub(crate) struct SegCounters {
    pub(crate) segments: AtomicUsize,
    pub(crate) blocks: AtomicUsize,
    pub(crate) bytes: AtomicUsize,
    pub(crate) reclaimed: AtomicUsize,
}

pub(crate) struct Seg {
    contents: Box<[AtomicU64]>,
    pub(crate) len: AtomicU32,
    live: AtomicU32,
    parent: *const Seg,
    /// Offset in the parent at which this segment hangs.
    parent_off: u32,
    pub(crate) lock: Mutex<()>,
    children: AtomicPtr<ChildTable>,
    entry_count: AtomicU32,
    entries: [HolderEntry; INLINE_ENTRIES],
    more: AtomicPtr<EntryChunk>,
    /// For slots below 64: the index of the slot's entry (`NO_ENTRY` when it has none), so a
    /// lookup with few workers left reads their entries directly instead of scanning them all.
    entry_of: [AtomicU8; HINTED_SLOTS],
}

/// Zeroed atomic words straight from the allocator (`vec![0; n]` is a calloc: pages are
/// faulted in only when used).
fn zeroed_words(n: usize) -> Box<[AtomicU64]> {
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

fn seg_bytes(cap: usize) -> usize {
    std::mem::size_of::<Seg>() + cap * 8
}

impl Seg {
    fn new(parent: *const Seg, parent_off: u32, cap: usize, live: u32) -> Seg {
        Seg {
            contents: zeroed_words(cap),
            len: AtomicU32::new(0),
            live: AtomicU32::new(live),
            parent,
            parent_off,
            lock: Mutex::new(()),
            children: AtomicPtr::new(std::ptr::null_mut()),
            entry_count: AtomicU32::new(0),
            entries: [const { HolderEntry::new() }; INLINE_ENTRIES],
            more: AtomicPtr::new(std::ptr::null_mut()),
            entry_of: [const { AtomicU8::new(NO_ENTRY) }; HINTED_SLOTS],
        }
    }

    /// The root: no blocks, never reclaimed (its own reference is never released).
    pub(crate) fn root() -> Box<Seg> {
        Box::new(Seg::new(std::ptr::null(), 0, 0, 1))
    }

    #[inline(always)]
    pub(crate) fn cap(&self) -> usize {
        self.contents.len()
    }

    /// The published blocks' content keys.
    #[inline(always)]
    pub(crate) fn published(&self) -> &[AtomicU64] {
        let len = (self.len.load(Ordering::Acquire) as usize).min(self.contents.len());
        &self.contents[..len]
    }

    /// The published blocks' content keys as plain words, for comparing in bulk.
    #[inline(always)]
    pub(crate) fn published_words(&self) -> &[u64] {
        let published = self.published();
        // SAFETY: `AtomicU64` and `u64` share size, alignment and bit validity (asserted in
        // `zeroed_words`), and published blocks are never written again (appends only write
        // past `len`, which the acquire load above ordered after their writes), so reading
        // them non-atomically races with nothing.
        unsafe { std::slice::from_raw_parts(published.as_ptr() as *const u64, published.len()) }
    }

    /// Append `contents` at `at` (the current length). Caller holds the lock, checked that
    /// `len == at` and that they fit.
    pub(crate) fn append_locked(&self, at: usize, contents: impl Iterator<Item = u64>) -> usize {
        let mut end = at;
        for (cell, content) in self.contents[at..].iter().zip(contents) {
            cell.store(content, Ordering::Relaxed);
            end += 1;
        }
        self.len.store(end as u32, Ordering::Release);
        end
    }

    /// Holder entries published so far.
    #[inline]
    pub(crate) fn holders(&self) -> impl Iterator<Item = &HolderEntry> {
        let count = self.entry_count.load(Ordering::Acquire) as usize;
        let inline = self.entries.iter().take(count);
        let mut left = count.saturating_sub(INLINE_ENTRIES);
        let mut chunk = if left > 0 {
            self.more.load(Ordering::Acquire)
        } else {
            std::ptr::null_mut()
        };
        let chunked = std::iter::from_fn(move || {
            if left == 0 || chunk.is_null() {
                return None;
            }
            // SAFETY: chunks are allocated before the count covering them is published, never
            // freed while the segment lives, and the caller's reference keeps it alive.
            let current = unsafe { &*chunk };
            let take = left.min(CHUNK_ENTRIES);
            left -= take;
            chunk = current.next.load(Ordering::Acquire);
            Some(current.entries[..take].iter())
        })
        .flatten();
        inline.chain(chunked)
    }

    /// Entries published so far.
    #[inline(always)]
    pub(crate) fn entry_count(&self) -> usize {
        self.entry_count.load(Ordering::Acquire) as usize
    }

    /// The entry of `slot` (below [`HINTED_SLOTS`]) through the header's index, without a
    /// scan. `None` when the slot never held a block here.
    #[inline]
    pub(crate) fn hinted_entry(&self, slot: usize) -> Option<&HolderEntry> {
        let index = self.entry_of.get(slot)?.load(Ordering::Acquire);
        if index == NO_ENTRY {
            return None;
        }
        let index = index as usize;
        if index < INLINE_ENTRIES {
            return self.entries.get(index);
        }
        let mut at = index - INLINE_ENTRIES;
        let mut chunk = self.more.load(Ordering::Acquire);
        loop {
            if chunk.is_null() {
                return None;
            }
            // SAFETY: chunks are published before the index that points into them and live as
            // long as the segment, which the caller's pin keeps.
            let current = unsafe { &*chunk };
            if at < CHUNK_ENTRIES {
                return current.entries.get(at);
            }
            at -= CHUNK_ENTRIES;
            chunk = current.next.load(Ordering::Acquire);
        }
    }

    /// `slot`'s entry, added if the slot never held a block here.
    pub(crate) fn entry_for(&self, slot: u32, counters: &SegCounters) -> &HolderEntry {
        if let Some(entry) = self
            .holders()
            .find(|e| e.slot.load(Ordering::Relaxed) == slot)
        {
            return entry;
        }
        let _guard = self.lock.lock();
        if let Some(entry) = self
            .holders()
            .find(|e| e.slot.load(Ordering::Relaxed) == slot)
        {
            return entry;
        }
        let index = self.entry_count.load(Ordering::Relaxed) as usize;
        let entry = if index < INLINE_ENTRIES {
            &self.entries[index]
        } else {
            let mut at = index - INLINE_ENTRIES;
            let mut link = &self.more;
            loop {
                let mut chunk = link.load(Ordering::Acquire);
                if chunk.is_null() {
                    chunk = Box::into_raw(Box::new(EntryChunk {
                        entries: [const { HolderEntry::new() }; CHUNK_ENTRIES],
                        next: AtomicPtr::new(std::ptr::null_mut()),
                    }));
                    counters
                        .bytes
                        .fetch_add(std::mem::size_of::<EntryChunk>(), Ordering::Relaxed);
                    link.store(chunk, Ordering::Release);
                }
                // SAFETY: just loaded or allocated; chunks live as long as the segment.
                let current = unsafe { &*chunk };
                if at < CHUNK_ENTRIES {
                    break &current.entries[at];
                }
                at -= CHUNK_ENTRIES;
                link = &current.next;
            }
        };
        entry.slot.store(slot, Ordering::Relaxed);
        entry.depth.store(0, Ordering::Relaxed);
        self.entry_count.store(index as u32 + 1, Ordering::Release);
        if let Some(hint) = self.entry_of.get(slot as usize) {
            if index < NO_ENTRY as usize {
                hint.store(index as u8, Ordering::Release);
            }
        }
        entry
    }

    /// The child continuing after `off` blocks with `content` (lock-free; may be dead).
    #[inline]
    pub(crate) fn find_child<'g>(
        &self,
        off: u32,
        content: u64,
        _guard: &'g Guard,
    ) -> Option<&'g Seg> {
        let table = self.children.load(Ordering::Acquire);
        if table.is_null() {
            return None;
        }
        // SAFETY: tables are retired through the epoch collector and the caller is pinned.
        let child = unsafe { (*table).find(off, content) };
        // SAFETY: segments are retired through the epoch collector and the caller is pinned.
        (!child.is_null()).then(|| unsafe { &*child })
    }

    /// Take a reference unless the segment was reclaimed.
    #[inline]
    pub(crate) fn try_acquire(&self) -> bool {
        self.live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |live| {
                (live != DEAD).then(|| live + 1)
            })
            .is_ok()
    }

    /// Give back a reference taken by [`Seg::try_acquire`] when the caller is known to hold
    /// another one (so this cannot be the last).
    #[inline]
    pub(crate) fn release_extra(&self) {
        self.live.fetch_sub(1, Ordering::AcqRel);
    }

    /// The child continuing after `off` blocks with `content`, created (first block written,
    /// capacity `cap`) if absent or dead, returned with a reference the caller now owns. The
    /// caller holds a reference to `self`.
    pub(crate) fn acquire_child<'g>(
        &self,
        off: u32,
        content: u64,
        cap: usize,
        counters: &SegCounters,
        guard: &'g Guard,
    ) -> &'g Seg {
        if let Some(child) = self.find_child(off, content, guard) {
            if child.try_acquire() {
                return child;
            }
        }
        let _lock = self.lock.lock();
        let mut table = self.children.load(Ordering::Acquire);
        if !table.is_null() {
            // SAFETY: we hold the lock; only lock holders replace or retire the table.
            let current = unsafe { &*table };
            let child = current.find(off, content);
            if !child.is_null() {
                // SAFETY: pinned; see `find_child`.
                let found = unsafe { &*child };
                if found.try_acquire() {
                    return found;
                }
                // Dead but not unlinked yet: unlink it for its reclaimer (which will find
                // nothing left to do) and hang a fresh child in its place.
                current.remove(off, content, child);
            }
            if current.full() {
                let next = Box::into_raw(current.rebuilt());
                // SAFETY: both pointers are valid; the new table is complete before publishing.
                let (old_bytes, new_bytes) = unsafe { ((*table).bytes(), (*next).bytes()) };
                self.children.store(next, Ordering::Release);
                counters.bytes.fetch_add(new_bytes, Ordering::Relaxed);
                counters.bytes.fetch_sub(old_bytes, Ordering::Relaxed);
                let old = SendPtr(table);
                // SAFETY: unpublished above; readers still in it are pinned, so the collector
                // frees it only after they unpin.
                unsafe { guard.defer_unchecked(move || drop(Box::from_raw(old.get()))) };
                table = next;
            }
        } else {
            table = Box::into_raw(ChildTable::with_room(1));
            // SAFETY: just allocated.
            counters
                .bytes
                .fetch_add(unsafe { (*table).bytes() }, Ordering::Relaxed);
            self.children.store(table, Ordering::Release);
        }
        let cap = cap.clamp(MIN_CAP, MAX_CAP);
        let child = Box::into_raw(Box::new(Seg::new(self, off, cap, 1)));
        // SAFETY: just allocated, not yet published.
        let child_ref = unsafe { &*child };
        child_ref.append_locked(0, std::iter::once(content));
        counters.segments.fetch_add(1, Ordering::Relaxed);
        counters.blocks.fetch_add(cap, Ordering::Relaxed);
        counters.bytes.fetch_add(seg_bytes(cap), Ordering::Relaxed);
        // The child holds a reference to its parent for as long as it lives.
        self.live.fetch_add(1, Ordering::AcqRel);
        // SAFETY: `table` is the current table and we hold the lock.
        unsafe { (*table).insert(off, content, child) };
        child_ref
    }

    /// Drop one reference; the last one reclaims the segment (and, through the child
    /// reference, possibly its ancestors).
    pub(crate) fn release(&self, counters: &SegCounters, guard: &Guard) {
        let mut seg: *const Seg = self;
        loop {
            // SAFETY: the caller (or the child being reclaimed) held a reference to `seg`.
            let current = unsafe { &*seg };
            if current.live.fetch_sub(1, Ordering::AcqRel) != 1 || current.parent.is_null() {
                return;
            }
            if current
                .live
                .compare_exchange(0, DEAD, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                return; // re-acquired meanwhile; its new holder releases it later
            }
            // SAFETY: a live child keeps a reference to its parent, so the parent is alive.
            let parent = unsafe { &*current.parent };
            {
                let _lock = parent.lock.lock();
                let table = parent.children.load(Ordering::Acquire);
                if !table.is_null() {
                    // SAFETY: lock held; the table is current.
                    unsafe { (*table).remove(current.parent_off, current.first(), seg) };
                }
            }
            counters.segments.fetch_sub(1, Ordering::Relaxed);
            counters.blocks.fetch_sub(current.cap(), Ordering::Relaxed);
            counters.bytes.fetch_sub(current.bytes(), Ordering::Relaxed);
            counters.reclaimed.fetch_add(1, Ordering::Relaxed);
            let dead = SendPtr(seg as *mut Seg);
            // SAFETY: unlinked above and unnamed by every lane (live reached zero), so only
            // pinned readers can still reach it; the collector frees it after they unpin.
            unsafe { guard.defer_unchecked(move || free(dead.get())) };
            seg = parent;
        }
    }

    fn first(&self) -> u64 {
        self.contents
            .first()
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Heap bytes of this segment (header, contents, entry chunks, child table).
    fn bytes(&self) -> usize {
        let mut bytes = seg_bytes(self.cap());
        let mut chunk = self.more.load(Ordering::Acquire);
        while !chunk.is_null() {
            bytes += std::mem::size_of::<EntryChunk>();
            // SAFETY: chunks live as long as the segment.
            chunk = unsafe { (*chunk).next.load(Ordering::Acquire) };
        }
        let table = self.children.load(Ordering::Acquire);
        if !table.is_null() {
            // SAFETY: the table lives as long as the segment (or until retired by the owner).
            bytes += unsafe { (*table).bytes() };
        }
        bytes
    }

    /// Free every segment below `self` (the index is being dropped: no reader or writer
    /// remains). Dead segments are not in any table and are freed by the collector.
    pub(crate) fn free_descendants(&self) {
        let mut stack: Vec<*mut Seg> = self.children_now();
        while let Some(seg) = stack.pop() {
            // SAFETY: reachable from the root, so alive and owned by the index.
            stack.extend(unsafe { (*seg).children_now() });
            // SAFETY: each live segment is in exactly one table, so it is freed once.
            unsafe { free(seg) };
        }
        self.free_own_parts();
    }

    fn children_now(&self) -> Vec<*mut Seg> {
        let table = self.children.load(Ordering::Acquire);
        if table.is_null() {
            return Vec::new();
        }
        // SAFETY: the table is current.
        unsafe { (*table).entries().map(|(_, _, child)| child).collect() }
    }

    /// Free the entry chunks and the child table (not the children).
    fn free_own_parts(&self) {
        let table = self.children.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if !table.is_null() {
            // SAFETY: allocated by `Box::into_raw`, now unpublished.
            drop(unsafe { Box::from_raw(table) });
        }
        let mut chunk = self.more.swap(std::ptr::null_mut(), Ordering::AcqRel);
        while !chunk.is_null() {
            // SAFETY: allocated by `Box::into_raw`, now unpublished.
            let owned = unsafe { Box::from_raw(chunk) };
            chunk = owned.next.load(Ordering::Acquire);
        }
    }
}

/// Free a segment allocated by `acquire_child`.
///
/// # Safety
/// `seg` came from `Box::into_raw` in `acquire_child`, and nobody can reach it any more.
unsafe fn free(seg: *mut Seg) {
    // SAFETY: per the contract above.
    let owned = unsafe { Box::from_raw(seg) };
    owned.free_own_parts();
}

/// A raw pointer handed to the epoch collector, which may run the deferred free on another
/// thread.
struct SendPtr<T>(*mut T);

impl<T> SendPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

// SAFETY: the pointee is only freed by the receiving closure, once, after every thread that
// could reach it unpinned.
unsafe impl<T> Send for SendPtr<T> {}
