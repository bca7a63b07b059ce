//! Byte-level BPE model: merges applied by rank, exactly as HF `tokenizers`' `BPE` does.
//!
//! HF's `Word::merge_all` keeps a min-heap of candidate pairs ordered by (merge rank, position
//! of the left symbol) and lazily drops stale entries; the result is "repeatedly merge the
//! adjacent pair with the lowest rank, leftmost on ties". Two implementations of that rule:
//! a quadratic scan over a small array for short pieces (almost all of them) and a heap over a
//! linked list for long ones (CJK letter runs, long symbol or digit runs).
//!
//! Shortcut: a piece whose bytes are themselves a vocabulary token is usually that one token,
//! but merge order can in principle make BPE miss it, so (unless the model says
//! `ignore_merges`, where HF looks the piece up first) each token's "BPE of my own bytes is me"
//! bit is computed the first time it is needed and remembered in a lock-free table.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU8, Ordering};

/// No merge for this pair.
const NO_MERGE: u64 = u64::MAX;

/// One merge rule: ((left id, right id), (rank, merged id)).
pub(crate) type MergeRule = ((u32, u32), (u32, u32));
/// Pieces up to this many bytes use the quadratic merge loop.
const SMALL_PIECE: usize = 48;

/// A small, fast hasher for byte strings and integer keys (FxHash's multiply-rotate scheme).
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher {
    hash: u64,
}

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

pub(crate) type FxBuild = BuildHasherDefault<FxHasher>;

/// Open-addressing table (pair of ids) -> (rank << 32 | new id). Packing rank in the high half
/// makes "lowest rank" a plain integer minimum.
struct MergeTable {
    slots: Vec<(u64, u64)>,
    mask: usize,
}

impl MergeTable {
    fn new(pairs: &[MergeRule]) -> Self {
        let cap = (pairs.len() * 2).next_power_of_two().max(16);
        let mut t = MergeTable {
            slots: vec![(u64::MAX, NO_MERGE); cap],
            mask: cap - 1,
        };
        for &((a, b), (rank, new_id)) in pairs {
            t.insert(key(a, b), (u64::from(rank) << 32) | u64::from(new_id));
        }
        t
    }

    #[inline(always)]
    fn slot(&self, k: u64) -> usize {
        (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize & self.mask
    }

    fn insert(&mut self, k: u64, v: u64) {
        let mut i = self.slot(k);
        loop {
            let s = &mut self.slots[i];
            if s.0 == u64::MAX || s.0 == k {
                // Same pair listed twice: the later rank wins, as in HF's HashMap collect.
                *s = (k, v);
                return;
            }
            i = (i + 1) & self.mask;
        }
    }

    #[inline(always)]
    fn get(&self, a: u32, b: u32) -> u64 {
        let k = key(a, b);
        let mut i = self.slot(k);
        loop {
            let s = self.slots[i];
            if s.0 == k {
                return s.1;
            }
            if s.0 == u64::MAX {
                return NO_MERGE;
            }
            i = (i + 1) & self.mask;
        }
    }
}

#[inline(always)]
fn key(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

pub(crate) struct Bpe {
    /// Token id of each single byte.
    byte_ids: [u32; 256],
    merges: MergeTable,
    /// Token bytes -> id, for whole-piece lookups.
    vocab: HashMap<Box<[u8]>, u32, FxBuild>,
    ignore_merges: bool,
    /// Per token id: 0 = not yet known, 1 = BPE of its bytes is itself, 2 = it is not.
    self_merges: Vec<AtomicU8>,
}

impl Bpe {
    /// `merges`: ((left id, right id), (rank, merged id)) in file order.
    pub(crate) fn new(
        byte_ids: [u32; 256],
        merges: &[MergeRule],
        vocab: HashMap<Box<[u8]>, u32, FxBuild>,
        vocab_len: usize,
        ignore_merges: bool,
    ) -> Self {
        Bpe {
            byte_ids,
            merges: MergeTable::new(merges),
            vocab,
            ignore_merges,
            self_merges: (0..vocab_len).map(|_| AtomicU8::new(0)).collect(),
        }
    }

    /// Appends the ids of one pre-tokenized piece (raw bytes) to `out`.
    #[inline]
    pub(crate) fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        if piece.len() == 1 {
            out.push(self.byte_ids[piece[0] as usize]);
            return;
        }
        if let Some(&id) = self.vocab.get(piece) {
            if self.ignore_merges || self.merges_to_itself(id, piece) {
                out.push(id);
                return;
            }
        }
        self.merge(piece, out);
    }

    fn merges_to_itself(&self, id: u32, piece: &[u8]) -> bool {
        let Some(state) = self.self_merges.get(id as usize) else {
            return false;
        };
        match state.load(Ordering::Relaxed) {
            1 => true,
            2 => false,
            _ => {
                let mut tmp = Vec::with_capacity(4);
                self.merge(piece, &mut tmp);
                let yes = tmp.len() == 1 && tmp[0] == id;
                state.store(if yes { 1 } else { 2 }, Ordering::Relaxed);
                yes
            }
        }
    }

    fn merge(&self, piece: &[u8], out: &mut Vec<u32>) {
        if piece.len() <= SMALL_PIECE {
            self.merge_small(piece, out);
        } else {
            self.merge_large(piece, out);
        }
    }

    /// Quadratic loop: `syms[i]` is the i-th symbol, `pairs[i]` the packed merge of
    /// `(syms[i], syms[i + 1])`.
    fn merge_small(&self, piece: &[u8], out: &mut Vec<u32>) {
        let mut syms = [0u32; SMALL_PIECE];
        let mut pairs = [NO_MERGE; SMALL_PIECE];
        let mut n = piece.len();
        for (s, &b) in syms.iter_mut().zip(piece) {
            *s = self.byte_ids[b as usize];
        }
        for i in 0..n - 1 {
            pairs[i] = self.merges.get(syms[i], syms[i + 1]);
        }
        loop {
            // Lowest packed value = lowest rank; the strict `<` keeps the leftmost on ties.
            let mut best = NO_MERGE;
            let mut at = 0;
            for (i, &p) in pairs[..n - 1].iter().enumerate() {
                if p < best {
                    best = p;
                    at = i;
                }
            }
            if best == NO_MERGE {
                break;
            }
            syms[at] = best as u32;
            syms.copy_within(at + 2..n, at + 1);
            if at + 2 < n {
                pairs.copy_within(at + 2..n - 1, at + 1);
            }
            n -= 1;
            if at + 1 < n {
                pairs[at] = self.merges.get(syms[at], syms[at + 1]);
            } else {
                pairs[at] = NO_MERGE;
            }
            if at > 0 {
                pairs[at - 1] = self.merges.get(syms[at - 1], syms[at]);
            }
            if n == 1 {
                break;
            }
        }
        out.extend_from_slice(&syms[..n]);
    }

    /// Heap over a doubly linked list of symbols, indexed by the original byte position of each
    /// symbol's first byte (HF's `pos`), so heap order is (rank, leftmost position).
    fn merge_large(&self, piece: &[u8], out: &mut Vec<u32>) {
        const NONE: u32 = u32::MAX;
        let n = piece.len();
        let mut id: Vec<u32> = piece.iter().map(|&b| self.byte_ids[b as usize]).collect();
        let mut next: Vec<u32> = (1..=n as u32).collect();
        next[n - 1] = NONE;
        let mut prev: Vec<u32> = (0..n as u32).map(|i| i.wrapping_sub(1)).collect();
        prev[0] = NONE;
        let mut alive = vec![true; n];
        let mut heap: BinaryHeap<Reverse<(u32, u32)>> = BinaryHeap::with_capacity(n);
        for i in 0..n - 1 {
            let m = self.merges.get(id[i], id[i + 1]);
            if m != NO_MERGE {
                heap.push(Reverse(((m >> 32) as u32, i as u32)));
            }
        }
        while let Some(Reverse((rank, pos))) = heap.pop() {
            let p = pos as usize;
            if !alive[p] || next[p] == NONE {
                continue;
            }
            let q = next[p] as usize;
            // Stale entry: the pair at `p` changed since it was pushed. A pair's rank
            // identifies it, so comparing ranks is the validity check.
            let m = self.merges.get(id[p], id[q]);
            if m == NO_MERGE || (m >> 32) as u32 != rank {
                continue;
            }
            id[p] = m as u32;
            alive[q] = false;
            next[p] = next[q];
            if next[q] != NONE {
                prev[next[q] as usize] = pos;
            }
            if prev[p] != NONE {
                let l = prev[p] as usize;
                let m = self.merges.get(id[l], id[p]);
                if m != NO_MERGE {
                    heap.push(Reverse(((m >> 32) as u32, l as u32)));
                }
            }
            if next[p] != NONE {
                let r = next[p] as usize;
                let m = self.merges.get(id[p], id[r]);
                if m != NO_MERGE {
                    heap.push(Reverse(((m >> 32) as u32, pos)));
                }
            }
        }
        let mut i = 0u32;
        while i != NONE {
            out.push(id[i as usize]);
            i = next[i as usize];
        }
    }

    /// Both merge loops on the same piece (for tests).
    #[cfg(test)]
    fn both(&self, piece: &[u8]) -> (Vec<u32>, Vec<u32>) {
        let mut a = Vec::new();
        let mut b = Vec::new();
        self.merge_small(piece, &mut a);
        self.merge_large(piece, &mut b);
        (a, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: bytes a=0, b=1, c=2; merges (a,b)->ab=3 rank 0, (b,c)->bc=4 rank 1,
    /// (ab,c)->abc=5 rank 2, (a,a)->aa=6 rank 3.
    fn toy() -> Bpe {
        let mut byte_ids = [0u32; 256];
        byte_ids[b'a' as usize] = 0;
        byte_ids[b'b' as usize] = 1;
        byte_ids[b'c' as usize] = 2;
        let merges = [
            ((0, 1), (0, 3)),
            ((1, 2), (1, 4)),
            ((3, 2), (2, 5)),
            ((0, 0), (3, 6)),
        ];
        let mut vocab: HashMap<Box<[u8]>, u32, FxBuild> = HashMap::default();
        for (t, id) in [
            ("a", 0),
            ("b", 1),
            ("c", 2),
            ("ab", 3),
            ("bc", 4),
            ("abc", 5),
            ("aa", 6),
        ] {
            vocab.insert(t.as_bytes().into(), id);
        }
        Bpe::new(byte_ids, &merges, vocab, 7, false)
    }

    #[test]
    fn merges_lowest_rank_leftmost_first() {
        let bpe = toy();
        assert_eq!(bpe.both(b"abc"), (vec![5], vec![5]));
        assert_eq!(bpe.both(b"aaa"), (vec![6, 0], vec![6, 0]));
        assert_eq!(bpe.both(b"bcab"), (vec![4, 3], vec![4, 3]));
        let mut out = Vec::new();
        bpe.encode_piece(b"abc", &mut out);
        bpe.encode_piece(b"bc", &mut out);
        assert_eq!(out, [5, 4]);
    }
}
