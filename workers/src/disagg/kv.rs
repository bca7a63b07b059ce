//! The simulated KV bytes of a block and checksums over them.
//!
//! A prefill worker's block holds `block_size * kv_bytes_per_token` bytes derived from the
//! block's sequence hash and position (splitmix64 stream), so the bytes identify the prompt
//! prefix they belong to: a decode worker can check that what it pulled is what the prefill
//! worker computed for *this* prompt, and a checksum equal on both sides proves the bytes were
//! moved, not regenerated.

use bytes::Bytes;
use kvroute_proto::hashing::{local_block_hashes, namespace_seed, sequence_hashes};
use xxhash_rust::xxh3::Xxh3;

/// The bytes of the block at `position` whose sequence hash is `seq_hash`.
pub fn block_bytes(seq_hash: u64, position: usize, len: usize) -> Bytes {
    let mut state = seq_hash ^ (position as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut out = Vec::with_capacity(len);
    while out.len() + 8 <= len {
        out.extend_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    let rest = len - out.len();
    out.extend_from_slice(&splitmix64(&mut state).to_le_bytes()[..rest]);
    Bytes::from(out)
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Sequence hashes of the full blocks of a prompt (Dynamo-compatible, as the block manager
/// computes them).
pub fn prompt_block_hashes(
    tokens: &[u32],
    block_size: usize,
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
) -> Vec<u64> {
    let seed = namespace_seed(lora_name, cache_salt);
    sequence_hashes(&local_block_hashes(tokens, block_size, seed))
}

/// Streaming xxh3-64 over a sequence of buffers.
#[derive(Default)]
pub struct Checksum(Xxh3);

impl Checksum {
    pub fn new() -> Checksum {
        Checksum(Xxh3::new())
    }

    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    pub fn hex(&self) -> String {
        format!("{:016x}", self.0.digest())
    }
}

/// The checksum a prefill worker reports for a prompt's full blocks.
pub fn prompt_checksum(
    tokens: &[u32],
    block_size: usize,
    block_len: usize,
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
) -> String {
    let mut c = Checksum::new();
    for (i, h) in prompt_block_hashes(tokens, block_size, lora_name, cache_salt)
        .into_iter()
        .enumerate()
    {
        c.update(&block_bytes(h, i, block_len));
    }
    c.hex()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_deterministic_and_distinct() {
        assert_eq!(block_bytes(7, 0, 13), block_bytes(7, 0, 13));
        assert_ne!(block_bytes(7, 0, 64), block_bytes(7, 1, 64));
        assert_ne!(block_bytes(7, 0, 64), block_bytes(8, 0, 64));
        assert_eq!(block_bytes(1, 2, 0).len(), 0);
        assert_eq!(block_bytes(1, 2, 1001).len(), 1001);
    }
}
