//! Aggregated direct mode through the sidecar over real sockets, against real simulated
//! workers (`kvroute-worker --engine sim`) and, where the test must see exactly what reached
//! the engine, a recording upstream.

mod common;

use std::time::{Duration, Instant};

use common::*;
use http_body_util::BodyExt;
use kvroute_proto::hints;
use serde_json::{json, Value};

fn chat(stream: bool, max_tokens: u32) -> Value {
    let mut b = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the quick brown fox."}],
        "max_tokens": max_tokens,
        "stream": stream,
    });
    if stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_json_and_sse_pass_through_unchanged_and_route_by_instance_id() {
    let a = start_worker("agg-a", 200.0, &[]).await;
    let b = start_worker("agg-b", 200.0, &[]).await;
    let sc = start_sidecar(config(&[
        format!("name=agg-a,url={}", a.url),
        format!("name=agg-b,url={}", b.url),
    ]))
    .await;
    let id_a = kvroute_proto::worker_id::instance_id_for_pod("agg-a").to_string();
    let id_b = kvroute_proto::worker_id::instance_id_for_pod("agg-b").to_string();

    // JSON, routed to b by its pod-name instance id.
    let url = format!("{}/v1/chat/completions", sc.url);
    let (status, headers, body) = post_json(
        &url,
        &[
            (hints::WORKER_INSTANCE_ID, &id_b),
            ("x-request-id", "rid-1"),
        ],
        &chat(false, 8),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(header(&headers, "x-kvroute-worker-id"), Some(id_b.as_str()));
    assert_eq!(header(&headers, "x-request-id"), Some("rid-1"));
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 8);
    // The same request straight to the engine gives the same body (ids aside).
    let (_, _, direct) = post_json(
        &format!("{}/v1/chat/completions", b.url),
        &[("x-request-id", "rid-1")],
        &chat(false, 8),
    )
    .await;
    let mut d: Value = serde_json::from_slice(&direct).unwrap();
    let mut v2 = v.clone();
    for x in [&mut d, &mut v2] {
        x["created"] = json!(0);
        x["usage"]["prompt_tokens_details"] = json!(null);
    }
    assert_eq!(v2, d);

    // SSE routed to a, every event through, usage chunk and [DONE] last.
    let (status, headers, body) =
        post_json(&url, &[(hints::WORKER_INSTANCE_ID, &id_a)], &chat(true, 6)).await;
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "x-kvroute-worker-id"), Some(id_a.as_str()));
    assert!(header(&headers, "content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    assert!(
        header(&headers, "x-request-id").is_some(),
        "a request id is added when absent"
    );
    let events = sse_data(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    // role chunk + 6 content chunks + finish chunk + usage + [DONE]
    assert_eq!(events.len(), 10, "{events:?}");

    // Completions go through too.
    let (status, _, body) = post_json(
        &format!("{}/v1/completions", sc.url),
        &[(hints::WORKER_INSTANCE_ID, &id_a)],
        &json!({"model": MODEL, "prompt": "hello", "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));

    // /v1/models is proxied, /health checks the local engines, /metrics counts by mode.
    let (status, _, body) = get(&format!("{}/v1/models", sc.url)).await.unwrap();
    assert_eq!(status, 200);
    assert!(String::from_utf8_lossy(&body).contains(MODEL));
    let (status, _, _) = get(&format!("{}/health", sc.url)).await.unwrap();
    assert_eq!(status, 200);
    let (_, _, m) = get(&format!("{}/metrics", sc.url)).await.unwrap();
    let m = String::from_utf8_lossy(&m);
    assert!(
        m.contains(r#"kvroute_sidecar_requests_total{mode="aggregated",status="200"} 3"#),
        "{m}"
    );
    assert!(
        m.contains("kvroute_sidecar_overhead_seconds_count 3"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hint_headers_are_stripped_before_the_engine() {
    let rec = Recorder::start(|_| Canned::json(200, json!({"ok": true}))).await;
    // A per-rank engine entry: the rank hint is consumed by routing, nothing is forwarded.
    let sc = start_sidecar(config(&[format!("name=5,url={},dp_rank=5", rec.url)])).await;
    let mut headers: Vec<(&str, &str)> = hints::ALL.iter().map(|h| (*h, "5")).collect();
    headers.retain(|(h, _)| {
        *h != hints::PREFILLER_HOST_PORT
            && *h != hints::PREFILL_INSTANCE_ID
            && *h != "x-prefill-instance-id"
            && *h != "x-dynamo-prefill-worker-id"
            && *h != hints::ROUTING_MODE
    });
    headers.push(("authorization", "Bearer secret"));
    headers.push(("x-request-id", "keep-me"));
    let (status, _, _) = post_json(
        &format!("{}/v1/chat/completions", sc.url),
        &headers,
        &chat(false, 1),
    )
    .await;
    assert_eq!(status, 200);
    let got = rec.recorded();
    assert_eq!(got.len(), 1);
    for (name, _) in &got[0].headers {
        assert!(
            !hints::is_hint_header(name),
            "hint header {name} reached the engine: {:?}",
            got[0].headers
        );
    }
    assert_eq!(
        header(&got[0].headers, "authorization"),
        Some("Bearer secret")
    );
    assert_eq!(header(&got[0].headers, "x-request-id"), Some("keep-me"));
    assert_eq!(got[0].body, chat(false, 1), "body forwarded as is");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_serving_several_ranks_gets_the_rank_from_the_sidecar() {
    let rec = Recorder::start(|_| Canned::json(200, json!({}))).await;
    let sc = start_sidecar(config(&[format!("name=5,url={}", rec.url)])).await;
    let (status, _, _) = post_json(
        &format!("{}/v1/chat/completions", sc.url),
        &[
            (hints::WORKER_INSTANCE_ID, "5"),
            ("x-data-parallel-rank", "3"),
        ],
        &chat(false, 1),
    )
    .await;
    assert_eq!(status, 200);
    let got = rec.recorded();
    assert_eq!(header(&got[0].headers, hints::DP_RANK), Some("3"));
    assert_eq!(header(&got[0].headers, "x-data-parallel-rank"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_hint_is_400_unless_serving_locally() {
    let w = start_worker("nohint", 200.0, &[]).await;
    let engines = [format!("name=nohint,url={}", w.url)];
    let sc = start_sidecar(config(&engines)).await;
    let url = format!("{}/v1/chat/completions", sc.url);
    let (status, _, body) = post_json(&url, &[], &chat(false, 2)).await;
    assert_eq!(status, 400);
    let v: Value = serde_json::from_slice(&body).unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("requires x-dynamo-worker-instance-id (set by the EPP)"),
        "{msg}"
    );
    assert_eq!(v["error"]["code"], 400);

    let mut cfg = config(&engines);
    cfg.serve_without_hint = true;
    let local = start_sidecar(cfg).await;
    let (status, _, body) = post_json(
        &format!("{}/v1/chat/completions", local.url),
        &[],
        &chat(false, 2),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_instance_id_is_503_naming_the_id() {
    let rec = Recorder::start(|_| Canned::json(200, json!({}))).await;
    let sc = start_sidecar(config(&[format!("name=5,url={}", rec.url)])).await;
    let (status, _, body) = post_json(
        &format!("{}/v1/chat/completions", sc.url),
        &[(hints::WORKER_INSTANCE_ID, "12345")],
        &chat(false, 1),
    )
    .await;
    assert_eq!(status, 503);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("instance_id=12345 not found"),
        "{v}"
    );
    assert!(rec.recorded().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_target_outside_the_pool_is_403() {
    let rec = Recorder::start(|_| Canned::json(200, json!({}))).await;
    let mut cfg = config(&[format!("name=5,url={}", rec.url)]);
    cfg.pool_endpoints = vec!["10.1.2.3:8000".into()];
    let sc = start_sidecar(cfg).await;
    for (h, v) in [
        (hints::PREFILLER_HOST_PORT, "169.254.169.254:80"),
        (
            hints::PREFILLER_HOST_PORT,
            format!("{}", rec.addr).leak() as &str,
        ),
    ] {
        let (status, _, body) = post_json(
            &format!("{}/v1/chat/completions", sc.url),
            &[(hints::WORKER_INSTANCE_ID, "5"), (h, v)],
            &chat(false, 1),
        )
        .await;
        assert_eq!(status, 403, "{}", String::from_utf8_lossy(&body));
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("not a worker of this pool"),
            "{v}"
        );
    }
    assert!(
        rec.recorded().is_empty(),
        "nothing may be sent for a refused target"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_down_is_503() {
    let port = free_port();
    let sc = start_sidecar(config(&[format!("name=5,url=http://127.0.0.1:{port}")])).await;
    let (status, _, body) = post_json(
        &format!("{}/v1/chat/completions", sc.url),
        &[(hints::WORKER_INSTANCE_ID, "5")],
        &chat(true, 1),
    )
    .await;
    assert_eq!(status, 503);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["type"], "service_unavailable", "{v}");
    let (status, _, _) = get(&format!("{}/health", sc.url)).await.unwrap();
    assert_eq!(status, 503, "no healthy local engine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_errors_pass_through_with_their_status() {
    let w = start_worker("errs", 200.0, &[]).await;
    let sc = start_sidecar(config(&[format!("name=errs,url={}", w.url)])).await;
    let url = format!("{}/v1/chat/completions", sc.url);
    let hint = [(hints::WORKER_INSTANCE_ID, "errs")];
    let id = kvroute_proto::worker_id::instance_id_for_pod("errs").to_string();
    let hint = [(hint[0].0, id.as_str())];
    // Unknown model: the engine's 404 and body.
    let mut body = chat(false, 1);
    body["model"] = json!("nope");
    let (status, _, got) = post_json(&url, &hint, &body).await;
    let (dstatus, _, direct) =
        post_json(&format!("{}/v1/chat/completions", w.url), &[], &body).await;
    assert_eq!((status, dstatus), (404, 404));
    assert_eq!(got, direct);
    // Invalid body: the engine's 400.
    let (status, _, got) = post_json(&url, &hint, &json!({"model": MODEL})).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&got));
    // A 5xx from an engine is passed through too.
    let rec =
        Recorder::start(|_| Canned::json(500, json!({"error": {"message": "boom", "code": 500}})))
            .await;
    let sc = start_sidecar(config(&[format!("name=5,url={}", rec.url)])).await;
    let (status, _, got) = post_json(
        &format!("{}/v1/chat/completions", sc.url),
        &[(hints::WORKER_INSTANCE_ID, "5")],
        &chat(false, 1),
    )
    .await;
    assert_eq!(status, 500);
    assert_eq!(
        serde_json::from_slice::<Value>(&got).unwrap()["error"]["message"],
        "boom"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_cancels_the_engine_within_100ms() {
    // speedup 1: real-time simulated decode, so 4000 tokens would run for many seconds.
    let w = start_worker("cancel", 1.0, &[]).await;
    let sc = start_sidecar(config(&[format!("name=cancel,url={}", w.url)])).await;
    let id = kvroute_proto::worker_id::instance_id_for_pod("cancel").to_string();
    let c = client();
    let resp = send(
        &c,
        "POST",
        &format!("{}/v1/chat/completions", sc.url),
        &[
            (hints::WORKER_INSTANCE_ID, id.as_str()),
            ("content-type", "application/json"),
        ],
        chat(true, 4000).to_string(),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(!first.data_ref().unwrap().is_empty());
    assert_eq!(metric(&w.url, "vllm:num_requests_running").await, 1.0);
    let before = metric(&w.url, "kvroute_worker_requests_cancelled_total").await;
    let dropped = Instant::now();
    drop(body);
    drop(c);
    loop {
        let cancelled = metric(&w.url, "kvroute_worker_requests_cancelled_total").await;
        let running = metric(&w.url, "vllm:num_requests_running").await;
        if cancelled > before && running == 0.0 {
            break;
        }
        assert!(
            dropped.elapsed() < Duration::from_millis(100),
            "engine still generating {:?} after the client left",
            dropped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let took = dropped.elapsed();
    eprintln!("engine cancelled {took:?} after the client disconnected");
    assert!(took < Duration::from_millis(100));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(metric(&sc.url, "kvroute_sidecar_client_cancellations_total").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_before_headers_cancels_a_json_request() {
    let w = start_worker("cancel-json", 1.0, &[]).await;
    let sc = start_sidecar(config(&[format!("name=cancel-json,url={}", w.url)])).await;
    let id = kvroute_proto::worker_id::instance_id_for_pod("cancel-json").to_string();
    let url = format!("{}/v1/chat/completions", sc.url);
    let before = metric(&w.url, "kvroute_worker_requests_cancelled_total").await;
    let task = tokio::spawn(async move {
        let _ = post_json(
            &url,
            &[(hints::WORKER_INSTANCE_ID, id.as_str())],
            &chat(false, 4000),
        )
        .await;
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric(&w.url, "vllm:num_requests_running").await < 1.0 {
        assert!(Instant::now() < deadline, "request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let aborted = Instant::now();
    task.abort();
    loop {
        if metric(&w.url, "kvroute_worker_requests_cancelled_total").await > before {
            break;
        }
        assert!(
            aborted.elapsed() < Duration::from_millis(100),
            "engine still generating after the client left"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The binary itself: flags from the environment, serves, and exits cleanly on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_and_stops_on_sigterm() {
    let rec = Recorder::start(|_| Canned::json(200, json!({"ok": true}))).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-sidecar"))
        .env("KVROUTE_SIDECAR_LISTEN", &addr)
        .env("KVROUTE_SIDECAR_ENGINES", format!("name=5,url={}", rec.url))
        .env("KVROUTE_SIDECAR_SERVE_WITHOUT_HINT", "true")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://{addr}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !matches!(get(&format!("{url}/health")).await, Ok((200, _, _))) {
        assert!(Instant::now() < deadline, "sidecar binary not healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _, _) =
        post_json(&format!("{url}/v1/chat/completions"), &[], &chat(false, 1)).await;
    assert_eq!(status, 200);
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            assert!(st.success(), "exit status {st}");
            break;
        }
        assert!(Instant::now() < deadline, "sidecar did not stop on SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
