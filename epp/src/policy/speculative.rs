//! Speculative prefix entries: at pick time the chosen worker is assumed to hold the request's
//! blocks for a short TTL, until its KV events confirm them. Without this, a burst of requests
//! sharing a prefix (parallel agent calls, a quick follow-up turn) arrives before the first
//! request's events and scatters (llm-d's `speculativeTTL` 2 s; Dynamo's predicted indexer).
//! Keys are sequence hashes, so an entry names a block *position*, not just its content.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::load::WorkerKey;

pub struct SpeculativeIndex {
    ttl: Duration,
    capacity: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    holders: HashMap<u64, Vec<(WorkerKey, Instant)>>,
    /// Insertion order, for expiry and the capacity bound.
    fifo: VecDeque<(u64, WorkerKey, Instant)>,
}

impl SpeculativeIndex {
    /// `ttl` zero disables it.
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        SpeculativeIndex {
            ttl,
            capacity: capacity.max(1),
            state: Mutex::new(State::default()),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.ttl.is_zero()
    }

    /// Leading positions of `seq_hashes` each worker is speculated to hold.
    pub fn overlaps(&self, seq_hashes: &[u64], workers: &[WorkerKey]) -> Vec<u32> {
        if !self.enabled() {
            return vec![0; workers.len()];
        }
        let now = Instant::now();
        let st = self.state.lock();
        workers
            .iter()
            .map(|w| {
                seq_hashes
                    .iter()
                    .take_while(|h| {
                        st.holders
                            .get(h)
                            .is_some_and(|v| v.iter().any(|(k, exp)| k == w && *exp > now))
                    })
                    .count() as u32
            })
            .collect()
    }

    pub fn record(&self, seq_hashes: &[u64], worker: WorkerKey) {
        if !self.enabled() {
            return;
        }
        let now = Instant::now();
        let expiry = now + self.ttl;
        let mut st = self.state.lock();
        for &h in seq_hashes {
            let v = st.holders.entry(h).or_default();
            match v.iter_mut().find(|(k, _)| *k == worker) {
                Some(e) => e.1 = expiry,
                None => v.push((worker, expiry)),
            }
            st.fifo.push_back((h, worker, expiry));
        }
        // Drop expired entries, and the oldest beyond capacity.
        while let Some(&(h, w, exp)) = st.fifo.front() {
            if exp > now && st.fifo.len() <= self.capacity {
                break;
            }
            st.fifo.pop_front();
            if let Some(v) = st.holders.get_mut(&h) {
                // Only drop if this fifo entry is the live one (a re-record extends it).
                v.retain(|(k, e)| !(*k == w && *e <= exp));
                if v.is_empty() {
                    st.holders.remove(&h);
                }
            }
        }
    }

    pub fn forget_worker(&self, worker_id: u64) {
        let mut st = self.state.lock();
        st.fifo.retain(|(_, w, _)| w.0 != worker_id);
        st.holders.retain(|_, v| {
            v.retain(|(w, _)| w.0 != worker_id);
            !v.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_prefixes_score_until_they_expire() {
        let s = SpeculativeIndex::new(Duration::from_millis(50), 1000);
        s.record(&[1, 2, 3], (7, 0));
        assert_eq!(s.overlaps(&[1, 2, 9], &[(7, 0), (8, 0)]), vec![2, 0]);
        // Keys are sequence hashes: the same block content after another prefix is another key.
        use kvroute_proto::hashing::sequence_hashes;
        let a = sequence_hashes(&[10, 20, 30]);
        let b = sequence_hashes(&[11, 20, 30]);
        s.record(&a, (9, 0));
        assert_eq!(s.overlaps(&a, &[(9, 0)]), vec![3]);
        assert_eq!(s.overlaps(&b, &[(9, 0)]), vec![0]);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(s.overlaps(&[1, 2, 3], &[(7, 0)]), vec![0]);
        s.record(&[4], (7, 0));
        assert!(
            !s.state.lock().holders.contains_key(&1),
            "expired entries are dropped"
        );
    }

    #[test]
    fn capacity_and_forget() {
        let s = SpeculativeIndex::new(Duration::from_secs(10), 2);
        s.record(&[1, 2, 3], (7, 0));
        assert_eq!(
            s.overlaps(&[1, 2, 3], &[(7, 0)]),
            vec![0],
            "oldest entry evicted"
        );
        assert_eq!(s.overlaps(&[2, 3], &[(7, 0)]), vec![2]);
        s.forget_worker(7);
        assert_eq!(s.overlaps(&[2, 3], &[(7, 0)]), vec![0]);
        let off = SpeculativeIndex::new(Duration::ZERO, 10);
        off.record(&[1], (1, 0));
        assert_eq!(off.overlaps(&[1], &[(1, 0)]), vec![0]);
    }
}
