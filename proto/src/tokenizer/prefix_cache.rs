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
//! Each remembered text keeps its ids and its safe boundaries (at most one per 32 bytes), and is
//! indexed by a chained hash of every 256-byte prefix. A new text hashes its own prefixes, finds
//! the longest one some remembered text shares, extends that to the exact common prefix length
//! `L` byte by byte (which also rules out hash collisions), and resumes at the remembered text's
//! last boundary `b` with `b + M <= L`. Entries are evicted least recently used.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use xxhash_rust::xxh3::xxh3_64;

use super::bpe::FxBuild;
use super::{Checkpoint, CheckpointRecorder, FastTokenizer, TokenEncoder, TokenizerError};

/// Bytes between grid points.
const GRID: usize = 256;
/// At most one recorded boundary per this many bytes.
const RECORD_GAP: usize = 32;
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

/// A remembered text, stored as a delta on the text it continued (a rope), so a conversation's
/// turns share their common prefix instead of each holding a full copy: remembering a
/// follow-up costs memory and copying proportional to the new text only.
struct Entry {
    /// The remembered text this one continues; this entry keeps its first `start_byte` bytes,
    /// `start_ids` ids and `start_points` boundaries.
    base: Option<Arc<Entry>>,
    start_byte: usize,
    start_ids: usize,
    start_points: usize,
    /// Own parts: bytes from `start_byte`, the ids after `start_ids` (raw, no post-processor
    /// specials), safe boundaries after those kept (absolute offsets, increasing).
    text: Box<[u8]>,
    ids: Vec<u32>,
    points: Vec<Checkpoint>,
    /// `hashes[k]`: chained hash of the whole text's first `(k + 1) * GRID` bytes.
    hashes: Vec<u64>,
    /// Length of the `base` chain.
    depth: usize,
}

/// One link of a rope, with how much of its own parts belongs to the text being read.
struct Segment<'a> {
    entry: &'a Arc<Entry>,
    bytes: usize,
    ids: usize,
    points: usize,
}

/// Chains longer than this are flattened into one entry (bounds lookup cost).
const MAX_DEPTH: usize = 24;

/// The rope from the root text to `leaf`.
fn segments(leaf: &Arc<Entry>) -> Vec<Segment<'_>> {
    let mut chain = vec![Segment {
        entry: leaf,
        bytes: leaf.text.len(),
        ids: leaf.ids.len(),
        points: leaf.points.len(),
    }];
    let mut cur = leaf;
    while let Some(base) = cur.base.as_ref() {
        chain.push(Segment {
            entry: base,
            bytes: cur.start_byte - base.start_byte,
            ids: cur.start_ids - base.start_ids,
            points: cur.start_points - base.start_points,
        });
        cur = base;
    }
    chain.reverse();
    chain
}

/// Length of the common prefix of a rope and `new`.
fn rope_common_prefix(segs: &[Segment<'_>], new: &[u8]) -> usize {
    let mut at = 0;
    for s in segs {
        let own = &s.entry.text[..s.bytes];
        let rest = &new[at.min(new.len())..];
        let c = common_prefix(own, rest);
        at += c;
        if c < own.len() {
            break;
        }
    }
    at
}

/// The last boundary `b` of a rope with `b.byte + margin <= limit` and `b.byte > 0`: the
/// boundary, the number of boundaries up to and including it, and the entry that owns it (the
/// base a continuation from `b` links to).
fn rope_last_point<'a>(
    segs: &[Segment<'a>],
    limit: usize,
    margin: usize,
) -> Option<(Checkpoint, usize, &'a Arc<Entry>)> {
    for s in segs.iter().rev() {
        let pts = &s.entry.points[..s.points];
        let idx = pts.partition_point(|p| p.byte + margin <= limit);
        if idx > 0 {
            let cp = pts[idx - 1];
            return (cp.byte > 0).then_some((cp, s.entry.start_points + idx, s.entry));
        }
    }
    None
}

/// Appends the rope's first `n` ids to `out`.
fn rope_ids(segs: &[Segment<'_>], mut n: usize, out: &mut Vec<u32>) {
    for s in segs {
        let take = n.min(s.ids);
        out.extend_from_slice(&s.entry.ids[..take]);
        n -= take;
        if n == 0 {
            break;
        }
    }
}

/// Appends the rope's first `n` boundaries to `out`.
fn rope_points(segs: &[Segment<'_>], mut n: usize, out: &mut Vec<Checkpoint>) {
    for s in segs {
        let take = n.min(s.points);
        out.extend_from_slice(&s.entry.points[..take]);
        n -= take;
        if n == 0 {
            break;
        }
    }
}

#[derive(Default)]
struct Cache {
    /// Entry id -> (entry, last use tick).
    entries: HashMap<u64, (Arc<Entry>, u64), FxBuild>,
    /// Last use tick -> entry id, oldest first.
    lru: BTreeMap<u64, u64>,
    /// Prefix hash -> entry id (the latest text that has that prefix).
    index: HashMap<u64, u64, FxBuild>,
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
    // Unseeded xxh3 per chunk, chained with a multiply-rotate step: a seeded xxh3 call on
    // more than 240 bytes derives a fresh secret each time, which costs more than the hash.
    let mut h = HASH_SEED;
    text.chunks_exact(GRID)
        .map(|c| {
            h = (h.rotate_left(23) ^ xxh3_64(c)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            h
        })
        .collect()
}

/// Length of the common prefix of two byte strings: whole 1 KiB blocks by `memcmp`, then
/// 8-byte words, then bytes (a per-16-byte slice comparison would call `memcmp` thousands of
/// times for an 8K-token prompt).
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 1024;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + BLOCK <= n && a[i..i + BLOCK] == b[i..i + BLOCK] {
        i += BLOCK;
    }
    while i + 8 <= n {
        let mut x = [0u8; 8];
        let mut y = [0u8; 8];
        x.copy_from_slice(&a[i..i + 8]);
        y.copy_from_slice(&b[i..i + 8]);
        let diff = u64::from_le_bytes(x) ^ u64::from_le_bytes(y);
        if diff != 0 {
            return i + (diff.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
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
            let hit = best.and_then(|(id, k)| {
                cache.entries.get_mut(&id).map(|(e, used)| {
                    let old = std::mem::replace(used, tick);
                    (Arc::clone(e), k, old, id)
                })
            });
            hit.map(|(e, k, old, id)| {
                cache.lru.remove(&old);
                cache.lru.insert(tick, id);
                (e, k)
            })
        };
        // Resume point: the exact common prefix with the remembered text (this comparison
        // also rules out a hash collision), then its last boundary at least `margin` before.
        let resume = found.and_then(|(e, _)| {
            let segs = segments(&e);
            let common = rope_common_prefix(&segs, text.as_bytes());
            let (cp, kept_points, owner) = rope_last_point(&segs, common, margin)?;
            let owner = Arc::clone(owner);
            let mut ids = Vec::with_capacity(cp.ids + (text.len() - cp.byte) / 3 + 8);
            rope_ids(&segs, cp.ids, &mut ids);
            // Too deep a rope: the new entry becomes a flat copy instead.
            let flat_points = (owner.depth + 1 >= MAX_DEPTH).then(|| {
                let mut pts = Vec::with_capacity(kept_points + 64);
                rope_points(&segs, kept_points, &mut pts);
                pts
            });
            drop(segs);
            Some((owner, cp, kept_points, ids, flat_points))
        });

        let mut rec = CheckpointRecorder::new(RECORD_GAP);
        let entry = match resume {
            Some((e, cp, kept_points, mut ids, flat_points)) => {
                rec.skip_until(cp.byte + RECORD_GAP);
                fast.encode_raw_into(&text[cp.byte..], &mut ids, cp.byte, Some(&mut rec));
                self.hits.fetch_add(1, Ordering::Relaxed);
                self.reused.fetch_add(cp.ids as u64, Ordering::Relaxed);
                self.encoded
                    .fetch_add((ids.len() - cp.ids) as u64, Ordering::Relaxed);
                let entry = match flat_points {
                    Some(mut points) => {
                        points.extend_from_slice(&rec.points);
                        Entry {
                            base: None,
                            start_byte: 0,
                            start_ids: 0,
                            start_points: 0,
                            text: text.as_bytes().into(),
                            ids: ids.clone(),
                            points,
                            hashes,
                            depth: 0,
                        }
                    }
                    None => Entry {
                        depth: e.depth + 1,
                        base: Some(e),
                        start_byte: cp.byte,
                        start_ids: cp.ids,
                        start_points: kept_points,
                        text: text.as_bytes()[cp.byte..].into(),
                        ids: ids[cp.ids..].to_vec(),
                        points: rec.points,
                        hashes,
                    },
                };
                (entry, ids)
            }
            None => {
                let mut ids = Vec::with_capacity(text.len() / 3 + 8);
                rec.points.push(Checkpoint { byte: 0, ids: 0 });
                rec.skip_until(RECORD_GAP);
                fast.encode_raw_into(text, &mut ids, 0, Some(&mut rec));
                self.encoded.fetch_add(ids.len() as u64, Ordering::Relaxed);
                let entry = Entry {
                    base: None,
                    start_byte: 0,
                    start_ids: 0,
                    start_points: 0,
                    text: text.as_bytes().into(),
                    ids: ids.clone(),
                    points: rec.points,
                    hashes,
                    depth: 0,
                };
                (entry, ids)
            }
        };
        let (entry, ids) = entry;
        self.insert(Arc::new(entry));
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
        cache.lru.insert(tick, id);
        while cache.entries.len() > self.capacity {
            let Some((_, oldest)) = cache.lru.pop_first() else {
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
