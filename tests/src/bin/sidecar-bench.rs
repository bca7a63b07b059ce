//! `sidecar-bench`: what the sidecar costs. Starts one simulated worker and one
//! `kvroute-sidecar` process in front of it (both the binaries next to this one), then:
//!
//! 1. **Added latency**: the same small JSON request sent to the engine directly and through
//!    the sidecar, interleaved (alternating which goes first) on one keep-alive client, so
//!    both see the same machine load; p50/p90/p99 and the per-pair difference.
//! 2. **SSE throughput**: long streams (`max_tokens` large, simulated engine sped up so it is
//!    not the bottleneck) read to the end, direct vs through the sidecar, alternating:
//!    events/s and bytes/s.
//!
//! Progress goes to stderr, the table to stdout, a latency CDF chart to
//! `docs/img/sidecar-latency.svg`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use kvroute_tests::harness::client::{new_client, HttpClient};
use kvroute_tests::harness::stack::{start_sidecar, start_worker, StackOptions};
use kvroute_tests::harness::stats::{cdf_svg, percentile, Series};
use serde_json::json;

#[derive(Debug, Parser)]
#[command(
    name = "sidecar-bench",
    about = "kvroute-sidecar added latency and SSE throughput"
)]
struct Args {
    /// Latency pairs (one direct + one sidecar request each).
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Tokens generated per latency request.
    #[arg(long, default_value_t = 4)]
    max_tokens: u32,
    /// Streams per path for the throughput test.
    #[arg(long, default_value_t = 10)]
    streams: usize,
    /// Tokens per throughput stream.
    #[arg(long, default_value_t = 20000)]
    stream_tokens: u32,
    /// Simulated engine speedup (high: the engine should not be what is measured).
    #[arg(long, default_value_t = 1000.0)]
    speedup: f64,
    /// Where the CDF chart goes.
    #[arg(long, default_value = "docs/img/sidecar-latency.svg")]
    svg: PathBuf,
}

const MODEL: &str = "Qwen/Qwen3-0.6B";

async fn run(
    c: &HttpClient,
    url: &str,
    hint: Option<&str>,
    body: &str,
) -> anyhow::Result<(Duration, usize, usize)> {
    let mut req = hyper::Request::post(url).header("content-type", "application/json");
    if let Some(h) = hint {
        req = req.header("x-dynamo-worker-instance-id", h);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string())))?;
    let t = Instant::now();
    let resp = c.request(req).await?;
    if resp.status() != 200 {
        bail!("{url}: status {}", resp.status());
    }
    let mut body = resp.into_body();
    let (mut events, mut bytes) = (0usize, 0usize);
    while let Some(f) = body.frame().await {
        if let Ok(d) = f?.into_data() {
            bytes += d.len();
            events += d.windows(2).filter(|w| w == b"\n\n").count();
        }
    }
    Ok((t.elapsed(), events, bytes))
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let opts = StackOptions {
        speedup: args.speedup,
        ..StackOptions::default()
    };
    let extra = ["--max-num-seqs".to_string(), "1024".to_string()];
    let mut worker = start_worker("bench-worker", &opts, &extra).await?;
    start_sidecar(&mut worker, &[], &opts).await?;
    let direct = format!("http://{}", worker.http);
    let via = format!("http://{}", worker.destination());
    let c = new_client();
    let hint = worker.instance_id.to_string();
    let direct_url = format!("{direct}/v1/chat/completions");
    let via_url = format!("{via}/v1/chat/completions");

    // 1. Added latency, interleaved pairs.
    let small = json!({"model": MODEL, "max_tokens": args.max_tokens,
        "messages": [{"role": "user", "content": "What is a KV cache?"}]})
    .to_string();
    for _ in 0..50 {
        run(&c, &direct_url, None, &small).await?;
        run(&c, &via_url, Some(&hint), &small).await?;
    }
    let (mut d_lat, mut s_lat, mut diffs) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..args.requests {
        let (d, s) = if i % 2 == 0 {
            let d = run(&c, &direct_url, None, &small).await?.0;
            (d, run(&c, &via_url, Some(&hint), &small).await?.0)
        } else {
            let s = run(&c, &via_url, Some(&hint), &small).await?.0;
            (run(&c, &direct_url, None, &small).await?.0, s)
        };
        diffs.push(s.as_secs_f64() - d.as_secs_f64());
        d_lat.push(d);
        s_lat.push(s);
        if (i + 1) % 500 == 0 {
            eprintln!("latency: {}/{} pairs", i + 1, args.requests);
        }
    }
    diffs.sort_by(f64::total_cmp);
    let diff_p = |p: f64| {
        diffs[((p / 100.0 * diffs.len() as f64).ceil() as usize).clamp(1, diffs.len()) - 1] * 1e6
    };

    // 2. SSE throughput.
    let long = json!({"model": MODEL, "max_tokens": args.stream_tokens, "stream": true,
        "messages": [{"role": "user", "content": "Write a long story."}]})
    .to_string();
    let (mut d_tp, mut s_tp) = (
        (Duration::ZERO, 0usize, 0usize),
        (Duration::ZERO, 0usize, 0usize),
    );
    for i in 0..args.streams {
        // Alternate which path goes first.
        let order = if i % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for is_direct in order {
            let (url, h) = if is_direct {
                (&direct_url, None)
            } else {
                (&via_url, Some(hint.as_str()))
            };
            let (t, e, b) = run(&c, url, h, &long).await?;
            let slot = if is_direct { &mut d_tp } else { &mut s_tp };
            slot.0 += t;
            slot.1 += e;
            slot.2 += b;
        }
        eprintln!("throughput: {}/{} stream pairs", i + 1, args.streams);
    }

    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n## added latency ({} interleaved pairs, chat JSON, max_tokens={}, speedup {})\n",
        args.requests, args.max_tokens, args.speedup
    );
    let _ = writeln!(out, "| path | p50 µs | p90 µs | p99 µs | mean µs |");
    let _ = writeln!(out, "|---|---:|---:|---:|---:|");
    for (name, v) in [
        ("engine directly", &d_lat),
        ("through kvroute-sidecar", &s_lat),
    ] {
        let mean = v.iter().map(|d| us(*d)).sum::<f64>() / v.len().max(1) as f64;
        let _ = writeln!(
            out,
            "| {name} | {:.0} | {:.0} | {:.0} | {mean:.0} |",
            us(percentile(v, 50.0)),
            us(percentile(v, 90.0)),
            us(percentile(v, 99.0))
        );
    }
    let _ = writeln!(
        out,
        "| added (p50 / p99 of these) | {:.0} | | {:.0} | |",
        us(percentile(&s_lat, 50.0)) - us(percentile(&d_lat, 50.0)),
        us(percentile(&s_lat, 99.0)) - us(percentile(&d_lat, 99.0))
    );
    let _ = writeln!(
        out,
        "| per-pair difference (sidecar − direct) | {:.0} | {:.0} | {:.0} | |",
        diff_p(50.0),
        diff_p(90.0),
        diff_p(99.0)
    );
    let _ = writeln!(
        out,
        "\n## SSE throughput ({} streams per path, {} tokens each)\n",
        args.streams, args.stream_tokens
    );
    let _ = writeln!(out, "| path | events/s | MB/s | events | bytes |");
    let _ = writeln!(out, "|---|---:|---:|---:|---:|");
    for (name, (t, e, b)) in [("engine directly", d_tp), ("through kvroute-sidecar", s_tp)] {
        let secs = t.as_secs_f64().max(1e-9);
        let _ = writeln!(
            out,
            "| {name} | {:.0} | {:.1} | {e} | {b} |",
            e as f64 / secs,
            b as f64 / secs / 1e6
        );
    }
    println!("{out}");

    let svg = cdf_svg(
        "Chat request latency: engine directly vs through kvroute-sidecar",
        &[
            Series {
                label: "engine directly".into(),
                samples: &d_lat,
            },
            Series {
                label: "via kvroute-sidecar".into(),
                samples: &s_lat,
            },
        ],
    );
    if let Some(dir) = args.svg.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.svg, svg).with_context(|| format!("writing {}", args.svg.display()))?;
    eprintln!("chart written to {}", args.svg.display());
    Ok(())
}
