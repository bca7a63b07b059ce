//! Hashing helpers the index owns: the child table's bucket function and a cheap hasher for
//! maps keyed by values that are already hashes.
//!
//! Neither is part of the index's *answers*: a child-table slot is matched on its exact
//! `(segment, offset, content hash)` key, so the bucket function only decides where to look; a
//! collision only costs a longer probe.

use std::hash::{BuildHasherDefault, Hasher};

const K1: u64 = 0x9e37_79b9_7f4a_7c15;
const K2: u64 = 0xbf58_476d_1ce4_e5b9;

/// 64x64->128 multiply folded to 64 bits (the wyhash/foldhash "mum"): non-linear, so crafted
/// keys cannot be made to collide by linear algebra over the content hashes.
#[inline(always)]
fn fold_mul(a: u64, b: u64) -> u64 {
    let full = (a as u128).wrapping_mul(b as u128);
    (full as u64) ^ ((full >> 64) as u64)
}

/// Mix of a packed key and a content hash (the child table's probe start).
#[inline(always)]
pub(crate) fn step(parent: u64, content: u64) -> u64 {
    fold_mul(parent ^ content, K1)
}

/// Home bucket of a mixed key in a table of `1 << (64 - shift)` slots.
#[inline(always)]
pub(crate) fn bucket(locator: u64, shift: u32) -> usize {
    (locator.wrapping_mul(K2) >> shift) as usize
}

/// Hasher for maps keyed by engine block hashes. Engine hashes are usually already uniform, but
/// some sources (tests, simple engines) use small counters, so one multiply-fold mixes them;
/// SipHash would cost more than the rest of the probe.
#[derive(Default, Clone, Copy)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u64(&mut self, value: u64) {
        self.0 = fold_mul(self.0 ^ value ^ K2, K1);
    }

    #[inline]
    fn write_u32(&mut self, value: u32) {
        self.write_u64(value as u64);
    }
}

/// `BuildHasher` for [`MixHasher`].
pub type MixBuild = BuildHasherDefault<MixHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_depends_on_key_and_content_order() {
        assert_ne!(step(step(7, 1), 2), step(step(7, 2), 1));
        assert_ne!(step(7, 1), step(step(7, 1), 1));
    }

    #[test]
    fn buckets_of_small_counters_spread() {
        let shift = 64 - 10;
        let mut seen = std::collections::HashSet::new();
        for i in 0..256u64 {
            seen.insert(bucket(step(0, i), shift));
        }
        assert!(seen.len() > 200, "only {} distinct buckets", seen.len());
    }
}
