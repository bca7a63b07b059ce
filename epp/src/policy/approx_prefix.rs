//! GAIE-style approximate prefix affinity, kept as a baseline: the prompt's characters are cut
//! into blocks of `4 × block_size` characters (the "4 characters per token" guess), chained by
//! hash, and remembered per worker at pick time with no feedback from the engines. Its blind
//! spots (guessed token counts, unseen evictions) are what the exact KV policy fixes.

use std::collections::{HashMap, VecDeque};

use parking_lot::Mutex;

use crate::load::WorkerKey;

pub struct ApproxPrefixIndex {
    chars_per_block: usize,
    capacity: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    holders: HashMap<u64, Vec<WorkerKey>>,
    /// Insertion order for eviction once `capacity` entries are held.
    fifo: VecDeque<(u64, WorkerKey)>,
}

impl ApproxPrefixIndex {
    pub fn new(block_size_tokens: u32, capacity: usize) -> Self {
        ApproxPrefixIndex {
            chars_per_block: (block_size_tokens as usize * 4).max(1),
            capacity: capacity.max(1),
            state: Mutex::new(State::default()),
        }
    }

    /// Chained hashes of the full character blocks of `prompt`.
    pub fn block_hashes(&self, prompt: &str) -> Vec<u64> {
        let chars: Vec<char> = prompt.chars().collect();
        let mut prev = 0u64;
        chars
            .chunks_exact(self.chars_per_block)
            .map(|chunk| {
                let s: String = chunk.iter().collect();
                let mut buf = prev.to_le_bytes().to_vec();
                buf.extend_from_slice(s.as_bytes());
                prev = kvroute_proto::hashing::xxh3(&buf);
                prev
            })
            .collect()
    }

    /// Consecutive matched blocks for each worker.
    pub fn scores(&self, hashes: &[u64], workers: &[WorkerKey]) -> Vec<u32> {
        let st = self.state.lock();
        workers
            .iter()
            .map(|w| {
                hashes
                    .iter()
                    .take_while(|h| st.holders.get(h).is_some_and(|v| v.contains(w)))
                    .count() as u32
            })
            .collect()
    }

    /// Remembers that `worker` now holds these blocks.
    pub fn record(&self, hashes: &[u64], worker: WorkerKey) {
        let mut st = self.state.lock();
        for &h in hashes {
            let holders = st.holders.entry(h).or_default();
            if holders.contains(&worker) {
                continue;
            }
            holders.push(worker);
            st.fifo.push_back((h, worker));
        }
        while st.fifo.len() > self.capacity {
            let Some((h, w)) = st.fifo.pop_front() else {
                break;
            };
            if let Some(v) = st.holders.get_mut(&h) {
                v.retain(|x| *x != w);
                if v.is_empty() {
                    st.holders.remove(&h);
                }
            }
        }
    }

    pub fn forget_worker(&self, worker_id: u64) {
        let mut st = self.state.lock();
        st.fifo.retain(|(_, w)| w.0 != worker_id);
        st.holders.retain(|_, v| {
            v.retain(|w| w.0 != worker_id);
            !v.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_follow_recorded_prefixes() {
        let idx = ApproxPrefixIndex::new(1, 100); // 4 chars per block
        let a = idx.block_hashes("aaaabbbbcccc");
        let b = idx.block_hashes("aaaabbbbdddd");
        assert_eq!(a.len(), 3);
        assert_eq!(&a[..2], &b[..2]);
        assert_ne!(a[2], b[2]);
        idx.record(&a, (1, 0));
        assert_eq!(idx.scores(&b, &[(1, 0), (2, 0)]), vec![2, 0]);
        idx.forget_worker(1);
        assert_eq!(idx.scores(&b, &[(1, 0)]), vec![0]);
    }

    #[test]
    fn capacity_evicts_oldest() {
        let idx = ApproxPrefixIndex::new(1, 2);
        let a = idx.block_hashes("aaaabbbbcccc");
        idx.record(&a, (1, 0));
        // Only the two newest entries survive: the chain's head is gone, so nothing matches.
        assert_eq!(idx.scores(&a, &[(1, 0)]), vec![0]);
    }
}
