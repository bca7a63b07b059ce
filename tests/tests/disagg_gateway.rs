//! End-to-end disaggregated serving through a real Envoy: EPP picks prefill + decode workers,
//! the decode worker's sidecar runs the prefill leg, the decode worker pulls the prompt's KV bytes
//! from the prefill worker over the transfer agent and decodes without recomputing the prompt.
//! Topology: `required` never crosses zones, and `preferred` shifts the share with its weight.

use std::collections::HashMap;

use kvroute_proto::openai::{parse_request, ApiKind};
use kvroute_proto::prompt::PromptRenderer;
use kvroute_tests::harness::client::{self, header, new_client, Headers};
use kvroute_tests::harness::conversation::{text, Conversation};
use kvroute_tests::harness::model_dir;
use kvroute_tests::harness::stack::{Stack, StackOptions};
use serde_json::Value;

const MODEL: &str = "Qwen/Qwen3-0.6B";
/// The sim worker's default `--kv-bytes-per-token` times the block size.
const BLOCK_BYTES: usize = 4096 * 16;

async fn chat(stack: &Stack, body: &Value) -> anyhow::Result<(u16, Headers, Vec<u8>)> {
    let (s, h, b) = client::request(
        &new_client(),
        "POST",
        &format!("{}/v1/chat/completions", stack.gateway_url),
        &[("content-type", "application/json")],
        serde_json::to_vec(body)?,
    )
    .await?;
    Ok((s, h, b.to_vec()))
}

async fn worker_metric(http: &str, name: &str) -> anyhow::Result<f64> {
    let (_, _, body) = client::get(&format!("http://{http}/metrics")).await?;
    Ok(
        kvroute_tests::harness::stack::metric_value(&String::from_utf8_lossy(&body), name)
            .unwrap_or(0.0),
    )
}

/// (decode worker name, prefill worker name) of a disaggregated response.
fn legs(stack: &Stack, h: &Headers) -> (String, String) {
    let decode_id: u64 = header(h, "x-kvroute-worker-id")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let decode = stack
        .worker_by_id(decode_id)
        .map(|w| w.name.clone())
        .unwrap_or_default();
    // remote_engine_id is "<prefill worker name>-<uuid>".
    let source = header(h, "x-kvroute-kv-source").unwrap_or_default();
    let prefill = source
        .rsplit_once('-')
        .map(|(n, _)| n.to_string())
        .unwrap_or_default();
    (decode, prefill)
}

fn zone_of(stack: &Stack, name: &str) -> Option<String> {
    stack
        .workers
        .iter()
        .find(|w| w.name == name)
        .and_then(|w| w.zone.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_requests_move_kv_and_stream_end_to_end() -> anyhow::Result<()> {
    let stack = Stack::start(StackOptions {
        workers: 0,
        prefill_workers: 1,
        decode_workers: 1,
        ..StackOptions::default()
    })
    .await?;
    let decode = stack
        .workers
        .iter()
        .find(|w| w.role == "decode")
        .expect("decode worker");
    let renderer = PromptRenderer::from_dir(&model_dir()?)?;
    let conv = Conversation::new(11, 300);
    let body = conv.request(MODEL, 16, false);
    let tokens = renderer.token_ids(&parse_request(
        ApiKind::ChatCompletions,
        &serde_json::to_vec(&body)?,
    )?)?;
    let full_blocks = tokens.len() / 16;

    // JSON through the gateway.
    let (s, h, b) = chat(&stack, &body).await?;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let (d, p) = legs(&stack, &h);
    assert_eq!(d, decode.name, "served by the decode worker");
    assert_eq!(p, "prefill-worker-0", "KV came from the prefill worker");
    let expected =
        kvroute_worker::disagg::kv::prompt_checksum(&tokens, 16, BLOCK_BYTES, None, None);
    assert_eq!(
        header(&h, "x-kvroute-kv-checksum"),
        Some(expected.as_str()),
        "decode's KV bytes equal the prefill's"
    );
    assert_eq!(
        header(&h, "x-kvroute-kv-blocks"),
        Some(full_blocks.to_string().as_str())
    );
    let v: Value = serde_json::from_slice(&b)?;
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64(),
        Some(tokens.len() as u64)
    );
    // The decode worker computed only the last partial block of the prompt.
    let computed =
        worker_metric(&decode.http, "kvroute_worker_prompt_tokens_computed_total").await?;
    let received = worker_metric(&decode.http, "kvroute_worker_kv_tokens_received_total").await?;
    assert_eq!(received, (full_blocks * 16) as f64);
    assert!(
        computed <= 16.0,
        "decode recomputed {computed} prompt tokens"
    );

    // SSE through the gateway: a new prompt, streamed to the end.
    let mut stream_body = Conversation::new(12, 200).request(MODEL, 20, true);
    stream_body["stream_options"] = serde_json::json!({"include_usage": true});
    let (s, h, b) = chat(&stack, &stream_body).await?;
    assert_eq!(s, 200);
    assert_eq!(header(&h, "content-type"), Some("text/event-stream"));
    let text = String::from_utf8_lossy(&b);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    let content: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!content.is_empty());
    assert_eq!(
        events
            .last()
            .map(|e| e["usage"]["completion_tokens"].clone()),
        Some(Value::from(20))
    );
    assert_eq!(legs(&stack, &h).1, "prefill-worker-0");
    let computed =
        worker_metric(&decode.http, "kvroute_worker_prompt_tokens_computed_total").await?;
    assert!(
        computed <= 32.0,
        "two requests, at most one partial block each: {computed}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_topology_never_crosses_zones() -> anyhow::Result<()> {
    let stack = Stack::start(StackOptions {
        workers: 0,
        prefill_workers: 4,
        decode_workers: 4,
        zones: vec!["a".into(), "b".into()],
        kv_transfer: ("required".into(), 0.0),
        ..StackOptions::default()
    })
    .await?;
    let mut per_zone: HashMap<String, usize> = HashMap::new();
    for i in 0..200u64 {
        let body = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": text(1000 + i, 60)}], "max_tokens": 2});
        let (s, h, b) = chat(&stack, &body).await?;
        assert_eq!(s, 200, "request {i}: {}", String::from_utf8_lossy(&b));
        let (d, p) = legs(&stack, &h);
        let (dz, pz) = (zone_of(&stack, &d), zone_of(&stack, &p));
        assert!(
            dz.is_some() && dz == pz,
            "request {i} crossed zones: decode {d} ({dz:?}), prefill {p} ({pz:?})"
        );
        *per_zone.entry(dz.unwrap_or_default()).or_default() += 1;
    }
    assert_eq!(per_zone.len(), 2, "both zones serve: {per_zone:?}");

    // Zone b loses its decode workers: zone a serves everything, still never crossing.
    let b_decode: Vec<&str> = stack
        .workers
        .iter()
        .filter(|w| w.role == "decode" && w.zone.as_deref() == Some("b"))
        .map(|w| w.name.as_str())
        .collect();
    stack.drop_from_discovery(&b_decode).await?;
    for i in 0..20u64 {
        let body = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": text(5000 + i, 60)}], "max_tokens": 2});
        let (s, h, _) = chat(&stack, &body).await?;
        assert_eq!(s, 200);
        let (d, p) = legs(&stack, &h);
        assert_eq!(zone_of(&stack, &d).as_deref(), Some("a"));
        assert_eq!(zone_of(&stack, &p).as_deref(), Some("a"));
    }
    // And with zone a's prefill workers gone too, no prefill worker has a decode worker in its
    // domain: 503 naming the domain.
    let mut gone = b_decode.clone();
    gone.extend(
        stack
            .workers
            .iter()
            .filter(|w| w.role == "prefill" && w.zone.as_deref() == Some("a"))
            .map(|w| w.name.as_str()),
    );
    stack.drop_from_discovery(&gone).await?;
    let body = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": text(9999, 60)}], "max_tokens": 2});
    let (s, _, b) = chat(&stack, &body).await?;
    assert_eq!(s, 503, "{}", String::from_utf8_lossy(&b));
    let v: Value = serde_json::from_slice(&b)?;
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("zone=b"),
        "{v}"
    );
    Ok(())
}

/// Share of decode picks in the prefill worker's zone, with concurrent long requests so that
/// decode load competes with the preference.
async fn preferred_share(weight: f32) -> anyhow::Result<f64> {
    let stack = Stack::start(StackOptions {
        workers: 0,
        prefill_workers: 1,
        decode_workers: 2,
        zones: vec!["a".into(), "b".into()],
        kv_transfer: ("preferred".into(), weight),
        speedup: 10.0,
        ..StackOptions::default()
    })
    .await?;
    let stack = std::sync::Arc::new(stack);
    let mut tasks = Vec::new();
    for c in 0..8u64 {
        let stack = stack.clone();
        tasks.push(tokio::spawn(async move {
            let mut same = 0usize;
            for i in 0..8u64 {
                let body = serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": text(c * 100 + i, 40)}], "max_tokens": 48});
                let (s, h, _) = chat(&stack, &body).await?;
                anyhow::ensure!(s == 200, "status {s}");
                let (d, _) = legs(&stack, &h);
                same += usize::from(zone_of(&stack, &d).as_deref() == Some("a"));
            }
            Ok::<usize, anyhow::Error>(same)
        }));
    }
    let mut same = 0;
    for t in tasks {
        same += t.await??;
    }
    Ok(same as f64 / 64.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_topology_shifts_the_share_with_weight() -> anyhow::Result<()> {
    let none = preferred_share(0.0).await?;
    let full = preferred_share(1.0).await?;
    assert!(
        (0.25..=0.75).contains(&none),
        "weight 0: no preference, got {none}"
    );
    assert!(
        full >= none + 0.15,
        "weight 1 must shift decode towards the prefill zone: {none} → {full}"
    );
    assert!(
        full < 1.0 || none < 0.6,
        "preferred must not act like required under load: {full}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_stops_generation_within_100ms_and_releases_the_booking(
) -> anyhow::Result<()> {
    use http_body_util::BodyExt;
    use std::time::{Duration, Instant};
    let stack = Stack::start(StackOptions {
        workers: 0,
        prefill_workers: 1,
        decode_workers: 1,
        speedup: 1.0,
        ..StackOptions::default()
    })
    .await?;
    let decode = stack
        .workers
        .iter()
        .find(|w| w.role == "decode")
        .expect("decode worker");
    let body = Conversation::new(21, 80).request(MODEL, 4000, true);
    let resp = client::send(
        &new_client(),
        "POST",
        &format!("{}/v1/chat/completions", stack.gateway_url),
        &[("content-type", "application/json")],
        serde_json::to_vec(&body)?,
    )
    .await?;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = tokio::time::timeout(Duration::from_secs(20), body.frame()).await?;
    assert!(first.is_some(), "the stream started");
    assert_eq!(
        worker_metric(&decode.http, "vllm:num_requests_running").await?,
        1.0
    );
    assert_eq!(
        stack
            .epp_metric("inference_objective_running_requests")
            .await?,
        Some(1.0)
    );
    let cancelled_before =
        worker_metric(&decode.http, "kvroute_worker_requests_cancelled_total").await?;
    drop(body);
    let dropped = Instant::now();
    let stopped = loop {
        if worker_metric(&decode.http, "vllm:num_requests_running").await? == 0.0 {
            break dropped.elapsed();
        }
        anyhow::ensure!(
            dropped.elapsed() < Duration::from_secs(5),
            "generation never stopped"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    assert!(
        stopped < Duration::from_millis(100),
        "generation stopped {stopped:?} after the disconnect"
    );
    assert_eq!(
        worker_metric(&decode.http, "kvroute_worker_requests_cancelled_total").await?,
        cancelled_before + 1.0
    );
    let deadline = Instant::now() + Duration::from_secs(2);
    while stack
        .epp_metric("inference_objective_running_requests")
        .await?
        != Some(0.0)
    {
        anyhow::ensure!(Instant::now() < deadline, "EPP booking not released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}
