//! Side-by-side tokenization benchmark (issue 5): HF `tokenizers` vs kvroute's fast exact
//! encoder on the same inputs, in one run.
//!
//! Inputs are Qwen3 chat prompts (the chat template's `<|im_start|>role\n...<|im_end|>\n`
//! framing) of about 1K, 8K and 32K tokens, generated deterministically from a mix of English
//! prose, source code, JSON tool output, numbers and CJK text. For each size it times a cold
//! encode with HF `Tokenizer::encode`, HF `Tokenizer::encode_fast` and `FastTokenizer::encode`
//! (ids checked equal), then the follow-up turn of the 8K conversation through
//! `PrefixReuseEncoder` (previous prompt remembered; each follow-up is new text). Progress goes
//! to stderr, a Markdown table to stdout, and an SVG bar chart to `--svg`.
//!
//! ```text
//! cargo run --release -p kvroute-proto --bin tokenizer-bench -- \
//!     [--model-dir .cache/models/qwen3] [--svg docs/img/tokenizer-bench.svg] [--seconds 1.0]
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvroute_proto::tokenizer::{FastTokenizer, PrefixReuseEncoder};
use tokenizers::Tokenizer;

/// Small deterministic generator (xorshift64*): the bench must not depend on dev-only crates.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

const WORDS: &[&str] = &[
    "the",
    "router",
    "cache",
    "prefix",
    "worker",
    "request",
    "token",
    "latency",
    "model",
    "is",
    "a",
    "of",
    "to",
    "and",
    "in",
    "that",
    "we",
    "it's",
    "don't",
    "block",
    "decode",
    "prefill",
    "throughput",
    "scheduler",
    "GPU",
    "memory",
    "Kubernetes",
    "gateway",
    "endpoint",
    "picker",
    "conversation",
    "agent",
    "tool",
    "function",
    "returns",
    "error",
    "value",
    "because",
    "however",
    "therefore",
    "transfer",
    "NIXL",
    "events",
    "hash",
    "index",
    "overlap",
];
const CODE: &[&str] = &[
    "fn pick(&self, req: &Request) -> Result<WorkerId, Error> {\n",
    "    let overlap = self.index.find_matches(&hashes)?;\n",
    "    for (i, w) in workers.iter().enumerate() {\n",
    "        if w.load > 0.85 { continue; }\n",
    "    }\n}\n",
    "def score(blocks, load):\n    return 0.7 * blocks - 0.3 * load  # weighted\n",
    "    assert len(ids) == 8192, f\"got {len(ids)}\"\n",
    "import json, sys\nfrom pathlib import Path\n",
    "#include <stdio.h>\nint main(void) { return printf(\"%d\\n\", 42) < 0; }\n",
];
const CJK: &[&str] = &[
    "路由器根据键值缓存的命中情况选择工作节点。",
    "预填充和解码可以在不同的GPU上运行，",
    "多轮对话的前缀通常可以复用。",
    "トークン化はリクエストごとに必要です。",
];

fn sentence(rng: &mut Rng) -> String {
    let n = 6 + rng.below(14);
    let mut s = String::new();
    for i in 0..n {
        let w = rng.pick(WORDS);
        if i == 0 {
            let mut c = w.chars();
            if let Some(f) = c.next() {
                s.extend(f.to_uppercase());
                s.push_str(c.as_str());
            }
        } else {
            s.push(' ');
            s.push_str(w);
        }
        if rng.below(12) == 0 {
            s.push(',');
        }
    }
    s.push_str(rng.pick(&[".", ".", ".", "?", "!", ":"]));
    s
}

/// One message body: prose paragraphs, a code block, a JSON tool result, numbers, some CJK.
fn message(rng: &mut Rng, target_chars: usize) -> String {
    let mut s = String::new();
    while s.len() < target_chars {
        match rng.below(10) {
            0..=4 => {
                for _ in 0..3 + rng.below(4) {
                    s.push_str(&sentence(rng));
                    s.push(' ');
                }
                s.push_str("\n\n");
            }
            5 | 6 => {
                s.push_str("```rust\n");
                for _ in 0..3 + rng.below(6) {
                    s.push_str(rng.pick(CODE));
                }
                s.push_str("```\n\n");
            }
            7 => {
                s.push_str(&format!(
                    "{{\"worker\": \"pod-{}\", \"blocks\": [{}, {}, {}], \"kv_usage\": {}.{:03}, \"ok\": true}}\n",
                    rng.below(64),
                    rng.below(100_000),
                    rng.below(100_000),
                    rng.below(100_000),
                    rng.below(1),
                    rng.below(1000)
                ));
            }
            8 => {
                s.push_str(rng.pick(CJK));
                s.push_str(rng.pick(CJK));
                s.push('\n');
            }
            _ => {
                s.push_str(&format!(
                    "- step {}: took {} ms ({} tokens, {:.2}% hit rate)\n",
                    rng.below(100),
                    rng.below(5000),
                    rng.below(50_000),
                    rng.below(10_000) as f64 / 100.0
                ));
            }
        }
    }
    s
}

fn turn(role: &str, body: &str) -> String {
    format!("<|im_start|>{role}\n{body}<|im_end|>\n")
}

/// A conversation prompt of at least `target_tokens` (counted with HF), ending with the
/// generation prompt, plus the conversation's message list for follow-ups.
fn conversation(hf: &Tokenizer, rng: &mut Rng, target_tokens: usize) -> String {
    let mut prompt = turn("system", "You are a helpful coding agent.");
    let mut user = true;
    let mut have = 0usize;
    loop {
        // About 4 bytes per token: keep the last message from overshooting small targets.
        let room = (target_tokens.saturating_sub(have) * 4).max(200);
        let len = (600 + rng.below(2400)).min(room);
        let body = message(rng, len);
        prompt.push_str(&turn(if user { "user" } else { "assistant" }, &body));
        user = !user;
        let with_gen = format!("{prompt}<|im_start|>assistant\n");
        let n = hf.encode(with_gen.as_str(), false).map_or(0, |e| e.len());
        have = n;
        if n >= target_tokens && !user {
            return with_gen;
        }
    }
}

/// Median seconds of `f` over at least 5 runs and at least `budget` of time.
fn time_it(budget: Duration, mut f: impl FnMut()) -> f64 {
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < 5 || start.elapsed() < budget {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64());
        if samples.len() >= 10_000 {
            break;
        }
    }
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

struct Row {
    label: String,
    tokens: usize,
    hf: f64,
    hf_fast: f64,
    ours: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut model_dir = PathBuf::from(".cache/models/qwen3");
    let mut svg = Some(PathBuf::from("docs/img/tokenizer-bench.svg"));
    let mut budget = Duration::from_secs_f64(1.0);
    let mut profile_followup = 0usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--model-dir" => model_dir = args.next().ok_or("--model-dir needs a value")?.into(),
            "--svg" => svg = Some(args.next().ok_or("--svg needs a value")?.into()),
            "--no-svg" => svg = None,
            // Only the follow-up loop, repeated, for `perf record`.
            "--profile-followup" => {
                profile_followup = args
                    .next()
                    .ok_or("--profile-followup needs a count")?
                    .parse()?
            }
            "--seconds" => {
                budget =
                    Duration::from_secs_f64(args.next().ok_or("--seconds needs a value")?.parse()?)
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let path = model_dir.join("tokenizer.json");
    eprintln!("loading {}", path.display());
    let hf = Tokenizer::from_file(&path).map_err(|e| format!("HF load: {e}"))?;
    let t = Instant::now();
    let fast = FastTokenizer::from_file(&path)?
        .ok_or("this tokenizer.json is not supported by the fast path")?;
    eprintln!("fast tokenizer loaded in {:.2}s", t.elapsed().as_secs_f64());

    let mut rng = Rng(0x6b76_726f_7574_6521);
    let mut rows = Vec::new();
    let mut conv8k = String::new();
    for (label, target) in [("1K", 1024), ("8K", 8192), ("32K", 32768)] {
        let text = conversation(&hf, &mut rng, target);
        if profile_followup > 0 {
            if label == "8K" {
                conv8k = text;
                break;
            }
            continue;
        }
        let want = hf
            .encode(text.as_str(), false)
            .map_err(|e| e.to_string())?
            .get_ids()
            .to_vec();
        let got = fast.encode(&text, false);
        if want != got {
            return Err(format!("{label}: ids differ from HF").into());
        }
        eprintln!(
            "{label}: {} tokens, {} bytes; timing HF encode ...",
            want.len(),
            text.len()
        );
        let hf_t = time_it(budget, || {
            let _ = std::hint::black_box(hf.encode(text.as_str(), false));
        });
        eprintln!("{label}: timing HF encode_fast ...");
        let hf_fast_t = time_it(budget, || {
            let _ = std::hint::black_box(hf.encode_fast(text.as_str(), false));
        });
        eprintln!("{label}: timing fast encoder ...");
        let ours_t = time_it(budget, || {
            std::hint::black_box(fast.encode(&text, false));
        });
        if label == "8K" {
            conv8k = text.clone();
        }
        rows.push(Row {
            label: label.to_string(),
            tokens: want.len(),
            hf: hf_t,
            hf_fast: hf_fast_t,
            ours: ours_t,
        });
    }

    // Follow-up turn of the 8K conversation: the previous prompt is remembered; each follow-up
    // appends a different assistant answer and user message (so nothing but the shared prefix
    // can be reused).
    eprintln!("follow-up turn of the 8K conversation ...");
    let fast2 = FastTokenizer::from_file(&path)?.ok_or("unsupported")?;
    let reuse = PrefixReuseEncoder::new(fast2, 4096);
    reuse.encode(&conv8k, false)?;
    let followups: Vec<String> = (0..200 + profile_followup)
        .map(|_| {
            let (a, q) = (400 + rng.below(400), 200 + rng.below(400));
            let answer = message(&mut rng, a);
            let question = message(&mut rng, q);
            format!(
                "{conv8k}{answer}<|im_end|>\n{}<|im_start|>assistant\n",
                turn("user", &question)
            )
        })
        .collect();
    for f in followups.iter().take(5) {
        let want = hf
            .encode(f.as_str(), false)
            .map_err(|e| e.to_string())?
            .get_ids()
            .to_vec();
        if reuse.encode(f, false)? != want {
            return Err("follow-up ids differ from HF".into());
        }
    }
    if profile_followup > 0 {
        let t = Instant::now();
        for i in 0..profile_followup {
            std::hint::black_box(reuse.encode(&followups[5 + i], false)?);
        }
        eprintln!(
            "{:.1} us per follow-up",
            t.elapsed().as_secs_f64() * 1e6 / profile_followup as f64
        );
        return Ok(());
    }
    // Separate loops per encoder (interleaving them would time each one with the previous
    // one's data in the CPU caches instead of its own).
    let mut follow_tokens = 0;
    let mut follow_ours = Vec::new();
    for f in followups.iter().skip(5) {
        let t = Instant::now();
        let ids = std::hint::black_box(reuse.encode(f, false)?);
        follow_ours.push(t.elapsed().as_secs_f64());
        follow_tokens = ids.len();
    }
    let mut cold_ours = Vec::new();
    for f in followups.iter().skip(5) {
        let t = Instant::now();
        std::hint::black_box(fast.encode(f, false));
        cold_ours.push(t.elapsed().as_secs_f64());
    }
    let mut cold_hf = Vec::new();
    for f in followups.iter().skip(5).take(40) {
        let t = Instant::now();
        let _ = std::hint::black_box(hf.encode(f.as_str(), false));
        cold_hf.push(t.elapsed().as_secs_f64());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (fo, co, ch) = (
        median(&mut follow_ours),
        median(&mut cold_ours),
        median(&mut cold_hf),
    );
    let stats = reuse.stats();

    println!("| prompt | tokens | HF encode | HF encode_fast | kvroute fast | tok/s HF | tok/s fast | speedup vs HF encode | speedup vs HF encode_fast |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2}M | {:.2}M | {:.1}x | {:.1}x |",
            r.label,
            r.tokens,
            r.hf * 1e3,
            r.hf_fast * 1e3,
            r.ours * 1e3,
            r.tokens as f64 / r.hf / 1e6,
            r.tokens as f64 / r.ours / 1e6,
            r.hf / r.ours,
            r.hf_fast / r.ours
        );
    }
    println!();
    println!("| follow-up turn of the 8K conversation | median |");
    println!("|---|---:|");
    println!("| tokens in the follow-up prompt | {follow_tokens} |");
    println!("| HF cold encode | {:.3} ms |", ch * 1e3);
    println!("| kvroute cold encode | {:.3} ms |", co * 1e3);
    println!("| kvroute PrefixReuseEncoder | {:.3} ms |", fo * 1e3);
    println!(
        "| follow-up cost / kvroute cold | {:.1}% |",
        fo / co * 100.0
    );
    println!("| follow-up cost / HF cold | {:.1}% |", fo / ch * 100.0);
    println!(
        "| reuse stats | {} requests, {} hits, {} tokens reused, {} encoded |",
        stats.requests, stats.hits, stats.reused_tokens, stats.encoded_tokens
    );
    let at8k = rows
        .iter()
        .find(|r| r.label == "8K")
        .map_or(0.0, |r| r.hf / r.ours);
    println!();
    println!("speedup vs HF tokenizers at 8K: {at8k:.1}");

    if let Some(svg_path) = svg {
        write_svg(&svg_path, &rows, (ch, co, fo))?;
        eprintln!("wrote {}", svg_path.display());
    }
    Ok(())
}

/// Grouped horizontal bars of throughput (M tokens/s) per prompt size, plus follow-up cost.
fn write_svg(path: &PathBuf, rows: &[Row], follow: (f64, f64, f64)) -> std::io::Result<()> {
    let series = [
        ("HF encode", "#9e9e9e"),
        ("HF encode_fast", "#616161"),
        ("kvroute fast", "#1e88e5"),
    ];
    let bars: Vec<(String, Vec<f64>)> = rows
        .iter()
        .map(|r| {
            let tps = |s: f64| r.tokens as f64 / s / 1e6;
            (
                format!("{} tokens cold", r.label),
                vec![tps(r.hf), tps(r.hf_fast), tps(r.ours)],
            )
        })
        .collect();
    let max = bars
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let width = 760.0;
    let left = 150.0;
    let bar_h = 16.0;
    let group_h = bar_h * 3.0 + 18.0;
    let height = 60.0 + group_h * bars.len() as f64 + 70.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"22\" font-size=\"15\" font-weight=\"bold\">Qwen3 tokenization throughput (M tokens/s, higher is better)</text>\n"
    );
    for (gi, (label, vals)) in bars.iter().enumerate() {
        let y0 = 40.0 + gi as f64 * group_h;
        s.push_str(&format!(
            "<text x=\"10\" y=\"{:.1}\">{label}</text>\n",
            y0 + bar_h * 1.8
        ));
        for (si, v) in vals.iter().enumerate() {
            let w = (width - left - 90.0) * v / max;
            let y = y0 + si as f64 * bar_h;
            s.push_str(&format!(
                "<rect x=\"{left}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"{:.1}\" fill=\"{}\"/>\n<text x=\"{:.1}\" y=\"{:.1}\">{v:.2}</text>\n",
                bar_h - 2.0,
                series[si].1,
                left + w + 4.0,
                y + bar_h - 4.0
            ));
        }
    }
    let y = 40.0 + group_h * bars.len() as f64 + 10.0;
    for (i, (name, color)) in series.iter().enumerate() {
        let x = 10.0 + i as f64 * 170.0;
        s.push_str(&format!(
            "<rect x=\"{x}\" y=\"{y}\" width=\"12\" height=\"12\" fill=\"{color}\"/><text x=\"{:.1}\" y=\"{:.1}\">{name}</text>\n",
            x + 16.0,
            y + 10.0
        ));
    }
    let (ch, co, fo) = follow;
    s.push_str(&format!(
        "<text x=\"10\" y=\"{:.1}\">8K follow-up turn: HF cold {:.2} ms, kvroute cold {:.2} ms, kvroute prefix reuse {:.3} ms ({:.1}% of cold)</text>\n</svg>\n",
        y + 40.0,
        ch * 1e3,
        co * 1e3,
        fo * 1e3,
        fo / co * 100.0
    ));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, s)
}
