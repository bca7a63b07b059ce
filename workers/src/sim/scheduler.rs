//! Continuous-batching scheduler of one dp rank (vLLM v1 style), run as a tokio task.
//!
//! Each step: drop cancelled requests; give every running request (oldest first) its next
//! tokens out of the `max_num_batched_tokens` budget — the rest of its prompt in chunks, or one
//! decode token — preempting the newest running request back to the waiting queue when the KV
//! cache cannot grow; then, if nothing was preempted, admit waiting requests FCFS while blocks,
//! budget and `max_num_seqs` allow. The step then lasts its simulated duration
//! ([`super::timing`]), after which requests whose tokens are all computed emit a token.
//!
//! Blocks are allocated when a step is scheduled (as vLLM does), so KV events precede the step;
//! they are published while the rank lock is held, so the event order is the cache-change order.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};

use super::block_manager::{AllocError, BlockManager, Namespace, SeqId};
use super::engine::{EngineOutput, FinishReason, RankStats, SimConfig, TimedOutput};
use super::timing::{step_duration, VirtualClock};
use crate::events::EventLog;

/// Where a request's outputs go: plain, or stamped with the simulated time since it was queued.
#[derive(Debug)]
pub(crate) enum OutputTx {
    Plain(mpsc::UnboundedSender<EngineOutput>),
    Timed(mpsc::UnboundedSender<TimedOutput>),
}

impl OutputTx {
    fn is_closed(&self) -> bool {
        match self {
            OutputTx::Plain(tx) => tx.is_closed(),
            OutputTx::Timed(tx) => tx.is_closed(),
        }
    }

    /// False when the receiver is gone.
    fn send(&self, output: EngineOutput, sim_elapsed: Duration) -> bool {
        match self {
            OutputTx::Plain(tx) => tx.send(output).is_ok(),
            OutputTx::Timed(tx) => tx
                .send(TimedOutput {
                    output,
                    sim_elapsed,
                })
                .is_ok(),
        }
    }
}

/// A request inside the scheduler.
#[derive(Debug)]
pub(crate) struct SimRequest {
    request_id: String,
    ns: Namespace,
    prompt_len: usize,
    /// Prompt followed by the generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose KV is in the cache (mirrors the block manager while running).
    computed: usize,
    max_tokens: u32,
    generated: u32,
    /// Prompt tokens served from the prefix cache at first admission.
    cached_tokens: u32,
    admitted: bool,
    seq: SeqId,
    /// Tokens scheduled in the current step.
    scheduled: usize,
    tx: OutputTx,
    /// The rank's simulated time when the request was queued.
    sim_enqueued: Duration,
}

impl SimRequest {
    pub(crate) fn new(
        request_id: String,
        ns: Namespace,
        prompt: Vec<u32>,
        max_tokens: u32,
        tx: OutputTx,
    ) -> Self {
        SimRequest {
            request_id,
            ns,
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            max_tokens,
            generated: 0,
            cached_tokens: 0,
            admitted: false,
            seq: 0,
            scheduled: 0,
            tx,
            sim_enqueued: Duration::ZERO,
        }
    }

    fn remaining(&self) -> usize {
        self.tokens.len().saturating_sub(self.computed)
    }

    /// True while prompt (or, after a preemption, prompt + output) tokens are being recomputed.
    fn in_prefill(&self) -> bool {
        self.generated == 0 || self.remaining() > 1
    }

    fn finished_output(&self, reason: FinishReason) -> EngineOutput {
        EngineOutput::Finished {
            finish_reason: reason,
            prompt_tokens: self.prompt_len as u32,
            completion_tokens: self.generated,
            cached_tokens: self.cached_tokens,
        }
    }
}

/// One rank's scheduling state, guarded by [`RankShared::core`].
#[derive(Debug)]
struct RankCore {
    manager: BlockManager,
    waiting: VecDeque<SimRequest>,
    running: Vec<SimRequest>,
    next_seq: SeqId,
    preemptions: u64,
    finished: u64,
    /// Prefill tokens computed by scheduled steps (prompt tokens not served from the cache,
    /// plus recomputation after preemption).
    prefill_computed: u64,
    /// Sum of the unscaled durations of completed steps.
    simulated: Duration,
    stopped: bool,
}

/// What a planned step costs.
#[derive(Debug, Clone, Copy, PartialEq)]
struct StepPlan {
    prefill_tokens: u64,
    decodes: bool,
    utilisation: f64,
}

/// A rank shared between its scheduler task and the engine handles.
#[derive(Debug)]
pub(crate) struct RankShared {
    dp_rank: u32,
    cfg: Arc<SimConfig>,
    log: EventLog,
    core: Mutex<RankCore>,
    wake: Notify,
    stop: AtomicBool,
}

impl RankShared {
    pub(crate) fn new(dp_rank: u32, cfg: Arc<SimConfig>, log: EventLog) -> Self {
        RankShared {
            dp_rank,
            core: Mutex::new(RankCore {
                manager: BlockManager::new(cfg.kv_capacity_blocks, cfg.block_size),
                waiting: VecDeque::new(),
                running: Vec::new(),
                next_seq: 1,
                preemptions: 0,
                finished: 0,
                prefill_computed: 0,
                simulated: Duration::ZERO,
                stopped: false,
            }),
            cfg,
            log,
            wake: Notify::new(),
            stop: AtomicBool::new(false),
        }
    }

    /// Queues a request; false once the rank has stopped.
    pub(crate) fn enqueue(&self, mut req: SimRequest) -> bool {
        {
            let mut core = self.core.lock();
            if core.stopped {
                return false;
            }
            req.sim_enqueued = core.simulated;
            core.waiting.push_back(req);
        }
        // notify_one stores a permit when the task is busy, so no wake-up is lost.
        self.wake.notify_one();
        true
    }

    pub(crate) fn dp_rank(&self) -> u32 {
        self.dp_rank
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    pub(crate) fn stats(&self) -> RankStats {
        let core = self.core.lock();
        let bs = core.manager.stats();
        let active_prefill_tokens = core
            .running
            .iter()
            .filter(|r| r.in_prefill())
            .map(|r| r.remaining() as u64)
            .chain(core.waiting.iter().map(|r| r.tokens.len() as u64))
            .sum();
        RankStats {
            dp_rank: self.dp_rank,
            running: core.running.len() as u32,
            waiting: core.waiting.len() as u32,
            kv_used_blocks: bs.used_blocks,
            kv_total_blocks: bs.total_blocks,
            kv_cached_blocks: bs.cached_blocks,
            active_prefill_tokens,
            prefix_queries_tokens: bs.prefix_queries_tokens,
            prefix_hits_tokens: bs.prefix_hits_tokens,
            preemptions: core.preemptions,
            finished_requests: core.finished,
            prefill_tokens_computed: core.prefill_computed,
            simulated_time: core.simulated,
        }
    }

    /// (queued + running requests, used blocks): the key for least-loaded placement.
    pub(crate) fn load(&self) -> (u64, u64) {
        let core = self.core.lock();
        (
            (core.running.len() + core.waiting.len()) as u64,
            core.manager.stats().used_blocks,
        )
    }

    pub(crate) fn simulated_time(&self) -> Duration {
        self.core.lock().simulated
    }

    pub(crate) fn reset_prefix_cache(&self) {
        let mut core = self.core.lock();
        core.manager.reset();
        self.publish(&mut core);
        tracing::info!(dp_rank = self.dp_rank, "prefix cache reset");
    }

    /// Pins (or installs) the full blocks of `tokens` in a hold sequence; see
    /// [`BlockManager::hold_prefix`]. Returns the sequence and the blocks already cached.
    pub(crate) fn hold_prefix(
        &self,
        ns: Namespace,
        tokens: &[u32],
    ) -> Result<(SeqId, usize), AllocError> {
        let mut core = self.core.lock();
        let seq = core.next_seq;
        core.next_seq += 1;
        let r = core.manager.hold_prefix(seq, ns, tokens);
        self.publish(&mut core);
        r.map(|cached| (seq, cached))
    }

    /// Releases a hold; its blocks become evictable (or stay referenced by requests).
    pub(crate) fn release_hold(&self, seq: SeqId) {
        {
            let mut core = self.core.lock();
            core.manager.free(seq);
            self.publish(&mut core);
        }
        // Freed blocks may let a waiting request in.
        self.wake.notify_one();
    }

    /// Publishes the manager's pending events; called with the core lock held.
    fn publish(&self, core: &mut RankCore) {
        let events = core.manager.drain_events();
        if !events.is_empty() {
            self.log.publish(self.dp_rank, events);
        }
    }

    /// Schedules the next step; `None` when there is nothing to do.
    fn plan_step(&self) -> Option<StepPlan> {
        let mut core = self.core.lock();
        let plan = core.plan(&self.cfg);
        self.publish(&mut core);
        plan
    }

    fn finish_step(&self, unscaled: Duration) {
        let mut core = self.core.lock();
        core.simulated += unscaled;
        core.finish(&self.cfg);
        self.publish(&mut core);
    }

    /// Ends every request (their receivers see the channel close) and frees their blocks.
    fn shut_down(&self) {
        let mut core = self.core.lock();
        core.stopped = true;
        let running = std::mem::take(&mut core.running);
        for r in running {
            core.manager.free(r.seq);
        }
        core.waiting.clear();
        self.publish(&mut core);
    }
}

impl RankCore {
    fn plan(&mut self, cfg: &SimConfig) -> Option<StepPlan> {
        // Cancelled requests (receiver dropped) leave before anything is scheduled.
        let manager = &mut self.manager;
        self.running.retain(|r| {
            let keep = !r.tx.is_closed();
            if !keep {
                manager.free(r.seq);
                tracing::debug!(request_id = %r.request_id, "running request cancelled");
            }
            keep
        });
        self.waiting.retain(|r| !r.tx.is_closed());
        if self.running.is_empty() && self.waiting.is_empty() {
            return None;
        }

        let mut budget = cfg.max_num_batched_tokens as usize;
        let mut prefill_tokens = 0u64;
        let mut decodes = false;
        let mut preempted = false;
        for r in &mut self.running {
            r.scheduled = 0;
        }

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let r = &self.running[i];
            let n = r.remaining().min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let range = r.computed..r.computed + n;
            let seq = r.seq;
            match self.manager.append(seq, &self.running[i].tokens[range]) {
                Ok(()) => {
                    let r = &mut self.running[i];
                    if r.in_prefill() {
                        prefill_tokens += n as u64;
                    } else {
                        decodes = true;
                    }
                    r.computed += n;
                    r.scheduled = n;
                    budget -= n;
                    i += 1;
                }
                Err(AllocError::OutOfBlocks { .. }) => {
                    let victim = self.running.len() - 1;
                    if victim == i && i == 0 {
                        // Alone and still cannot grow: the cache can never hold this sequence.
                        let r = self.running.remove(i);
                        self.manager.free(r.seq);
                        self.finished += 1;
                        tracing::warn!(request_id = %r.request_id, tokens = r.tokens.len(), "sequence outgrew the KV cache; finishing early");
                        let elapsed = self.simulated.saturating_sub(r.sim_enqueued);
                        r.tx.send(r.finished_output(FinishReason::Length), elapsed);
                        continue;
                    }
                    // The newest running request goes back to the front of the queue and will
                    // recompute everything it had (prompt + output so far).
                    preempted = true;
                    let mut v = self.running.remove(victim);
                    self.manager.free(v.seq);
                    v.computed = 0;
                    v.scheduled = 0;
                    self.preemptions += 1;
                    tracing::debug!(request_id = %v.request_id, "preempted");
                    self.waiting.push_front(v);
                    // Retry the same request (unless it was the victim itself).
                }
                Err(e) => {
                    tracing::error!(error = %e, "block manager lost a running sequence");
                    let r = self.running.remove(i);
                    let elapsed = self.simulated.saturating_sub(r.sim_enqueued);
                    r.tx.send(r.finished_output(FinishReason::Length), elapsed);
                }
            }
        }

        if !preempted {
            let bs = self.manager.block_size();
            while budget > 0 && self.running.len() < cfg.max_num_seqs {
                let Some(r) = self.waiting.front() else { break };
                let matched = self.manager.match_prefix(&r.ns, &r.tokens);
                let n = (r.tokens.len() - matched * bs).min(budget);
                let seq = self.next_seq;
                match self
                    .manager
                    .start_sequence(seq, r.ns.clone(), &r.tokens, matched, n)
                {
                    Ok(cached) => {
                        self.next_seq += 1;
                        let Some(mut r) = self.waiting.pop_front() else {
                            break;
                        };
                        if !r.admitted {
                            r.admitted = true;
                            r.cached_tokens = cached as u32;
                        }
                        r.seq = seq;
                        r.computed = cached + n;
                        r.scheduled = n;
                        prefill_tokens += n as u64;
                        budget -= n;
                        self.running.push(r);
                    }
                    // Not enough KV space: stop admitting until requests finish.
                    Err(_) => break,
                }
            }
        }

        self.prefill_computed += prefill_tokens;
        let any = self.running.iter().any(|r| r.scheduled > 0);
        if !any {
            return Some(StepPlan {
                prefill_tokens: 0,
                decodes: false,
                utilisation: 0.0,
            });
        }
        let st = self.manager.stats();
        Some(StepPlan {
            prefill_tokens,
            decodes,
            utilisation: st.used_blocks as f64 / st.total_blocks.max(1) as f64,
        })
    }

    /// The step's compute is done: requests whose tokens are all computed sample a token.
    fn finish(&mut self, cfg: &SimConfig) {
        let filler = &cfg.filler_tokens;
        let mut i = 0;
        while i < self.running.len() {
            let r = &mut self.running[i];
            if r.scheduled == 0 || r.remaining() > 0 {
                i += 1;
                continue;
            }
            r.scheduled = 0;
            let token_id = filler
                .get(r.generated as usize % filler.len().max(1))
                .copied()
                .unwrap_or(0);
            let out = if r.generated == 0 {
                EngineOutput::FirstToken {
                    token_id,
                    cached_tokens: r.cached_tokens,
                }
            } else {
                EngineOutput::Token { token_id }
            };
            r.generated += 1;
            r.tokens.push(token_id);
            let elapsed = self.simulated.saturating_sub(r.sim_enqueued);
            let mut alive = r.tx.send(out, elapsed);
            let done = r.generated >= r.max_tokens;
            if done && alive {
                alive = r.tx.send(r.finished_output(FinishReason::Length), elapsed);
            }
            if done || !alive {
                let r = self.running.remove(i);
                self.manager.free(r.seq);
                if done {
                    self.finished += 1;
                }
                continue;
            }
            i += 1;
        }
    }
}

/// The scheduler task of one rank.
pub(crate) async fn run(rank: Arc<RankShared>) {
    let mut clock = VirtualClock::new();
    loop {
        if rank.stop.load(Ordering::Acquire) {
            rank.shut_down();
            tracing::debug!(dp_rank = rank.dp_rank, "scheduler stopped");
            return;
        }
        match rank.plan_step() {
            None => rank.wake.notified().await,
            Some(plan) if plan.prefill_tokens == 0 && !plan.decodes => {
                // Requests exist but none could be scheduled: wait for a change, briefly.
                let _ = tokio::time::timeout(Duration::from_millis(5), rank.wake.notified()).await;
            }
            Some(plan) => {
                let unscaled =
                    step_duration(plan.prefill_tokens, plan.decodes, plan.utilisation, 1.0);
                clock.advance(unscaled.div_f64(rank.cfg.speedup)).await;
                rank.finish_step(unscaled);
            }
        }
    }
}
