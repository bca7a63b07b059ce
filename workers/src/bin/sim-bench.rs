//! sim-bench: drives requests through the simulated engine (`SimEngine`) directly, with no HTTP
//! in between, and reports how fast the engine core runs (requests/s and tokens/s of wall
//! time) and its TTFT for cold prompts vs prompts with a prefix-cache hit.
//!
//! Requests are closed-loop (`--concurrency` in flight). Request `i` uses shared prefix group
//! `i % --prefix-groups` followed by a private tail, so the first request of each group is cold
//! and later ones hit the cache. TTFTs are reported in simulated milliseconds, stamped by the
//! engine (`SimEngine::submit_timed`: the rank's unscaled step times since the request was
//! queued): what a real engine following the mocker's perf model would show, even when the
//! simulator cannot keep up with the requested speedup.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use kvroute_worker::sim::{EngineOutput, EngineRequest, SimConfig, SimEngine, TimedOutput};
use tokio::sync::Semaphore;

#[derive(Parser, Debug)]
#[command(about = "Throughput benchmark of the simulated engine core")]
struct Args {
    /// Number of requests to run.
    #[arg(long, default_value_t = 2000)]
    requests: u32,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 1024)]
    prompt_tokens: u32,
    /// Fraction of each prompt shared with its prefix group (0..=1).
    #[arg(long, default_value_t = 0.5)]
    shared_prefix_frac: f64,
    /// Number of distinct shared prefixes.
    #[arg(long, default_value_t = 8)]
    prefix_groups: u32,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    output_tokens: u32,
    /// Divides simulated time.
    #[arg(long, default_value_t = 1000.0)]
    speedup: f64,
    /// Requests in flight.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    #[arg(long, default_value_t = 64)]
    block_size: u32,
    /// KV capacity per dp rank, in blocks.
    #[arg(long, default_value_t = 16_384)]
    kv_blocks: u64,
    #[arg(long, default_value_t = 1)]
    dp_size: u32,
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: u32,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    ttft: Duration,
    cached_tokens: u32,
    completion_tokens: u32,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn prompt(args: &Args, i: u32) -> Vec<u32> {
    let len = args.prompt_tokens.max(1);
    let shared = ((f64::from(len) * args.shared_prefix_frac.clamp(0.0, 1.0)) as u32).min(len);
    let group = i % args.prefix_groups.max(1);
    // Disjoint token ranges per group and per request keep prefixes from colliding.
    let mut p: Vec<u32> = (0..shared).map(|t| 1_000_000 + group * len + t).collect();
    p.extend((0..len - shared).map(|t| 50_000_000 + i.wrapping_mul(len) + t));
    p
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.requests > 0, "--requests must be positive");
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be positive");
    let engine = SimEngine::start(SimConfig {
        block_size: args.block_size,
        kv_capacity_blocks: args.kv_blocks,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        speedup: args.speedup,
        dp_size: args.dp_size,
        worker_id: 1,
        filler_tokens: (100..164).collect(),
    });
    let done = Arc::new(AtomicU64::new(0));
    let sem = Arc::new(Semaphore::new(args.concurrency));
    let start = Instant::now();

    let progress = {
        let (done, total) = (done.clone(), u64::from(args.requests));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let n = done.load(Ordering::Relaxed);
                let secs = start.elapsed().as_secs_f64();
                eprintln!(
                    "[{secs:6.1}s] {n}/{total} requests done ({:.0} req/s)",
                    n as f64 / secs
                );
            }
        })
    };

    let mut tasks = Vec::with_capacity(args.requests as usize);
    for i in 0..args.requests {
        let permit = sem
            .clone()
            .acquire_owned()
            .await
            .context("semaphore closed")?;
        let req = EngineRequest {
            request_id: format!("bench-{i}"),
            prompt_tokens: prompt(&args, i),
            max_tokens: args.output_tokens,
            lora_name: None,
            cache_salt: None,
            dp_rank: Some(i % args.dp_size.max(1)),
        };
        let mut rx = engine.submit_timed(req).context("submit")?;
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let mut sample = Sample {
                ttft: Duration::ZERO,
                cached_tokens: 0,
                completion_tokens: 0,
            };
            while let Some(TimedOutput {
                output,
                sim_elapsed,
            }) = rx.recv().await
            {
                match output {
                    EngineOutput::FirstToken { cached_tokens, .. } => {
                        sample.ttft = sim_elapsed;
                        sample.cached_tokens = cached_tokens;
                    }
                    EngineOutput::Token { .. } => {}
                    EngineOutput::Finished {
                        completion_tokens, ..
                    } => sample.completion_tokens = completion_tokens,
                }
            }
            done.fetch_add(1, Ordering::Relaxed);
            sample
        }));
    }
    let mut samples = Vec::with_capacity(tasks.len());
    for t in tasks {
        samples.push(t.await.context("request task")?);
    }
    let wall = start.elapsed();
    progress.abort();

    let secs = wall.as_secs_f64();
    let completion: u64 = samples.iter().map(|s| u64::from(s.completion_tokens)).sum();
    let prompt_total = u64::from(args.requests) * u64::from(args.prompt_tokens);
    let stats = engine.stats();
    let queries: u64 = stats.iter().map(|s| s.prefix_queries_tokens).sum();
    let hits: u64 = stats.iter().map(|s| s.prefix_hits_tokens).sum();
    let preemptions: u64 = stats.iter().map(|s| s.preemptions).sum();
    let sim_ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let simulated: Duration = stats
        .iter()
        .map(|s| s.simulated_time)
        .max()
        .unwrap_or_default();
    let mut cold: Vec<f64> = Vec::new();
    let mut hit: Vec<f64> = Vec::new();
    for s in &samples {
        if s.cached_tokens == 0 {
            cold.push(sim_ms(s.ttft));
        } else {
            hit.push(sim_ms(s.ttft));
        }
    }
    cold.sort_by(f64::total_cmp);
    hit.sort_by(f64::total_cmp);

    println!(
        "sim-bench: {} requests, prompt {} tokens ({:.0}% shared, {} groups), output {} tokens, \
         speedup {}, concurrency {}, block size {}, {} KV blocks x {} dp rank(s)",
        args.requests,
        args.prompt_tokens,
        args.shared_prefix_frac * 100.0,
        args.prefix_groups,
        args.output_tokens,
        args.speedup,
        args.concurrency,
        args.block_size,
        args.kv_blocks,
        args.dp_size
    );
    println!();
    println!("| metric | value |");
    println!("| --- | --- |");
    println!("| wall time | {secs:.2} s |");
    println!(
        "| simulated engine time (busiest rank) | {:.2} s (effective speedup {:.0}x) |",
        simulated.as_secs_f64(),
        simulated.as_secs_f64() / secs
    );
    println!(
        "| requests/s (wall) | {:.0} |",
        f64::from(args.requests) / secs
    );
    println!(
        "| output tokens/s (wall) | {:.0} |",
        completion as f64 / secs
    );
    println!(
        "| prompt + output tokens/s (wall) | {:.0} |",
        (prompt_total + completion) as f64 / secs
    );
    println!(
        "| output tokens/s (simulated time) | {:.0} |",
        completion as f64 / simulated.as_secs_f64().max(1e-9)
    );
    println!(
        "| prefix cache hit rate (tokens) | {:.1}% |",
        100.0 * hits as f64 / queries.max(1) as f64
    );
    println!("| preemptions | {preemptions} |");
    for (name, v) in [("cold", &cold), ("prefix hit", &hit)] {
        println!(
            "| TTFT {name} p50 / p99, simulated ms (n={}) | {:.1} / {:.1} |",
            v.len(),
            percentile(v, 0.5),
            percentile(v, 0.99)
        );
    }
    Ok(())
}
