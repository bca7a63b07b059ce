//! Concurrent replay: one writer thread per worker replays its own engine-like event stream
//! (prompts from a shared pool, a small LRU cache that evicts whatever is least recently used,
//! so chains get holes; occasional clears and a removal and re-registration of the worker)
//! while reader threads look up continuously. Afterwards every worker's log is replayed into the
//! reference index and every pool prompt must score identically; the readers' answers during
//! the run must be well-formed (depths within the request, known workers only).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvroute_epp::index::reference::ReferenceIndex;
use kvroute_epp::index::{KvIndex, WorkerKey};
use kvroute_proto::events::{KvEventData, StoredBlock};

const WORKERS: u64 = 8;
const PROMPTS: usize = 900;
const CAPACITY: usize = 600;
const REQUESTS: usize = 1500;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn pool() -> Vec<Vec<u64>> {
    let mut rng = Rng(0xfeed_beef_1234_5678);
    let heads: Vec<Vec<u64>> = (0..6)
        .map(|_| {
            (0..(4 + rng.next() % 12))
                .map(|_| rng.next() % 50)
                .collect()
        })
        .collect();
    (0..PROMPTS)
        .map(|_| {
            let mut prompt = heads[(rng.next() % heads.len() as u64) as usize].clone();
            let extra = 1 + rng.next() % 64;
            // Small alphabet: chunk collisions at different positions are common.
            prompt.extend((0..extra).map(|_| rng.next() % 50));
            prompt
        })
        .collect()
}

enum Logged {
    Event(KvEventData),
    RemoveWorker,
}

/// One worker's engine: prompts through an LRU block cache, emitting events.
fn worker_stream(worker: u64, prompts: &[Vec<u64>]) -> Vec<Logged> {
    let mut rng = Rng(0x9e37_79b9 ^ (worker + 1).wrapping_mul(0x1234_5678_9abc));
    let mut log = Vec::new();
    // engine hash -> last use
    let mut cache: HashMap<u64, u64> = HashMap::new();
    let mut clock = 0u64;
    for request in 0..REQUESTS {
        if request % 400 == 399 {
            log.push(Logged::Event(KvEventData::Cleared));
            cache.clear();
        }
        if worker.is_multiple_of(3) && request == REQUESTS / 2 {
            log.push(Logged::RemoveWorker);
            cache.clear();
        }
        let prompt = &prompts[(rng.next() % prompts.len() as u64) as usize];
        // Engine hashes chain the parent's hash and the content, per worker seed.
        let mut engine = Vec::with_capacity(prompt.len());
        let mut at = worker.wrapping_mul(0x5851_f42d_4c95_7f2d);
        for &c in prompt {
            at = (at ^ c).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
            engine.push(at);
        }
        let hit = engine.iter().take_while(|h| cache.contains_key(h)).count();
        clock += 1;
        for h in &engine[..hit] {
            cache.insert(*h, clock);
        }
        if hit < prompt.len() {
            let blocks: Vec<StoredBlock> = (hit..prompt.len())
                .map(|i| StoredBlock {
                    block_hash: engine[i],
                    tokens_hash: prompt[i],
                })
                .collect();
            for b in &blocks {
                cache.insert(b.block_hash, clock);
            }
            log.push(Logged::Event(KvEventData::Stored {
                parent_hash: hit.checked_sub(1).map(|i| engine[i]),
                blocks,
                token_ids: Vec::new(),
                block_size: 16,
                lora_name: None,
                cache_salt: None,
            }));
        }
        if cache.len() > CAPACITY {
            let mut by_age: Vec<(u64, u64)> = cache.iter().map(|(h, t)| (*t, *h)).collect();
            by_age.sort_unstable();
            let evict: Vec<u64> = by_age[..cache.len() - CAPACITY]
                .iter()
                .map(|(_, h)| *h)
                .collect();
            for h in &evict {
                cache.remove(h);
            }
            log.push(Logged::Event(KvEventData::Removed {
                block_hashes: evict,
            }));
        }
    }
    log
}

#[test]
fn concurrent_replay_equals_reference() {
    let prompts = Arc::new(pool());
    let streams: Vec<Vec<Logged>> = (0..WORKERS).map(|w| worker_stream(w, &prompts)).collect();
    let index = Arc::new(KvIndex::new());
    let done = Arc::new(AtomicBool::new(false));
    let lookups = Arc::new(AtomicU64::new(0));

    let readers: Vec<_> = (0..2)
        .map(|r| {
            let index = index.clone();
            let prompts = prompts.clone();
            let done = done.clone();
            let lookups = lookups.clone();
            std::thread::spawn(move || {
                let mut out = Vec::new();
                let mut i = r;
                while !done.load(Ordering::Relaxed) {
                    let prompt = &prompts[i % prompts.len()];
                    index.find_matches_into(prompt, &mut out);
                    for &((worker, rank), depth) in &out {
                        assert!(worker < WORKERS && rank == 0, "unknown worker {worker}");
                        assert!(depth >= 1 && depth as usize <= prompt.len());
                    }
                    i += 7;
                    lookups.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();

    let streams = Arc::new(streams);
    let writers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let index = index.clone();
            let streams = streams.clone();
            std::thread::spawn(move || {
                let key: WorkerKey = (w, 0);
                for logged in &streams[w as usize] {
                    match logged {
                        Logged::Event(event) => index
                            .apply(key, event)
                            .expect("engine-like streams never name an unknown parent"),
                        Logged::RemoveWorker => index.remove_worker(w),
                    }
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().expect("writer thread");
    }
    done.store(true, Ordering::Relaxed);
    for reader in readers {
        reader.join().expect("reader thread");
    }
    assert!(lookups.load(Ordering::Relaxed) > 0);

    let mut reference = ReferenceIndex::new();
    for (w, stream) in streams.iter().enumerate() {
        for logged in stream {
            match logged {
                Logged::Event(event) => reference
                    .apply((w as u64, 0), event)
                    .expect("reference accepts the stream"),
                Logged::RemoveWorker => reference.remove_worker(w as u64),
            }
        }
    }
    let stats = index.stats();
    assert!(
        stats.segments_reclaimed > 0,
        "the run should free segments as workers evict: {stats:?}"
    );
    assert_eq!(stats.blocks, reference.blocks());
    let mut matched = 0;
    for prompt in prompts.iter() {
        let got: std::collections::BTreeMap<_, _> =
            index.find_matches(prompt).scores.into_iter().collect();
        let want = reference.find_matches(prompt);
        matched += want.len();
        assert_eq!(got, want, "prompt {prompt:?}");
    }
    assert!(
        matched > 0,
        "the replay should leave cached prefixes to find"
    );
}

/// Segment lifetimes under contention: four writers store and then wholly remove the same few
/// chains (each with its own engine hashes) thousands of times while two readers look them up,
/// so segments die, are unlinked, get replaced under their parent's lock and are re-acquired
/// through child tables concurrently. Every answer must be well-formed while it runs; afterwards
/// nothing is held and every segment has been freed.
#[test]
fn segments_die_and_revive_concurrently_without_leaks() {
    const WRITERS: u64 = 4;
    const ROUNDS: u64 = 3000;
    let chains: Arc<Vec<Vec<u64>>> = Arc::new(vec![
        vec![1, 2, 3, 4, 5, 6],
        vec![1, 2, 3, 9, 9],
        vec![1, 2, 7],
        vec![4, 4, 4, 4],
    ]);
    let index = Arc::new(KvIndex::new());
    let done = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (index, chains, done) = (index.clone(), chains.clone(), done.clone());
            std::thread::spawn(move || {
                let mut out = Vec::new();
                let mut answers = 0u64;
                while !done.load(Ordering::Relaxed) {
                    for chain in chains.iter() {
                        index.find_matches_into(chain, &mut out);
                        for &((worker, rank), depth) in &out {
                            assert!(worker < WRITERS && rank == 0);
                            assert!(depth >= 1 && depth as usize <= chain.len());
                        }
                        answers += 1;
                    }
                }
                answers
            })
        })
        .collect();
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (index, chains) = (index.clone(), chains.clone());
            std::thread::spawn(move || {
                let key: WorkerKey = (w, 0);
                for round in 0..ROUNDS {
                    let chain = &chains[((round + w) % chains.len() as u64) as usize];
                    let hashes: Vec<u64> = (0..chain.len() as u64)
                        .map(|i| (w << 48) | (round << 8) | i)
                        .collect();
                    let blocks: Vec<StoredBlock> = hashes
                        .iter()
                        .zip(chain)
                        .map(|(&block_hash, &tokens_hash)| StoredBlock {
                            block_hash,
                            tokens_hash,
                        })
                        .collect();
                    index
                        .apply_stored(key, None, &blocks)
                        .expect("chain from the root");
                    // Evict tail first, sometimes in two events, as an LRU would.
                    let cut = (round as usize) % hashes.len();
                    index.apply_removed(key, &hashes[cut..]);
                    index.apply_removed(key, &hashes[..cut]);
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().expect("writer thread");
    }
    done.store(true, Ordering::Relaxed);
    let answers: u64 = readers
        .into_iter()
        .map(|r| r.join().expect("reader thread"))
        .sum();
    assert!(answers > 0);
    let stats = index.stats();
    assert_eq!(stats.blocks, 0, "{stats:?}");
    assert_eq!(stats.segments, 0, "every segment freed: {stats:?}");
    assert!(stats.segments_reclaimed >= ROUNDS as usize, "{stats:?}");
    for chain in chains.iter() {
        assert!(index.find_matches(chain).scores.is_empty());
    }
}
