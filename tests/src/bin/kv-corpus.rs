//! `kv-corpus`: replays a Mooncake trace through N simulated workers' block managers into the
//! deterministic event + lookup corpus that `index-bench` feeds to every KV index backend.
//! See `kvroute_tests::index_bench::corpus` for the rules and the file format.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use kvroute_tests::index_bench::corpus::{generate, read_trace, GenConfig};
use sha2::{Digest, Sha256};

#[derive(Parser, Debug)]
#[command(about = "Generate the KV index replay corpus from a Mooncake trace")]
struct Args {
    /// Mooncake JSONL trace (the copies in tests/data/traces/ are checked against SOURCE.txt).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/data/traces/conversation_trace.jsonl"))]
    trace: PathBuf,
    /// Simulated workers (dp rank 0 each).
    #[arg(long, default_value_t = 16)]
    workers: u32,
    /// Engine block size in tokens (each 512-token trace id is re-chunked at it).
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV cache capacity of each worker, in blocks.
    #[arg(long, default_value_t = 16_384)]
    capacity_blocks: u64,
    /// Seed of the routing tie-break.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Simulated decode time per output token (sets when a request frees its blocks).
    #[arg(long, default_value_t = 20_000)]
    decode_us_per_token: u64,
    /// Only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Output file (default: .cache/corpus/<trace>-w<workers>-bs<block size>.kvc under the
    /// workspace root).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// If `trace` sits next to a SOURCE.txt that lists its sha256, check it.
fn verify(trace: &Path) -> Result<()> {
    let Some(dir) = trace.parent() else {
        return Ok(());
    };
    let Ok(source) = std::fs::read_to_string(dir.join("SOURCE.txt")) else {
        return Ok(());
    };
    let name = trace
        .file_name()
        .and_then(|n| n.to_str())
        .context("trace path has no file name")?;
    let Some(line) = source.lines().find(|l| l.starts_with(name)) else {
        return Ok(());
    };
    let Some(want) = line
        .split_whitespace()
        .skip_while(|w| *w != "sha256")
        .nth(1)
    else {
        return Ok(());
    };
    let bytes = std::fs::read(trace).with_context(|| format!("reading {}", trace.display()))?;
    let got = hex::encode(Sha256::digest(&bytes));
    if got != want {
        bail!(
            "{} has sha256 {got}, SOURCE.txt says {want}",
            trace.display()
        );
    }
    eprintln!("trace {name}: sha256 verified");
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    verify(&args.trace)?;
    let stem = args
        .trace
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("trace")
        .trim_end_matches("_trace")
        .to_string();
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.cache/corpus")).join(format!(
            "{stem}-w{}-bs{}.kvc",
            args.workers, args.block_size
        ))
    });
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let rows = read_trace(&args.trace)?;
    let cfg = GenConfig {
        workers: args.workers,
        block_size: args.block_size,
        capacity_blocks: args.capacity_blocks,
        seed: args.seed,
        decode_us_per_token: args.decode_us_per_token,
        limit: args.limit,
    };
    let t0 = Instant::now();
    let (corpus, stats) = generate(&rows, &stem, &cfg, |done, total| {
        eprintln!("  replaying requests: {done}/{total}");
    })?;
    let totals = corpus.totals();
    eprintln!(
        "generated in {:.1} s: {} requests (preempted {}, skipped {}, decode skipped {}), \
         routed prefix hits {:.1}% of lookup blocks",
        t0.elapsed().as_secs_f64(),
        stats.requests,
        stats.preempted,
        stats.skipped,
        stats.decode_skipped,
        100.0 * stats.routed_hit_blocks as f64 / stats.lookup_blocks.max(1) as f64
    );
    eprintln!(
        "ops {}: {} lookups / {} blocks, {} stored events / {} blocks, {} removed events / {} \
         blocks, {} cleared; {} block ops over {:.1} s of trace time",
        corpus.ops.len(),
        totals.lookups,
        totals.lookup_blocks,
        totals.stored_events,
        totals.stored_blocks,
        totals.removed_events,
        totals.removed_blocks,
        totals.cleared_events,
        totals.block_ops(),
        corpus.span_ns() as f64 / 1e9
    );
    corpus.write(&out)?;
    println!("{}", out.display());
    Ok(())
}
