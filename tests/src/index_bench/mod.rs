//! The KV index replay benchmark (issue 4): a Mooncake-trace corpus of KV events and lookups
//! ([`corpus`]), the indexers under test ([`backends`]), the open-loop replay and sustained-rate
//! search ([`replay`]), the exactness cross-check ([`cross_check`]) and the chart ([`svg`]).
//! Driven by the `kv-corpus` and `index-bench` binaries.

pub mod backends;
pub mod corpus;
pub mod replay;
pub mod svg;

use std::collections::BTreeMap;

use kvroute_epp::index::reference::ReferenceIndex;
use kvroute_proto::events::{KvEventData, StoredBlock};

use backends::{Backend, Chain, Event, Naive, Ours, Shared};
use corpus::OpKind;

/// Result of replaying a corpus single-threaded into every index and comparing every lookup.
#[derive(Debug, Clone, Copy, Default)]
pub struct CrossCheck {
    pub lookups: u64,
    /// Lookups where our scores differ from the reference index's.
    pub ours_vs_reference: u64,
    /// Lookups where our scores differ from ChainIndex's.
    pub ours_vs_chain: u64,
    /// Lookups where ChainIndex differs from the reference (for the record).
    pub chain_vs_reference: u64,
    /// Lookups where the naive baseline differs from the reference.
    pub naive_vs_reference: u64,
    /// Lookups with at least one worker scored (so the check is not vacuous).
    pub nonempty: u64,
    /// Rejected stores per index (a sim-engine corpus has none).
    pub ours_rejected: u64,
    pub chain_rejected: u64,
    pub reference_rejected: u64,
}

/// Replay the corpus in order into our index, ChainIndex, the naive baseline and the reference
/// index, comparing the scores of every lookup.
pub fn cross_check(
    shared: &Shared<'_>,
    events: &[Option<Event>],
    mut progress: impl FnMut(usize, usize),
) -> anyhow::Result<CrossCheck> {
    let corpus = shared.corpus;
    let ours = Ours::prepare(shared);
    let chain = Chain::prepare(shared)?;
    let naive = Naive::prepare(shared);
    let mut chain_lane = chain.new_lane();
    let mut reference = ReferenceIndex::new();
    let mut result = CrossCheck::default();
    let mut got = Vec::new();
    let sorted = |v: &mut Vec<(usize, u32)>| v.sort_unstable();
    for (i, (op, event)) in corpus.ops.iter().zip(events).enumerate() {
        if i % 50_000 == 0 {
            progress(i, corpus.ops.len());
        }
        match (op.kind, event) {
            (OpKind::Lookup { start, len }, _) => {
                let hashes = corpus.lookup(start, len);
                let want: Vec<(usize, u32)> = reference
                    .find_matches(hashes)
                    .into_iter()
                    .map(|(key, depth)| (shared.worker_index(key), depth))
                    .collect::<BTreeMap<_, _>>()
                    .into_iter()
                    .collect();
                ours.lookup(hashes, &mut got);
                sorted(&mut got);
                let ours_scores = got.clone();
                chain.lookup(hashes, &mut got);
                sorted(&mut got);
                let chain_scores = got.clone();
                naive.lookup(hashes, &mut got);
                sorted(&mut got);
                result.lookups += 1;
                result.nonempty += u64::from(!want.is_empty());
                result.ours_vs_reference += u64::from(ours_scores != want);
                result.ours_vs_chain += u64::from(ours_scores != chain_scores);
                result.chain_vs_reference += u64::from(chain_scores != want);
                result.naive_vs_reference += u64::from(got != want);
            }
            (_, Some(event)) => {
                result.ours_rejected += u64::from(!ours.apply(&mut (), event));
                result.chain_rejected += u64::from(!chain.apply(&mut chain_lane, event));
                naive.apply(&mut (), event);
                let key = op.worker;
                let applied = match *event {
                    Event::Stored {
                        parent, start, len, ..
                    } => {
                        let blocks: Vec<StoredBlock> = corpus.stored[start..start + len]
                            .iter()
                            .map(|&(block_hash, tokens_hash)| StoredBlock {
                                block_hash,
                                tokens_hash,
                            })
                            .collect();
                        reference.apply_stored(key, parent, &blocks).is_ok()
                    }
                    Event::Removed { start, len, .. } => {
                        reference.apply_removed(key, &corpus.hashes[start..start + len]);
                        true
                    }
                    Event::Cleared { .. } => reference.apply(key, &KvEventData::Cleared).is_ok(),
                };
                result.reference_rejected += u64::from(!applied);
            }
            (_, None) => {}
        }
    }
    progress(corpus.ops.len(), corpus.ops.len());
    Ok(result)
}
