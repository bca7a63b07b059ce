//! The open-loop replay harness: a corpus's operations on their deadlines, scaled into a
//! window, issued by the lanes themselves (no separate issuer thread competing for the two
//! cores), and the sustained-rate search.
//!
//! - Lanes: event lane = worker index % lanes (a worker's events stay in order on one lane),
//!   lookup lane = routed worker index % lanes. Every lane runs its ops in deadline order; an op
//!   whose deadline has not come waits for it (sleep, then spin), an op that is late runs at
//!   once, so a backend that falls behind queues work exactly like an open-loop system.
//! - Block ops = looked-up blocks + stored blocks + removed blocks. Offered rate = block ops /
//!   window. Achieved rate = block ops / (last completion on any lane - start), drain included.
//! - A trial *keeps up* when achieved >= 99% of offered. **Sustained block ops/s** is the highest
//!   offered rate at which every repeat keeps up, found by bisection between a passing and a
//!   failing rate (geometric midpoints) starting under the flat-out capacity (best of `repeats`
//!   flat-out trials), climbing by 10% a step until a rate fails.
//! - Lookup latency is the service time of one lookup call on its lane (the clock read before
//!   and after), nearest-rank percentiles, measured at the load of the trial.

use std::time::{Duration, Instant};

use super::backends::{Backend, Event, Shared};
use super::corpus::OpKind;

#[derive(Debug, Clone, Copy)]
pub enum LaneKind {
    Lookup { start: usize, len: usize },
    Event(Event),
}

#[derive(Debug, Clone, Copy)]
pub struct LaneOp {
    /// Deadline relative to the corpus's first op, unscaled.
    pub deadline_ns: u64,
    pub kind: LaneKind,
}

pub struct Plan {
    pub lanes: Vec<Vec<LaneOp>>,
    pub block_ops: u64,
    pub span_ns: u64,
}

impl Plan {
    pub fn new(shared: &Shared<'_>, events: &[Option<Event>], lanes: usize) -> Plan {
        let corpus = shared.corpus;
        let first = corpus.ops.first().map_or(0, |op| op.deadline_ns);
        let mut plan: Vec<Vec<LaneOp>> = vec![Vec::new(); lanes.max(1)];
        for (op, event) in corpus.ops.iter().zip(events) {
            let lane = shared.worker_index(op.worker) % plan.len();
            let kind = match (op.kind, event) {
                (OpKind::Lookup { start, len }, _) => LaneKind::Lookup { start, len },
                (_, Some(event)) => LaneKind::Event(*event),
                (_, None) => continue,
            };
            plan[lane].push(LaneOp {
                deadline_ns: op.deadline_ns - first,
                kind,
            });
        }
        Plan {
            lanes: plan,
            block_ops: corpus.totals().block_ops(),
            span_ns: corpus.span_ns().max(1),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct Trial {
    /// Offered block ops/s (infinite for a flat-out trial).
    pub offered: f64,
    pub achieved: f64,
    pub elapsed: Duration,
    /// Lookup service times, sorted (ns).
    pub lookup_ns: Vec<u64>,
    pub apply_failures: u64,
    pub memory_bytes: usize,
    pub notes: String,
}

impl Trial {
    pub fn kept_up(&self) -> bool {
        self.achieved >= 0.99 * self.offered
    }

    pub fn percentile(&self, p: f64) -> u64 {
        if self.lookup_ns.is_empty() {
            return 0;
        }
        let rank = ((p / 100.0) * self.lookup_ns.len() as f64).ceil() as usize;
        self.lookup_ns[rank.clamp(1, self.lookup_ns.len()) - 1]
    }
}

struct LaneOutcome {
    end: Instant,
    lookup_ns: Vec<u64>,
    failures: u64,
}

/// Wait until `target`: sleep while far, spin when near.
#[inline]
fn wait_until(target: Instant, mut now: Instant) -> Instant {
    while now < target {
        let left = target - now;
        if left > Duration::from_micros(300) {
            std::thread::sleep(left - Duration::from_micros(200));
        } else {
            std::hint::spin_loop();
        }
        now = Instant::now();
    }
    now
}

/// One trial: a fresh backend from `make`, the plan's deadlines scaled into `window`
/// (`Duration::ZERO`: flat out).
pub fn run_trial<B: Backend>(
    make: &dyn Fn() -> B,
    plan: &Plan,
    hashes: &[u64],
    window: Duration,
) -> Trial {
    let backend = make();
    let scale = window.as_nanos() as f64 / plan.span_ns as f64;
    let mut lanes: Vec<B::Lane> = plan.lanes.iter().map(|_| backend.new_lane()).collect();
    let start = Instant::now() + Duration::from_millis(5);
    let outcomes: Vec<LaneOutcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = plan
            .lanes
            .iter()
            .zip(lanes.iter_mut())
            .map(|(ops, lane)| {
                let backend = &backend;
                scope.spawn(move || {
                    let mut lookup_ns = Vec::with_capacity(ops.len() / 4);
                    let mut failures = 0u64;
                    let mut out = Vec::with_capacity(128);
                    let mut now = wait_until(start, Instant::now());
                    for op in ops {
                        let target =
                            start + Duration::from_nanos((op.deadline_ns as f64 * scale) as u64);
                        if target > now {
                            now = wait_until(target, Instant::now());
                        }
                        match op.kind {
                            LaneKind::Lookup { start, len } => {
                                let t0 = Instant::now();
                                backend.lookup(&hashes[start..start + len], &mut out);
                                std::hint::black_box(&out);
                                now = Instant::now();
                                lookup_ns.push((now - t0).as_nanos() as u64);
                            }
                            LaneKind::Event(event) => {
                                if !backend.apply(lane, &event) {
                                    failures += 1;
                                }
                            }
                        }
                    }
                    LaneOutcome {
                        end: Instant::now(),
                        lookup_ns,
                        failures,
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(outcome) => outcome,
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    });
    let end = outcomes.iter().map(|o| o.end).max().unwrap_or(start);
    let elapsed = end
        .saturating_duration_since(start)
        .max(Duration::from_nanos(1));
    let mut lookup_ns: Vec<u64> = outcomes
        .iter()
        .flat_map(|o| o.lookup_ns.iter().copied())
        .collect();
    lookup_ns.sort_unstable();
    let memory_bytes = backend.memory_bytes(&lanes);
    let notes = backend.notes();
    Trial {
        offered: if window.is_zero() {
            f64::INFINITY
        } else {
            plan.block_ops as f64 / window.as_secs_f64()
        },
        achieved: plan.block_ops as f64 / elapsed.as_secs_f64(),
        elapsed,
        lookup_ns,
        apply_failures: outcomes.iter().map(|o| o.failures).sum(),
        memory_bytes,
        notes,
    }
}

#[derive(Debug, Clone, Default)]
pub struct Search {
    pub capacity: Trial,
    /// Every rate tried: (offered rate, kept up in every repeat).
    pub points: Vec<(f64, bool, f64)>,
    /// Highest offered rate that kept up, with its trial (lookup percentiles at that load).
    pub sustained: Option<(f64, Trial)>,
}

/// Flat-out capacity (the best of `repeats` trials: interference from the rest of the machine
/// only ever slows a trial down), then bisection for the sustained rate. The search starts just
/// under that capacity and, while every rate tried keeps up, climbs by 10% before bisecting, so
/// one slow capacity trial cannot cap the result.
pub fn search<B: Backend>(
    make: &dyn Fn() -> B,
    plan: &Plan,
    hashes: &[u64],
    steps: usize,
    repeats: usize,
    mut progress: impl FnMut(&str),
) -> Search {
    let mut capacity = run_trial(make, plan, hashes, Duration::ZERO);
    for _ in 1..repeats.max(1) {
        let again = run_trial(make, plan, hashes, Duration::ZERO);
        if again.achieved > capacity.achieved {
            capacity = again;
        }
    }
    progress(&format!(
        "capacity (flat out, best of {}): {:.2} M block ops/s in {:.2} s {}",
        repeats.max(1),
        capacity.achieved / 1e6,
        capacity.elapsed.as_secs_f64(),
        capacity.notes
    ));
    let mut result = Search {
        capacity: capacity.clone(),
        ..Search::default()
    };
    let mut lo = 0.0f64;
    // No failing rate known yet: `hi` is only where the climb goes next.
    let mut failed = false;
    let mut hi = capacity.achieved * 1.05;
    let mut rate = capacity.achieved * 0.9;
    for _ in 0..steps {
        let window = Duration::from_secs_f64(plan.block_ops as f64 / rate);
        let mut pass = true;
        let mut worst: Option<Trial> = None;
        for _ in 0..repeats.max(1) {
            let trial = run_trial(make, plan, hashes, window);
            pass &= trial.kept_up();
            let achieved = trial.achieved;
            if worst.as_ref().is_none_or(|w| achieved < w.achieved) {
                worst = Some(trial);
            }
            if !pass {
                break;
            }
        }
        let Some(worst) = worst else { break };
        progress(&format!(
            "offered {:.2} M/s -> achieved {:.2} M/s {} (lookup p50 {} ns, p99 {} ns)",
            rate / 1e6,
            worst.achieved / 1e6,
            if pass { "kept up" } else { "FELL BEHIND" },
            worst.percentile(50.0),
            worst.percentile(99.0),
        ));
        result.points.push((rate, pass, worst.achieved));
        if pass {
            lo = rate;
            result.sustained = Some((rate, worst));
            if !failed {
                hi = hi.max(rate * 1.1);
            }
        } else {
            hi = rate;
            failed = true;
        }
        rate = if lo == 0.0 {
            hi * 0.6
        } else if !failed {
            rate * 1.1
        } else {
            (lo * hi).sqrt()
        };
    }
    result
}
