//! Disaggregated prefill/decode at the worker level: a prefill worker and a decode worker run
//! in-process on 127.0.0.1:0 (HTTP API + KV transfer agent over real sockets). The test sends
//! the prefill leg, then the decode leg with the returned `kv_transfer_params`, and checks the
//! KV bytes moved (checksums), that decode did not recompute the prompt (engine metrics), the
//! output (JSON and SSE), and that the prefill side released its pins.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ::http::{HeaderMap, Request};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_proto::metadata::WorkerRole;
use kvroute_proto::prompt::PromptRenderer;
use kvroute_worker::disagg::kv::{prompt_block_hashes, prompt_checksum};
use kvroute_worker::disagg::{Disagg, DisaggConfig};
use kvroute_worker::http::{self, AppState, HttpConfig};
use kvroute_worker::metrics::Metrics;
use kvroute_worker::sim::{SimConfig, SimEngine};
use serde_json::{json, Value};
use tokio::net::TcpListener;

const MODEL: &str = "Qwen/Qwen3-0.6B";
const BS: u32 = 16;
const KV_BYTES_PER_TOKEN: u64 = 2048;

fn renderer() -> Arc<PromptRenderer> {
    static R: OnceLock<Arc<PromptRenderer>> = OnceLock::new();
    R.get_or_init(|| {
        let dir = std::env::var_os("KVROUTE_MODEL_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/models/qwen3")
            });
        Arc::new(PromptRenderer::from_dir(&dir).expect("Qwen3 tokenizer (run ./dev setup)"))
    })
    .clone()
}

struct Worker {
    addr: SocketAddr,
    state: Arc<AppState>,
    disagg: Arc<Disagg>,
}

async fn worker(role: WorkerRole, id: u64, pin_timeout: Duration) -> Worker {
    let renderer = renderer();
    let engine = SimEngine::start(SimConfig {
        block_size: BS,
        kv_capacity_blocks: 512,
        max_num_seqs: 16,
        max_num_batched_tokens: 2048,
        speedup: 50.0,
        dp_size: 2,
        worker_id: id,
        filler_tokens: http::filler_tokens(&renderer).unwrap(),
    });
    let metrics = Arc::new(Metrics::new(MODEL, BS, 512).unwrap());
    let disagg = Disagg::start(
        DisaggConfig {
            role,
            block_size: BS,
            kv_bytes_per_token: KV_BYTES_PER_TOKEN,
            pool_blocks: 256,
            pin_timeout,
            ..DisaggConfig::default()
        },
        engine.clone(),
        metrics.registry(),
    )
    .await
    .unwrap();
    let state = Arc::new(
        AppState::new(
            HttpConfig {
                served_model: MODEL.into(),
                instance_id: id,
                default_max_tokens: 8,
                ..HttpConfig::default()
            },
            engine,
            renderer,
            metrics,
        )
        .with_disagg(disagg.clone()),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(http::serve(listener, state.clone(), std::future::pending()));
    Worker {
        addr,
        state,
        disagg,
    }
}

struct Resp {
    status: u16,
    headers: HeaderMap,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
    fn header(&self, n: &str) -> Option<&str> {
        self.headers.get(n).and_then(|v| v.to_str().ok())
    }
}

async fn post(addr: SocketAddr, body: &Value) -> Resp {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::post(format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Resp {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

async fn metric(w: &Worker, name: &str) -> f64 {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let resp = client
        .get(format!("http://{}/metrics", w.addr).parse().unwrap())
        .await
        .unwrap();
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&text);
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn prompt(n: u32, salt: u32) -> Vec<u32> {
    (0..n).map(|i| 1000 + (i * 7 + salt) % 5000).collect()
}

fn prefill_leg(tokens: &[u32]) -> Value {
    json!({
        "model": MODEL, "prompt": tokens, "max_tokens": 1, "stream": false,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_then_decode_moves_kv_and_skips_recompute() {
    let p = worker(WorkerRole::Prefill, 11, Duration::from_secs(60)).await;
    let d = worker(WorkerRole::Decode, 22, Duration::from_secs(60)).await;

    for (stream, len) in [(true, 203u32), (false, 160u32)] {
        let tokens = prompt(len, len);
        let full_blocks = (len / BS) as usize;

        // Prefill leg.
        let r = post(p.addr, &prefill_leg(&tokens)).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let body = r.json();
        assert_eq!(body["usage"]["completion_tokens"], 1);
        let params = body["kv_transfer_params"].clone();
        assert_eq!(params["do_remote_prefill"], true);
        assert_eq!(params["do_remote_decode"], false);
        assert_eq!(params["tp_size"], 1);
        assert_eq!(params["remote_host"], "127.0.0.1");
        assert_eq!(
            params["remote_port"].as_u64(),
            p.disagg.advertised().map(|a| u64::from(a.1))
        );
        assert!(params["remote_engine_id"].is_string() && params["remote_request_id"].is_string());
        assert_eq!(
            params["remote_block_ids"].as_array().unwrap().len(),
            full_blocks
        );
        assert_eq!(
            params["kv_num_tokens"].as_u64(),
            Some(u64::from(BS) * full_blocks as u64)
        );
        let expected = prompt_checksum(
            &tokens,
            BS as usize,
            (u64::from(BS) * KV_BYTES_PER_TOKEN) as usize,
            None,
            None,
        );
        assert_eq!(params["kv_checksum"].as_str(), Some(expected.as_str()));
        assert_eq!(
            p.disagg.pinned_blocks(),
            full_blocks,
            "prefill pins its blocks"
        );

        // Decode leg: the original body plus the params, verbatim.
        let computed_before = metric(&d, "kvroute_worker_prompt_tokens_computed_total").await;
        let mut body = json!({"model": MODEL, "prompt": tokens, "max_tokens": 6, "stream": stream,
            "stream_options": {"include_usage": true}});
        body["kv_transfer_params"] = params.clone();
        let r = post(d.addr, &body).await;
        assert_eq!(r.status, 200, "{}", r.body);

        // The bytes moved: decode's checksum of what it received == prefill's.
        assert_eq!(r.header("x-kvroute-kv-checksum"), Some(expected.as_str()));
        let hashes = prompt_block_hashes(&tokens, BS as usize, None, None);
        assert_eq!(
            d.disagg.received_checksum(&hashes).as_deref(),
            Some(expected.as_str())
        );
        let bytes = full_blocks as u64 * u64::from(BS) * KV_BYTES_PER_TOKEN;
        assert_eq!(
            r.header("x-kvroute-kv-transfer-bytes"),
            Some(bytes.to_string().as_str())
        );

        // Output and usage: the transferred blocks are prefix hits on the decode worker.
        let usage = if stream {
            assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
            let chunks: Vec<Value> = r
                .body
                .split("\n\n")
                .filter_map(|e| e.strip_prefix("data: "))
                .filter(|d| *d != "[DONE]")
                .map(|d| serde_json::from_str(d).unwrap())
                .collect();
            let text: String = chunks
                .iter()
                .filter_map(|c| c["choices"][0]["text"].as_str())
                .collect();
            assert!(!text.is_empty());
            chunks.last().unwrap()["usage"].clone()
        } else {
            let b = r.json();
            assert_eq!(b["choices"][0]["finish_reason"], "length");
            b["usage"].clone()
        };
        assert_eq!(usage["completion_tokens"], 6);
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        // vLLM keeps the last prompt token for compute: an aligned prompt recomputes its last
        // block, otherwise only the trailing partial block.
        let want_cached = if len % BS == 0 {
            (full_blocks - 1) as u64
        } else {
            full_blocks as u64
        } * u64::from(BS);
        assert_eq!(cached, want_cached, "{usage}");

        // Sim metrics: decode computed only the tail of the prompt.
        let computed =
            metric(&d, "kvroute_worker_prompt_tokens_computed_total").await - computed_before;
        assert_eq!(computed as u64, u64::from(len) - want_cached);
        assert!(
            computed as u32 <= BS,
            "decode recomputed {computed} prompt tokens"
        );

        // The prefill side released the blocks.
        assert_eq!(p.disagg.pinned_blocks(), 0);
        assert_eq!(p.disagg.pinned_requests(), 0);
    }

    // The decode worker stored the blocks like any cache fill.
    let cached_blocks: u64 = d
        .state
        .engine
        .stats()
        .iter()
        .map(|s| s.kv_cached_blocks)
        .sum();
    assert!(cached_blocks >= 12 + 10, "{cached_blocks}");
    assert_eq!(
        metric(&d, "kvroute_worker_kv_tokens_received_total").await,
        f64::from(12 * BS + 10 * BS)
    );
    assert!(metric(&d, "kvroute_worker_kv_transfer_seconds_count").await >= 2.0);
    let received = metric(
        &d,
        "kvroute_worker_kv_transfer_bytes_total{direction=\"received\"}",
    )
    .await;
    assert_eq!(received as u64, 22 * u64::from(BS) * KV_BYTES_PER_TOKEN);
    let sent = metric(
        &p,
        "kvroute_worker_kv_transfer_bytes_total{direction=\"sent\"}",
    )
    .await;
    assert_eq!(sent, received);
    assert_eq!(
        metric(
            &p,
            "kvroute_worker_kv_pins_released_total{reason=\"notified\"}"
        )
        .await,
        2.0
    );
    // TTFT includes the transfer: the TTFT sum is at least the pulls' time.
    let ttft = metric(&d, "vllm:time_to_first_token_seconds_sum").await;
    let pulls = metric(&d, "kvroute_worker_kv_transfer_seconds_sum").await;
    assert!(ttft >= pulls, "ttft {ttft} < transfer {pulls}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_with_unreachable_or_released_prefill_is_a_clear_5xx() {
    let p = worker(WorkerRole::Prefill, 33, Duration::from_millis(200)).await;
    let d = worker(WorkerRole::Decode, 44, Duration::from_secs(60)).await;
    let tokens = prompt(100, 1);

    // Unreachable prefill agent.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = l.local_addr().unwrap().port();
    drop(l);
    let mut body = json!({"model": MODEL, "prompt": tokens, "max_tokens": 4});
    body["kv_transfer_params"] = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": "gone", "remote_block_ids": [0, 1], "remote_host": "127.0.0.1",
        "remote_port": dead, "remote_request_id": "r", "tp_size": 1});
    let r = post(d.addr, &body).await;
    assert_eq!(r.status, 502, "{}", r.body);
    let e = r.json();
    assert_eq!(e["error"]["type"], "kv_transfer_error");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cannot connect"),
        "{e}"
    );

    // Pins expire when nobody pulls; a late pull then fails cleanly instead of reading
    // released memory.
    let r = post(p.addr, &prefill_leg(&tokens)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let params = r.json()["kv_transfer_params"].clone();
    assert_eq!(p.disagg.pinned_blocks(), 6);
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(p.disagg.pinned_blocks(), 0, "pin timed out");
    assert_eq!(
        metric(
            &p,
            "kvroute_worker_kv_pins_released_total{reason=\"timeout\"}"
        )
        .await,
        1.0
    );
    body["kv_transfer_params"] = params.clone();
    let r = post(d.addr, &body).await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(r.body.contains("not populated"), "{}", r.body);

    // A decode leg whose prompt differs from the prefill's is refused (integrity check).
    let r = post(p.addr, &prefill_leg(&tokens)).await;
    let mut params = r.json()["kv_transfer_params"].clone();
    params["kv_checksum"] = Value::Null;
    let other = json!({"model": MODEL, "prompt": prompt(100, 2), "max_tokens": 4, "kv_transfer_params": params});
    let r = post(d.addr, &other).await;
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(
        r.body.contains("does not belong to this prompt"),
        "{}",
        r.body
    );

    // A prefill leg must not stream; a decode-role worker cannot serve a prefill leg.
    let mut s = prefill_leg(&tokens);
    s["stream"] = json!(true);
    assert_eq!(post(p.addr, &s).await.status, 400);
    assert_eq!(post(d.addr, &prefill_leg(&tokens)).await.status, 400);
}
