//! The sim engine's own KV event stream, applied to the EPP's index, lets the index find every
//! follow-up turn's prefix on the worker that served the previous turn (no gateway involved:
//! this isolates engine events + tokenization + index from the network path).

use std::time::Duration;

use kvroute_epp::index::{overlap_of, KvIndex};
use kvroute_proto::hashing::{local_block_hashes, XXH3_SEED};
use kvroute_proto::openai::{parse_request, ApiKind};
use kvroute_proto::prompt::PromptRenderer;
use kvroute_tests::harness::conversation::Conversation;
use kvroute_tests::harness::model_dir;
use kvroute_worker::sim::engine::{EngineOutput, EngineRequest, SimConfig, SimEngine};

const BS: u32 = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_events_make_follow_up_prefixes_findable() -> anyhow::Result<()> {
    let renderer = PromptRenderer::from_dir(&model_dir()?)?;
    let index = std::sync::Arc::new(KvIndex::new());
    let mut engines = Vec::new();
    for w in 1..=4u64 {
        let engine = SimEngine::start(SimConfig {
            block_size: BS,
            kv_capacity_blocks: 4096,
            max_num_seqs: 64,
            max_num_batched_tokens: 8192,
            speedup: 1e4,
            dp_size: 1,
            worker_id: w,
            filler_tokens: renderer
                .encode(" The quick brown fox jumps over the lazy dog.", false)?,
        });
        // Feed the index from the engine's live event stream, as the EPP does.
        let mut sub = engine
            .event_log()
            .subscribe(0, 0, 0)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let idx = index.clone();
        if let Some(snap) = sub.snapshot.take() {
            for ev in snap.events {
                idx.apply((w, 0), &ev.data)
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
            }
        }
        tokio::spawn(async move {
            while let Ok(ev) = sub.live.recv().await {
                if let Err(e) = idx.apply((w, 0), &ev.data) {
                    panic!("index rejected event {} of worker {w}: {e}", ev.event_id);
                }
            }
        });
        engines.push(engine);
    }
    let tokens_of = |conv: &Conversation| -> anyhow::Result<Vec<u32>> {
        let body = serde_json::to_vec(&conv.request("m", 8, false))?;
        Ok(renderer.token_ids(&parse_request(ApiKind::ChatCompletions, &body)?)?)
    };
    let mut misses = Vec::new();
    for c in 0..40u64 {
        let w = (c % 4) as usize;
        let mut conv = Conversation::new(c + 1, 120);
        for turn in 0..3 {
            let tokens = tokens_of(&conv)?;
            let hashes = local_block_hashes(&tokens, BS as usize, XXH3_SEED);
            if turn > 0 {
                // Events are applied asynchronously: allow a moment for the stream.
                let mut overlap = 0;
                for _ in 0..50 {
                    overlap = overlap_of(&index.find_matches(&hashes), (w as u64 + 1, 0));
                    if overlap > 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                if overlap == 0 {
                    misses.push((c, turn, index.find_matches(&hashes)));
                }
            }
            let mut rx = engines[w]
                .submit(EngineRequest {
                    request_id: format!("{c}-{turn}"),
                    prompt_tokens: tokens,
                    max_tokens: 8,
                    lora_name: None,
                    cache_salt: None,
                    dp_rank: None,
                })
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            while let Some(out) = rx.recv().await {
                if matches!(out, EngineOutput::Finished { .. }) {
                    break;
                }
            }
            conv.advance(" The quick brown fox jumps over the lazy", 40);
        }
    }
    assert!(
        misses.is_empty(),
        "follow-ups with no overlap on their worker: {misses:?}"
    );
    Ok(())
}
