//! End-to-end tests of `SimEngine`: output protocol, TTFT vs prefix hits, chunked prefill,
//! cancellation, preemption under a small cache, rejections, and that the event log always
//! agrees with the cache.

use std::time::{Duration, Instant};

use kvroute_worker::sim::{
    EngineError, EngineOutput, EngineRequest, FinishReason, SimConfig, SimEngine,
};
use tokio::sync::mpsc::UnboundedReceiver;

fn cfg() -> SimConfig {
    SimConfig {
        block_size: 16,
        kv_capacity_blocks: 4096,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        speedup: 100.0,
        dp_size: 1,
        worker_id: 7,
        filler_tokens: vec![11, 12, 13],
    }
}

fn req(id: &str, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        request_id: id.into(),
        prompt_tokens: prompt,
        max_tokens,
        lora_name: None,
        cache_salt: None,
        dp_rank: None,
    }
}

/// Distinct tokens for prompt number `n`.
fn unique(n: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| n * 100_000 + i).collect()
}

async fn collect(mut rx: UnboundedReceiver<EngineOutput>) -> Vec<EngineOutput> {
    let mut out = Vec::new();
    while let Some(o) = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("engine makes progress")
    {
        out.push(o);
    }
    out
}

/// Waits until `cond` holds on the engine's stats, or fails after `limit`.
async fn wait_for(
    engine: &SimEngine,
    limit: Duration,
    what: &str,
    cond: impl Fn(&SimEngine) -> bool,
) {
    let start = Instant::now();
    while !cond(engine) {
        assert!(
            start.elapsed() < limit,
            "timed out waiting for {what}: {:?}",
            engine.stats()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn assert_log_matches_cache(engine: &SimEngine) {
    let log = engine.event_log();
    for s in engine.stats() {
        assert_eq!(
            log.live_blocks(s.dp_rank).len() as u64,
            s.kv_cached_blocks,
            "rank {}: event log live set vs cache",
            s.dp_rank
        );
    }
}

#[tokio::test]
async fn outputs_in_order_with_counts() {
    let engine = SimEngine::start(cfg());
    let out = collect(engine.submit(req("a", unique(1, 40), 5)).unwrap()).await;
    assert_eq!(out.len(), 6, "{out:?}");
    assert_eq!(
        out[0],
        EngineOutput::FirstToken {
            token_id: 11,
            cached_tokens: 0
        }
    );
    assert_eq!(out[1], EngineOutput::Token { token_id: 12 });
    assert_eq!(
        out[3],
        EngineOutput::Token { token_id: 11 },
        "filler cycles"
    );
    assert_eq!(
        out[5],
        EngineOutput::Finished {
            finish_reason: FinishReason::Length,
            prompt_tokens: 40,
            completion_tokens: 5,
            cached_tokens: 0
        }
    );
    // max_tokens 0 behaves as 1.
    let out = collect(engine.submit(req("b", unique(2, 10), 0)).unwrap()).await;
    assert!(matches!(out[0], EngineOutput::FirstToken { .. }));
    assert!(matches!(
        out[1],
        EngineOutput::Finished {
            completion_tokens: 1,
            ..
        }
    ));
    // The same prompt again: its full blocks (2 of 40 tokens → 32 tokens) come from the cache.
    let out = collect(engine.submit(req("c", unique(1, 40), 1)).unwrap()).await;
    assert_eq!(
        out[0],
        EngineOutput::FirstToken {
            token_id: 11,
            cached_tokens: 32
        }
    );
    let st = engine.stats()[0];
    assert_eq!(st.running + st.waiting, 0);
    assert_eq!(st.kv_used_blocks, 0);
    assert_eq!(st.prefix_queries_tokens, 90);
    assert_eq!(st.prefix_hits_tokens, 32);
    assert_eq!(st.finished_requests, 3);
    assert_log_matches_cache(&engine);
}

#[tokio::test]
async fn rejects_what_can_never_run() {
    let engine = SimEngine::start(SimConfig {
        kv_capacity_blocks: 10,
        ..cfg()
    });
    assert_eq!(
        engine.submit(req("big", unique(1, 161), 1)).unwrap_err(),
        EngineError::PromptTooLong {
            tokens: 161,
            capacity: 160
        }
    );
    assert_eq!(
        engine.submit(req("empty", vec![], 1)).unwrap_err(),
        EngineError::EmptyPrompt
    );
    let mut r = req("rank", unique(1, 4), 1);
    r.dp_rank = Some(1);
    assert!(matches!(
        engine.submit(r).unwrap_err(),
        EngineError::BadDpRank {
            dp_rank: 1,
            dp_size: 1
        }
    ));
    // A prompt that exactly fills the cache runs; it cannot grow, so it ends early.
    let out = collect(engine.submit(req("full", unique(2, 160), 50)).unwrap()).await;
    match out.last() {
        Some(EngineOutput::Finished {
            finish_reason: FinishReason::Length,
            completion_tokens,
            ..
        }) => assert!(*completion_tokens < 50),
        other => panic!("unexpected end {other:?}"),
    }
    engine.shutdown();
    assert_eq!(
        engine.submit(req("late", unique(3, 4), 1)).unwrap_err(),
        EngineError::ShuttingDown
    );
}

async fn ttft(engine: &SimEngine, prompt: Vec<u32>) -> (Duration, u32) {
    let start = Instant::now();
    let mut rx = engine.submit(req("t", prompt, 1)).unwrap();
    let first = rx.recv().await.expect("first token");
    let took = start.elapsed();
    let EngineOutput::FirstToken { cached_tokens, .. } = first else {
        panic!("expected FirstToken, got {first:?}")
    };
    while rx.recv().await.is_some() {}
    (took, cached_tokens)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::test]
async fn prefix_hits_cut_ttft() {
    // 8000-token prompts: cold prefill ≈ 165 ms, 90% cached ≈ 29 ms (÷ speedup 5).
    let engine = SimEngine::start(SimConfig {
        speedup: 5.0,
        ..cfg()
    });
    let mut cold = Vec::new();
    let mut warm = Vec::new();
    for i in 0..5u32 {
        let (t, cached) = ttft(&engine, unique(10 + i, 8000)).await;
        assert_eq!(cached, 0);
        cold.push(t);
        // Prime a 7200-token prefix, then send it with a different 800-token tail.
        let prefix = unique(20 + i, 7200);
        let mut primer = prefix.clone();
        primer.extend(unique(30 + i, 16));
        ttft(&engine, primer).await;
        let mut prompt = prefix;
        prompt.extend(unique(40 + i, 800));
        let (t, cached) = ttft(&engine, prompt).await;
        assert_eq!(cached, 7200, "450 shared blocks of 16");
        warm.push(t);
    }
    let (cold, warm) = (median(cold), median(warm));
    eprintln!("median TTFT: cold {cold:?}, 90% cached {warm:?}");
    assert!(
        warm.as_secs_f64() < 0.6 * cold.as_secs_f64(),
        "cached TTFT {warm:?} should be well below cold TTFT {cold:?}"
    );
    assert!(
        cold > Duration::from_millis(25),
        "cold TTFT follows the model: {cold:?}"
    );
}

#[tokio::test]
async fn timed_outputs_follow_the_perf_model_exactly() {
    use kvroute_worker::sim::timing::step_duration;
    // Simulated time does not depend on how fast the simulator runs: use a huge speedup.
    let engine = SimEngine::start(SimConfig {
        speedup: 10_000.0,
        ..cfg()
    });
    let first = |mut rx: UnboundedReceiver<kvroute_worker::sim::TimedOutput>| async move {
        let first = rx.recv().await.expect("first token");
        while rx.recv().await.is_some() {}
        first
    };
    // Idle engine, one 8000-token prompt: TTFT is exactly one 8000-token prefill step.
    let cold = first(
        engine
            .submit_timed(req("cold", unique(1, 8000), 1))
            .unwrap(),
    )
    .await;
    assert_eq!(cold.sim_elapsed, step_duration(8000, false, 0.0, 1.0));
    // 7200 of 8000 tokens cached: exactly one 800-token prefill step.
    let mut p = unique(1, 7200);
    p.extend(unique(2, 800));
    let warm = first(engine.submit_timed(req("warm", p, 1)).unwrap()).await;
    assert!(matches!(
        warm.output,
        EngineOutput::FirstToken {
            cached_tokens: 7200,
            ..
        }
    ));
    assert_eq!(warm.sim_elapsed, step_duration(800, false, 0.0, 1.0));
    assert!(warm.sim_elapsed.as_secs_f64() < 0.2 * cold.sim_elapsed.as_secs_f64());
}

#[tokio::test]
async fn long_prompts_prefill_in_chunks() {
    // Budget of 256 tokens per step: a 1000-token prompt needs 4 prefill steps.
    let engine = SimEngine::start(SimConfig {
        max_num_batched_tokens: 256,
        speedup: 20.0,
        ..cfg()
    });
    let mut rx = engine.submit(req("long", unique(1, 1000), 2)).unwrap();
    // While it prefills, the rank reports the remaining prefill tokens.
    wait_for(&engine, Duration::from_secs(5), "chunked prefill", |e| {
        let s = e.stats()[0];
        s.running == 1 && s.active_prefill_tokens > 0 && s.active_prefill_tokens < 1000
    })
    .await;
    assert!(matches!(
        rx.recv().await,
        Some(EngineOutput::FirstToken { .. })
    ));
    let out = collect(rx).await;
    assert!(matches!(
        out.last(),
        Some(EngineOutput::Finished {
            completion_tokens: 2,
            ..
        })
    ));
}

#[tokio::test]
async fn dropping_the_receiver_frees_blocks() {
    let engine = SimEngine::start(SimConfig {
        speedup: 10.0,
        ..cfg()
    });
    let mut rx = engine.submit(req("c", unique(1, 500), 100_000)).unwrap();
    assert!(matches!(
        rx.recv().await,
        Some(EngineOutput::FirstToken { .. })
    ));
    let used = engine.stats()[0].kv_used_blocks;
    assert!(used >= 32, "500 tokens hold 32 blocks, got {used}");
    drop(rx);
    // Decode steps take ~0.6 ms at this speedup; the request must be gone within a few.
    let start = Instant::now();
    wait_for(&engine, Duration::from_millis(200), "cancellation", |e| {
        let s = e.stats()[0];
        s.running == 0 && s.kv_used_blocks == 0
    })
    .await;
    assert!(start.elapsed() < Duration::from_millis(200));
    let s = engine.stats()[0];
    assert!(
        s.kv_cached_blocks >= 31,
        "its full blocks stay cached for reuse"
    );
    assert_eq!(s.finished_requests, 0);
    assert_log_matches_cache(&engine);
}

#[tokio::test]
async fn small_cache_preempts_and_still_finishes_everything() {
    // 40 blocks of 16 tokens; 8 requests of 100 prompt + 150 output tokens (16 blocks each at
    // the end) cannot all fit: the scheduler must stop admitting and preempt.
    let engine = SimEngine::start(SimConfig {
        kv_capacity_blocks: 40,
        speedup: 200.0,
        ..cfg()
    });
    let rxs: Vec<_> = (0..8)
        .map(|i| {
            let mut p = unique(99, 48); // a shared 3-block prefix
            p.extend(unique(i, 52));
            engine.submit(req(&format!("r{i}"), p, 150)).unwrap()
        })
        .collect();
    for rx in rxs {
        let out = collect(rx).await;
        assert_eq!(out.len(), 151);
        assert!(matches!(
            out.last(),
            Some(EngineOutput::Finished {
                completion_tokens: 150,
                prompt_tokens: 100,
                ..
            })
        ));
    }
    let s = engine.stats()[0];
    assert!(s.preemptions > 0, "expected preemptions: {s:?}");
    assert_eq!(s.kv_used_blocks, 0);
    assert_eq!(s.finished_requests, 8);
    assert_log_matches_cache(&engine);
}

#[tokio::test]
async fn dp_ranks_share_load_and_reset_clears() {
    let engine = SimEngine::start(SimConfig {
        dp_size: 2,
        speedup: 50.0,
        ..cfg()
    });
    let rxs: Vec<_> = (0..6)
        .map(|i| engine.submit(req("r", unique(i, 64), 20)).unwrap())
        .collect();
    let st = engine.stats();
    assert_eq!(st.len(), 2);
    let per_rank: Vec<u32> = st.iter().map(|s| s.running + s.waiting).collect();
    assert!(
        per_rank.iter().all(|&n| n >= 2),
        "least-loaded placement spreads requests: {per_rank:?}"
    );
    for rx in rxs {
        collect(rx).await;
    }
    let log = engine.event_log();
    assert!(!log.live_blocks(0).is_empty() && !log.live_blocks(1).is_empty());
    assert_log_matches_cache(&engine);
    engine.reset_prefix_cache();
    for s in engine.stats() {
        assert_eq!(s.kv_cached_blocks, 0);
    }
    assert!(log.live_blocks(0).is_empty() && log.live_blocks(1).is_empty());
    // An explicit rank is honoured.
    let mut r = req("pinned", unique(50, 64), 1);
    r.dp_rank = Some(1);
    collect(engine.submit(r).unwrap()).await;
    assert!(log.live_blocks(0).is_empty());
    assert_eq!(log.live_blocks(1).len(), 4);
}
