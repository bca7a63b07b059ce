//! Paged KV block manager with prefix caching, one per dp rank of the simulated engine.
//!
//! Owns the block accounting of one rank: which physical blocks exist, which full blocks are
//! cached under their Dynamo-compatible sequence hash, their refcounts, the LRU of unreferenced
//! cached blocks and every sequence's block table. It emits the KV events the cache changes
//! imply, in exactly the order the changes happen (see [`BlockManager::drain_events`]):
//!
//! - a full block that enters the cache for the first time → `Stored` (cache hits emit nothing);
//! - an unreferenced cached block evicted to make room → `Removed`;
//! - [`BlockManager::reset`] → `Cleared`.
//!
//! The published `block_hash` is the sequence hash (chain of local hashes seeded with the
//! LoRA / cache-salt namespace seed); `tokens_hash` is the block's local hash. Partial blocks are
//! private to their sequence and never published.
//!
//! Invariant that keeps event streams rebuildable: a cached block's parent is cached whenever
//! the block is. Sequences hold whole prefix chains and release them tail first, so a child
//! always enters the LRU before its parent and is evicted first.

use std::collections::{BTreeMap, HashMap};

use kvroute_proto::events::{KvEventData, StoredBlock};
use kvroute_proto::hashing::{
    blocks_for_tokens, chain_sequence_hash, local_block_hash, namespace_seed,
};

/// Internal id of a physical block.
type BlockId = u64;

/// Identifies a sequence (request) inside one manager.
pub type SeqId = u64;

/// Why an allocation could not be made. Nothing was changed when this is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("KV cache full: need {needed} blocks, {available} free or evictable")]
    OutOfBlocks { needed: u64, available: u64 },
    #[error("sequence {0} is unknown to the block manager")]
    UnknownSequence(SeqId),
    #[error("sequence {0} is already allocated")]
    DuplicateSequence(SeqId),
}

/// LoRA adapter and cache salt: the namespace a sequence's block hashes live in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Namespace {
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
}

impl Namespace {
    pub fn seed(&self) -> u64 {
        namespace_seed(self.lora_name.as_deref(), self.cache_salt.as_deref())
    }
}

#[derive(Debug)]
struct Block {
    /// Sequence hash when the block is in the hash index (cached); `None` for partial blocks and
    /// for blocks detached from the cache by a reset while still in use.
    hash: Option<u64>,
    /// Sequence hash of the previous block in the chain (meaningful while cached).
    parent: Option<u64>,
    refcount: u32,
    /// Key in the LRU while unreferenced and cached.
    lru_tick: Option<u64>,
}

#[derive(Debug)]
struct Sequence {
    ns: Namespace,
    seed: u64,
    /// Block table: full blocks first, then at most one partial block.
    blocks: Vec<BlockId>,
    /// Tokens of the trailing partial block (empty at a block boundary).
    tail: Vec<u32>,
    /// Sequence hash of the last full block.
    last_hash: Option<u64>,
    num_tokens: usize,
    /// False once a reset detached this sequence from the cache: its later full blocks stay
    /// private, so no event ever names a parent the subscribers were told is gone.
    cacheable: bool,
}

/// Counters for metrics and load reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockStats {
    /// Blocks referenced by at least one sequence.
    pub used_blocks: u64,
    /// Cached full blocks (referenced or not).
    pub cached_blocks: u64,
    pub total_blocks: u64,
    /// Prompt tokens looked up in the prefix cache (vLLM `prefix_cache_queries`).
    pub prefix_queries_tokens: u64,
    /// Prompt tokens served from the prefix cache (vLLM `prefix_cache_hits`).
    pub prefix_hits_tokens: u64,
    pub evictions: u64,
}

/// Merges consecutive events of the same kind so one allocation yields one `Stored` per chain
/// run and one eviction burst one `Removed`, without ever reordering changes.
#[derive(Debug, Default)]
struct Emitter {
    done: Vec<KvEventData>,
    current: Option<KvEventData>,
}

impl Emitter {
    fn stored(&mut self, parent: Option<u64>, block: StoredBlock, tokens: &[u32], ns: &Namespace) {
        let bs = tokens.len() as u32;
        if let Some(KvEventData::Stored {
            blocks,
            token_ids,
            block_size,
            lora_name,
            cache_salt,
            ..
        }) = &mut self.current
        {
            let extends = blocks.last().map(|b| b.block_hash) == parent
                && *block_size == bs
                && *lora_name == ns.lora_name
                && *cache_salt == ns.cache_salt;
            if extends {
                blocks.push(block);
                token_ids.extend_from_slice(tokens);
                return;
            }
        }
        self.flush();
        self.current = Some(KvEventData::Stored {
            parent_hash: parent,
            blocks: vec![block],
            token_ids: tokens.to_vec(),
            block_size: bs,
            lora_name: ns.lora_name.clone(),
            cache_salt: ns.cache_salt.clone(),
        });
    }

    fn removed(&mut self, hash: u64) {
        if let Some(KvEventData::Removed { block_hashes }) = &mut self.current {
            block_hashes.push(hash);
            return;
        }
        self.flush();
        self.current = Some(KvEventData::Removed {
            block_hashes: vec![hash],
        });
    }

    fn cleared(&mut self) {
        self.flush();
        self.done.push(KvEventData::Cleared);
    }

    fn flush(&mut self) {
        if let Some(ev) = self.current.take() {
            self.done.push(ev);
        }
    }
}

/// The paged KV cache of one dp rank.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    capacity: u64,
    blocks: HashMap<BlockId, Block>,
    next_block_id: BlockId,
    /// Sequence hash → cached block.
    index: HashMap<u64, BlockId>,
    /// Unreferenced cached blocks, oldest release first.
    lru: BTreeMap<u64, BlockId>,
    next_tick: u64,
    seqs: HashMap<SeqId, Sequence>,
    emitter: Emitter,
    stats: BlockStats,
}

impl BlockManager {
    /// `block_size` and `capacity` are clamped to at least 1.
    pub fn new(capacity_blocks: u64, block_size: u32) -> Self {
        BlockManager {
            block_size: block_size.max(1) as usize,
            capacity: capacity_blocks.max(1),
            blocks: HashMap::new(),
            next_block_id: 1,
            index: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 1,
            seqs: HashMap::new(),
            emitter: Emitter::default(),
            stats: BlockStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Blocks neither allocated nor cached.
    pub fn free_blocks(&self) -> u64 {
        self.capacity - self.blocks.len() as u64
    }

    /// Blocks that could be handed out now: free plus evictable.
    pub fn available_blocks(&self) -> u64 {
        self.free_blocks() + self.lru.len() as u64
    }

    pub fn stats(&self) -> BlockStats {
        BlockStats {
            used_blocks: self.blocks.len() as u64 - self.lru.len() as u64,
            cached_blocks: self.index.len() as u64,
            total_blocks: self.capacity,
            ..self.stats
        }
    }

    /// Sequence hashes of every cached block (what subscribers should believe is live).
    pub fn cached_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.index.keys().copied()
    }

    pub fn is_cached(&self, hash: u64) -> bool {
        self.index.contains_key(&hash)
    }

    /// Refcount of a cached block (`None` if not cached).
    pub fn refcount(&self, hash: u64) -> Option<u32> {
        let id = self.index.get(&hash)?;
        self.blocks.get(id).map(|b| b.refcount)
    }

    pub fn has_sequence(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// Tokens whose KV a sequence holds.
    pub fn sequence_tokens(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.num_tokens)
    }

    /// Number of leading full blocks of `tokens` found in the cache, capped so that at least one
    /// token is left to compute (like vLLM: the last token must run to produce logits).
    pub fn match_prefix(&self, ns: &Namespace, tokens: &[u32]) -> usize {
        self.match_blocks(ns, tokens, tokens.len().saturating_sub(1) / self.block_size)
    }

    /// Leading cached full blocks of `tokens`, at most `max_blocks`.
    fn match_blocks(&self, ns: &Namespace, tokens: &[u32], max_blocks: usize) -> usize {
        let seed = ns.seed();
        let mut parent: Option<u64> = None;
        let mut matched = 0;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let local = local_block_hash(chunk, seed);
            let hash = match parent {
                None => local,
                Some(p) => chain_sequence_hash(p, local),
            };
            if !self.index.contains_key(&hash) {
                break;
            }
            matched += 1;
            parent = Some(hash);
        }
        matched
    }

    /// Starts a sequence: references the `matched_blocks` cached prefix blocks of `tokens` (as
    /// returned by [`match_prefix`](Self::match_prefix) under the same lock) and computes the
    /// next `first_chunk` tokens after them. Atomic: on error nothing changed. Returns the
    /// number of cached tokens.
    pub fn start_sequence(
        &mut self,
        seq: SeqId,
        ns: Namespace,
        tokens: &[u32],
        matched_blocks: usize,
        first_chunk: usize,
    ) -> Result<usize, AllocError> {
        if self.seqs.contains_key(&seq) {
            return Err(AllocError::DuplicateSequence(seq));
        }
        let bs = self.block_size;
        let seed = ns.seed();
        // Re-derive the hashes: the caller's count must still hold (same lock), but never trust
        // it past what is actually cached.
        let mut hashes = Vec::with_capacity(matched_blocks);
        let mut parent: Option<u64> = None;
        for chunk in tokens.chunks_exact(bs).take(matched_blocks) {
            let local = local_block_hash(chunk, seed);
            let hash = parent.map_or(local, |p| chain_sequence_hash(p, local));
            if !self.index.contains_key(&hash) {
                break;
            }
            hashes.push(hash);
            parent = Some(hash);
        }
        let cached_tokens = hashes.len() * bs;
        let chunk_end = (cached_tokens + first_chunk).min(tokens.len());
        let in_lru = hashes
            .iter()
            .filter(|h| {
                self.index
                    .get(h)
                    .and_then(|id| self.blocks.get(id))
                    .is_some_and(|b| b.lru_tick.is_some())
            })
            .count() as u64;
        let needed = (blocks_for_tokens(chunk_end, bs) - hashes.len()) as u64;
        let available = self.available_blocks() - in_lru;
        if needed > available {
            return Err(AllocError::OutOfBlocks { needed, available });
        }

        let mut table = Vec::with_capacity(blocks_for_tokens(tokens.len(), bs));
        for h in &hashes {
            if let Some(&id) = self.index.get(h) {
                self.acquire(id);
                table.push(id);
            }
        }
        self.stats.prefix_queries_tokens += tokens.len() as u64;
        self.stats.prefix_hits_tokens += cached_tokens as u64;
        self.seqs.insert(
            seq,
            Sequence {
                ns,
                seed,
                blocks: table,
                tail: Vec::with_capacity(bs),
                last_hash: hashes.last().copied(),
                num_tokens: cached_tokens,
                cacheable: true,
            },
        );
        self.append_unchecked(seq, &tokens[cached_tokens..chunk_end]);
        self.emitter.flush();
        Ok(cached_tokens)
    }

    /// Starts a sequence that holds the full blocks of `tokens` (a trailing partial block is
    /// ignored): cached blocks are referenced, missing ones are allocated and cached as if
    /// computed, emitting `Stored` like any cache fill. This pins blocks for a KV transfer
    /// (prefill side) and installs blocks received by one (decode side). It is not a prefix
    /// query, so the hit/query counters do not move. Atomic: on error nothing changed.
    /// Returns how many of the blocks were already cached.
    pub fn hold_prefix(
        &mut self,
        seq: SeqId,
        ns: Namespace,
        tokens: &[u32],
    ) -> Result<usize, AllocError> {
        let bs = self.block_size;
        let full = tokens.len() / bs * bs;
        let tokens = &tokens[..full];
        let matched = self.match_blocks(&ns, tokens, full / bs);
        let counters = (
            self.stats.prefix_queries_tokens,
            self.stats.prefix_hits_tokens,
        );
        let cached = self.start_sequence(seq, ns, tokens, matched, full - matched * bs)?;
        (
            self.stats.prefix_queries_tokens,
            self.stats.prefix_hits_tokens,
        ) = counters;
        Ok(cached / bs)
    }

    /// Blocks a sequence would need to grow by `n` tokens (0 if unknown).
    pub fn blocks_needed(&self, seq: SeqId, n: usize) -> u64 {
        self.seqs.get(&seq).map_or(0, |s| {
            (blocks_for_tokens(s.num_tokens + n, self.block_size) - s.blocks.len()) as u64
        })
    }

    /// Appends computed tokens to a sequence; blocks that become full are cached (or merged
    /// with an identical cached block). Atomic: on error nothing changed.
    pub fn append(&mut self, seq: SeqId, tokens: &[u32]) -> Result<(), AllocError> {
        if !self.seqs.contains_key(&seq) {
            return Err(AllocError::UnknownSequence(seq));
        }
        let needed = self.blocks_needed(seq, tokens.len());
        let available = self.available_blocks();
        if needed > available {
            return Err(AllocError::OutOfBlocks { needed, available });
        }
        self.append_unchecked(seq, tokens);
        self.emitter.flush();
        Ok(())
    }

    /// Releases every block of a sequence. Cached blocks whose refcount drops to zero join the
    /// LRU tail first, so children are always evicted before their parents.
    pub fn free(&mut self, seq: SeqId) -> bool {
        let Some(s) = self.seqs.remove(&seq) else {
            return false;
        };
        for &id in s.blocks.iter().rev() {
            self.release(id);
        }
        true
    }

    /// Drops every unreferenced cached block and detaches the referenced ones from the cache
    /// (they stay private to their sequences), then emits `Cleared`: afterwards nothing is
    /// cached, which is exactly what subscribers are told.
    pub fn reset(&mut self) {
        self.emitter.flush();
        let lru = std::mem::take(&mut self.lru);
        for id in lru.into_values() {
            self.blocks.remove(&id);
        }
        for id in std::mem::take(&mut self.index).into_values() {
            if let Some(b) = self.blocks.get_mut(&id) {
                b.hash = None;
            }
        }
        for s in self.seqs.values_mut() {
            s.cacheable = false;
        }
        self.emitter.cleared();
    }

    /// Events caused by the changes since the last drain, in the order they happened.
    pub fn drain_events(&mut self) -> Vec<KvEventData> {
        self.emitter.flush();
        std::mem::take(&mut self.emitter.done)
    }

    /// Caller has checked capacity: `blocks_needed(seq, tokens.len()) <= available_blocks()`.
    /// Like vLLM, all blocks for the new tokens are allocated first (evicting as needed) and
    /// then filled and cached, so one step yields one `Removed` burst followed by `Stored` runs.
    fn append_unchecked(&mut self, seq: SeqId, tokens: &[u32]) {
        let bs = self.block_size;
        let needed = self.blocks_needed(seq, tokens.len());
        let mut fresh = Vec::with_capacity(needed as usize);
        for _ in 0..needed {
            match self.allocate_private() {
                Some(id) => fresh.push(id),
                None => {
                    // Unreachable after the capacity check; stop rather than corrupt state.
                    tracing::error!(seq, "block allocation failed after capacity check");
                    for id in fresh {
                        self.blocks.remove(&id);
                    }
                    return;
                }
            }
        }
        let mut fresh = fresh.into_iter();
        let mut rest = tokens;
        while !rest.is_empty() {
            let Some(s) = self.seqs.get_mut(&seq) else {
                return;
            };
            if s.tail.is_empty() {
                match fresh.next() {
                    Some(id) => s.blocks.push(id),
                    None => {
                        tracing::error!(seq, "block accounting mismatch while appending");
                        return;
                    }
                }
            }
            let take = (bs - s.tail.len()).min(rest.len());
            s.tail.extend_from_slice(&rest[..take]);
            s.num_tokens += take;
            rest = &rest[take..];
            if s.tail.len() == bs {
                self.promote_last(seq);
            }
        }
    }

    /// The sequence's last block just became full: hash it and cache it, or merge it into the
    /// identical cached block (no event, like a prefix hit).
    fn promote_last(&mut self, seq: SeqId) {
        let bs = self.block_size;
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        let local = local_block_hash(&s.tail, s.seed);
        let parent = s.last_hash;
        let hash = parent.map_or(local, |p| chain_sequence_hash(p, local));
        s.last_hash = Some(hash);
        let tail = std::mem::replace(&mut s.tail, Vec::with_capacity(bs));
        if !s.cacheable {
            return;
        }
        let Some(slot) = s.blocks.last_mut() else {
            return;
        };
        let private = *slot;
        if let Some(&existing) = self.index.get(&hash) {
            *slot = existing;
            self.blocks.remove(&private);
            self.acquire(existing);
            return;
        }
        let ns = s.ns.clone();
        if let Some(b) = self.blocks.get_mut(&private) {
            b.hash = Some(hash);
            b.parent = parent;
        }
        self.index.insert(hash, private);
        self.emitter.stored(
            parent,
            StoredBlock {
                block_hash: hash,
                tokens_hash: local,
            },
            &tail,
            &ns,
        );
    }

    fn allocate_private(&mut self) -> Option<BlockId> {
        if self.free_blocks() == 0 && !self.evict_one() {
            return None;
        }
        let id = self.next_block_id;
        self.next_block_id += 1;
        self.blocks.insert(
            id,
            Block {
                hash: None,
                parent: None,
                refcount: 1,
                lru_tick: None,
            },
        );
        Some(id)
    }

    /// Evicts the least recently released unreferenced cached block.
    fn evict_one(&mut self) -> bool {
        let Some((_, id)) = self.lru.pop_first() else {
            return false;
        };
        if let Some(b) = self.blocks.remove(&id) {
            if let Some(h) = b.hash {
                self.index.remove(&h);
                self.emitter.removed(h);
            }
        }
        self.stats.evictions += 1;
        true
    }

    fn acquire(&mut self, id: BlockId) {
        if let Some(b) = self.blocks.get_mut(&id) {
            if let Some(tick) = b.lru_tick.take() {
                self.lru.remove(&tick);
            }
            b.refcount += 1;
        }
    }

    fn release(&mut self, id: BlockId) {
        let Some(b) = self.blocks.get_mut(&id) else {
            return;
        };
        b.refcount = b.refcount.saturating_sub(1);
        if b.refcount > 0 {
            return;
        }
        if b.hash.is_some() {
            let tick = self.next_tick;
            self.next_tick += 1;
            b.lru_tick = Some(tick);
            self.lru.insert(tick, id);
        } else {
            self.blocks.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_proto::hashing::{local_block_hashes, sequence_hashes};
    use std::collections::HashSet;

    const BS: u32 = 4;

    fn ns() -> Namespace {
        Namespace::default()
    }

    fn hashes(tokens: &[u32]) -> Vec<u64> {
        sequence_hashes(&local_block_hashes(tokens, BS as usize, ns().seed()))
    }

    /// Starts a sequence with its whole prompt computed at once.
    fn start(m: &mut BlockManager, seq: SeqId, tokens: &[u32]) -> Result<usize, AllocError> {
        let matched = m.match_prefix(&ns(), tokens);
        m.start_sequence(seq, ns(), tokens, matched, tokens.len())
    }

    #[test]
    fn prefix_hits_count_shared_full_blocks() {
        let mut m = BlockManager::new(64, BS);
        let a: Vec<u32> = (0..10).collect(); // 2 full blocks + 2 tokens
        assert_eq!(start(&mut m, 1, &a), Ok(0));
        let evs = m.drain_events();
        assert_eq!(evs.len(), 1, "one Stored run for the two full blocks");
        match &evs[0] {
            KvEventData::Stored {
                parent_hash,
                blocks,
                token_ids,
                block_size,
                ..
            } => {
                assert_eq!(*parent_hash, None);
                assert_eq!(
                    blocks.iter().map(|b| b.block_hash).collect::<Vec<_>>(),
                    hashes(&a)
                );
                assert_eq!(
                    blocks[0].tokens_hash,
                    local_block_hash(&a[..4], ns().seed())
                );
                assert_eq!(token_ids, &a[..8]);
                assert_eq!(*block_size, BS);
            }
            other => panic!("expected Stored, got {other:?}"),
        }
        // Same 8-token prefix, different tail: 2 shared full blocks → 8 cached tokens.
        let b: Vec<u32> = (0..8).chain([100, 101, 102, 103, 104]).collect();
        assert_eq!(start(&mut m, 2, &b), Ok(8));
        let evs = m.drain_events();
        assert_eq!(evs.len(), 1, "only the fresh third block is stored");
        match &evs[0] {
            KvEventData::Stored {
                parent_hash,
                blocks,
                ..
            } => {
                assert_eq!(*parent_hash, Some(hashes(&a)[1]));
                assert_eq!(blocks.len(), 1);
            }
            other => panic!("expected Stored, got {other:?}"),
        }
        assert_eq!(m.refcount(hashes(&a)[0]), Some(2));
        let st = m.stats();
        assert_eq!(st.prefix_queries_tokens, 23);
        assert_eq!(st.prefix_hits_tokens, 8);
        // 3 blocks for a, 2 fresh (block 3 full + tail) for b.
        assert_eq!(st.used_blocks, 5);
        assert_eq!(st.cached_blocks, 3);
    }

    #[test]
    fn fully_cached_prompt_still_computes_last_token() {
        let mut m = BlockManager::new(64, BS);
        let a: Vec<u32> = (0..8).collect();
        start(&mut m, 1, &a).unwrap();
        m.free(1);
        m.drain_events();
        // Only 1 of 2 blocks counts as a hit; the recomputed block merges with the cached one.
        assert_eq!(start(&mut m, 2, &a), Ok(4));
        assert!(m.drain_events().is_empty(), "a merge emits nothing");
        assert_eq!(m.stats().used_blocks, 2);
        assert_eq!(m.refcount(hashes(&a)[1]), Some(1));
    }

    #[test]
    fn eviction_is_lru_and_children_first() {
        let mut m = BlockManager::new(4, BS);
        let a: Vec<u32> = (0..8).collect();
        let b: Vec<u32> = (100..108).collect();
        start(&mut m, 1, &a).unwrap();
        start(&mut m, 2, &b).unwrap();
        m.free(1); // a released first → oldest
        m.free(2);
        m.drain_events();
        assert_eq!(m.stats().used_blocks, 0);
        assert_eq!(m.available_blocks(), 4);
        // Needs 2 blocks: evicts a's two blocks, child before parent.
        let c: Vec<u32> = (200..208).collect();
        start(&mut m, 3, &c).unwrap();
        let evs = m.drain_events();
        let ha = hashes(&a);
        assert_eq!(
            evs[0],
            KvEventData::Removed {
                block_hashes: vec![ha[1], ha[0]]
            }
        );
        assert!(matches!(evs[1], KvEventData::Stored { .. }));
        assert!(m.is_cached(hashes(&b)[0]) && m.is_cached(hashes(&b)[1]));
        assert!(!m.is_cached(ha[0]));
        // c was released after b, so b is older and goes first, child before parent.
        m.free(3);
        let d: Vec<u32> = (300..304).chain([1]).collect();
        start(&mut m, 4, &d).unwrap();
        let hb = hashes(&b);
        let evs = m.drain_events();
        assert_eq!(
            evs[0],
            KvEventData::Removed {
                block_hashes: vec![hb[1], hb[0]]
            }
        );
        assert_eq!(evs.len(), 2);
        assert!(m.is_cached(hashes(&c)[0]) && m.is_cached(hashes(&c)[1]));
    }

    #[test]
    fn referenced_blocks_are_never_evicted() {
        let mut m = BlockManager::new(4, BS);
        let a: Vec<u32> = (0..8).collect();
        start(&mut m, 1, &a).unwrap();
        let b: Vec<u32> = (100..108).collect();
        start(&mut m, 2, &b).unwrap();
        m.free(2);
        m.drain_events();
        // 2 free-able (b's), a in use: a 3-block prompt cannot fit.
        let c: Vec<u32> = (200..212).collect();
        let err = start(&mut m, 3, &c).unwrap_err();
        assert_eq!(
            err,
            AllocError::OutOfBlocks {
                needed: 3,
                available: 2
            }
        );
        assert!(
            m.drain_events().is_empty(),
            "a failed allocation changes nothing"
        );
        assert!(!m.has_sequence(3));
        assert!(
            m.is_cached(hashes(&b)[0]),
            "failed allocation evicted nothing"
        );
        // 2 blocks fit by evicting b; a stays.
        let d: Vec<u32> = (300..308).collect();
        start(&mut m, 4, &d).unwrap();
        assert!(m.is_cached(hashes(&a)[0]) && m.is_cached(hashes(&a)[1]));
        assert_eq!(m.refcount(hashes(&a)[0]), Some(1));
        assert!(!m.is_cached(hashes(&b)[0]));
        // Growing beyond capacity is reported, not a panic.
        assert!(matches!(
            m.append(1, &[9]),
            Err(AllocError::OutOfBlocks { needed: 1, .. })
        ));
        assert_eq!(m.append(99, &[1]), Err(AllocError::UnknownSequence(99)));
    }

    #[test]
    fn decode_fills_blocks_and_caches_them() {
        let mut m = BlockManager::new(16, BS);
        let a: Vec<u32> = (0..6).collect();
        start(&mut m, 1, &a).unwrap();
        m.drain_events();
        m.append(1, &[6]).unwrap();
        assert!(m.drain_events().is_empty(), "block not full yet");
        m.append(1, &[7]).unwrap();
        let evs = m.drain_events();
        let full: Vec<u32> = (0..8).collect();
        assert_eq!(evs.len(), 1);
        match &evs[0] {
            KvEventData::Stored {
                parent_hash,
                blocks,
                token_ids,
                ..
            } => {
                assert_eq!(*parent_hash, Some(hashes(&full)[0]));
                assert_eq!(blocks[0].block_hash, hashes(&full)[1]);
                assert_eq!(token_ids, &full[4..8]);
            }
            other => panic!("expected Stored, got {other:?}"),
        }
        assert_eq!(m.sequence_tokens(1), Some(8));
    }

    #[test]
    fn hold_prefix_pins_and_installs_full_blocks() {
        let mut m = BlockManager::new(8, BS);
        let tokens: Vec<u32> = (0..10).collect(); // 2 full blocks + 2 tokens
        assert_eq!(m.hold_prefix(100, ns(), &tokens).unwrap(), 0);
        let h = hashes(&tokens[..8]);
        let evs = m.drain_events();
        assert!(matches!(&evs[..], [KvEventData::Stored { blocks, .. }] if blocks.len() == 2));
        assert_eq!(m.refcount(h[1]), Some(1));
        assert_eq!(m.stats().prefix_queries_tokens, 0);
        // A request for the same prompt now hits both blocks.
        assert_eq!(start(&mut m, 1, &tokens).unwrap(), 8);
        assert_eq!(m.refcount(h[0]), Some(2));
        // Holding again references, stores nothing.
        assert_eq!(m.hold_prefix(101, ns(), &tokens).unwrap(), 2);
        assert!(m.drain_events().is_empty());
        m.free(100);
        m.free(101);
        m.free(1);
        assert_eq!(m.refcount(h[0]), Some(0));
    }

    #[test]
    fn reset_clears_and_detaches() {
        let mut m = BlockManager::new(16, BS);
        let a: Vec<u32> = (0..8).collect();
        start(&mut m, 1, &a).unwrap();
        start(&mut m, 2, &(50..58).collect::<Vec<_>>()).unwrap();
        m.free(2);
        m.drain_events();
        m.reset();
        assert_eq!(m.drain_events(), vec![KvEventData::Cleared]);
        assert_eq!(m.cached_hashes().count(), 0);
        assert_eq!(m.stats().used_blocks, 2, "a's blocks are still in use");
        // The detached sequence keeps growing privately: no events.
        m.append(1, &[8, 9, 10, 11]).unwrap();
        assert!(m.drain_events().is_empty());
        m.free(1);
        assert_eq!(m.stats().used_blocks, 0);
        assert_eq!(m.available_blocks(), 16);
    }

    #[test]
    fn namespaces_do_not_share() {
        let mut m = BlockManager::new(16, BS);
        let a: Vec<u32> = (0..9).collect();
        start(&mut m, 1, &a).unwrap();
        let salted = Namespace {
            lora_name: None,
            cache_salt: Some("tenant".into()),
        };
        assert_eq!(m.match_prefix(&salted, &a), 0);
        assert_eq!(m.match_prefix(&ns(), &a), 2);
    }

    /// Replays events into a set of live block hashes, checking each event is consistent.
    fn replay(live: &mut HashSet<u64>, evs: &[KvEventData]) {
        for ev in evs {
            match ev {
                KvEventData::Stored {
                    parent_hash,
                    blocks,
                    token_ids,
                    block_size,
                    ..
                } => {
                    assert_eq!(token_ids.len(), blocks.len() * *block_size as usize);
                    if let Some(p) = parent_hash {
                        assert!(live.contains(p), "parent {p} of a stored block is live");
                    }
                    for b in blocks {
                        assert!(live.insert(b.block_hash), "stored twice: {}", b.block_hash);
                    }
                }
                KvEventData::Removed { block_hashes } => {
                    for h in block_hashes {
                        assert!(live.remove(h), "removed a block never stored: {h}");
                    }
                }
                KvEventData::Cleared => live.clear(),
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Start { prefix: u8, len: u8, salt: bool },
        Decode { which: u8, n: u8 },
        Free { which: u8 },
        Reset,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            6 => (0u8..4, 1u8..40, proptest::bool::weighted(0.1))
                .prop_map(|(prefix, len, salt)| Op::Start { prefix, len, salt }),
            6 => (any::<u8>(), 1u8..9).prop_map(|(which, n)| Op::Decode { which, n }),
            4 => any::<u8>().prop_map(|which| Op::Free { which }),
            1 => Just(Op::Reset),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Whatever the workload, replaying the emitted events yields exactly the cached set,
        /// and every event is self-consistent (parents live, no double store or phantom remove).
        #[test]
        fn events_replay_to_the_cached_set(ops in proptest::collection::vec(op(), 1..120)) {
            let mut m = BlockManager::new(12, BS);
            let mut live = HashSet::new();
            let mut active: Vec<SeqId> = Vec::new();
            let mut next: SeqId = 1;
            // Four shared "system prompts"; requests take a prefix of one plus a private tail.
            let bases: Vec<Vec<u32>> = (0..4u32).map(|p| (0..24).map(|i| p * 1000 + i).collect()).collect();
            for op in ops {
                match op {
                    Op::Start { prefix, len, salt } => {
                        let base = &bases[prefix as usize];
                        let shared = (len as usize).min(base.len());
                        let mut toks = base[..shared].to_vec();
                        toks.extend((0..(len as u32 % 7)).map(|i| 50_000 + next as u32 * 10 + i));
                        let ns = Namespace { lora_name: None, cache_salt: salt.then(|| "s".to_string()) };
                        let matched = m.match_prefix(&ns, &toks);
                        // Chunked: start with part of the prompt, grow with the rest.
                        let first = (toks.len() - matched * BS as usize).min(5);
                        match m.start_sequence(next, ns, &toks, matched, first) {
                            Ok(cached) => {
                                let done = cached + first;
                                if done < toks.len() && m.append(next, &toks[done..]).is_err() {
                                    m.free(next);
                                } else {
                                    active.push(next);
                                }
                            }
                            Err(AllocError::OutOfBlocks { .. }) => {}
                            Err(e) => panic!("unexpected {e}"),
                        }
                        next += 1;
                    }
                    Op::Decode { which, n } => {
                        if !active.is_empty() {
                            let s = active[which as usize % active.len()];
                            let toks: Vec<u32> = (0..n as u32).map(|i| 7 + i % 3).collect();
                            let _ = m.append(s, &toks);
                        }
                    }
                    Op::Free { which } => {
                        if !active.is_empty() {
                            let s = active.remove(which as usize % active.len());
                            proptest::prop_assert!(m.free(s));
                        }
                    }
                    Op::Reset => m.reset(),
                }
                replay(&mut live, &m.drain_events());
                let cached: HashSet<u64> = m.cached_hashes().collect();
                proptest::prop_assert_eq!(&live, &cached);
                let st = m.stats();
                proptest::prop_assert!(st.used_blocks + (m.lru.len() as u64) <= st.total_blocks);
                // Cached blocks' parents are cached (the chain invariant).
                for b in m.blocks.values() {
                    if let (Some(_), Some(p)) = (b.hash, b.parent) {
                        proptest::prop_assert!(m.index.contains_key(&p), "orphaned cached block");
                    }
                }
                for s in m.seqs.values() {
                    proptest::prop_assert!(s.blocks.len() == blocks_for_tokens(s.num_tokens, BS as usize));
                }
            }
            for s in active {
                m.free(s);
            }
            proptest::prop_assert_eq!(m.stats().used_blocks, 0);
            proptest::prop_assert_eq!(m.available_blocks(), 12);
        }
    }
}
