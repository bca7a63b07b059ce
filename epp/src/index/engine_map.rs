//! One worker's map from engine block hash to block location: the structure every store and
//! every removal touches once per block, so it is the writers' hot path.
//!
//! Open addressing with 16-byte slots `(key, location)`, a multiplicative (Fibonacci) home slot
//! (engine hashes are usually uniform already; the multiply spreads counters too), linear
//! probing, at most half full, and backward-shift deletion so steady churn never leaves
//! tombstones. Callers prefetch the home slots of keys a few ahead in a batch
//! ([`EngineMap::prefetch`]) so that one event's cache misses overlap instead of serialising.

const EMPTY: u64 = u64::MAX;
const K: u64 = 0x9e37_79b9_7f4a_7c15;
const MIN_SLOTS: usize = 16;

#[derive(Clone, Copy)]
struct Slot {
    key: u64,
    /// `EMPTY` marks a free slot (a block location is never `u64::MAX`).
    value: u64,
}

const FREE: Slot = Slot {
    key: 0,
    value: EMPTY,
};

#[derive(Default)]
pub(crate) struct EngineMap {
    slots: Box<[Slot]>,
    len: usize,
    shift: u32,
}

impl EngineMap {
    #[inline(always)]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline(always)]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(K) >> self.shift) as usize
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Hint the CPU to fetch `key`'s home slot.
    #[inline(always)]
    pub(crate) fn prefetch(&self, key: u64) {
        #[cfg(target_arch = "x86_64")]
        if !self.slots.is_empty() {
            let ptr = &self.slots[self.home(key)] as *const Slot as *const i8;
            // SAFETY: a prefetch is a hint that never faults; the pointer is into our slice.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ptr);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = key;
    }

    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let slot = self.slots[i];
            if slot.value == EMPTY {
                return None;
            }
            if slot.key == key {
                return Some(slot.value);
            }
            i = (i + 1) & mask;
        }
    }

    /// Insert or replace; returns the previous value.
    #[inline]
    pub(crate) fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        debug_assert_ne!(value, EMPTY);
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let slot = &mut self.slots[i];
            if slot.value == EMPTY {
                *slot = Slot { key, value };
                self.len += 1;
                return None;
            }
            if slot.key == key {
                return Some(std::mem::replace(&mut slot.value, value));
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let slot = self.slots[i];
            if slot.value == EMPTY {
                return None;
            }
            if slot.key == key {
                break;
            }
            i = (i + 1) & mask;
        }
        let removed = self.slots[i].value;
        // Backward shift: pull later entries of the probe run into the hole when their home is
        // at or before it, so lookups never meet a tombstone.
        let mut hole = i;
        let mut j = (i + 1) & mask;
        loop {
            let slot = self.slots[j];
            if slot.value == EMPTY {
                break;
            }
            let home = self.home(slot.key);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = slot;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = FREE;
        self.len -= 1;
        Some(removed)
    }

    fn grow(&mut self) {
        let slots = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![FREE; slots].into_boxed_slice());
        self.shift = 64 - slots.trailing_zeros();
        self.len = 0;
        for slot in old.iter().filter(|s| s.value != EMPTY) {
            self.insert(slot.key, slot.value);
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
}
