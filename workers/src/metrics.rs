//! The worker's Prometheus metrics, under vLLM's names (engine-kv-events.md §10) so GAIE-style
//! EPPs that scrape vLLM can scrape the simulated worker unchanged.
//!
//! Load gauges and the prefix-cache counters are read from [`SimEngine::stats`] at scrape
//! time (summed over dp ranks); per-request metrics (TTFT, successes, cancellations, token
//! counts) are recorded by the HTTP layer as requests progress.

use parking_lot::Mutex;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use crate::sim::{FinishReason, RankStats};

/// vLLM's `vllm:time_to_first_token_seconds` buckets.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("metrics registry: {0}")]
    Prometheus(#[from] prometheus::Error),
}

/// All metrics of one worker, in their own registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    running: IntGauge,
    waiting: IntGauge,
    kv_usage: Gauge,
    prefix_queries: IntCounter,
    prefix_hits: IntCounter,
    preemptions: IntCounter,
    ttft: Histogram,
    success: IntCounterVec,
    cancelled: IntCounter,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    prompt_tokens_computed: IntCounter,
    /// Serialises scrape-time refreshes: engine counters are copied into Prometheus counters
    /// as deltas, which two concurrent scrapes must not both apply.
    refresh: Mutex<()>,
}

impl Metrics {
    /// Registers every metric. `model_name` labels the series vLLM labels with it.
    pub fn new(
        model_name: &str,
        block_size: u32,
        num_gpu_blocks: u64,
    ) -> Result<Metrics, MetricsError> {
        let registry = Registry::new();
        let opts = |name: &str, help: &str| {
            Opts::new(name, help).const_label("model_name", model_name.to_string())
        };
        let running = IntGauge::with_opts(opts(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
        ))?;
        let waiting = IntGauge::with_opts(opts(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
        ))?;
        let kv_usage = Gauge::with_opts(opts(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
        ))?;
        let prefix_queries = IntCounter::with_opts(opts(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
        ))?;
        let prefix_hits = IntCounter::with_opts(opts(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
        ))?;
        let preemptions = IntCounter::with_opts(opts(
            "vllm:num_preemptions_total",
            "Cumulative number of preemptions from the engine.",
        ))?;
        let cache_config = IntGaugeVec::new(
            Opts::new(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
            ),
            &["block_size", "num_gpu_blocks"],
        )?;
        cache_config
            .with_label_values(&[&block_size.to_string(), &num_gpu_blocks.to_string()])
            .set(1);
        let ttft = Histogram::with_opts(
            HistogramOpts::new(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
            )
            .const_label("model_name", model_name.to_string())
            .buckets(TTFT_BUCKETS.to_vec()),
        )?;
        let success = IntCounterVec::new(
            opts(
                "vllm:request_success_total",
                "Count of successfully processed requests.",
            ),
            &["finished_reason"],
        )?;
        // Pre-create the series so the metric is exported before the first request ends.
        for reason in [FinishReason::Stop, FinishReason::Length] {
            success.with_label_values(&[reason.as_str()]);
        }
        let cancelled = IntCounter::with_opts(opts(
            "kvroute_worker_requests_cancelled_total",
            "Requests whose client went away before they finished.",
        ))?;
        let prompt_tokens = IntCounter::with_opts(opts(
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
        ))?;
        let generation_tokens = IntCounter::with_opts(opts(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
        ))?;
        let prompt_tokens_computed = IntCounter::with_opts(opts(
            "kvroute_worker_prompt_tokens_computed_total",
            "Prefill tokens the engine actually computed (prompt tokens not served from the prefix cache or a KV transfer).",
        ))?;
        registry.register(Box::new(prompt_tokens_computed.clone()))?;
        registry.register(Box::new(running.clone()))?;
        registry.register(Box::new(waiting.clone()))?;
        registry.register(Box::new(kv_usage.clone()))?;
        registry.register(Box::new(prefix_queries.clone()))?;
        registry.register(Box::new(prefix_hits.clone()))?;
        registry.register(Box::new(preemptions.clone()))?;
        registry.register(Box::new(cache_config))?;
        registry.register(Box::new(ttft.clone()))?;
        registry.register(Box::new(success.clone()))?;
        registry.register(Box::new(cancelled.clone()))?;
        registry.register(Box::new(prompt_tokens.clone()))?;
        registry.register(Box::new(generation_tokens.clone()))?;
        Ok(Metrics {
            registry,
            running,
            waiting,
            kv_usage,
            prefix_queries,
            prefix_hits,
            preemptions,
            ttft,
            success,
            cancelled,
            prompt_tokens,
            generation_tokens,
            prompt_tokens_computed,
            refresh: Mutex::new(()),
        })
    }

    pub fn observe_ttft(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    /// A request ran to completion.
    pub fn request_finished(
        &self,
        reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
    ) {
        self.success.with_label_values(&[reason.as_str()]).inc();
        self.prompt_tokens.inc_by(u64::from(prompt_tokens));
        self.generation_tokens.inc_by(u64::from(completion_tokens));
    }

    /// The client went away before the request finished.
    pub fn request_cancelled(&self) {
        self.cancelled.inc();
    }

    /// Copies the engine's load and cache counters into the exported metrics.
    pub fn refresh(&self, stats: &[RankStats]) {
        let _guard = self.refresh.lock();
        let sum = |f: fn(&RankStats) -> u64| stats.iter().map(f).sum::<u64>();
        self.running.set(sum(|s| u64::from(s.running)) as i64);
        self.waiting.set(sum(|s| u64::from(s.waiting)) as i64);
        let total = sum(|s| s.kv_total_blocks);
        let used = sum(|s| s.kv_used_blocks);
        self.kv_usage.set(if total == 0 {
            0.0
        } else {
            used as f64 / total as f64
        });
        let advance = |c: &IntCounter, now: u64| {
            let seen = c.get();
            if now > seen {
                c.inc_by(now - seen);
            }
        };
        advance(&self.prefix_queries, sum(|s| s.prefix_queries_tokens));
        advance(&self.prefix_hits, sum(|s| s.prefix_hits_tokens));
        advance(&self.preemptions, sum(|s| s.preemptions));
        advance(
            &self.prompt_tokens_computed,
            sum(|s| s.prefill_tokens_computed),
        );
    }

    /// The registry, for metrics other layers own (the KV transfer layer).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Prometheus text exposition of every metric.
    pub fn encode(&self) -> Result<String, MetricsError> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    /// The Content-Type of [`encode`](Self::encode)'s output.
    pub fn content_type(&self) -> &'static str {
        "text/plain; version=0.0.4; charset=utf-8"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refresh_sums_ranks_and_advances_counters() {
        let m = Metrics::new("m", 16, 100).unwrap();
        let rank = |running, used, queries| RankStats {
            running,
            kv_used_blocks: used,
            kv_total_blocks: 100,
            prefix_queries_tokens: queries,
            ..RankStats::default()
        };
        m.refresh(&[rank(1, 10, 5), rank(2, 30, 7)]);
        m.refresh(&[rank(1, 10, 5), rank(2, 30, 7)]);
        let text = m.encode().unwrap();
        assert!(
            text.contains("vllm:num_requests_running{model_name=\"m\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("vllm:kv_cache_usage_perc{model_name=\"m\"} 0.2"),
            "{text}"
        );
        assert!(
            text.contains("vllm:prefix_cache_queries_total{model_name=\"m\"} 12"),
            "{text}"
        );
        assert!(text.contains("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1"));
    }
}
