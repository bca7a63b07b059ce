//! The disaggregated flow through the sidecar over real sockets.
//!
//! The prefill worker here is a recording fake written from vLLM's NixlConnector contract
//! (routing-and-disagg.md §6.2: the prefill response carries top-level `kv_transfer_params`
//! with `do_remote_prefill: true`, `remote_engine_id`, `remote_block_ids`, `remote_host`,
//! `remote_port`, …) and SGLang's bootstrap fields (§6.3: `bootstrap_host`, `bootstrap_port`,
//! `bootstrap_room`, the same body to both legs at once), so the test sees exactly what each
//! leg received. The decode engine is the real simulated worker where the test checks
//! end-to-end streaming, and a recorder where it checks the decode body.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvroute_proto::hints;
use kvroute_sidecar::config::KvConnector;
use serde_json::{json, Value};

fn remote_params() -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": "prefill-engine-1",
        "remote_block_ids": [1, 2, 3],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_request_id": "prefill-req-1",
        "tp_size": 1
    })
}

/// What a vLLM prefill worker answers to a `do_remote_decode` request.
fn prefill_ok(rec: &Recorded) -> Canned {
    let chat = rec.path.ends_with("chat/completions");
    let choice = if chat {
        json!({"index": 0, "message": {"role": "assistant", "content": " The"}, "finish_reason": "length"})
    } else {
        json!({"index": 0, "text": " The", "finish_reason": "length"})
    };
    Canned::json(
        200,
        json!({
            "id": "cmpl-prefill",
            "object": if chat { "chat.completion" } else { "text_completion" },
            "model": MODEL,
            "choices": [choice],
            "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21,
                      "prompt_tokens_details": {"cached_tokens": 7}},
            "kv_transfer_params": remote_params(),
        }),
    )
}

fn chat(stream: bool) -> Value {
    let mut b = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Explain disaggregated prefill in one line."}],
        "max_tokens": 5,
        "stream": stream,
    });
    if stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

fn completion(stream: bool) -> Value {
    let mut b =
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "stream": stream});
    if stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

fn disagg_config(decode_url: &str, prefill: &Recorder) -> kvroute_sidecar::config::Config {
    let mut cfg = config(&[format!("name=9,url={decode_url}")]);
    cfg.pool_endpoints = vec![prefill.addr.to_string()];
    cfg
}

fn usage_cached(v: &Value) -> Option<u64> {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_prefill_then_decode_json_and_sse_for_chat_and_completions() {
    let prefill = Recorder::start(prefill_ok).await;
    let decode = start_worker("decode-1", 200.0, &[]).await;
    let sc = start_sidecar(disagg_config(&decode.url, &prefill)).await;
    let target = prefill.addr.to_string();
    let hints = [
        (hints::WORKER_INSTANCE_ID, "9"),
        (hints::PREFILLER_HOST_PORT, target.as_str()),
        ("x-request-id", "rq-1"),
    ];

    for (path, body) in [
        ("/v1/chat/completions", chat(false)),
        ("/v1/completions", completion(false)),
    ] {
        let (status, headers, got) = post_json(&format!("{}{path}", sc.url), &hints, &body).await;
        assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&got));
        assert_eq!(header(&headers, "x-request-id"), Some("rq-1"));
        let v: Value = serde_json::from_slice(&got).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
        assert_eq!(
            usage_cached(&v),
            Some(7),
            "cached_tokens is the prefill worker's: {v}"
        );
    }
    for (path, body) in [
        ("/v1/chat/completions", chat(true)),
        ("/v1/completions", completion(true)),
    ] {
        let (status, headers, got) = post_json(&format!("{}{path}", sc.url), &hints, &body).await;
        assert_eq!(status, 200);
        assert!(header(&headers, "content-type")
            .unwrap()
            .starts_with("text/event-stream"));
        let events = sse_data(&got);
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
        let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 5);
        assert_eq!(usage_cached(&usage), Some(7), "{usage}");
    }

    // Every prefill leg: one token, no stream, vLLM's do_remote_decode params, same request id.
    let legs = prefill.recorded();
    assert_eq!(legs.len(), 4);
    for leg in &legs {
        let b = &leg.body;
        assert_eq!(b["stream"], false);
        assert!(b.get("stream_options").is_none());
        assert_eq!(b["max_tokens"], 1);
        assert_eq!(b["max_completion_tokens"], 1);
        assert_eq!(
            b["kv_transfer_params"],
            json!({
                "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                "remote_block_ids": null, "remote_host": null, "remote_port": null
            })
        );
        assert_eq!(header(&leg.headers, "x-request-id"), Some("rq-1"));
        assert!(
            leg.headers.iter().all(|(k, _)| !hints::is_hint_header(k)),
            "{:?}",
            leg.headers
        );
    }
    assert_eq!(legs[0].path, "/v1/chat/completions");
    assert_eq!(legs[1].path, "/v1/completions");
    assert_eq!(legs[0].body["messages"], chat(false)["messages"]);
    assert!(metric(&sc.url, "kvroute_sidecar_prefill_leg_seconds_count").await >= 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_leg_gets_original_body_plus_prefill_params_verbatim() {
    let prefill = Recorder::start(prefill_ok).await;
    let decode = Recorder::start(|_| Canned {
        status: 200,
        content_type: "text/event-stream",
        chunks: vec![
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" a\"}}]}\n\n".into(),
            // The usage event split over two frames, as TCP may deliver it.
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":1,".into(),
            "\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\ndata: [DONE]\n\n".into(),
        ],
        delay: Duration::ZERO,
    })
    .await;
    let sc = start_sidecar(disagg_config(&decode.url, &prefill)).await;
    let target = prefill.addr.to_string();
    let body = chat(true);
    let (status, _, got) = post_json(
        &format!("{}/v1/chat/completions", sc.url),
        &[
            (hints::WORKER_INSTANCE_ID, "9"),
            (hints::PREFILLER_HOST_PORT, target.as_str()),
        ],
        &body,
    )
    .await;
    assert_eq!(status, 200);
    let events = sse_data(&got);
    assert_eq!(events.len(), 3, "{events:?}");
    assert_eq!(
        events[0], "{\"choices\":[{\"index\":0,\"delta\":{\"content\":\" a\"}}]}",
        "other events pass unchanged"
    );
    assert_eq!(
        usage_cached(&serde_json::from_str(&events[1]).unwrap()),
        Some(7)
    );
    let d = decode.recorded();
    assert_eq!(d.len(), 1);
    let mut expected = body.clone();
    expected["kv_transfer_params"] = remote_params();
    assert_eq!(
        d[0].body, expected,
        "original stream/limits restored, params verbatim"
    );
    // Same request id on both legs (a fresh one, since the client sent none).
    let rid = header(&d[0].headers, "x-request-id").unwrap();
    assert_eq!(
        header(&prefill.recorded()[0].headers, "x-request-id"),
        Some(rid)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_5xx_falls_back_to_local_prefill_or_passes_through() {
    let prefill = Recorder::start(|_| {
        Canned::json(
            500,
            json!({"error": {"message": "prefill exploded", "code": 500}}),
        )
    })
    .await;
    let decode = start_worker("decode-fallback", 200.0, &[]).await;
    let target = prefill.addr.to_string();
    let hints = [
        (hints::WORKER_INSTANCE_ID, "9"),
        (hints::PREFILLER_HOST_PORT, target.as_str()),
    ];

    let strict = start_sidecar(disagg_config(&decode.url, &prefill)).await;
    let (status, _, got) = post_json(
        &format!("{}/v1/chat/completions", strict.url),
        &hints,
        &chat(false),
    )
    .await;
    assert_eq!(status, 500);
    assert_eq!(
        serde_json::from_slice::<Value>(&got).unwrap()["error"]["message"],
        "prefill exploded"
    );

    let mut cfg = disagg_config(&decode.url, &prefill);
    cfg.fallback_local_prefill = true;
    let lenient = start_sidecar(cfg).await;
    for body in [chat(false), chat(true)] {
        let (status, _, got) = post_json(
            &format!("{}/v1/chat/completions", lenient.url),
            &hints,
            &body,
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&got));
    }
    assert!(metric(&lenient.url, "kvroute_sidecar_prefill_fallbacks_total").await >= 2.0);

    // An unreachable prefill worker falls back too.
    let gone = format!("127.0.0.1:{}", free_port());
    let mut cfg = config(&[format!("name=9,url={}", decode.url)]);
    cfg.pool_endpoints = vec![gone.clone()];
    cfg.fallback_local_prefill = true;
    let sc = start_sidecar(cfg).await;
    let (status, _, _) = post_json(
        &format!("{}/v1/chat/completions", sc.url),
        &[
            (hints::WORKER_INSTANCE_ID, "9"),
            (hints::PREFILLER_HOST_PORT, gone.as_str()),
        ],
        &chat(false),
    )
    .await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_4xx_is_returned_as_is_even_with_fallback() {
    let prefill = Recorder::start(|_| {
        Canned::json(
            400,
            json!({"error": {"message": "prompt too long", "code": 400}}),
        )
    })
    .await;
    let decode = Recorder::start(|_| Canned::json(200, json!({}))).await;
    let mut cfg = disagg_config(&decode.url, &prefill);
    cfg.fallback_local_prefill = true;
    let sc = start_sidecar(cfg).await;
    let target = prefill.addr.to_string();
    let (status, _, got) = post_json(
        &format!("{}/v1/completions", sc.url),
        &[
            (hints::WORKER_INSTANCE_ID, "9"),
            (hints::PREFILLER_HOST_PORT, target.as_str()),
        ],
        &completion(false),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(
        serde_json::from_slice::<Value>(&got).unwrap()["error"]["message"],
        "prompt too long"
    );
    assert!(
        decode.recorded().is_empty(),
        "no decode leg after a client error"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_by_instance_id_resolves_through_prefill_flag() {
    let prefill = Recorder::start(prefill_ok).await;
    let decode = Recorder::start(|_| {
        Canned::json(
            200,
            json!({"usage": {"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 19}}}),
        )
    })
    .await;
    let mut cfg = disagg_config(&decode.url, &prefill);
    cfg.prefills = vec![kvroute_sidecar::config::EngineSpec::parse(
        "--prefill",
        &format!("name=prefill-pod-0,url={}", prefill.url),
    )
    .unwrap()];
    let sc = start_sidecar(cfg).await;
    let pid = kvroute_proto::worker_id::instance_id_for_pod("prefill-pod-0").to_string();
    let (status, _, got) = post_json(
        &format!("{}/v1/chat/completions", sc.url),
        &[
            (hints::WORKER_INSTANCE_ID, "9"),
            (hints::PREFILL_INSTANCE_ID, pid.as_str()),
            (hints::PREFILL_DP_RANK, "2"),
        ],
        &chat(false),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&got));
    assert_eq!(
        usage_cached(&serde_json::from_slice(&got).unwrap()),
        Some(7)
    );
    assert_eq!(
        header(&prefill.recorded()[0].headers, hints::DP_RANK),
        Some("2"),
        "prefill rank forwarded"
    );
    // An id that is not configured names itself.
    let (status, _, got) = post_json(
        &format!("{}/v1/chat/completions", sc.url),
        &[
            (hints::WORKER_INSTANCE_ID, "9"),
            (hints::PREFILL_INSTANCE_ID, "77"),
        ],
        &chat(false),
    )
    .await;
    assert_eq!(status, 503);
    assert!(String::from_utf8_lossy(&got).contains("prefill instance_id=77 not found"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_bootstrap_sends_the_same_body_to_both_legs_concurrently() {
    // The prefill leg answers only after 300 ms; the decode leg must not wait for it.
    let prefill = Recorder::start(|_| Canned {
        delay: Duration::from_millis(300),
        ..Canned::json(
            200,
            json!({"usage": {"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 3}}}),
        )
    })
    .await;
    let decode = start_worker("decode-sglang", 200.0, &[]).await;
    let mut cfg = disagg_config(&decode.url, &prefill);
    cfg.kv_connector = KvConnector::Sglang;
    cfg.prefills = vec![kvroute_sidecar::config::EngineSpec::parse(
        "--prefill",
        &format!("name=sg-prefill,url={},bootstrap_port=8998", prefill.url),
    )
    .unwrap()];
    let sc = start_sidecar(cfg).await;
    let pid = kvroute_proto::worker_id::instance_id_for_pod("sg-prefill").to_string();
    let started = Instant::now();
    let c = client();
    let resp = send(
        &c,
        "POST",
        &format!("{}/v1/chat/completions", sc.url),
        &[
            (hints::WORKER_INSTANCE_ID, "9"),
            (hints::PREFILL_INSTANCE_ID, pid.as_str()),
            ("content-type", "application/json"),
        ],
        chat(true).to_string(),
    )
    .await
    .unwrap();
    let headers_after = started.elapsed();
    let status = resp.status().as_u16();
    let got = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&got));
    // Concurrency: the decode stream started before the (300 ms) prefill leg answered.
    assert!(
        headers_after < Duration::from_millis(300),
        "decode waited for prefill: {headers_after:?}"
    );
    let events = sse_data(&got);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    let legs = prefill.recorded();
    assert_eq!(legs.len(), 1);
    let b = &legs[0].body;
    assert_eq!(b["bootstrap_host"], "127.0.0.1");
    assert_eq!(b["bootstrap_port"], 8998);
    let room = b["bootstrap_room"].as_u64().unwrap();
    assert!(room <= i64::MAX as u64);
    let mut expected = chat(true);
    expected["bootstrap_host"] = json!("127.0.0.1");
    expected["bootstrap_port"] = json!(8998);
    expected["bootstrap_room"] = json!(room);
    assert_eq!(
        b, &expected,
        "the prefill leg gets the original body plus the bootstrap fields"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_failing_prefill_aborts_the_decode_leg() {
    let prefill = Recorder::start(|_| Canned {
        delay: Duration::from_millis(200),
        ..Canned::json(
            500,
            json!({"error": {"message": "bootstrap failed", "code": 500}}),
        )
    })
    .await;
    // Real-time decode: 4000 tokens would take far longer than the prefill failure.
    let decode = start_worker("decode-abort", 1.0, &[]).await;
    let mut cfg = disagg_config(&decode.url, &prefill);
    cfg.kv_connector = KvConnector::Sglang;
    let sc = start_sidecar(cfg).await;
    let target = prefill.addr.to_string();
    let mut body = chat(true);
    body["max_tokens"] = json!(4000);
    let before = metric(&decode.url, "kvroute_worker_requests_cancelled_total").await;
    let (status, _, got) = post_json(
        &format!("{}/v1/chat/completions", sc.url),
        &[
            (hints::WORKER_INSTANCE_ID, "9"),
            (hints::PREFILLER_HOST_PORT, target.as_str()),
        ],
        &body,
    )
    .await;
    let text = String::from_utf8_lossy(&got);
    if status == 200 {
        // Failed mid-stream: an error event ends the stream.
        assert!(
            text.contains("bootstrap failed") && text.ends_with("data: [DONE]\n\n"),
            "{text}"
        );
    } else {
        assert_eq!(status, 500, "{text}");
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while metric(&decode.url, "kvroute_worker_requests_cancelled_total").await <= before {
        assert!(
            Instant::now() < deadline,
            "decode leg still running after the prefill failed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        prefill.recorded()[0].body["bootstrap_port"],
        8998,
        "llm-d's default bootstrap port"
    );
}

/// The real thing: a `--role prefill` sim worker computes the prompt and pins its KV blocks,
/// the `--role decode` sim worker behind the sidecar pulls them (the workers' KV transfer
/// agent) and decodes. `cached_tokens` must be the prefill worker's: 0 for a new prompt, then
/// its prefix-cache hits when the same prompt comes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_prefill_and_decode_workers_through_the_sidecar() {
    let prefill = start_worker("real-prefill", 200.0, &["--role", "prefill"]).await;
    let decode = start_worker("real-decode", 200.0, &["--role", "decode"]).await;
    let mut cfg = config(&[format!("name=real-decode,url={}", decode.url)]);
    cfg.pool_endpoints = vec![prefill.addr.clone()];
    let sc = start_sidecar(cfg).await;
    let id = kvroute_proto::worker_id::instance_id_for_pod("real-decode").to_string();
    let hints = [
        (hints::WORKER_INSTANCE_ID, id.as_str()),
        (hints::PREFILLER_HOST_PORT, prefill.addr.as_str()),
    ];
    let long_prompt = "Disaggregated serving splits prefill from decode. ".repeat(8);
    let mut body = chat(false);
    body["messages"] = json!([{"role": "user", "content": long_prompt}]);

    let (status, headers, got) =
        post_json(&format!("{}/v1/chat/completions", sc.url), &hints, &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&got));
    assert_eq!(
        header(&headers, "x-kvroute-worker-id"),
        Some(id.as_str()),
        "decoded locally"
    );
    let v: Value = serde_json::from_slice(&got).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 64);
    assert_eq!(
        usage_cached(&v),
        Some(0),
        "a new prompt was computed on the prefill worker: {v}"
    );

    // The same prompt again, streamed: the prefill worker now has its blocks cached.
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, _, got) =
        post_json(&format!("{}/v1/chat/completions", sc.url), &hints, &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&got));
    let events = sse_data(&got);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    let cached = usage_cached(&usage).unwrap();
    assert!(
        cached > 0 && cached < prompt_tokens,
        "prefix hits on the prefill worker: {usage}"
    );

    // Completions too.
    let (status, _, got) = post_json(
        &format!("{}/v1/completions", sc.url),
        &hints,
        &completion(true),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&got));
    assert_eq!(sse_data(&got).last().map(String::as_str), Some("[DONE]"));
    assert_eq!(metric(&prefill.url, "vllm:num_requests_running").await, 0.0);
}
