//! The simulated engine's public API: configuration, requests, streamed outputs, errors and the
//! [`SimEngine`] handle the HTTP layer and the gRPC control service code against.
//!
//! [`SimEngine::start`] spawns one continuous-batching scheduler task per dp rank
//! ([`super::scheduler`]); each rank owns a [`BlockManager`](super::block_manager::BlockManager)
//! and publishes its KV events into the shared [`EventLog`]. Dropping the last handle stops the
//! tasks; outstanding requests then see their output channel close.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use super::block_manager::{AllocError, Namespace, SeqId};
use super::scheduler::{self, OutputTx, RankShared, SimRequest};
use crate::events::{EventLog, EventLogConfig};

/// Simulated engine configuration (defaults follow Dynamo's mocker).
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV capacity of each dp rank, in blocks.
    pub kv_capacity_blocks: u64,
    pub max_num_seqs: usize,
    /// Token budget of one scheduler step (chunked prefill + one token per decode).
    pub max_num_batched_tokens: u32,
    /// Divides every simulated duration.
    pub speedup: f64,
    pub dp_size: u32,
    pub worker_id: u64,
    /// Deterministic output cycles through these; never empty.
    pub filler_tokens: Vec<u32>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            block_size: 64,
            kv_capacity_blocks: 16_384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8_192,
            speedup: 1.0,
            dp_size: 1,
            worker_id: 1,
            filler_tokens: vec![1],
        }
    }
}

impl SimConfig {
    /// Replaces values the engine cannot run with (zero sizes, empty filler, bad speedup) by the
    /// nearest usable ones, logging each fix.
    fn sanitized(mut self) -> SimConfig {
        fn fix<T: std::fmt::Debug>(name: &str, v: &mut T, bad: bool, good: T) {
            if bad {
                tracing::warn!(field = name, value = ?v, replacement = ?good, "unusable sim config value replaced");
                *v = good;
            }
        }
        let b = self.block_size == 0;
        fix("block_size", &mut self.block_size, b, 1);
        let b = self.kv_capacity_blocks == 0;
        fix("kv_capacity_blocks", &mut self.kv_capacity_blocks, b, 1);
        let b = self.max_num_seqs == 0;
        fix("max_num_seqs", &mut self.max_num_seqs, b, 1);
        let b = self.max_num_batched_tokens == 0;
        fix(
            "max_num_batched_tokens",
            &mut self.max_num_batched_tokens,
            b,
            1,
        );
        let b = !(self.speedup.is_finite() && self.speedup > 0.0);
        fix("speedup", &mut self.speedup, b, 1.0);
        let b = self.dp_size == 0;
        fix("dp_size", &mut self.dp_size, b, 1);
        let b = self.filler_tokens.is_empty();
        fix("filler_tokens", &mut self.filler_tokens, b, vec![1]);
        self
    }
}

/// One generation request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EngineRequest {
    pub request_id: String,
    pub prompt_tokens: Vec<u32>,
    /// 0 is treated as 1.
    pub max_tokens: u32,
    pub lora_name: Option<String>,
    pub cache_salt: Option<String>,
    /// `None` = least loaded rank.
    pub dp_rank: Option<u32>,
}

/// What a request's receiver yields, in order: `FirstToken`, `Token`*, `Finished`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineOutput {
    /// Prefill finished; `cached_tokens` = prompt tokens served from the prefix cache.
    FirstToken {
        token_id: u32,
        cached_tokens: u32,
    },
    Token {
        token_id: u32,
    },
    Finished {
        finish_reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
        cached_tokens: u32,
    },
}

/// An output stamped with the simulated engine time since its request was queued (unscaled by
/// the speedup: what a real engine following the perf model would take). See
/// [`SimEngine::submit_timed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedOutput {
    pub output: EngineOutput,
    pub sim_elapsed: std::time::Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached (or the KV cache cannot hold a longer sequence).
    Length,
    Stop,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum EngineError {
    #[error("prompt has {tokens} tokens but the KV cache holds at most {capacity} tokens")]
    PromptTooLong { tokens: u64, capacity: u64 },
    #[error("prompt is empty")]
    EmptyPrompt,
    #[error("dp rank {dp_rank} does not exist (this worker has {dp_size} dp ranks)")]
    BadDpRank { dp_rank: u32, dp_size: u32 },
    #[error("the engine is shutting down")]
    ShuttingDown,
    #[error("KV cache full: need {needed} blocks, {available} free or evictable")]
    KvCacheFull { needed: u64, available: u64 },
}

/// Per dp rank load and cache counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankStats {
    pub dp_rank: u32,
    pub running: u32,
    pub waiting: u32,
    /// Blocks referenced by requests (vLLM counts unreferenced cached blocks as free).
    pub kv_used_blocks: u64,
    pub kv_total_blocks: u64,
    /// Cached full blocks, referenced or not.
    pub kv_cached_blocks: u64,
    /// Prompt tokens still to be computed by waiting and running requests.
    pub active_prefill_tokens: u64,
    pub prefix_queries_tokens: u64,
    pub prefix_hits_tokens: u64,
    pub preemptions: u64,
    pub finished_requests: u64,
    /// Prefill tokens the rank actually computed (prompt tokens not served from the cache,
    /// plus recomputation after preemption): what a KV transfer saves the decode worker.
    pub prefill_tokens_computed: u64,
    /// Simulated engine time of all steps so far, before the speedup divisor: what a real
    /// engine following the perf model would have spent computing.
    pub simulated_time: std::time::Duration,
}

/// Blocks held by [`SimEngine::hold_prefix`]; released on drop.
#[derive(Debug)]
pub struct PrefixHold {
    rank: Arc<RankShared>,
    seq: SeqId,
    pub dp_rank: u32,
    /// Full blocks held.
    pub blocks: usize,
    /// Of those, how many were cached before the hold (the rest were installed).
    pub already_cached: usize,
}

impl Drop for PrefixHold {
    fn drop(&mut self) {
        self.rank.release_hold(self.seq);
    }
}

#[derive(Debug)]
struct EngineInner {
    cfg: SimConfig,
    ranks: Vec<Arc<RankShared>>,
    log: EventLog,
    shutdown: AtomicBool,
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        for r in &self.ranks {
            r.stop();
        }
    }
}

/// Handle to a running simulated engine. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SimEngine {
    inner: Arc<EngineInner>,
}

impl SimEngine {
    /// Spawns one scheduler task per dp rank; must be called inside a tokio runtime.
    pub fn start(cfg: SimConfig) -> SimEngine {
        Self::start_with_log(cfg, EventLogConfig::default())
    }

    /// Like [`start`](Self::start), with explicit event history / subscriber buffer sizes.
    pub fn start_with_log(cfg: SimConfig, log_cfg: EventLogConfig) -> SimEngine {
        let cfg = cfg.sanitized();
        let log = EventLog::new(cfg.worker_id, cfg.dp_size, log_cfg);
        let cfg_arc = Arc::new(cfg.clone());
        let ranks: Vec<Arc<RankShared>> = (0..cfg.dp_size)
            .map(|r| Arc::new(RankShared::new(r, cfg_arc.clone(), log.clone())))
            .collect();
        for r in &ranks {
            tokio::spawn(scheduler::run(r.clone()));
        }
        tracing::info!(
            worker_id = cfg.worker_id,
            dp_size = cfg.dp_size,
            kv_capacity_blocks = cfg.kv_capacity_blocks,
            block_size = cfg.block_size,
            speedup = cfg.speedup,
            epoch = log.epoch(),
            "simulated engine started"
        );
        SimEngine {
            inner: Arc::new(EngineInner {
                cfg,
                ranks,
                log,
                shutdown: AtomicBool::new(false),
            }),
        }
    }

    /// The configuration in effect (after unusable values were replaced).
    pub fn config(&self) -> &SimConfig {
        &self.inner.cfg
    }

    /// Queues a request; outputs arrive on the returned receiver. Dropping the receiver cancels
    /// the request (it is removed and its blocks freed at the next scheduler step).
    pub fn submit(
        &self,
        req: EngineRequest,
    ) -> Result<mpsc::UnboundedReceiver<EngineOutput>, EngineError> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.enqueue(req, OutputTx::Plain(tx))?;
        Ok(rx)
    }

    /// Like [`submit`](Self::submit), with every output stamped with the simulated time since
    /// the request was queued (TTFT / latency in simulated time, independent of how fast the
    /// simulator itself runs).
    pub fn submit_timed(
        &self,
        req: EngineRequest,
    ) -> Result<mpsc::UnboundedReceiver<TimedOutput>, EngineError> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.enqueue(req, OutputTx::Timed(tx))?;
        Ok(rx)
    }

    fn enqueue(&self, req: EngineRequest, tx: OutputTx) -> Result<(), EngineError> {
        if self.inner.shutdown.load(Ordering::Acquire) {
            return Err(EngineError::ShuttingDown);
        }
        if req.prompt_tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let cfg = &self.inner.cfg;
        let capacity = cfg.kv_capacity_blocks * u64::from(cfg.block_size);
        let tokens = req.prompt_tokens.len() as u64;
        if tokens > capacity {
            return Err(EngineError::PromptTooLong { tokens, capacity });
        }
        let rank = match req.dp_rank {
            Some(r) => self
                .inner
                .ranks
                .get(r as usize)
                .ok_or(EngineError::BadDpRank {
                    dp_rank: r,
                    dp_size: cfg.dp_size,
                })?,
            None => self.least_loaded(),
        };
        let request = SimRequest::new(
            req.request_id,
            Namespace {
                lora_name: req.lora_name.filter(|s| !s.is_empty()),
                cache_salt: req.cache_salt.filter(|s| !s.is_empty()),
            },
            req.prompt_tokens,
            req.max_tokens.max(1),
            tx,
        );
        if !rank.enqueue(request) {
            return Err(EngineError::ShuttingDown);
        }
        Ok(())
    }

    /// The rank a request with this `dp_rank` hint would run on (the least loaded when
    /// `None`), so callers can pin or install KV blocks on that rank first.
    pub fn pick_rank(&self, dp_rank: Option<u32>) -> Result<u32, EngineError> {
        match dp_rank {
            Some(r) if (r as usize) < self.inner.ranks.len() => Ok(r),
            Some(r) => Err(EngineError::BadDpRank {
                dp_rank: r,
                dp_size: self.inner.cfg.dp_size,
            }),
            None => Ok(self.least_loaded().dp_rank()),
        }
    }

    /// Holds the full blocks of `tokens` (in the LoRA / cache-salt namespace) on `dp_rank`
    /// until the returned [`PrefixHold`] is dropped: cached blocks are pinned, missing ones
    /// are installed as cached without any compute (emitting `Stored`). Prefill workers pin
    /// the blocks a decode worker will pull; decode workers install the pulled blocks so
    /// the request that follows hits them in the prefix cache instead of recomputing.
    pub fn hold_prefix(
        &self,
        dp_rank: u32,
        lora_name: Option<String>,
        cache_salt: Option<String>,
        tokens: &[u32],
    ) -> Result<PrefixHold, EngineError> {
        if self.inner.shutdown.load(Ordering::Acquire) {
            return Err(EngineError::ShuttingDown);
        }
        let rank = self
            .inner
            .ranks
            .get(dp_rank as usize)
            .ok_or(EngineError::BadDpRank {
                dp_rank,
                dp_size: self.inner.cfg.dp_size,
            })?;
        let ns = Namespace {
            lora_name: lora_name.filter(|s| !s.is_empty()),
            cache_salt: cache_salt.filter(|s| !s.is_empty()),
        };
        let (seq, already_cached) = rank.hold_prefix(ns, tokens).map_err(|e| match e {
            AllocError::OutOfBlocks { needed, available } => {
                EngineError::KvCacheFull { needed, available }
            }
            _ => EngineError::ShuttingDown,
        })?;
        let bs = self.inner.cfg.block_size as usize;
        Ok(PrefixHold {
            rank: rank.clone(),
            seq,
            dp_rank,
            blocks: tokens.len() / bs,
            already_cached,
        })
    }

    fn least_loaded(&self) -> &Arc<RankShared> {
        let mut best = &self.inner.ranks[0];
        let mut best_key = (u64::MAX, u64::MAX);
        for r in &self.inner.ranks {
            let key = r.load();
            if key < best_key {
                best_key = key;
                best = r;
            }
        }
        best
    }

    pub fn stats(&self) -> Vec<RankStats> {
        self.inner.ranks.iter().map(|r| r.stats()).collect()
    }

    /// Simulated time of a rank's steps so far (unscaled; see [`RankStats::simulated_time`]).
    /// Cheaper than [`stats`](Self::stats), for timing requests in simulated time.
    pub fn simulated_time(&self, dp_rank: u32) -> Option<std::time::Duration> {
        self.inner
            .ranks
            .get(dp_rank as usize)
            .map(|r| r.simulated_time())
    }

    /// The shared KV event log of all ranks.
    pub fn event_log(&self) -> EventLog {
        self.inner.log.clone()
    }

    /// Drops all unreferenced cached blocks on every rank and emits `Cleared`; blocks still in
    /// use leave the cache and are freed when their requests end.
    pub fn reset_prefix_cache(&self) {
        for r in &self.inner.ranks {
            r.reset_prefix_cache();
        }
    }

    /// Stops the scheduler tasks; queued and running requests see their channel close.
    pub fn shutdown(&self) {
        self.inner.shutdown.store(true, Ordering::Release);
        for r in &self.inner.ranks {
            r.stop();
        }
    }
}
