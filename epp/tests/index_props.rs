//! Property tests: after any event sequence, `KvIndex` answers exactly like the single-threaded
//! `ReferenceIndex` (scores of every lookup, the result of every apply, blocks held).
//!
//! Content keys come from a tiny alphabet so chunk-hash collisions at different positions and
//! under different parents are everywhere; engine hashes come from a small per-test universe so
//! removals of held and unknown blocks, moves of a hash to a new position and twins (two hashes
//! naming one position) all happen; workers come and go.

use kvroute_epp::index::reference::ReferenceIndex;
use kvroute_epp::index::{KvIndex, WorkerKey};
use kvroute_proto::events::{KvEventData, StoredBlock};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Store {
        worker: WorkerKey,
        parent: Option<u64>,
        blocks: Vec<(u64, u64)>,
    },
    Remove {
        worker: WorkerKey,
        hashes: Vec<u64>,
    },
    Clear {
        worker: WorkerKey,
    },
    RemoveWorker {
        worker_id: u64,
    },
    Lookup {
        contents: Vec<u64>,
    },
}

fn worker() -> impl Strategy<Value = WorkerKey> {
    (1u64..4, 0u32..2)
}

fn op(engines: u64, alphabet: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (
            worker(),
            prop::option::weighted(0.6, 0..engines),
            prop::collection::vec((0..engines, 1..=alphabet), 1..6)
        )
            .prop_map(|(worker, parent, blocks)| Op::Store { worker, parent, blocks }),
        3 => (worker(), prop::collection::vec(0..engines, 1..4))
            .prop_map(|(worker, hashes)| Op::Remove { worker, hashes }),
        1 => worker().prop_map(|worker| Op::Clear { worker }),
        1 => (1u64..4).prop_map(|worker_id| Op::RemoveWorker { worker_id }),
        5 => prop::collection::vec(1..=alphabet, 0..9).prop_map(|contents| Op::Lookup { contents }),
    ]
}

fn stored(parent: Option<u64>, blocks: &[(u64, u64)]) -> KvEventData {
    KvEventData::Stored {
        parent_hash: parent,
        blocks: blocks
            .iter()
            .map(|&(block_hash, tokens_hash)| StoredBlock {
                block_hash,
                tokens_hash,
            })
            .collect(),
        token_ids: Vec::new(),
        block_size: 16,
        lora_name: None,
        cache_salt: None,
    }
}

/// Runs `ops` through both indexes, asserting equal answers at every step; returns the
/// lookups made so the caller can re-check them at the end.
fn run(index: KvIndex, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut reference = ReferenceIndex::new();
    let mut queries: Vec<Vec<u64>> = Vec::new();
    for op in ops {
        match op {
            Op::Store {
                worker,
                parent,
                blocks,
            } => {
                let event = stored(*parent, blocks);
                let got = index.apply(*worker, &event);
                let want = reference.apply(*worker, &event);
                prop_assert_eq!(got, want, "store {:?}", op);
            }
            Op::Remove { worker, hashes } => {
                let event = KvEventData::Removed {
                    block_hashes: hashes.clone(),
                };
                prop_assert_eq!(
                    index.apply(*worker, &event),
                    reference.apply(*worker, &event)
                );
            }
            Op::Clear { worker } => {
                let event = KvEventData::Cleared;
                prop_assert_eq!(
                    index.apply(*worker, &event),
                    reference.apply(*worker, &event)
                );
            }
            Op::RemoveWorker { worker_id } => {
                index.remove_worker(*worker_id);
                reference.remove_worker(*worker_id);
            }
            Op::Lookup { contents } => {
                let got: std::collections::BTreeMap<_, _> =
                    index.find_matches(contents).scores.into_iter().collect();
                prop_assert_eq!(
                    got,
                    reference.find_matches(contents),
                    "lookup {:?}",
                    contents
                );
                queries.push(contents.clone());
            }
        }
    }
    for contents in &queries {
        let got: std::collections::BTreeMap<_, _> =
            index.find_matches(contents).scores.into_iter().collect();
        prop_assert_eq!(got, reference.find_matches(contents));
    }
    prop_assert_eq!(index.stats().blocks, reference.blocks());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Dense collisions: 3 content keys, 12 engine hashes; segments die and are reclaimed
    /// between nearly every pair of operations, and chains are re-stored where they were.
    #[test]
    fn index_equals_reference_dense(ops in prop::collection::vec(op(12, 3), 1..80)) {
        run(KvIndex::new(), &ops)?;
    }

    /// Sparser: longer chains survive, lookups go deeper.
    #[test]
    fn index_equals_reference_sparse(ops in prop::collection::vec(op(48, 6), 1..160)) {
        run(KvIndex::new(), &ops)?;
    }
}

/// Engine-like chains (engine hash = chain of the parent's engine hash and the content), with a
/// hole evicted in the middle of a chain and healed by a re-store.
#[test]
fn holes_stop_the_match_and_heal() {
    let index = KvIndex::new();
    let mut reference = ReferenceIndex::new();
    let w = (7, 0);
    let chain: Vec<(u64, u64)> = (0..6)
        .map(|i| (100 + i, [5, 6, 5, 6, 5, 6][i as usize]))
        .collect();
    let event = stored(None, &chain);
    index.apply(w, &event).expect("store");
    reference.apply(w, &event).expect("store");
    let query = [5, 6, 5, 6, 5, 6];
    assert_eq!(index.find_matches(&query).get(&w), 6);
    let hole = KvEventData::Removed {
        block_hashes: vec![102],
    };
    index.apply(w, &hole).expect("remove");
    reference.apply(w, &hole).expect("remove");
    assert_eq!(index.find_matches(&query).get(&w), 2);
    // The same content at another position is not the evicted block.
    assert_eq!(index.find_matches(&[5, 6]).get(&w), 2);
    let heal = stored(Some(101), &[(102, 5)]);
    index.apply(w, &heal).expect("heal");
    reference.apply(w, &heal).expect("heal");
    assert_eq!(index.find_matches(&query).get(&w), 6);
    assert_eq!(
        index
            .find_matches(&query)
            .scores
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>(),
        reference.find_matches(&query)
    );
}

#[test]
fn unknown_parent_is_rejected_and_counted() {
    let index = KvIndex::new();
    let w = (1, 0);
    let err = index.apply(w, &stored(Some(9), &[(1, 1)]));
    assert!(err.is_err());
    assert_eq!(index.stats().rejected_stores, 1);
    assert_eq!(index.stats().blocks, 0);
    index
        .apply(
            w,
            &KvEventData::Removed {
                block_hashes: vec![42],
            },
        )
        .expect("removal of unknown is ignored");
    assert_eq!(index.stats().unknown_removals, 1);
}

/// Many workers (more than one 64-bit slot word) and enough blocks to rebuild child tables
/// several times; removals and worker churn free segments as they go.
#[test]
fn growth_and_wide_worker_sets_stay_exact() {
    let index = KvIndex::new();
    let mut reference = ReferenceIndex::new();
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let workers: Vec<WorkerKey> = (0..150).map(|i| (i / 2, (i % 2) as u32)).collect();
    let mut chains: Vec<Vec<u64>> = Vec::new();
    for round in 0..3000u64 {
        let w = workers[(next() % workers.len() as u64) as usize];
        // Chains share a few heads so many workers hold common prefixes.
        let head = next() % 8;
        let len = 1 + next() % 40;
        let contents: Vec<u64> = std::iter::once(head)
            .chain((1..len).map(|i| if i < 4 { i } else { next() % 1000 }))
            .collect();
        let blocks: Vec<(u64, u64)> = contents
            .iter()
            .enumerate()
            .map(|(i, &c)| (round << 16 | i as u64, c))
            .collect();
        let event = stored(None, &blocks);
        assert_eq!(index.apply(w, &event), reference.apply(w, &event));
        if round % 3 == 0 {
            let tail: Vec<u64> = blocks.iter().skip(blocks.len() / 2).map(|b| b.0).collect();
            let event = KvEventData::Removed { block_hashes: tail };
            assert_eq!(index.apply(w, &event), reference.apply(w, &event));
        }
        if round % 500 == 499 {
            let gone = next() % 75;
            index.remove_worker(gone);
            reference.remove_worker(gone);
        }
        chains.push(contents);
    }
    assert!(index.stats().segments_reclaimed > 0, "{:?}", index.stats());
    for contents in &chains {
        let got: std::collections::BTreeMap<_, _> =
            index.find_matches(contents).scores.into_iter().collect();
        assert_eq!(got, reference.find_matches(contents));
    }
    assert_eq!(index.stats().blocks, reference.blocks());
}

/// A segment many workers hold, reached with few workers left: the lookup reads the remaining
/// workers' depths through the segment's slot index instead of scanning its entries. Forty
/// workers hold a chain whose second half hangs off another worker's segment; most then evict
/// the chain's first block, so only a few are still matching when the lookup reaches the half
/// they all hold. Scores must equal the reference's at every step of the evictions.
#[test]
fn few_remaining_workers_among_many_holders_score_exactly() {
    let index = KvIndex::new();
    let mut reference = ReferenceIndex::new();
    let head = [11u64, 12, 13, 14];
    let branch = [21u64, 22, 23, 24];
    let other = [31u64, 32];
    let apply = |index: &KvIndex, reference: &mut ReferenceIndex, w: WorkerKey, e: KvEventData| {
        assert_eq!(index.apply(w, &e), reference.apply(w, &e));
    };
    // Worker 0 lays down head + other, so the branch becomes a child segment.
    let w0: WorkerKey = (0, 0);
    let chain0: Vec<(u64, u64)> = head
        .iter()
        .chain(&other)
        .enumerate()
        .map(|(i, &c)| (i as u64, c))
        .collect();
    apply(&index, &mut reference, w0, stored(None, &chain0));
    for w in 1..40u64 {
        let chain: Vec<(u64, u64)> = head
            .iter()
            .chain(&branch)
            .enumerate()
            .map(|(i, &c)| ((w << 32) | i as u64, c))
            .collect();
        apply(&index, &mut reference, (w, 0), stored(None, &chain));
    }
    let query: Vec<u64> = head.iter().chain(&branch).copied().collect();
    let check = |index: &KvIndex, reference: &ReferenceIndex| {
        for len in 1..=query.len() {
            let got: std::collections::BTreeMap<_, _> = index
                .find_matches(&query[..len])
                .scores
                .into_iter()
                .collect();
            assert_eq!(got, reference.find_matches(&query[..len]), "prefix {len}");
        }
    };
    check(&index, &reference);
    for w in 3..40u64 {
        let hole = KvEventData::Removed {
            block_hashes: vec![(w << 32) | (w % 4)],
        };
        apply(&index, &mut reference, (w, 0), hole);
        check(&index, &reference);
    }
    // Workers 1 and 2 still match all eight blocks; the others stop at their holes.
    assert_eq!(index.find_matches(&query).get(&(1, 0)), 8);
    assert_eq!(index.find_matches(&query).get(&(7, 0)), 3);
}
