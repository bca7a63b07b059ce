//! `epp-bench`: how long the EPP takes to route, and what the gateway path adds.
//!
//! 1. Pick latency: drives a real `kvroute-epp` over `ext_proc` exactly as Envoy does in
//!    FULL_DUPLEX_STREAMED mode (headers, body chunks ≤ 62,000 B, empty end-of-stream chunk) and
//!    times from the end-of-stream message to the routing headers reply — parsing, chat template,
//!    tokenization, block hashing, index lookup, scoring and the reply included. Per prompt size:
//!    cold prompts (never seen) and follow-up turns (a new message after the previous turn).
//! 2. Gateway overhead: the same request through Envoy → EPP → worker and through Envoy routing
//!    straight to the same worker, interleaved, end to end.
//!
//! Progress goes to stderr; a markdown table to stdout; CDF charts to `--svg-dir`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{body_mutation, processing_response};
use kvroute_proto::openai::{parse_request, ApiKind};
use kvroute_proto::prompt::PromptRenderer;
use kvroute_tests::harness::client::{self, new_client};
use kvroute_tests::harness::conversation::{text, Conversation};
use kvroute_tests::harness::envoy::{self, BodyMode, EnvoyConfig};
use kvroute_tests::harness::extproc::{self, Stream, FULL_DUPLEX_STREAMED};
use kvroute_tests::harness::stack::{start_worker, EppProcess, StackOptions};
use kvroute_tests::harness::stats::{cdf_svg, ms, percentile, Series};
use kvroute_tests::harness::{envoy_bin, free_port, model_dir};
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(name = "epp-bench", about = "EPP pick latency and gateway overhead")]
struct Args {
    /// Prompt sizes in tokens.
    #[arg(long, value_delimiter = ',', default_value = "1024,8192,32768")]
    sizes: Vec<usize>,
    /// Conversations per size (each gives one cold pick and one follow-up pick).
    #[arg(long, default_value_t = 100)]
    conversations: usize,
    /// Requests per path for the gateway-overhead comparison.
    #[arg(long, default_value_t = 400)]
    gateway_requests: usize,
    /// Where to write the SVG charts.
    #[arg(long, default_value = "docs/img")]
    svg_dir: PathBuf,
    /// Extra flags for the EPP (e.g. --policy round-robin).
    #[arg(long, allow_hyphen_values = true)]
    epp_arg: Vec<String>,
}

const MODEL: &str = "Qwen/Qwen3-0.6B";
const CHUNK: usize = 62_000;

/// One request through ext_proc as Envoy sends it; returns the time from end-of-stream to the
/// routing decision, and the chosen endpoint.
async fn pick(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    request_id: &str,
    body: &[u8],
) -> anyhow::Result<(Duration, String)> {
    let mut stream = Stream::open(client).await?;
    let headers = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("content-type", "application/json"),
        ("x-request-id", request_id),
    ];
    stream
        .request_headers(&headers, false, FULL_DUPLEX_STREAMED, None)
        .await?;
    for chunk in body.chunks(CHUNK) {
        stream.request_body(chunk, false).await?;
    }
    let started = Instant::now();
    stream.request_body(&[], true).await?;
    let first = stream.recv().await?.context("EPP closed the stream")?;
    let elapsed = started.elapsed();
    let endpoint = match first.response {
        Some(processing_response::Response::RequestHeaders(h)) => h
            .response
            .and_then(|r| r.header_mutation)
            .and_then(|m| {
                m.set_headers.into_iter().find_map(|o| {
                    o.header
                        .filter(|h| h.key == "x-gateway-destination-endpoint")
                })
            })
            .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
            .context("no destination header")?,
        Some(processing_response::Response::ImmediateResponse(r)) => {
            anyhow::bail!(
                "EPP rejected the request: {}",
                String::from_utf8_lossy(&r.body)
            )
        }
        other => anyhow::bail!("unexpected first reply {other:?}"),
    };
    // Drain the body echo, then end the stream (releases the booking).
    while let Some(m) = stream.recv().await? {
        if let Some(processing_response::Response::RequestBody(b)) = m.response {
            let eos = matches!(
                b.response.and_then(|r| r.body_mutation).and_then(|m| m.mutation),
                Some(body_mutation::Mutation::StreamedResponse(s)) if s.end_of_stream
            );
            if eos {
                break;
            }
        }
    }
    drop(stream);
    Ok((elapsed, endpoint))
}

/// Words of `text()` filler that make about `tokens` tokens in a chat prompt.
fn words_for(renderer: &PromptRenderer, tokens: usize) -> anyhow::Result<usize> {
    let probe = Conversation::new(1, 2000).request(MODEL, 1, false);
    let req = parse_request(ApiKind::ChatCompletions, &serde_json::to_vec(&probe)?)?;
    let n = renderer.token_ids(&req)?.len();
    Ok((tokens as f64 * 2000.0 / n as f64).round() as usize)
}

struct SizeResult {
    tokens: usize,
    cold: Vec<Duration>,
    follow: Vec<Duration>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let log_dir = std::env::temp_dir().join(format!("kvroute-epp-bench-{}", std::process::id()));
    let renderer = PromptRenderer::from_dir(&model_dir()?)?;
    let opts = StackOptions {
        speedup: 1e6,
        kv_blocks: 200_000,
        log_dir: log_dir.clone(),
        ..StackOptions::default()
    };
    eprintln!("starting 4 sim workers ...");
    let mut workers = Vec::new();
    for i in 0..4 {
        workers.push(start_worker(&format!("bench-worker-{i}"), &opts, &[]).await?);
    }
    let epp = EppProcess::for_workers(&workers.iter().collect::<Vec<_>>(), &args.epp_arg, &log_dir)
        .await?;
    let mut grpc = extproc::connect(epp.grpc_port).await?;
    let http = new_client();

    // --- 1. pick latency
    let mut results = Vec::new();
    for &size in &args.sizes {
        let words = words_for(&renderer, size)?;
        let mut r = SizeResult {
            tokens: 0,
            cold: Vec::new(),
            follow: Vec::new(),
        };
        for c in 0..args.conversations {
            let mut conv = Conversation::new((size * 10_000 + c) as u64, words);
            let body = serde_json::to_vec(&conv.request(MODEL, 1, false))?;
            if c == 0 {
                let req = parse_request(ApiKind::ChatCompletions, &body)?;
                r.tokens = renderer.token_ids(&req)?.len();
            }
            let (cold, endpoint) = pick(&mut grpc, &format!("cold-{size}-{c}"), &body).await?;
            r.cold.push(cold);
            // Serve the turn so the worker's KV events reach the index, as in real traffic.
            let (status, _, reply) = client::request(
                &http,
                "POST",
                &format!("http://{endpoint}/v1/chat/completions"),
                &[],
                body,
            )
            .await?;
            anyhow::ensure!(status == 200, "worker answered {status}");
            let reply: Value = serde_json::from_slice(&reply)?;
            conv.advance(
                reply["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or_default(),
                60,
            );
            let body = serde_json::to_vec(&conv.request(MODEL, 1, false))?;
            let (follow, _) = pick(&mut grpc, &format!("follow-{size}-{c}"), &body).await?;
            r.follow.push(follow);
            if (c + 1) % 10 == 0 {
                eprintln!(
                    "  {size} tokens: {}/{} conversations",
                    c + 1,
                    args.conversations
                );
            }
        }
        eprintln!(
            "{size:>6} tokens: cold p50 {:.3} ms p99 {:.3} ms | follow-up p50 {:.3} ms p99 {:.3} ms",
            ms(percentile(&r.cold, 50.0)),
            ms(percentile(&r.cold, 99.0)),
            ms(percentile(&r.follow, 50.0)),
            ms(percentile(&r.follow, 99.0))
        );
        results.push(r);
    }
    let (_, _, m) = client::get(&format!("http://127.0.0.1:{}/metrics", epp.metrics_port)).await?;
    let m = String::from_utf8_lossy(&m).into_owned();
    drop(epp);

    // --- 2. gateway overhead: Envoy → EPP → worker 0 vs Envoy → worker 0
    eprintln!(
        "gateway overhead: {} requests per path ...",
        args.gateway_requests
    );
    let target = &workers[0];
    let epp_one = EppProcess::for_workers(&[target], &args.epp_arg, &log_dir).await?;
    let envoy_bin = envoy_bin()?;
    let (via_port, direct_port) = (free_port()?, free_port()?);
    let base = EnvoyConfig {
        listen_port: via_port,
        admin_port: free_port()?,
        epp_port: epp_one.grpc_port,
        body_mode: BodyMode::FullDuplexStreamed,
        fail_open: false,
        pool_endpoints: vec![target.http.clone()],
        direct_to: None,
    };
    let _via = envoy::start(&envoy_bin, &base, &log_dir, "envoy-via-epp").await?;
    let direct_cfg = EnvoyConfig {
        listen_port: direct_port,
        admin_port: free_port()?,
        direct_to: Some(target.http.clone()),
        ..base
    };
    let _direct = envoy::start(&envoy_bin, &direct_cfg, &log_dir, "envoy-direct").await?;
    let words = words_for(&renderer, 1024)?;
    let body = serde_json::to_vec(
        &json!({"model": MODEL, "messages": [{"role": "user", "content": text(4242, words)}], "max_tokens": 1}),
    )?;
    let (mut via, mut direct) = (Vec::new(), Vec::new());
    for i in 0..args.gateway_requests + 20 {
        for (port, out) in [(via_port, &mut via), (direct_port, &mut direct)] {
            let t = Instant::now();
            let (status, _, _) = client::request(
                &http,
                "POST",
                &format!("http://127.0.0.1:{port}/v1/chat/completions"),
                &[("content-type", "application/json")],
                body.clone(),
            )
            .await?;
            anyhow::ensure!(status == 200, "status {status} via port {port}");
            if i >= 20 {
                out.push(t.elapsed()); // the first 20 warm connections and caches
            }
        }
        if (i + 1) % 100 == 0 {
            eprintln!("  {}/{}", i + 1, args.gateway_requests + 20);
        }
    }

    // --- report
    println!("### EPP pick latency (ext_proc end-of-stream → routing headers), {} conversations per size\n", args.conversations);
    println!("| prompt tokens | cold p50 (ms) | cold p99 (ms) | follow-up p50 (ms) | follow-up p99 (ms) |");
    println!("|---:|---:|---:|---:|---:|");
    for r in &results {
        println!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} |",
            r.tokens,
            ms(percentile(&r.cold, 50.0)),
            ms(percentile(&r.cold, 99.0)),
            ms(percentile(&r.follow, 50.0)),
            ms(percentile(&r.follow, 99.0))
        );
    }
    let tok = kvroute_tests::harness::stack::metric_value(
        &m,
        "kvroute_epp_tokenize_duration_seconds_sum",
    )
    .unwrap_or(0.0);
    let tok_n = kvroute_tests::harness::stack::metric_value(
        &m,
        "kvroute_epp_tokenize_duration_seconds_count",
    )
    .unwrap_or(1.0);
    println!(
        "\nmean tokenization share inside the EPP: {:.3} ms per request\n",
        tok / tok_n.max(1.0) * 1e3
    );
    println!(
        "### Gateway overhead, {} sequential requests per path (~1K-token chat, max_tokens 1)\n",
        args.gateway_requests
    );
    println!("| path | p50 (ms) | p99 (ms) |");
    println!("|---|---:|---:|");
    println!(
        "| Envoy → worker (direct) | {:.3} | {:.3} |",
        ms(percentile(&direct, 50.0)),
        ms(percentile(&direct, 99.0))
    );
    println!(
        "| Envoy → EPP → worker | {:.3} | {:.3} |",
        ms(percentile(&via, 50.0)),
        ms(percentile(&via, 99.0))
    );
    println!(
        "| added by the EPP path | {:.3} | {:.3} |",
        ms(percentile(&via, 50.0)) - ms(percentile(&direct, 50.0)),
        ms(percentile(&via, 99.0)) - ms(percentile(&direct, 99.0))
    );

    std::fs::create_dir_all(&args.svg_dir)?;
    let mut series = Vec::new();
    for r in &results {
        series.push(Series {
            label: format!("{} tok cold", r.tokens),
            samples: &r.cold,
        });
        series.push(Series {
            label: format!("{} tok follow-up", r.tokens),
            samples: &r.follow,
        });
    }
    std::fs::write(
        args.svg_dir.join("epp-pick-latency.svg"),
        cdf_svg("EPP pick latency (CDF)", &series),
    )?;
    std::fs::write(
        args.svg_dir.join("gateway-overhead.svg"),
        cdf_svg(
            "End-to-end latency through Envoy (CDF)",
            &[
                Series {
                    label: "direct".into(),
                    samples: &direct,
                },
                Series {
                    label: "via EPP".into(),
                    samples: &via,
                },
            ],
        ),
    )?;
    eprintln!("charts written to {}", args.svg_dir.display());
    drop(epp_one);
    Ok(())
}
