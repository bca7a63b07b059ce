//! One worker's map from engine block hash to block location (`hold << 32 | offset`): the
//! structure every store and every removal touches once per block, so it is the writers' hot
//! path, and the largest thing the index keeps per worker.
//!
//! - **Table**: 8-byte slots, eight to a 64-byte bucket: the top 32 bits of the key's
//!   multiplicative (Fibonacci) hash as a fingerprint, and the location packed into 32 bits. The
//!   key itself is not in the slot: it is kept once per *position* in a names array of the hold
//!   (`hold`, `offset` -> the key that names it), which a match is verified against. The
//!   random-access part is half the size of a `(key, value)` table, and the names are read in
//!   chain order, which the cache handles well.
//! - **Probing**: home bucket from the top bits of the same hash (so growing needs only the
//!   fingerprints), per-bucket *overflow counts* (the scheme of Folly's F14): an insert that
//!   finds its home bucket full moves on and counts itself in every full bucket it passed; a
//!   removal takes those counts back. A probe stops at the first bucket with a zero count, so an
//!   operation reads one line in the common case and a removal writes one word (no backward
//!   shift, no tombstone). At most three quarters full.
//! - **Extra map**: a key that cannot live in the table goes to a plain hash map beside it: a
//!   second name of a position whose name slot is taken (a "twin"), or a location that does not
//!   pack into 32 bits (a hold index past 2^18). Engines that name each position once and hold
//!   fewer than 2^18 segments never use it.
//!
//! Callers prefetch the home buckets of keys a few ahead in a batch ([`EngineMap::prefetch`]) so
//! that one event's cache misses overlap instead of serialising.

use std::collections::HashMap;

use super::hash::MixBuild;

const K: u64 = 0x9e37_79b9_7f4a_7c15;
const WAYS: usize = 8;
const MIN_BUCKETS: usize = 2;
/// An overflow count that reached this stays (a probe past it is merely longer).
const STUCK: u8 = u8::MAX;
/// Packed location: hold index in the high bits, offset (< 2^14, the largest segment) low.
const OFFSET_BITS: u32 = 14;
const HOLD_LIMIT: u64 = 1 << (32 - OFFSET_BITS);

/// Eight slots `fingerprint << 32 | packed location`; 0 is a free slot (fingerprints are odd).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Bucket([u64; WAYS]);

impl Bucket {
    /// Ways whose fingerprint is `fp`, as a bit mask.
    #[inline(always)]
    fn matches(&self, fp: u32) -> u32 {
        let mut mask = 0;
        for way in 0..WAYS {
            mask |= (((self.0[way] >> 32) as u32 == fp) as u32) << way;
        }
        mask
    }

    /// Free ways, as a bit mask.
    #[inline(always)]
    fn free(&self) -> u32 {
        let mut mask = 0;
        for way in 0..WAYS {
            mask |= ((self.0[way] == 0) as u32) << way;
        }
        mask
    }
}

/// `n` free buckets, zeroed by the allocator (no fill pass; pages fault in as used).
fn free_buckets(n: usize) -> Box<[Bucket]> {
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
    // layout `Box<[Bucket]>` frees with; a bucket is plain integers, for which all-zero bytes
    // are valid (and mean "free").
    unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, n)) }
}

/// The keys naming a hold's offsets in the table, and which offsets have one.
#[derive(Default)]
struct Names {
    keys: Box<[u64]>,
    named: Box<[u64]>,
}

#[inline(always)]
fn hashed(key: u64) -> u64 {
    key.wrapping_mul(K)
}

#[inline(always)]
fn fingerprint(hash: u64) -> u32 {
    (hash >> 32) as u32 | 1
}

#[inline(always)]
fn pack(at: u64) -> Option<u32> {
    let (hold, off) = (at >> 32, at & 0xffff_ffff);
    (hold < HOLD_LIMIT && off < 1 << OFFSET_BITS).then_some(((hold << OFFSET_BITS) | off) as u32)
}

#[inline(always)]
fn unpack(packed: u32) -> (usize, usize) {
    (
        (packed >> OFFSET_BITS) as usize,
        (packed & ((1 << OFFSET_BITS) - 1)) as usize,
    )
}

#[inline(always)]
fn location(packed: u32) -> u64 {
    let (hold, off) = unpack(packed);
    ((hold as u64) << 32) | off as u64
}

#[derive(Default)]
pub(crate) struct EngineMap {
    buckets: Box<[Bucket]>,
    /// Entries stored past this bucket because it was full when they were inserted.
    overflow: Box<[u8]>,
    len: usize,
    shift: u32,
    names: Vec<Names>,
    extra: HashMap<u64, u64, MixBuild>,
}

impl EngineMap {
    #[inline(always)]
    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    #[inline(always)]
    fn home(&self, hash: u64) -> usize {
        (hash >> self.shift) as usize
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len + self.extra.len()
    }

    /// Heap bytes: table, overflow counts, names and the extra map.
    pub(crate) fn bytes(&self) -> usize {
        self.buckets.len() * (std::mem::size_of::<Bucket>() + 1)
            + self
                .names
                .iter()
                .map(|n| (n.keys.len() + n.named.len()) * 8)
                .sum::<usize>()
            + self.extra.capacity() * 24
    }

    /// Make room for the names of hold `hold`, whose segment has `cap` offsets.
    pub(crate) fn open_hold(&mut self, hold: u32, cap: usize) {
        let hold = hold as usize;
        if self.names.len() <= hold {
            self.names.resize_with(hold + 1, Names::default);
        }
        self.names[hold] = Names {
            keys: vec![0; cap].into_boxed_slice(),
            named: vec![0; cap.div_ceil(64)].into_boxed_slice(),
        };
    }

    /// Release the names of a hold no key points into any more.
    pub(crate) fn close_hold(&mut self, hold: u32) {
        if let Some(names) = self.names.get_mut(hold as usize) {
            *names = Names::default();
        }
    }

    /// Hint the CPU to fetch `key`'s home bucket.
    #[inline(always)]
    pub(crate) fn prefetch(&self, key: u64) {
        #[cfg(target_arch = "x86_64")]
        if !self.buckets.is_empty() {
            let ptr = &self.buckets[self.home(hashed(key))] as *const Bucket as *const i8;
            // SAFETY: a prefetch is a hint that never faults; the pointer is into our slice.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ptr);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = key;
    }

    /// Whether the table slot `packed` is named by `key`.
    #[inline(always)]
    fn names_key(&self, packed: u32, key: u64) -> bool {
        let (hold, off) = unpack(packed);
        self.names
            .get(hold)
            .and_then(|names| names.keys.get(off))
            .is_some_and(|&k| k == key)
    }

    /// `(bucket, way)` of `key` in the table, if it is there.
    #[inline(always)]
    fn find(&self, key: u64, hash: u64) -> Option<(usize, usize)> {
        if self.buckets.is_empty() {
            return None;
        }
        let fp = fingerprint(hash);
        let mask = self.mask();
        let mut i = self.home(hash);
        loop {
            let mut found = self.buckets[i].matches(fp);
            while found != 0 {
                let way = found.trailing_zeros() as usize;
                if self.names_key(self.buckets[i].0[way] as u32, key) {
                    return Some((i, way));
                }
                found &= found - 1;
            }
            if self.overflow[i] == 0 {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    #[inline(always)]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        match self.find(key, hashed(key)) {
            Some((i, way)) => Some(location(self.buckets[i].0[way] as u32)),
            None if !self.extra.is_empty() => self.extra.get(&key).copied(),
            None => None,
        }
    }

    /// Insert or replace; returns the previous location.
    #[inline(always)]
    pub(crate) fn insert(&mut self, key: u64, at: u64) -> Option<u64> {
        let hash = hashed(key);
        let old = self.take(key, hash);
        self.put(key, hash, at);
        old
    }

    /// Remove `key`; its location when it was present.
    #[inline(always)]
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        self.take(key, hashed(key))
    }

    #[inline(always)]
    fn take(&mut self, key: u64, hash: u64) -> Option<u64> {
        let Some((i, way)) = self.find(key, hash) else {
            return if self.extra.is_empty() {
                None
            } else {
                self.extra.remove(&key)
            };
        };
        let packed = std::mem::replace(&mut self.buckets[i].0[way], 0) as u32;
        self.len -= 1;
        let (hold, off) = unpack(packed);
        if let Some(word) = self.names[hold].named.get_mut(off / 64) {
            *word &= !(1 << (off % 64));
        }
        // Take back the counts its insert left in the full buckets it passed.
        let mask = self.mask();
        let mut b = self.home(hash);
        while b != i {
            if self.overflow[b] != STUCK {
                self.overflow[b] -= 1;
            }
            b = (b + 1) & mask;
        }
        Some(location(packed))
    }

    /// Store an absent key: in the table when its location packs and has no name yet,
    /// otherwise in the extra map.
    #[inline(always)]
    fn put(&mut self, key: u64, hash: u64, at: u64) {
        let Some(packed) = pack(at) else {
            self.extra.insert(key, at);
            return;
        };
        let (hold, off) = unpack(packed);
        let Some(names) = self.names.get_mut(hold) else {
            self.extra.insert(key, at);
            return;
        };
        let (word, bit) = (off / 64, 1u64 << (off % 64));
        match names.named.get_mut(word) {
            Some(named) if *named & bit == 0 => {
                *named |= bit;
                names.keys[off] = key;
            }
            _ => {
                self.extra.insert(key, at);
                return;
            }
        }
        if (self.len + 1) * 4 > self.buckets.len() * WAYS * 3 {
            self.grow();
        }
        self.place(hash, packed);
    }

    #[inline(always)]
    fn place(&mut self, hash: u64, packed: u32) {
        let slot = ((fingerprint(hash) as u64) << 32) | packed as u64;
        let mask = self.mask();
        let mut i = self.home(hash);
        loop {
            let free = self.buckets[i].free();
            if free != 0 {
                self.buckets[i].0[free.trailing_zeros() as usize] = slot;
                self.len += 1;
                return;
            }
            if self.overflow[i] != STUCK {
                self.overflow[i] += 1;
            }
            i = (i + 1) & mask;
        }
    }

    fn grow(&mut self) {
        let buckets = (self.buckets.len() * 2).max(MIN_BUCKETS);
        let old = std::mem::replace(&mut self.buckets, free_buckets(buckets));
        self.overflow = vec![0; buckets].into_boxed_slice();
        self.shift = 64 - buckets.trailing_zeros();
        self.len = 0;
        for bucket in old.iter() {
            for &slot in &bucket.0 {
                if slot != 0 {
                    // The fingerprint is the hash's top half, which is all the home needs.
                    self.place(slot & !0xffff_ffff, slot as u32);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A splitmix64 stream: deterministic test input.
    fn stream(mut state: u64) -> impl FnMut() -> u64 {
        move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
    }

    /// Differential test against std's map under random inserts and removals over small key
    /// spaces and small location spaces: twins (two keys, one location) and keys moving between
    /// locations are everywhere, adversarial sequential keys too, and some holds are past the
    /// packable range so their keys live in the extra map.
    #[test]
    fn behaves_like_a_hash_map() {
        let mut next = stream(0x1234_5678);
        let holds: [u32; 4] = [0, 1, 7, HOLD_LIMIT as u32 + 3];
        for (keyspace, offsets) in [(8u64, 4u64), (64, 16), (1000, 300), (5000, 4000)] {
            let mut map = EngineMap::default();
            for &hold in &holds {
                map.open_hold(hold, offsets as usize);
            }
            let mut model: HashMap<u64, u64> = HashMap::new();
            for step in 0..20_000u64 {
                let key = if step % 3 == 0 {
                    next() % keyspace
                } else {
                    (next() % keyspace) << 20
                };
                let hold = holds[(next() % 4) as usize] as u64;
                let at = (hold << 32) | (next() % offsets);
                if next().is_multiple_of(3) {
                    assert_eq!(map.remove(key), model.remove(&key));
                } else {
                    assert_eq!(map.insert(key, at), model.insert(key, at));
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
            for k in model.keys() {
                assert!(map.remove(*k).is_some());
            }
            assert_eq!(map.len(), 0);
            assert!(map.overflow.iter().all(|&c| c == 0));
        }
    }

    /// Keys that all share one home bucket overflow into the next buckets; removing them in
    /// any order keeps every other key findable and takes every overflow count back.
    #[test]
    fn overflow_chains_survive_removals_in_any_order() {
        let mut map = EngineMap::default();
        map.open_hold(0, 64);
        // Grow to a fixed size first, then find keys with the same home bucket.
        for k in 0..40u64 {
            map.insert(k | 1 << 40, k);
        }
        for k in 0..40u64 {
            map.remove(k | 1 << 40);
        }
        let target = map.home(hashed(12345));
        let colliding: Vec<u64> = (0u64..)
            .filter(|k| map.home(hashed(*k)) == target)
            .take(19)
            .collect();
        let orders: [Vec<usize>; 2] = [
            (0..19).map(|i| (i * 7) % 19).collect(),
            (0..19).rev().collect(),
        ];
        for (round, order) in orders.iter().enumerate() {
            for (i, &k) in colliding.iter().enumerate() {
                assert_eq!(map.insert(k, i as u64), None, "round {round}");
            }
            assert!(
                map.overflow[target] > 0,
                "nineteen keys cannot fit one bucket"
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
