//! Reuse across requests: a conversation's next turn repeats the previous prompt, so encode only
//! the text after the longest remembered *safe boundary*.
//!
//! # Which boundaries are safe
//!
//! A boundary `b` of an encoded text `T` is safe when, for every text `T'` that agrees with `T`
//! on the first `b + M` bytes (`M` = [`FastTokenizer::lookahead_margin`]: the longest added
//! token plus 32 bytes), `ids(T') = ids(T)[..n_b] ++ ids_raw(T'[b..])`, where `n_b` is the number
//! of ids `T` produced before `b`. Two kinds are recorded while encoding:
//!
//! 1. **Either side of an added token.** HF splits added tokens out first and tokenizes the
//!    segments between them independently (normalizer, pre-tokenizer and BPE each see one
//!    segment). Which tokens are split out before `b` depends only on bytes before
//!    `b + longest token`, inside the shared `M` bytes, so `T'` splits identically up to `b`.
//! 2. **A pre-tokenizer piece end inside a segment** where the piece's last character is not
//!    whitespace and the next three bytes are ASCII, in a segment the NFC quick check left
//!    unchanged. Why that suffices:
//!    - *NFC*: an ASCII character is a starter that never composes with what precedes it, so
//!      `NFC(x ++ y) = NFC(x) ++ NFC(y)` when `y` starts with one; the part before `b` was already
//!      NFC in `T`, and the two ASCII characters after `b` stay as they are in `T'` (each is
//!      followed by an ASCII starter, which blocks composition).
//!    - *Split regex, after `b`*: the regex has no look-behind, so a match starting at `b`
//!      depends only on the text from `b` on: scanning `T'` from `b` is scanning `T'[b..]`.
//!    - *Split regex, before `b`*: every decision at a position before `b` reads at most two
//!      characters past `b`: a letter/number/symbol run stops at the first character that does
//!      not continue it, a contraction reads three characters from its apostrophe, and the
//!      whitespace alternatives (`\s*[\r\n]+`, `\s+(?!\S)`) read to the end of a whitespace run
//!      — which, because the character before `b` is not whitespace, ends before `b`. So `T'`
//!      makes the same decisions and `b` is a piece boundary of `T'` too. (Whitespace before `b`
//!      is excluded on purpose: `"a  " + "\t1"` splits as `"  ", "\t", "1"` but `"a   \t"`
//!      alone keeps the run together, because `\s+(?!\S)` reads to the run's end.)
//!    - BPE runs per piece, so equal pieces give equal ids.
//!
//! The tokenizer's post-processor specials (a BOS) are added around the reused raw ids.
//!
//! # Cache
//!
//! Each remembered text is indexed by a chained xxh3 hash of every 256-byte prefix (`G`); for each
//! such grid point `g` it keeps the last safe boundary `b` with `b + M <= g`. A new text hashes
//! its own prefixes, finds the longest `g` some remembered text shares (confirmed byte for
//! byte), and resumes at that text's boundary for `g`. Entries are evicted least recently used.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{Checkpoint, CheckpointRecorder, FastTokenizer, TokenEncoder, TokenizerError};

/// Bytes between grid points.
const GRID: usize = 256;
/// At most one recorded boundary per this many bytes.
const RECORD_GAP: usize = 48;
const HASH_SEED: u64 = 0x6b76_726f_7574_6521;

/// Counters since creation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReuseStats {
    /// `encode` calls.
    pub requests: u64,
    /// Calls that resumed from a remembered boundary.
    pub hits: u64,
    /// Ids copied from remembered texts instead of being computed.
    pub reused_tokens: u64,
    /// Ids computed.
    pub encoded_tokens: u64,
    /// Texts remembered now.
    pub entries: u64,
    /// Texts forgotten to stay within capacity.
    pub evictions: u64,
}

struct Entry {
    text: Box<str>,
    /// Raw ids (no post-processor specials).
    ids: Vec<u32>,
    /// `grid[k]`: last safe boundary `b` with `b + margin <= (k + 1) * GRID`, if any.
    grid: Vec<Option<Checkpoint>>,
    /// `hashes[k]`: chained hash of `text[..(k + 1) * GRID]`.
    hashes: Vec<u64>,
}

#[derive(Default)]
struct Cache {
    entries: HashMap<u64, (Arc<Entry>, u64)>,
    /// Prefix hash -> entry id (the latest text that has that prefix).
    index: HashMap<u64, u64>,
    tick: u64,
    next_id: u64,
}

/// Wraps an encoder with prefix reuse. `Send + Sync`; share one per model.
pub struct PrefixReuseEncoder {
    inner: TokenEncoder,
    capacity: usize,
    cache: Mutex<Cache>,
    requests: AtomicU64,
    hits: AtomicU64,
    reused: AtomicU64,
    encoded: AtomicU64,
    evictions: AtomicU64,
}

impl std::fmt::Debug for PrefixReuseEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixReuseEncoder")
            .field("inner", &self.inner)
            .field("capacity", &self.capacity)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Chained hashes of every full `GRID`-byte prefix of `text`.
fn prefix_hashes(text: &[u8]) -> Vec<u64> {
    let mut h = HASH_SEED;
    text.chunks_exact(GRID)
        .map(|c| {
            h = xxh3_64_with_seed(c, h);
            h
        })
        .collect()
}

impl PrefixReuseEncoder {
    /// `capacity`: how many texts to remember. Reuse needs the fast encoder; with HF inside,
    /// every call is a plain HF encode.
    pub fn new(inner: impl Into<TokenEncoder>, capacity: usize) -> Self {
        PrefixReuseEncoder {
            inner: inner.into(),
            capacity: capacity.max(1),
            cache: Mutex::new(Cache::default()),
            requests: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            encoded: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// The cache holds no invariant a panicking holder could break half-way, so a poisoned
    /// lock is still usable.
    fn lock(&self) -> MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn inner(&self) -> &TokenEncoder {
        &self.inner
    }

    pub fn stats(&self) -> ReuseStats {
        ReuseStats {
            requests: self.requests.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            reused_tokens: self.reused.load(Ordering::Relaxed),
            encoded_tokens: self.encoded.load(Ordering::Relaxed),
            entries: self.lock().entries.len() as u64,
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }

    /// Ids identical to HF `Tokenizer::encode(text, add_special_tokens)`. Errors only come
    /// from an HF fallback encoder.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let fast = match &self.inner {
            TokenEncoder::Fast(f) => f,
            TokenEncoder::Hf(_) => {
                let ids = self.inner.encode(text, add_special_tokens)?;
                self.encoded.fetch_add(ids.len() as u64, Ordering::Relaxed);
                return Ok(ids);
            }
        };
        let raw = self.encode_raw(fast, text);
        if !add_special_tokens {
            return Ok(raw);
        }
        let (before, after) = fast.specials();
        if before.is_empty() && after.is_empty() {
            return Ok(raw);
        }
        let mut out = Vec::with_capacity(before.len() + raw.len() + after.len());
        out.extend_from_slice(before);
        out.extend_from_slice(&raw);
        out.extend_from_slice(after);
        Ok(out)
    }

    fn encode_raw(&self, fast: &FastTokenizer, text: &str) -> Vec<u32> {
        let margin = fast.lookahead_margin();
        let hashes = prefix_hashes(text.as_bytes());
        if hashes.is_empty() {
            // Shorter than one grid step: nothing to reuse or remember.
            let mut ids = Vec::new();
            fast.encode_raw_into(text, &mut ids, 0, None);
            self.encoded.fetch_add(ids.len() as u64, Ordering::Relaxed);
            return ids;
        }

        // Longest remembered prefix: walk the grid while some text shares it.
        let found = {
            let mut cache = self.lock();
            let mut best: Option<(u64, usize)> = None;
            for (k, h) in hashes.iter().enumerate() {
                match cache.index.get(h) {
                    Some(&id) => best = Some((id, k)),
                    None => break,
                }
            }
            cache.tick += 1;
            let tick = cache.tick;
            best.and_then(|(id, k)| {
                cache.entries.get_mut(&id).map(|(e, used)| {
                    *used = tick;
                    (Arc::clone(e), k)
                })
            })
        };
        // Resume point: the entry's boundary for the shared grid point, if the bytes agree.
        let resume = found.and_then(|(e, k)| {
            let g = (k + 1) * GRID;
            let same = e.text.len() >= g && e.text.as_bytes()[..g] == text.as_bytes()[..g];
            let cp = e.grid.get(k).copied().flatten();
            match (same, cp) {
                (true, Some(cp)) => Some((e, k, cp)),
                _ => None,
            }
        });

        let mut rec = CheckpointRecorder::new(RECORD_GAP);
        let (ids, carried) = match &resume {
            Some((e, k, cp)) => {
                let mut ids = Vec::with_capacity(cp.ids + (text.len() - cp.byte) / 3 + 8);
                ids.extend_from_slice(&e.ids[..cp.ids]);
                rec.points.push(*cp);
                fast.encode_raw_into(&text[cp.byte..], &mut ids, cp.byte, Some(&mut rec));
                self.hits.fetch_add(1, Ordering::Relaxed);
                self.reused.fetch_add(cp.ids as u64, Ordering::Relaxed);
                self.encoded
                    .fetch_add((ids.len() - cp.ids) as u64, Ordering::Relaxed);
                (ids, &e.grid[..=*k])
            }
            None => {
                let mut ids = Vec::with_capacity(text.len() / 3 + 8);
                rec.points.push(Checkpoint { byte: 0, ids: 0 });
                fast.encode_raw_into(text, &mut ids, 0, Some(&mut rec));
                self.encoded.fetch_add(ids.len() as u64, Ordering::Relaxed);
                (ids, &[][..])
            }
        };

        // Grid for the new text: the carried points (its prefix is the old text's), then the
        // last recorded boundary at least `margin` before each later grid point.
        let mut grid = Vec::with_capacity(hashes.len());
        grid.extend_from_slice(carried);
        let mut p = 0;
        let mut last: Option<Checkpoint> = carried.last().copied().flatten();
        for k in carried.len()..hashes.len() {
            let g = (k + 1) * GRID;
            while p < rec.points.len() && rec.points[p].byte + margin <= g {
                let cp = rec.points[p];
                // Text start (byte 0) has nothing to reuse.
                if cp.byte > 0 {
                    last = Some(cp);
                }
                p += 1;
            }
            grid.push(last);
        }

        let entry = Arc::new(Entry {
            text: text.into(),
            ids: ids.clone(),
            grid,
            hashes,
        });
        self.insert(entry);
        ids
    }

    fn insert(&self, entry: Arc<Entry>) {
        let mut cache = self.lock();
        cache.tick += 1;
        let tick = cache.tick;
        let id = cache.next_id;
        cache.next_id += 1;
        for h in &entry.hashes {
            cache.index.insert(*h, id);
        }
        cache.entries.insert(id, (entry, tick));
        while cache.entries.len() > self.capacity {
            let Some(oldest) = cache
                .entries
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(id, _)| *id)
            else {
                break;
            };
            if let Some((old, _)) = cache.entries.remove(&oldest) {
                for h in &old.hashes {
                    if cache.index.get(h) == Some(&oldest) {
                        cache.index.remove(h);
                    }
                }
            }
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }
}
