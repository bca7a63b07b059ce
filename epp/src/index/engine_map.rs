//! One worker's map from engine block hash to block location: the structure every store and
//! every removal touches once per block, so it is the writers' hot path.
//!
//! Buckets of four `(key, location)` pairs in one 64-byte cache line, a multiplicative
//! (Fibonacci) home bucket (engine hashes are usually uniform already; the multiply spreads
//! counters too), and per-bucket *overflow counts* (the scheme of Folly's F14): an insert that
//! finds its home bucket full moves on to the next one and counts itself in every full bucket
//! it passed; a removal found past its home bucket takes that count back. A probe stops at the
//! first bucket with a zero count, so a lookup, an insert and a removal each read one line in
//! the common case, a removal writes one word (no backward shift, no tombstone), and steady
//! churn leaves nothing behind. At most five eighths full. Callers prefetch the home buckets of
//! keys a few ahead in a batch ([`EngineMap::prefetch`]) so that one event's cache misses
//! overlap instead of serialising.

/// Values are stored with this bit set, so that an all-zero bucket is an empty one and a new
/// table comes zeroed from the allocator (no fill pass; pages are faulted in as they are used).
/// Callers' values never use it (block locations are `hold << 32 | offset`, holds < 2^31).
const OCCUPIED: u64 = 1 << 63;
const EMPTY: u64 = 0;
const K: u64 = 0x9e37_79b9_7f4a_7c15;
const WAYS: usize = 4;
const MIN_BUCKETS: usize = 4;
/// An overflow count that reached this stays (a probe past it is merely longer).
const STUCK: u8 = u8::MAX;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Bucket {
    keys: [u64; WAYS],
    /// `EMPTY` marks a free way; a used one holds `value | OCCUPIED`.
    values: [u64; WAYS],
}

/// `n` empty buckets, zeroed by the allocator.
fn empty_buckets(n: usize) -> Box<[Bucket]> {
    if n == 0 {
        return Box::default();
    }
    let layout = match std::alloc::Layout::array::<Bucket>(n) {
        Ok(layout) => layout,
        Err(_) => panic!("engine map of {n} buckets exceeds the address space"),
    };
    // SAFETY: the layout has a non-zero size (n > 0, buckets are 64 bytes).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut Bucket;
    if ptr.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    // SAFETY: `ptr` is a fresh allocation of `n` buckets with the global allocator and the
    // layout `Box<[Bucket]>` frees with; a `Bucket` is plain integers, for which all-zero bytes
    // are valid (and an all-zero bucket is an empty one).
    unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, n)) }
}

impl Bucket {
    /// Ways holding `key`, as a bit mask.
    #[inline(always)]
    fn matches(&self, key: u64) -> u32 {
        let mut mask = 0;
        for way in 0..WAYS {
            mask |= (((self.keys[way] == key) & (self.values[way] != EMPTY)) as u32) << way;
        }
        mask
    }

    /// Free ways, as a bit mask.
    #[inline(always)]
    fn free(&self) -> u32 {
        let mut mask = 0;
        for way in 0..WAYS {
            mask |= ((self.values[way] == EMPTY) as u32) << way;
        }
        mask
    }
}

#[derive(Default)]
pub(crate) struct EngineMap {
    buckets: Box<[Bucket]>,
    /// Entries stored past this bucket because it was full when they were inserted.
    overflow: Box<[u8]>,
    len: usize,
    shift: u32,
}

impl EngineMap {
    #[inline(always)]
    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    #[inline(always)]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(K) >> self.shift) as usize
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Slots (four per bucket).
    pub(crate) fn capacity(&self) -> usize {
        self.buckets.len() * WAYS
    }

    /// Hint the CPU to fetch `key`'s home bucket.
    #[inline(always)]
    pub(crate) fn prefetch(&self, key: u64) {
        #[cfg(target_arch = "x86_64")]
        if !self.buckets.is_empty() {
            let ptr = &self.buckets[self.home(key)] as *const Bucket as *const i8;
            // SAFETY: a prefetch is a hint that never faults; the pointer is into our slice.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ptr);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = key;
    }

    /// `(bucket, way)` of `key`, if present.
    #[inline(always)]
    fn find(&self, key: u64) -> Option<(usize, usize)> {
        if self.buckets.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let found = self.buckets[i].matches(key);
            if found != 0 {
                return Some((i, found.trailing_zeros() as usize));
            }
            if self.overflow[i] == 0 {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    #[inline(always)]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        self.find(key)
            .map(|(i, way)| self.buckets[i].values[way] & !OCCUPIED)
    }

    /// Insert or replace; returns the previous value.
    #[inline(always)]
    pub(crate) fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        debug_assert_eq!(value & OCCUPIED, 0);
        if let Some((i, way)) = self.find(key) {
            let old = std::mem::replace(&mut self.buckets[i].values[way], value | OCCUPIED);
            return Some(old & !OCCUPIED);
        }
        if (self.len + 1) * 8 > self.capacity() * 5 {
            self.grow();
        }
        self.place(key, value | OCCUPIED);
        None
    }

    /// Store a key known to be absent (`value` carries `OCCUPIED`).
    #[inline(always)]
    fn place(&mut self, key: u64, value: u64) {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let free = self.buckets[i].free();
            if free != 0 {
                let way = free.trailing_zeros() as usize;
                self.buckets[i].keys[way] = key;
                self.buckets[i].values[way] = value;
                self.len += 1;
                return;
            }
            if self.overflow[i] != STUCK {
                self.overflow[i] += 1;
            }
            i = (i + 1) & mask;
        }
    }

    #[inline(always)]
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        let (i, way) = self.find(key)?;
        let removed = std::mem::replace(&mut self.buckets[i].values[way], EMPTY) & !OCCUPIED;
        self.len -= 1;
        // Take back the counts its insert left in the full buckets it passed.
        let mask = self.mask();
        let mut b = self.home(key);
        while b != i {
            if self.overflow[b] != STUCK {
                self.overflow[b] -= 1;
            }
            b = (b + 1) & mask;
        }
        Some(removed)
    }

    fn grow(&mut self) {
        let buckets = (self.buckets.len() * 2).max(MIN_BUCKETS);
        let old = std::mem::replace(&mut self.buckets, empty_buckets(buckets));
        self.overflow = vec![0; buckets].into_boxed_slice();
        self.shift = 64 - buckets.trailing_zeros();
        self.len = 0;
        for bucket in old.iter() {
            for way in 0..WAYS {
                if bucket.values[way] != EMPTY {
                    self.place(bucket.keys[way], bucket.values[way]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Differential test against std's map under random inserts and removals over a small key
    /// space (dense probe runs, many backward shifts), including adversarial sequential keys.
    #[test]
    fn behaves_like_a_hash_map() {
        let mut state = 0x1234_5678u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for keyspace in [8u64, 64, 1000] {
            let mut map = EngineMap::default();
            let mut model: HashMap<u64, u64> = HashMap::new();
            for step in 0..20_000u64 {
                let key = if step % 3 == 0 {
                    next() % keyspace
                } else {
                    (next() % keyspace) << 20
                };
                if next() % 3 == 0 {
                    assert_eq!(map.remove(key), model.remove(&key));
                } else {
                    assert_eq!(map.insert(key, step), model.insert(key, step));
                }
                assert_eq!(map.len(), model.len());
                if step % 997 == 0 {
                    for (k, v) in &model {
                        assert_eq!(map.get(*k), Some(*v));
                    }
                }
            }
            for (k, v) in &model {
                assert_eq!(map.get(*k), Some(*v));
            }
        }
    }

    /// Keys that all share one home bucket overflow into the next buckets; removing them in
    /// any order keeps every other key findable and takes every overflow count back.
    #[test]
    fn overflow_chains_survive_removals_in_any_order() {
        let mut map = EngineMap::default();
        // Grow to a fixed size first, then find keys with the same home bucket.
        for k in 0..100u64 {
            map.insert(k | 1 << 40, k);
        }
        for k in 0..100u64 {
            map.remove(k | 1 << 40);
        }
        let target = map.home(12345);
        let colliding: Vec<u64> = (0u64..)
            .filter(|k| map.home(*k) == target)
            .take(11)
            .collect();
        for (round, order) in [
            [0usize, 5, 10, 3, 8, 1, 6, 2, 9, 4, 7],
            [10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
        ]
        .iter()
        .enumerate()
        {
            for (i, &k) in colliding.iter().enumerate() {
                assert_eq!(map.insert(k, i as u64), None, "round {round}");
            }
            assert!(
                map.overflow[target] > 0,
                "eleven keys cannot fit one bucket"
            );
            let mut left: HashMap<u64, u64> = colliding
                .iter()
                .enumerate()
                .map(|(i, &k)| (k, i as u64))
                .collect();
            for &i in order {
                let k = colliding[i];
                assert_eq!(map.remove(k), Some(i as u64));
                left.remove(&k);
                for (&k, &v) in &left {
                    assert_eq!(map.get(k), Some(v), "round {round}");
                }
                assert_eq!(map.get(colliding[i]), None);
            }
            assert!(map.overflow.iter().all(|&c| c == 0), "round {round}");
            assert_eq!(map.len(), 0);
        }
    }
}
