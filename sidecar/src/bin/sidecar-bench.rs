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
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
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
    /// Tokenizer dir for the worker (default: .cache/models/qwen3).
    #[arg(long, env = "KVROUTE_MODEL_DIR", default_value = ".cache/models/qwen3")]
    model_dir: PathBuf,
}

const MODEL: &str = "Qwen/Qwen3-0.6B";

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGKILL is fine here: nothing of these processes is kept.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe.parent().map(|d| d.join(name)).unwrap_or_default();
    if !p.exists() {
        bail!(
            "{} is not built (cargo build --release -p kvroute-worker -p kvroute-sidecar)",
            p.display()
        );
    }
    Ok(p)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn spawn(program: &Path, args: &[String]) -> anyhow::Result<Proc> {
    let child = Command::new(program)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    Ok(Proc(child))
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn wait_healthy(c: &HttpClient, url: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = c.get(format!("{url}/health").parse()?).await {
            if r.status() == 200 {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("{url} not healthy after 60 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One request read to the end: (latency, events, bytes).
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

fn pct(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let mut s = v.to_vec();
    s.sort();
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let worker_addr = format!("127.0.0.1:{}", free_port()?);
    let sidecar_addr = format!("127.0.0.1:{}", free_port()?);
    let direct = format!("http://{worker_addr}");
    let via = format!("http://{sidecar_addr}");
    let _worker = spawn(
        &sibling("kvroute-worker")?,
        &[
            "--engine",
            "sim",
            "--listen",
            &worker_addr,
            "--grpc-listen",
            &format!("127.0.0.1:{}", free_port()?),
            "--model",
            MODEL,
            "--model-dir",
            &args.model_dir.display().to_string(),
            "--name",
            "bench-worker",
            "--speedup",
            &args.speedup.to_string(),
            "--max-num-seqs",
            "1024",
        ]
        .map(String::from),
    )?;
    let _sidecar = spawn(
        &sibling("kvroute-sidecar")?,
        &[
            "--listen".into(),
            sidecar_addr.clone(),
            "--engine".into(),
            format!("name=bench-worker,url={direct}"),
        ],
    )?;
    let c: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    wait_healthy(&c, &direct).await?;
    wait_healthy(&c, &via).await?;
    let hint = kvroute_proto::worker_id::instance_id_for_pod("bench-worker").to_string();
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
            us(pct(v, 50.0)),
            us(pct(v, 90.0)),
            us(pct(v, 99.0))
        );
    }
    let _ = writeln!(
        out,
        "| added (p50 / p99 of these) | {:.0} | | {:.0} | |",
        us(pct(&s_lat, 50.0)) - us(pct(&d_lat, 50.0)),
        us(pct(&s_lat, 99.0)) - us(pct(&d_lat, 99.0))
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
        &[("engine directly", &d_lat), ("via kvroute-sidecar", &s_lat)],
    );
    if let Some(dir) = args.svg.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.svg, svg).with_context(|| format!("writing {}", args.svg.display()))?;
    eprintln!("chart written to {}", args.svg.display());
    Ok(())
}

/// Latency CDFs (x: milliseconds, log scale) as a standalone SVG (the same layout as the
/// other benches' charts in `tests/src/harness/stats.rs`).
fn cdf_svg(title: &str, series: &[(&str, &Vec<Duration>)]) -> String {
    const COLORS: &[&str] = &["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e"];
    let (w, h, left, right, top, bottom) = (760.0, 420.0, 70.0, 220.0, 40.0, 50.0);
    let ms = |d: &Duration| (d.as_secs_f64() * 1e3).max(1e-3);
    let all: Vec<f64> = series.iter().flat_map(|(_, v)| v.iter().map(ms)).collect();
    let lo = all
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .max(1e-3)
        .log10()
        .floor();
    let hi = all
        .iter()
        .copied()
        .fold(0.0f64, f64::max)
        .max(1e-2)
        .log10()
        .ceil()
        .max(lo + 1.0);
    let x = |v: f64| left + (v.max(1e-3).log10() - lo) / (hi - lo) * (w - left - right);
    let y = |f: f64| top + (1.0 - f) * (h - top - bottom);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" font-size="15" text-anchor="middle">{title}</text>"#,
        (w - right + left) / 2.0
    );
    let mut e = lo;
    while e <= hi {
        let v = 10f64.powf(e);
        let xv = x(v);
        let label = if v >= 1.0 {
            format!("{v:.0}")
        } else {
            format!("{v}")
        };
        let _ = write!(
            s,
            r##"<line x1="{xv}" y1="{top}" x2="{xv}" y2="{}" stroke="#ddd"/><text x="{xv}" y="{}" text-anchor="middle">{label}</text>"##,
            h - bottom,
            h - bottom + 16.0
        );
        e += 1.0;
    }
    for f in [0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0] {
        let yv = y(f);
        let _ = write!(
            s,
            r##"<line x1="{left}" y1="{yv}" x2="{}" y2="{yv}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{f}</text>"##,
            w - right,
            left - 6.0,
            yv + 4.0
        );
    }
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">latency (ms, log scale)</text><text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">fraction of requests</text>"#,
        (w - right + left) / 2.0,
        h - 10.0,
        h / 2.0,
        h / 2.0
    );
    for (i, (label, v)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut v: Vec<f64> = v.iter().map(ms).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let pts: Vec<String> = v
            .iter()
            .enumerate()
            .map(|(k, m)| format!("{:.1},{:.1}", x(*m), y((k + 1) as f64 / n)))
            .collect();
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/><rect x="{}" y="{}" width="12" height="12" fill="{color}"/><text x="{}" y="{}">{label}</text>"#,
            pts.join(" "),
            w - right + 12.0,
            top + 18.0 * i as f64,
            w - right + 30.0,
            top + 18.0 * i as f64 + 10.0
        );
    }
    s.push_str("</svg>\n");
    s
}
