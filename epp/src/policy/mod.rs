//! Worker selection. The KV policy is Dynamo's cost function (routing-and-disagg.md §1):
//!
//! ```text
//! raw_prefill = (active_prefill_tokens + isl) / block_size
//! decay       = 1 / (1 + credit_decay · ((active_prefill − min_active_prefill) / bs) / request_blocks)
//! cost        = prefill_load_scale · max(raw_prefill − overlap_credit · decay · overlap_blocks, 0)
//!             + active_decode_blocks + request_blocks
//! cost       *= exp(−tanh(Σ matched preferred weights))        (topology preference, if any)
//! ```
//!
//! lowest cost wins (temperature 0, random tie-break) or a softmax over normalized costs
//! (temperature > 0). The baselines (`round-robin`, `random`, `least-loaded`, `approx-prefix`)
//! exist to measure the KV policy against. Eligibility (subset hints, busy thresholds,
//! topology `required`) is decided before scoring, by the caller.

pub mod approx_prefix;
pub mod speculative;

use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;

use crate::load::{LoadView, WorkerKey};

pub use approx_prefix::ApproxPrefixIndex;
pub use speculative::SpeculativeIndex;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyKind {
    /// Dynamo's KV-overlap + load cost function over exact KV events.
    Kv,
    RoundRobin,
    Random,
    /// Fewest active requests, then fewest decode blocks.
    LeastLoaded,
    /// GAIE-style prefix affinity from hashed prompt characters, no KV events.
    ApproxPrefix,
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PolicyKind::Kv => "kv",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::ApproxPrefix => "approx-prefix",
        })
    }
}

/// Knobs of the KV cost function (Dynamo names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostParams {
    /// Credit per device-tier overlapping block, in [0, 1].
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    /// 0 = argmin; > 0 = softmax sampling.
    pub temperature: f64,
    /// Shrinks the overlap credit of workers with a prefill backlog (0 = off).
    pub overlap_score_credit_decay: f64,
}

impl Default for CostParams {
    fn default() -> Self {
        CostParams {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            temperature: 0.0,
            overlap_score_credit_decay: 0.0,
        }
    }
}

/// Thresholds above which a rank is busy (Dynamo's `--active-decode-blocks-threshold` and
/// `--active-prefill-tokens-threshold`). Off when `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BusyThresholds {
    pub active_decode_blocks_frac: Option<f64>,
    pub active_prefill_tokens: Option<u64>,
}

impl BusyThresholds {
    /// Busy if any check holds; each reads the larger of this router's bookings and the
    /// worker's report (a report also carries other routers' traffic).
    pub fn is_busy(&self, load: &LoadView) -> bool {
        let r = &load.reported;
        if let (Some(frac), true) = (self.active_decode_blocks_frac, r.kv_total_blocks > 0) {
            let used = load.active_decode_blocks.max(r.kv_used_blocks);
            if used as f64 / r.kv_total_blocks as f64 > frac {
                return true;
            }
        }
        let prefill = load.active_prefill_tokens.max(r.active_prefill_tokens);
        matches!(self.active_prefill_tokens, Some(t) if prefill > t)
    }
}

/// One eligible (worker, dp rank) as the selector sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub key: WorkerKey,
    /// Consecutive device-tier blocks of the request this rank holds.
    pub overlap_blocks: u32,
    pub load: LoadView,
    /// Σ of matched topology preference weights (0 when none apply).
    pub preferred_weight: f64,
}

/// What the cost function needs to know about the request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestShape {
    pub isl_tokens: u64,
    pub block_size: u32,
}

impl RequestShape {
    pub fn request_blocks(&self) -> u64 {
        self.isl_tokens.div_ceil(u64::from(self.block_size.max(1)))
    }
}

/// Dynamo's cost of sending the request to `c`. Lower is better.
pub fn kv_cost(
    c: &Candidate,
    shape: &RequestShape,
    params: &CostParams,
    min_active_prefill: u64,
) -> f64 {
    let bs = f64::from(shape.block_size.max(1));
    let request_blocks = shape.request_blocks().max(1) as f64;
    let raw_prefill = (c.load.active_prefill_tokens as f64 + shape.isl_tokens as f64) / bs;
    let backlog_blocks = c
        .load
        .active_prefill_tokens
        .saturating_sub(min_active_prefill) as f64
        / bs;
    let decay = 1.0 / (1.0 + params.overlap_score_credit_decay * backlog_blocks / request_blocks);
    let credit = params.overlap_score_credit * decay * f64::from(c.overlap_blocks);
    let mut cost = params.prefill_load_scale * (raw_prefill - credit).max(0.0)
        + c.load.active_decode_blocks as f64
        + shape.request_blocks() as f64;
    if c.preferred_weight > 0.0 {
        cost *= (-c.preferred_weight.tanh()).exp();
    }
    cost
}

/// Orders candidates by preference; the first is the pick, the rest are fallbacks.
pub struct Selector {
    pub kind: PolicyKind,
    pub params: CostParams,
    rr: AtomicUsize,
}

impl Selector {
    pub fn new(kind: PolicyKind, params: CostParams) -> Self {
        Selector {
            kind,
            params,
            rr: AtomicUsize::new(0),
        }
    }

    /// Returns candidate indices, best first. `approx_scores` is only read by `approx-prefix`
    /// (one score per candidate, same order).
    pub fn rank(
        &self,
        cands: &[Candidate],
        shape: &RequestShape,
        approx_scores: &[u32],
    ) -> Vec<usize> {
        if cands.is_empty() {
            return Vec::new();
        }
        let mut rng = rand::rng();
        match self.kind {
            PolicyKind::RoundRobin => {
                let start = self.rr.fetch_add(1, Ordering::Relaxed) % cands.len();
                (0..cands.len())
                    .map(|i| (start + i) % cands.len())
                    .collect()
            }
            PolicyKind::Random => {
                let mut idx: Vec<usize> = (0..cands.len()).collect();
                rand::seq::SliceRandom::shuffle(idx.as_mut_slice(), &mut rng);
                idx
            }
            PolicyKind::LeastLoaded => order_by(cands.len(), &mut rng, |i| {
                let l = &cands[i].load;
                l.active_requests as f64 * 1e6 + l.active_decode_blocks as f64
            }),
            PolicyKind::ApproxPrefix => order_by(cands.len(), &mut rng, |i| {
                // Best prefix score first; least loaded among equals (GAIE prefix + load scorers).
                let score = approx_scores.get(i).copied().unwrap_or(0);
                -(f64::from(score) * 1e6) + cands[i].load.active_requests as f64
            }),
            PolicyKind::Kv => {
                let min_prefill = cands
                    .iter()
                    .map(|c| c.load.active_prefill_tokens)
                    .min()
                    .unwrap_or(0);
                let costs: Vec<f64> = cands
                    .iter()
                    .map(|c| kv_cost(c, shape, &self.params, min_prefill))
                    .collect();
                let mut order = order_by(cands.len(), &mut rng, |i| costs[i]);
                if self.params.temperature > 0.0 && order.len() > 1 {
                    let pick = softmax_pick(&costs, self.params.temperature, &mut rng);
                    order.retain(|&i| i != pick);
                    order.insert(0, pick);
                }
                order
            }
        }
    }
}

/// Ascending by key with a random tie-break (a fixed tie-break would pile ties on one worker).
fn order_by(n: usize, rng: &mut impl Rng, key: impl Fn(usize) -> f64) -> Vec<usize> {
    let mut idx: Vec<(f64, u32, usize)> =
        (0..n).map(|i| (key(i), rng.random::<u32>(), i)).collect();
    idx.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    idx.into_iter().map(|(_, _, i)| i).collect()
}

/// Dynamo's softmax: p ∝ exp(−(c − c_min) / ((c_max − c_min) · T)).
fn softmax_pick(costs: &[f64], temperature: f64, rng: &mut impl Rng) -> usize {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let span = max - min;
    if span <= f64::EPSILON {
        return rng.random_range(0..costs.len());
    }
    let weights: Vec<f64> = costs
        .iter()
        .map(|c| (-(c - min) / (span * temperature)).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut x = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return i;
        }
        x -= w;
    }
    costs.len() - 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(id: u64, overlap: u32, prefill: u64, decode: u64) -> Candidate {
        Candidate {
            key: (id, 0),
            overlap_blocks: overlap,
            load: LoadView {
                active_prefill_tokens: prefill,
                active_decode_blocks: decode,
                active_requests: decode,
                ..LoadView::default()
            },
            preferred_weight: 0.0,
        }
    }

    const SHAPE: RequestShape = RequestShape {
        isl_tokens: 1600,
        block_size: 16,
    };

    #[test]
    fn cost_matches_dynamo_formula() {
        let p = CostParams::default();
        // raw prefill = (320 + 1600)/16 = 120; credit = 50; decode 10; request blocks 100.
        let c = cand(1, 50, 320, 10);
        assert!((kv_cost(&c, &SHAPE, &p, 0) - (70.0 + 10.0 + 100.0)).abs() < 1e-9);
        // Overlap beyond the prefill never makes prefill negative.
        let full = cand(2, 500, 0, 0);
        assert!((kv_cost(&full, &SHAPE, &p, 0) - 100.0).abs() < 1e-9);
        // Preference multiplies by exp(-tanh(w)).
        let pref = Candidate {
            preferred_weight: 0.5,
            ..cand(3, 0, 0, 0)
        };
        let want = 200.0 * (-(0.5f64).tanh()).exp();
        assert!((kv_cost(&pref, &SHAPE, &p, 0) - want).abs() < 1e-9);
        // Decay shrinks the credit of a backlogged worker.
        let pd = CostParams {
            overlap_score_credit_decay: 1.0,
            ..p
        };
        let backlog = cand(4, 50, 1600, 0);
        assert!(kv_cost(&backlog, &SHAPE, &pd, 0) > kv_cost(&backlog, &SHAPE, &p, 0));
    }

    #[test]
    fn kv_prefers_overlap_then_load() {
        let s = Selector::new(PolicyKind::Kv, CostParams::default());
        let cands = vec![cand(1, 0, 0, 0), cand(2, 80, 0, 0), cand(3, 40, 0, 0)];
        assert_eq!(s.rank(&cands, &SHAPE, &[]), vec![1, 2, 0]);
        // A hot worker loses its overlap advantage once its decode load outweighs it.
        let cands = vec![cand(1, 0, 0, 0), cand(2, 80, 0, 200)];
        assert_eq!(s.rank(&cands, &SHAPE, &[])[0], 0);
    }

    #[test]
    fn ties_spread_randomly() {
        let s = Selector::new(PolicyKind::Kv, CostParams::default());
        let cands = vec![cand(1, 0, 0, 0), cand(2, 0, 0, 0), cand(3, 0, 0, 0)];
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            seen.insert(s.rank(&cands, &SHAPE, &[])[0]);
        }
        assert_eq!(seen.len(), 3);
    }

    #[test]
    fn temperature_samples_but_prefers_cheap() {
        let s = Selector::new(
            PolicyKind::Kv,
            CostParams {
                temperature: 0.5,
                ..CostParams::default()
            },
        );
        let cands = vec![cand(1, 100, 0, 0), cand(2, 0, 0, 0)];
        let firsts: Vec<usize> = (0..2000).map(|_| s.rank(&cands, &SHAPE, &[])[0]).collect();
        let cheap = firsts.iter().filter(|&&i| i == 0).count();
        assert!(cheap > 1500 && cheap < 2000, "cheap picked {cheap}/2000");
    }

    #[test]
    fn baselines() {
        let cands = vec![cand(1, 0, 0, 5), cand(2, 0, 0, 1), cand(3, 0, 0, 3)];
        let rr = Selector::new(PolicyKind::RoundRobin, CostParams::default());
        let firsts: Vec<usize> = (0..6).map(|_| rr.rank(&cands, &SHAPE, &[])[0]).collect();
        assert_eq!(firsts, vec![0, 1, 2, 0, 1, 2]);
        let ll = Selector::new(PolicyKind::LeastLoaded, CostParams::default());
        assert_eq!(ll.rank(&cands, &SHAPE, &[]), vec![1, 2, 0]);
        let ap = Selector::new(PolicyKind::ApproxPrefix, CostParams::default());
        assert_eq!(ap.rank(&cands, &SHAPE, &[0, 0, 4])[0], 2);
        let rnd = Selector::new(PolicyKind::Random, CostParams::default());
        let mut r = rnd.rank(&cands, &SHAPE, &[]);
        r.sort();
        assert_eq!(r, vec![0, 1, 2]);
    }

    #[test]
    fn busy_thresholds() {
        let t = BusyThresholds {
            active_decode_blocks_frac: Some(0.8),
            active_prefill_tokens: Some(1000),
        };
        let mut l = LoadView {
            active_decode_blocks: 80,
            ..LoadView::default()
        };
        l.reported.kv_total_blocks = 100;
        assert!(!t.is_busy(&l));
        l.active_decode_blocks = 81;
        assert!(t.is_busy(&l));
        l.active_decode_blocks = 0;
        l.reported.kv_used_blocks = 90;
        assert!(t.is_busy(&l), "the worker's own report counts too");
        l.reported.kv_used_blocks = 0;
        l.active_prefill_tokens = 1001;
        assert!(t.is_busy(&l));
        assert!(!BusyThresholds::default().is_busy(&l));
    }
}
