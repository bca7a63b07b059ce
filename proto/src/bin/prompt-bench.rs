//! `prompt-bench`: cost of prompt understanding per 1K prompt tokens with the real Qwen3 files.
//!
//! Measures, for prompts of several sizes: request parsing (`parse_request`), chat templating
//! (`render`), BPE tokenization (`encode`), and the full chat path the EPP and the worker run
//! (`parse_request` + `token_ids`). Text is deterministic pseudo-English so runs compare.
//! The tokenizer remembers recent prompts (prefix reuse), so each path is timed twice: *cold*,
//! with a unique first line per iteration so nothing can be reused, and *repeat*, the same
//! prompt again (what a retried or fanned-out request costs).
//!
//! Usage: `cargo run --release -p kvroute-proto --bin prompt-bench [-- --min-secs S]`
//! (model dir from `KVROUTE_MODEL_DIR`, else `.cache/models/qwen3`). Progress goes to stderr,
//! the table to stdout.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvroute_proto::openai::{parse_request, ApiKind};
use kvroute_proto::prompt::PromptRenderer;
use serde_json::json;

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "cache",
    "router",
    "worker",
    "prefill",
    "decode",
    "token",
    "block",
    "latency",
    "throughput",
    "request",
    "gateway",
    "kubernetes",
    "inference",
    "model",
    "attention",
    "memory",
    "transfer",
    "topology",
    "scheduler",
    "batch",
    "sequence",
    "prefix",
    "overlap",
    "hash",
    "engine",
    "deployment",
    "configuration",
    "performance",
    "distributed",
    "approximately",
    "international",
    "quickly",
    "understanding",
    "2024",
    "42",
    "3.14",
    "(see",
    "below)",
    "e.g.",
    "i.e.",
    "--",
    "don't",
    "it's",
    "naïve",
    "café",
    "résumé",
    "日本語",
    "数据",
    "🚀",
];

/// Deterministic xorshift64* so the text is identical on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn text_of_words(rng: &mut Rng, words: usize) -> String {
    let mut s = String::with_capacity(words * 7);
    for i in 0..words {
        let w = WORDS[(rng.next() % WORDS.len() as u64) as usize];
        if i > 0 {
            s.push(if i % 17 == 0 { '\n' } else { ' ' });
        }
        s.push_str(w);
        if i % 11 == 10 {
            s.push(if i % 3 == 0 { '.' } else { ',' });
        }
    }
    s
}

/// Runs `f` repeatedly for at least `min` (and 3 runs); returns the median run time.
fn time<T>(min: Duration, mut f: impl FnMut() -> T) -> Duration {
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < 3 || start.elapsed() < min {
        let t = Instant::now();
        std::hint::black_box(f());
        samples.push(t.elapsed());
        if samples.len() >= 10_000 {
            break;
        }
    }
    samples.sort();
    samples[samples.len() / 2]
}

fn per_1k(d: Duration, tokens: usize) -> f64 {
    d.as_secs_f64() * 1e6 * 1000.0 / tokens as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut min_secs = 1.0f64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--min-secs" => {
                min_secs = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--min-secs needs a number")?
            }
            "-h" | "--help" => {
                println!("prompt-bench [--min-secs S]   (model dir: $KVROUTE_MODEL_DIR or .cache/models/qwen3)");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    let min = Duration::from_secs_f64(min_secs);
    let dir = std::env::var_os("KVROUTE_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".cache/models/qwen3"));
    if !dir.join("tokenizer.json").exists() {
        return Err(format!(
            "no tokenizer.json in {}: run `./dev setup` or set KVROUTE_MODEL_DIR",
            dir.display()
        )
        .into());
    }

    let t = Instant::now();
    let r = PromptRenderer::from_dir(&dir)?;
    let load = t.elapsed();
    eprintln!("loaded {} in {load:.2?}", dir.display());

    struct Row {
        target: usize,
        tokens: usize,
        parse: f64,
        render: f64,
        encode: f64,
        encode_cold: f64,
        chat_total: f64,
        chat_cold: f64,
        completion_total: f64,
    }
    let mut rows = Vec::new();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for target in [256usize, 1024, 4096, 16384, 65536] {
        eprint!("{target:>6}-token prompts ... ");
        // ~0.75 words per token for this vocabulary mix; measure the real count below.
        let text = text_of_words(&mut rng, target * 3 / 4);
        // A multi-turn conversation carrying the same text in 8 turns.
        let chunk = text.len() / 8;
        let mut messages =
            vec![json!({"role": "system", "content": "You are a helpful assistant."})];
        let mut start = 0;
        for i in 0..8 {
            let mut end = if i == 7 { text.len() } else { start + chunk };
            while !text.is_char_boundary(end) {
                end += 1;
            }
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": &text[start..end]}));
            start = end;
        }
        let chat_body = json!({"model": "m", "messages": messages, "max_tokens": 16}).to_string();
        let completion_body = json!({"model": "m", "prompt": text, "max_tokens": 16}).to_string();
        let chat_req = parse_request(ApiKind::ChatCompletions, chat_body.as_bytes())?;
        let rendered = r.render(&chat_req)?;
        let tokens = r.token_ids(&chat_req)?.len();

        let parse = time(min, || {
            parse_request(ApiKind::ChatCompletions, chat_body.as_bytes()).map(|p| p.max_tokens)
        });
        let render = time(min, || r.render(&chat_req).map(|s| s.len()));
        let encode = time(min, || r.encode(&rendered, false).map(|v| v.len()));
        let mut n = 0u64;
        let encode_cold = time(min, || {
            n += 1;
            r.encode(&format!("{n}\n{rendered}"), false)
                .map(|v| v.len())
        });
        let chat_cold = time(min, || {
            n += 1;
            let mut m = messages.clone();
            m[0] = json!({"role": "system", "content": format!("Session {n}. You are a helpful assistant.")});
            let body = json!({"model": "m", "messages": m, "max_tokens": 16}).to_string();
            parse_request(ApiKind::ChatCompletions, body.as_bytes())
                .ok()
                .and_then(|p| r.token_ids(&p).ok())
                .map(|v| v.len())
        });
        let chat_total = time(min, || {
            parse_request(ApiKind::ChatCompletions, chat_body.as_bytes())
                .ok()
                .and_then(|p| r.token_ids(&p).ok())
                .map(|v| v.len())
        });
        let completion_total = time(min, || {
            parse_request(ApiKind::Completions, completion_body.as_bytes())
                .ok()
                .and_then(|p| r.token_ids(&p).ok())
                .map(|v| v.len())
        });
        eprintln!(
            "{tokens} tokens: chat path {:.0} µs/1K tokens",
            per_1k(chat_total, tokens)
        );
        rows.push(Row {
            target,
            tokens,
            parse: per_1k(parse, tokens),
            render: per_1k(render, tokens),
            encode: per_1k(encode, tokens),
            encode_cold: per_1k(encode_cold, tokens),
            chat_total: per_1k(chat_total, tokens),
            chat_cold: per_1k(chat_cold, tokens),
            completion_total: per_1k(completion_total, tokens),
        });
    }

    println!();
    println!(
        "prompt understanding cost, µs per 1K prompt tokens (median; tokenizer load {load:.2?})"
    );
    println!(
        "| target | tokens | parse | template | encode cold | encode repeat | chat cold | chat repeat | completion repeat |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for row in &rows {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            row.target,
            row.tokens,
            row.parse,
            row.render,
            row.encode_cold,
            row.encode,
            row.chat_cold,
            row.chat_total,
            row.completion_total
        );
    }
    println!();
    println!(
        "chat = parse_request + render + encode (what the EPP and the worker run per request);"
    );
    println!(
        "cold = a unique first line each time (no prefix reuse); repeat = the same prompt again"
    );
    Ok(())
}
