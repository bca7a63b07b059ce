//! Dynamo-compatible KV block hashing (DESIGN contract 5).
//!
//! A request's tokens are cut into full blocks of `block_size` tokens (the tail is never hashed).
//! Each block gets a *local hash*, `xxh3_64_with_seed(LE u32 tokens, seed)`, where the seed is 1337
//! mixed with the LoRA name and cache salt; blocks are chained into *sequence hashes* so that a
//! block's identity includes everything before it. Values follow Dynamo's `compute_block_hash` /
//! `compute_salt_hash` and SGLang kv-index's `namespace_seed` / `chain_prefix_hash`
//! (reference: engine-kv-events.md §6).

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Dynamo's `XXH3_SEED`.
pub const XXH3_SEED: u64 = 1337;

/// Hash of one block's tokens, independent of what came before it.
pub type LocalBlockHash = u64;
/// Hash of a block and all blocks before it.
pub type SequenceHash = u64;

/// The seed that namespaces local hashes by LoRA adapter and cache salt.
/// Empty strings count as absent, so `Some("")` and `None` hash the same.
pub fn namespace_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut seed = XXH3_SEED;
    if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
    }
    if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
    }
    seed
}

/// Local hash of one block of tokens under `seed`.
pub fn local_block_hash(tokens: &[u32], seed: u64) -> LocalBlockHash {
    // Stack buffer for the common block sizes; the hash input must be the LE bytes of the ids.
    const STACK_TOKENS: usize = 128;
    if tokens.len() <= STACK_TOKENS {
        let mut buf = [0u8; STACK_TOKENS * 4];
        for (chunk, t) in buf.chunks_exact_mut(4).zip(tokens) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&buf[..tokens.len() * 4], seed)
    } else {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, seed)
    }
}

/// Local hashes of every full block of `tokens`.
pub fn local_block_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<LocalBlockHash> {
    assert!(block_size > 0, "block_size must be positive");
    tokens
        .chunks_exact(block_size)
        .map(|block| local_block_hash(block, seed))
        .collect()
}

/// The next link of a sequence-hash chain.
pub fn chain_sequence_hash(parent: SequenceHash, local: LocalBlockHash) -> SequenceHash {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, XXH3_SEED)
}

/// Sequence hashes of a chain of local hashes: `seq[0] = local[0]`,
/// `seq[i] = xxh3(LE seq[i-1] ‖ LE local[i], 1337)`.
pub fn sequence_hashes(locals: &[LocalBlockHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(locals.len());
    let mut prev: Option<SequenceHash> = None;
    for &local in locals {
        let seq = match prev {
            None => local,
            Some(p) => chain_sequence_hash(p, local),
        };
        out.push(seq);
        prev = Some(seq);
    }
    out
}

/// Number of KV blocks a sequence of `tokens` occupies (partial tail included).
pub fn blocks_for_tokens(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size.max(1))
}

/// Unseeded xxh3, exposed for fingerprints (prefix caches, checksums).
pub fn xxh3(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Vectors computed independently with Python's `xxhash` 3.x package (xxh3_64_intdigest),
    // and cross-checked against the reference table in engine-kv-events.md §6.
    #[test]
    fn xxh3_plain_vector() {
        assert_eq!(xxh3(b"hello"), 0x9555e8555c62dcfd);
    }

    #[test]
    fn local_hash_vectors() {
        assert_eq!(
            local_block_hash(&[1, 2, 3, 4], XXH3_SEED),
            14643705804678351452
        );
        assert_eq!(
            local_block_hash(&[5, 6, 7, 8], XXH3_SEED),
            16777012769546811212
        );
    }

    #[test]
    fn sequence_chain_vector() {
        let locals = local_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, XXH3_SEED);
        assert_eq!(locals.len(), 2, "the partial tail block is not hashed");
        assert_eq!(
            sequence_hashes(&locals),
            vec![14643705804678351452, 4945711292740353085]
        );
    }

    #[test]
    fn namespace_seed_vector() {
        let seed = namespace_seed(Some("my-lora"), Some("tenant-a"));
        assert_eq!(seed, 14775598059325835610);
        assert_eq!(local_block_hash(&[1, 2, 3, 4], seed), 6157910915076630503);
    }

    #[test]
    fn empty_namespace_is_default_seed() {
        assert_eq!(namespace_seed(None, None), XXH3_SEED);
        assert_eq!(namespace_seed(Some(""), Some("")), XXH3_SEED);
        assert_ne!(
            namespace_seed(None, Some("a")),
            namespace_seed(Some("a"), None)
        );
    }

    #[test]
    fn long_blocks_hash_like_short_path() {
        let tokens: Vec<u32> = (0..300).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(local_block_hash(&tokens, 7), xxh3_64_with_seed(&bytes, 7));
        assert_eq!(
            local_block_hash(&tokens[..128], 7),
            xxh3_64_with_seed(&bytes[..512], 7)
        );
    }

    #[test]
    fn block_count_rounds_up() {
        assert_eq!(blocks_for_tokens(0, 16), 0);
        assert_eq!(blocks_for_tokens(16, 16), 1);
        assert_eq!(blocks_for_tokens(17, 16), 2);
    }
}
