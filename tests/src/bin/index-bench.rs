//! `index-bench`: the KV index replay benchmark. For each corpus (from `kv-corpus`): the
//! exactness cross-check (every lookup: ours vs the reference index vs ChainIndex), then per
//! backend the flat-out capacity and the sustained block ops/s (highest offered rate of which
//! at least 99% is achieved), lookup p50/p99 at that load and memory; ends with a table, a JSON
//! record and an SVG chart. See `kvroute_tests::index_bench::replay` for the definitions.
//!
//! With `--rounds N` the ours/ChainIndex searches run N times, alternating which goes first, so
//! that interference from the rest of the machine falls on both; the table shows each backend's
//! median round (by sustained rate) and the per-round ratios are printed beside it.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use kvroute_tests::index_bench::backends::{events, Backend, Chain, Naive, Ours, Shared};
use kvroute_tests::index_bench::corpus::Corpus;
use kvroute_tests::index_bench::replay::{search, Plan, Search};
use kvroute_tests::index_bench::svg::{bar_chart, Bar, Group};
use kvroute_tests::index_bench::{cross_check, CrossCheck};

#[derive(Parser, Debug)]
#[command(
    about = "Open-loop replay of KV index corpora against kvroute, ChainIndex and a naive map"
)]
struct Args {
    /// Corpus files written by kv-corpus (repeat for several).
    #[arg(long, required = true)]
    corpus: Vec<PathBuf>,
    /// Lanes (threads); each applies its workers' events and its share of lookups.
    #[arg(long, default_value_t = 2)]
    lanes: usize,
    /// Backends: ours, chain, naive.
    #[arg(long, value_delimiter = ',', default_value = "ours,chain,naive")]
    backends: Vec<String>,
    /// Bisection steps of the sustained-rate search.
    #[arg(long, default_value_t = 7)]
    steps: usize,
    /// Trials per tested rate; a rate is sustained only if every one keeps up.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Bisection steps for the naive baseline (slow: tens of seconds per trial).
    #[arg(long, default_value_t = 3)]
    naive_steps: usize,
    /// Rounds of the ours/ChainIndex searches (alternating order); the table reports each
    /// backend's median round. The naive baseline runs once.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Skip the exactness cross-check.
    #[arg(long)]
    no_cross_check: bool,
    /// Write the chart here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

struct Row {
    label: String,
    backend: &'static str,
    search: Search,
    /// Sustained rate of every round, in round order.
    rounds: Vec<f64>,
}

fn sustained(search: &Search) -> f64 {
    search.sustained.as_ref().map_or(0.0, |s| s.0)
}

/// The round with the median sustained rate (the lower middle for an even count).
fn median_round(mut searches: Vec<Search>) -> Search {
    searches.sort_by(|a, b| sustained(a).total_cmp(&sustained(b)));
    let middle = (searches.len() - 1) / 2;
    searches.swap_remove(middle)
}

fn mops(v: f64) -> String {
    format!("{:.2} M", v / 1e6)
}

fn us(ns: u64) -> String {
    format!("{:.1} µs", ns as f64 / 1e3)
}

fn run_backend<B: Backend>(
    label: &str,
    make: &dyn Fn() -> B,
    plan: &Plan,
    hashes: &[u64],
    steps: usize,
    repeats: usize,
) -> (&'static str, Search) {
    let name = make().name();
    eprintln!("[{label}] {name}");
    let t0 = Instant::now();
    let result = search(make, plan, hashes, steps, repeats, |line| {
        eprintln!("[{label}] {name}: {line}");
    });
    eprintln!(
        "[{label}] {name}: done in {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    (name, result)
}

fn main() -> Result<()> {
    let args = Args::parse();
    for b in &args.backends {
        if !["ours", "chain", "naive"].contains(&b.as_str()) {
            bail!("unknown backend {b:?} (ours, chain, naive)");
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!(
        "machine: {} CPUs, load average {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load.trim()
    );
    let mut rows: Vec<Row> = Vec::new();
    let mut checks: Vec<(String, CrossCheck)> = Vec::new();
    let mut corpora_json = Vec::new();
    for path in &args.corpus {
        let corpus = Corpus::read(path)?;
        let header = corpus.header()?.clone();
        let totals = corpus.totals();
        let label = format!("{} / {} workers", header.trace_name, header.workers);
        eprintln!(
            "[{label}] {}: {} ops, {} block ops ({} looked up, {} stored, {} removed), block \
             size {}, capacity {} blocks/worker",
            path.display(),
            corpus.ops.len(),
            totals.block_ops(),
            totals.lookup_blocks,
            totals.stored_blocks,
            totals.removed_blocks,
            header.block_size,
            header.capacity_blocks
        );
        let shared = Shared::new(&corpus);
        let evs = events(&shared);
        if !args.no_cross_check {
            let t0 = Instant::now();
            let check = cross_check(&shared, &evs, |done, total| {
                if done % 500_000 < 50_000 {
                    eprintln!("[{label}] cross-check {done}/{total}");
                }
            })?;
            eprintln!(
                "[{label}] cross-check in {:.0} s: {} lookups ({} non-empty); mismatches ours vs \
                 reference {}, ours vs ChainIndex {}, ChainIndex vs reference {}, naive vs \
                 reference {}; rejected stores ours {} chain {} reference {}",
                t0.elapsed().as_secs_f64(),
                check.lookups,
                check.nonempty,
                check.ours_vs_reference,
                check.ours_vs_chain,
                check.chain_vs_reference,
                check.naive_vs_reference,
                check.ours_rejected,
                check.chain_rejected,
                check.reference_rejected
            );
            checks.push((label.clone(), check));
        }
        let plan = Plan::new(&shared, &evs, args.lanes);
        let mut results: Vec<(&'static str, Vec<Search>)> = Vec::new();
        for round in 0..args.rounds.max(1) {
            let mut order: Vec<&String> = args.backends.iter().collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for backend in order {
                if backend == "naive" && round > 0 {
                    continue;
                }
                if args.rounds > 1 {
                    eprintln!("[{label}] round {} of {}", round + 1, args.rounds);
                }
                let (name, result) = match backend.as_str() {
                    "ours" => run_backend(
                        &label,
                        &|| Ours::prepare(&shared),
                        &plan,
                        &corpus.hashes,
                        args.steps,
                        args.repeats,
                    ),
                    "chain" => {
                        // Fail early, outside the timed closure, if interning cannot work.
                        Chain::prepare(&shared)?;
                        run_backend(
                            &label,
                            &|| match Chain::prepare(&shared) {
                                Ok(chain) => chain,
                                Err(e) => {
                                    panic!("ChainIndex preparation failed after succeeding: {e}")
                                }
                            },
                            &plan,
                            &corpus.hashes,
                            args.steps,
                            args.repeats,
                        )
                    }
                    _ => run_backend(
                        &label,
                        &|| Naive::prepare(&shared),
                        &plan,
                        &corpus.hashes,
                        args.naive_steps,
                        1,
                    ),
                };
                match results.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, searches)) => searches.push(result),
                    None => results.push((name, vec![result])),
                }
            }
        }
        // Table order: as the backends were given.
        for backend in &args.backends {
            let name = match backend.as_str() {
                "ours" => "kvroute KvIndex",
                "chain" => "kv-index ChainIndex",
                _ => "naive nested map",
            };
            if let Some(at) = results.iter().position(|(n, _)| *n == name) {
                let (name, searches) = results.swap_remove(at);
                let rounds = searches.iter().map(sustained).collect();
                rows.push(Row {
                    label: label.clone(),
                    backend: name,
                    search: median_round(searches),
                    rounds,
                });
            }
        }
        corpora_json.push(serde_json::json!({
            "path": path.display().to_string(),
            "trace": header.trace_name,
            "workers": header.workers,
            "block_size": header.block_size,
            "capacity_blocks": header.capacity_blocks,
            "seed": header.seed,
            "ops": corpus.ops.len(),
            "block_ops": totals.block_ops(),
            "lookup_blocks": totals.lookup_blocks,
            "stored_blocks": totals.stored_blocks,
            "removed_blocks": totals.removed_blocks,
        }));
    }

    // The table.
    println!();
    println!(
        "| corpus | backend | sustained block ops/s | capacity (flat out) | lookup p50 | lookup p99 | memory | ratio vs ChainIndex |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let mut json_rows = Vec::new();
    for row in &rows {
        let chain = rows
            .iter()
            .find(|r| r.label == row.label && r.backend == "kv-index ChainIndex")
            .and_then(|r| r.search.sustained.as_ref().map(|s| s.0));
        let (rate, p50, p99) = match &row.search.sustained {
            Some((rate, trial)) => (*rate, trial.percentile(50.0), trial.percentile(99.0)),
            None => (0.0, 0, 0),
        };
        let ratio = chain.filter(|c| *c > 0.0).map(|c| rate / c);
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.1} MiB | {} |",
            row.label,
            row.backend,
            mops(rate),
            mops(row.search.capacity.achieved),
            us(p50),
            us(p99),
            row.search.capacity.memory_bytes as f64 / (1 << 20) as f64,
            ratio.map_or("-".to_string(), |r| format!("{r:.2}")),
        );
        json_rows.push(serde_json::json!({
            "corpus": row.label,
            "backend": row.backend,
            "sustained_block_ops_per_s": rate,
            "capacity_block_ops_per_s": row.search.capacity.achieved,
            "lookup_p50_ns": p50,
            "lookup_p99_ns": p99,
            "memory_bytes": row.search.capacity.memory_bytes,
            "apply_failures": row.search.capacity.apply_failures,
            "ratio_vs_chain": ratio,
            "sustained_per_round": row.rounds,
            "points": row.search.points.iter().map(|(offered, kept, achieved)| serde_json::json!({
                "offered": offered, "kept_up": kept, "achieved": achieved
            })).collect::<Vec<_>>(),
        }));
    }
    for row in rows.iter().filter(|r| r.backend == "kvroute KvIndex") {
        let ours = row.search.sustained.as_ref().map_or(0.0, |s| s.0);
        if let Some(chain) = rows
            .iter()
            .find(|r| r.label == row.label && r.backend == "kv-index ChainIndex")
            .and_then(|r| r.search.sustained.as_ref().map(|s| s.0))
        {
            println!("{}: ratio vs ChainIndex: {:.2}", row.label, ours / chain);
            if let Some(chain_row) = rows
                .iter()
                .find(|r| r.label == row.label && r.backend == "kv-index ChainIndex")
            {
                if row.rounds.len() > 1 {
                    let per_round: Vec<String> = row
                        .rounds
                        .iter()
                        .zip(&chain_row.rounds)
                        .map(|(o, c)| format!("{:.2}", o / c))
                        .collect();
                    println!(
                        "{}: per round: ours {} M, ChainIndex {} M, ratio {}",
                        row.label,
                        row.rounds
                            .iter()
                            .map(|r| format!("{:.1}", r / 1e6))
                            .collect::<Vec<_>>()
                            .join(" / "),
                        chain_row
                            .rounds
                            .iter()
                            .map(|r| format!("{:.1}", r / 1e6))
                            .collect::<Vec<_>>()
                            .join(" / "),
                        per_round.join(" / ")
                    );
                }
            }
        }
    }
    for (label, check) in &checks {
        println!(
            "{label}: exactness mismatches: ours vs reference {}, ours vs ChainIndex {} ({} lookups, {} non-empty)",
            check.ours_vs_reference, check.ours_vs_chain, check.lookups, check.nonempty
        );
    }

    if let Some(path) = &args.svg {
        let mut groups: Vec<Group> = Vec::new();
        for row in &rows {
            if groups.last().is_none_or(|g| g.label != row.label) {
                groups.push(Group {
                    label: row.label.clone(),
                    bars: Vec::new(),
                });
            }
            let (value, note) = match &row.search.sustained {
                Some((rate, trial)) => (
                    *rate,
                    format!("p99 {:.1}µs", trial.percentile(99.0) as f64 / 1e3),
                ),
                None => (0.0, String::new()),
            };
            if let Some(group) = groups.last_mut() {
                group.bars.push(Bar {
                    backend: row.backend.to_string(),
                    value,
                    note,
                });
            }
        }
        let svg = bar_chart(
            "KV index replay: sustained block ops/s (>= 99% of offered kept up)",
            &format!(
                "Mooncake traces through simulated workers; {} lanes on a {}-CPU machine; bar label: lookup p99",
                args.lanes,
                std::thread::available_parallelism().map_or(0, |n| n.get())
            ),
            &groups,
        );
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("chart: {}", path.display());
    }
    if let Some(path) = &args.json {
        let record = serde_json::json!({
            "lanes": args.lanes,
            "rounds": args.rounds,
            "load_average_at_start": load.trim(),
            "corpora": corpora_json,
            "rows": json_rows,
            "cross_checks": checks.iter().map(|(label, c)| serde_json::json!({
                "corpus": label,
                "lookups": c.lookups,
                "nonempty": c.nonempty,
                "ours_vs_reference": c.ours_vs_reference,
                "ours_vs_chain": c.ours_vs_chain,
                "chain_vs_reference": c.chain_vs_reference,
                "naive_vs_reference": c.naive_vs_reference,
            })).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&record)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
