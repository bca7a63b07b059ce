//! The worker's OpenAI HTTP API over real sockets: the server runs in-process on 127.0.0.1:0
//! with the real Qwen3 tokenizer and the simulated engine; the client is raw HTTP/1.1 over TCP
//! so every byte (status, headers, chunked bodies, SSE framing) is checked as sent.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvroute_proto::openai::{parse_request, ApiKind};
use kvroute_proto::prompt::PromptRenderer;
use kvroute_worker::http::{self, AppState, HttpConfig, FILLER_TEXT};
use kvroute_worker::metrics::Metrics;
use kvroute_worker::sim::{SimConfig, SimEngine};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const MODEL: &str = "Qwen/Qwen3-0.6B";
const INSTANCE_ID: u64 = 4242;
const MAX_BODY: usize = 16384;
const BLOCK_SIZE: u32 = 16;
const KV_BLOCKS: u64 = 128;

fn model_dir() -> PathBuf {
    let dir = std::env::var_os("KVROUTE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/models/qwen3")
        });
    assert!(
        dir.join("tokenizer.json").exists(),
        "Qwen3 tokenizer files not found in {}: run `./dev setup` (or set KVROUTE_MODEL_DIR)",
        dir.display()
    );
    dir
}

fn renderer() -> Arc<PromptRenderer> {
    static R: OnceLock<Arc<PromptRenderer>> = OnceLock::new();
    R.get_or_init(|| Arc::new(PromptRenderer::from_dir(&model_dir()).expect("load renderer")))
        .clone()
}

struct Server {
    addr: SocketAddr,
    state: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

async fn start() -> Server {
    let renderer = renderer();
    let engine = SimEngine::start(SimConfig {
        block_size: BLOCK_SIZE,
        kv_capacity_blocks: KV_BLOCKS,
        max_num_seqs: 16,
        max_num_batched_tokens: 2048,
        speedup: 10.0,
        dp_size: 2,
        worker_id: INSTANCE_ID,
        filler_tokens: http::filler_tokens(&renderer).unwrap(),
    });
    let metrics = Arc::new(Metrics::new(MODEL, BLOCK_SIZE, KV_BLOCKS).unwrap());
    let state = Arc::new(AppState::new(
        HttpConfig {
            served_model: MODEL.into(),
            instance_id: INSTANCE_ID,
            max_body_bytes: MAX_BODY,
            default_max_tokens: 8,
            shutdown_grace: Duration::from_secs(2),
        },
        engine,
        renderer,
        metrics,
    ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(http::serve(listener, state.clone(), async {
        let _ = stopped.await;
    }));
    Server {
        addr,
        state,
        stop: Some(stop),
        task,
    }
}

#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    /// Every response must name the worker.
    fn assert_worker_id(&self) -> &Self {
        assert_eq!(
            self.header("x-kvroute-worker-id"),
            Some(INSTANCE_ID.to_string().as_str()),
            "worker id header on {} {:?}",
            self.status,
            self.headers
        );
        self
    }
    /// OpenAI error shape with this status.
    fn assert_error(&self, status: u16, message_part: &str) {
        assert_eq!(self.status, status, "{}", self.text());
        self.assert_worker_id();
        let j = self.json();
        let err = &j["error"];
        assert!(
            err["message"].as_str().unwrap_or("").contains(message_part),
            "{status}: {} should contain {message_part:?}",
            err["message"]
        );
        assert!(err["type"].is_string(), "{j}");
        assert_eq!(err["code"], status, "{j}");
        assert!(err.get("param").is_some(), "{j}");
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line_end = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size line");
        let size_str = std::str::from_utf8(&data[..line_end]).unwrap();
        let size = usize::from_str_radix(size_str.split(';').next().unwrap().trim(), 16).unwrap();
        data = &data[line_end + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

fn parse_response(raw: &[u8]) -> Resp {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(raw)));
    let head = std::str::from_utf8(&raw[..split]).unwrap();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let status = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_string(), v.trim().to_string())
        })
        .collect();
    let body = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_vec()
    };
    Resp {
        status,
        headers,
        body,
    }
}

/// Sends raw request bytes (which must ask for `Connection: close`) and reads to EOF.
async fn roundtrip(addr: SocketAddr, raw: &[u8]) -> Resp {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(raw).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut buf))
        .await
        .expect("response within 30 s")
        .unwrap();
    parse_response(&buf)
}

fn request(method: &str, path: &str, extra_headers: &str, body: &[u8]) -> Vec<u8> {
    let mut raw = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n{extra_headers}\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(body);
    raw
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    roundtrip(
        addr,
        &request("POST", path, "", body.to_string().as_bytes()),
    )
    .await
}

async fn get(addr: SocketAddr, path: &str) -> Resp {
    roundtrip(addr, &request("GET", path, "", b"")).await
}

/// A prompt several blocks long, so a repeat hits the prefix cache.
fn long_user_text() -> String {
    "Routing requests to the worker that already holds their KV blocks saves prefill. ".repeat(8)
}

fn expected_filler(n: usize) -> String {
    let r = renderer();
    let filler = r.encode(FILLER_TEXT, false).unwrap();
    let ids: Vec<u32> = filler.iter().cycle().take(n).copied().collect();
    r.decode_with(&ids, true).unwrap()
}

fn expected_prompt_tokens(kind: ApiKind, body: &Value) -> usize {
    let parsed = parse_request(kind, body.to_string().as_bytes()).unwrap();
    renderer().token_ids(&parsed).unwrap().len()
}

// ---------------------------------------------------------------- generation

#[tokio::test]
async fn chat_non_streaming_usage_and_cache_hits() {
    let srv = start().await;
    let body = json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": long_user_text()}
        ],
        "max_tokens": 5
    });
    let prompt_tokens = expected_prompt_tokens(ApiKind::ChatCompletions, &body);
    assert!(prompt_tokens > 4 * BLOCK_SIZE as usize);

    let raw = request(
        "POST",
        "/v1/chat/completions",
        "x-request-id: req-abc\r\n",
        body.to_string().as_bytes(),
    );
    let r = roundtrip(srv.addr, &raw).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.assert_worker_id();
    assert_eq!(r.header("x-request-id"), Some("req-abc"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    let j = r.json();
    assert_eq!(j["object"], "chat.completion");
    assert_eq!(j["id"], "chatcmpl-req-abc");
    assert_eq!(j["model"], MODEL);
    assert!(j["created"].as_u64().unwrap() > 1_600_000_000);
    let choice = &j["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], expected_filler(5));
    assert_eq!(choice["finish_reason"], "length");
    let usage = &j["usage"];
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    assert_eq!(usage["completion_tokens"], 5);
    assert_eq!(usage["total_tokens"], prompt_tokens + 5);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    // The same prompt again, pinned to the same dp rank: its full blocks are cached now.
    let mut cached = 0;
    for _ in 0..2 {
        let raw = request(
            "POST",
            "/v1/chat/completions",
            "x-dynamo-dp-rank: 0\r\n",
            body.to_string().as_bytes(),
        );
        let r = roundtrip(srv.addr, &raw).await;
        assert_eq!(r.status, 200, "{}", r.text());
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
    }
    assert!(cached > 0, "repeated prompt should hit the prefix cache");
    assert!(cached <= prompt_tokens as u64);
    // A generated request id is a uuid.
    let r = post(srv.addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.header("x-request-id").map(str::len), Some(36));
}

#[tokio::test]
async fn completion_non_streaming() {
    let srv = start().await;
    let body = json!({"model": MODEL, "prompt": long_user_text(), "max_tokens": 3});
    let r = post(srv.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.assert_worker_id();
    let j = r.json();
    assert_eq!(j["object"], "text_completion");
    assert!(j["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(j["choices"][0]["text"], expected_filler(3));
    assert_eq!(j["choices"][0]["finish_reason"], "length");
    assert_eq!(
        j["usage"]["prompt_tokens"],
        expected_prompt_tokens(ApiKind::Completions, &body)
    );
    assert_eq!(j["usage"]["completion_tokens"], 3);

    // Token-id prompts and the default max_tokens (8 in this server).
    let r = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [9707, 1879]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["prompt_tokens"], 2);
    assert_eq!(r.json()["usage"]["completion_tokens"], 8);
}

/// Splits an SSE body into its `data:` payloads, checking the framing.
fn sse_events(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "{body:?}");
    body.split_terminator("\n\n")
        .map(|ev| {
            ev.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad SSE event {ev:?}"))
                .to_string()
        })
        .collect()
}

#[tokio::test]
async fn chat_streaming_with_usage() {
    let srv = start().await;
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_completion_tokens": 6,
        "stream": true,
        "stream_options": {"include_usage": true}
    });
    let r = post(srv.addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.assert_worker_id();
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    let events = sse_events(&r.text());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let id = chunks[0]["id"].clone();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], MODEL);
        assert_eq!(c["id"], id);
        assert!(c["created"].is_u64());
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, expected_filler(6));
    // 1 role chunk + 6 token chunks + finish chunk + usage chunk.
    assert_eq!(chunks.len(), 9, "{chunks:#?}");
    let finish = &chunks[7];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert_eq!(finish["choices"][0]["delta"], json!({}));
    assert!(chunks[..7]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null() && c["usage"].is_null()));
    let usage_chunk = &chunks[8];
    assert_eq!(usage_chunk["choices"], json!([]));
    let usage = &usage_chunk["usage"];
    let prompt_tokens = expected_prompt_tokens(ApiKind::ChatCompletions, &body);
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    assert_eq!(usage["completion_tokens"], 6);
    assert_eq!(usage["total_tokens"], prompt_tokens + 6);
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());
}

#[tokio::test]
async fn completion_streaming_without_usage() {
    let srv = start().await;
    let body =
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "stream": true});
    let r = post(srv.addr, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let events = sse_events(&r.text());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks.len(), 5, "4 tokens + finish: {chunks:#?}");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "text_completion" && c.get("usage").is_none()));
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, expected_filler(4));
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn client_disconnect_cancels_the_request() {
    let srv = start().await;
    let body =
        json!({"model": MODEL, "prompt": "Go on forever", "max_tokens": 1_000_000, "stream": true});
    let mut s = TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(&request(
        "POST",
        "/v1/completions",
        "",
        body.to_string().as_bytes(),
    ))
    .await
    .unwrap();
    // Wait for the first streamed token, then hang up.
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "server closed early");
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(
        srv.state
            .engine
            .stats()
            .iter()
            .map(|s| s.running)
            .sum::<u32>(),
        1
    );
    drop(s);
    let mut text = String::new();
    for _ in 0..200 {
        text = get(srv.addr, "/metrics").await.text();
        if text
            .contains("kvroute_worker_requests_cancelled_total{model_name=\"Qwen/Qwen3-0.6B\"} 1")
            && text.contains("vllm:num_requests_running{model_name=\"Qwen/Qwen3-0.6B\"} 0")
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("request not cancelled after the client left:\n{text}");
}

// ---------------------------------------------------------------- other endpoints

#[tokio::test]
async fn models_health_and_metrics() {
    let srv = start().await;
    let r = get(srv.addr, "/v1/models").await;
    assert_eq!(r.status, 200);
    r.assert_worker_id();
    let j = r.json();
    assert_eq!(j["object"], "list");
    assert_eq!(j["data"][0]["id"], MODEL);
    assert_eq!(j["data"][0]["object"], "model");

    let r = get(srv.addr, "/health").await;
    assert_eq!(r.status, 200);
    r.assert_worker_id();

    // One request so the per-request metrics have samples.
    let ok = post(
        srv.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": long_user_text(), "max_tokens": 2}),
    )
    .await;
    assert_eq!(ok.status, 200);
    let r = get(srv.addr, "/metrics").await;
    assert_eq!(r.status, 200);
    r.assert_worker_id();
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    let text = r.text();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "vllm:request_success_total",
        "kvroute_worker_requests_cancelled_total",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(name)),
            "{name} missing from:\n{text}"
        );
    }
    assert!(text.contains(&format!(
        "vllm:cache_config_info{{block_size=\"{BLOCK_SIZE}\",num_gpu_blocks=\"{KV_BLOCKS}\"}} 1"
    )));
    assert!(text.contains(
        "vllm:request_success_total{finished_reason=\"length\",model_name=\"Qwen/Qwen3-0.6B\"} 1"
    ));
    assert!(
        text.contains("vllm:time_to_first_token_seconds_count{model_name=\"Qwen/Qwen3-0.6B\"} 1")
    );
    let queries: u64 = text
        .lines()
        .find(|l| l.starts_with("vllm:prefix_cache_queries_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(queries > 0, "prefix cache queries counted in tokens");
}

// ---------------------------------------------------------------- errors

#[tokio::test]
async fn error_statuses_use_openai_shape() {
    let srv = start().await;
    let a = srv.addr;
    let chat = "/v1/chat/completions";

    let r = roundtrip(a, &request("POST", chat, "", b"{\"model\": ")).await;
    r.assert_error(400, "not valid JSON");
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");

    roundtrip(a, &request("POST", chat, "", b"{\"model\": \"\xff\"}"))
        .await
        .assert_error(400, "UTF-8");
    post(
        a,
        chat,
        &json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .await
    .assert_error(400, "'model'");
    post(a, chat, &json!({"model": 3, "messages": []}))
        .await
        .assert_error(400, "must be a string");
    post(
        a,
        chat,
        &json!({"model": MODEL, "messages": {"role": "user"}}),
    )
    .await
    .assert_error(400, "must be an array");
    post(a, chat, &json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}))
        .await
        .assert_error(400, "max_tokens");

    let r = post(
        a,
        chat,
        &json!({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    r.assert_error(404, "gpt-4");
    assert_eq!(r.json()["error"]["param"], "model");

    // Engine rejection: the prompt does not fit in the KV cache (128 blocks × 16 tokens).
    let r = roundtrip(
        a,
        &request(
            "POST",
            "/v1/completions",
            "",
            json!({"model": MODEL, "prompt": vec![1u32; 2100]})
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    r.assert_error(400, "KV cache holds at most 2048 tokens");
    // An out-of-range dp rank from the EPP is rejected too.
    let r = roundtrip(
        a,
        &request(
            "POST",
            "/v1/completions",
            "x-dynamo-dp-rank: 9\r\n",
            json!({"model": MODEL, "prompt": "hi"})
                .to_string()
                .as_bytes(),
        ),
    )
    .await;
    r.assert_error(400, "dp rank 9");

    // 413: declared Content-Length over the limit, rejected before the body is sent.
    let r = roundtrip(
        a,
        format!(
            "POST {chat} HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            MAX_BODY + 1
        )
        .as_bytes(),
    )
    .await;
    r.assert_error(413, "limit of 16384 bytes");

    // 413: chunked body that grows past the limit.
    let mut raw = format!(
        "POST {chat} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    .into_bytes();
    for _ in 0..5 {
        raw.extend_from_slice(format!("{:x}\r\n", 4000).as_bytes());
        raw.extend_from_slice(&[b' '; 4000]);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    roundtrip(a, &raw).await.assert_error(413, "limit");

    // A chunked body under the limit is fine.
    let body = json!({"model": MODEL, "prompt": "hi", "max_tokens": 1}).to_string();
    let raw = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    );
    let r = roundtrip(a, raw.as_bytes()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.assert_worker_id();

    // 405 with Allow.
    let r = get(a, chat).await;
    r.assert_error(405, "GET");
    assert_eq!(r.header("allow"), Some("POST"));
    let r = roundtrip(a, &request("POST", "/v1/models", "", b"{}")).await;
    r.assert_error(405, "POST");
    assert_eq!(r.header("allow"), Some("GET"));
    let r = roundtrip(a, &request("DELETE", "/metrics", "", b"")).await;
    r.assert_error(405, "DELETE");

    // 404 for unknown paths.
    get(a, "/v2/nothing").await.assert_error(404, "/v2/nothing");
}

#[tokio::test]
async fn shutdown_drains_and_stops() {
    let mut srv = start().await;
    let r = get(srv.addr, "/health").await;
    assert_eq!(r.status, 200);
    // Once shutdown begins, health fails and new work is refused with 503.
    srv.state.begin_shutdown();
    get(srv.addr, "/health")
        .await
        .assert_error(503, "shutting down");
    post(
        srv.addr,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hi"}),
    )
    .await
    .assert_error(503, "shutting down");
    srv.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), &mut srv.task)
        .await
        .expect("serve returns after shutdown")
        .unwrap()
        .unwrap();
    assert!(srv.state.is_shutting_down());
    assert!(
        TcpStream::connect(srv.addr).await.is_err(),
        "listener closed"
    );
}

#[tokio::test]
async fn stopped_engine_gives_503() {
    let srv = start().await;
    srv.state.engine.shutdown();
    post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await
    .assert_error(503, "engine is shutting down");
}
