//! `transfer-bench`: KV transfer agent bandwidth against a plain loopback TCP copy of the same
//! bytes, in the same run.
//!
//! For each size it moves the same buffer three ways, each over one warm loopback connection:
//! - `plain-tcp`: the server `write_all`s the buffer, the client `read_exact`s it (the ceiling);
//! - `agent-host`: the agent reads a registered host region by a list of block-sized
//!   descriptors (coalesced into one on the wire);
//! - `agent-kv-pool`: the agent reads every page of a paged KV pool region (one descriptor per
//!   block, gathered by the target with vectored writes) — the sim prefill worker's path.
//!
//! Progress goes to stderr, the table to stdout, and an SVG bar chart to `--svg`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Parser;
use kvroute_worker::transfer::{Agent, Backend, Descriptor, Memory, PagedRegion};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug, Parser)]
#[command(
    name = "transfer-bench",
    about = "KV transfer agent vs plain loopback TCP copy"
)]
struct Args {
    /// Transfer sizes in MiB.
    #[arg(long, env = "KVROUTE_BENCH_SIZES_MIB", value_delimiter = ',', default_values_t = [16u64, 64, 256])]
    sizes_mib: Vec<u64>,
    /// Timed repetitions per size and method (the median is reported).
    #[arg(long, env = "KVROUTE_BENCH_ITERS", default_value_t = 7)]
    iters: usize,
    /// KV block size in KiB (descriptor granularity; 64 KiB = 16 tokens x 4 KiB).
    #[arg(long, env = "KVROUTE_BENCH_BLOCK_KIB", default_value_t = 64)]
    block_kib: u64,
    /// Where to write the SVG bar chart.
    #[arg(
        long,
        env = "KVROUTE_BENCH_SVG",
        default_value = "docs/img/transfer-bench.svg"
    )]
    svg: PathBuf,
}

const METHODS: [&str; 3] = ["plain-tcp", "agent-host", "agent-kv-pool"];

/// Plain copy: a server that answers each 8-byte length request with that many bytes.
async fn plain_server(data: Bytes) -> anyhow::Result<String> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?.to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let data = data.clone();
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let mut len = [0u8; 8];
                while s.read_exact(&mut len).await.is_ok() {
                    let n = u64::from_le_bytes(len) as usize;
                    if s.write_all(&data[..n.min(data.len())]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    Ok(addr)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.iters == 0 || args.sizes_mib.is_empty() || args.block_kib == 0 {
        bail!("--iters, --sizes-mib and --block-kib must be positive");
    }
    let block = (args.block_kib << 10) as usize;
    let max = (*args.sizes_mib.iter().max().unwrap_or(&1) << 20) as usize;
    eprintln!("generating {} MiB of data", max >> 20);
    let data: Bytes = {
        let mut v = vec![0u8; max];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for c in v.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
        Bytes::from(v)
    };

    // Targets: the plain server and one agent holding the same bytes two ways.
    let plain_addr = plain_server(data.clone()).await?;
    let target = Agent::new("bench-target", Backend::Tcp)?;
    let host = target.register_memory(Memory::Host(data.clone()));
    let pages = max.div_ceil(block);
    let pool = Arc::new(PagedRegion::new(pages, block as u64));
    for p in 0..pages {
        let start = p * block;
        let mut page = data.slice(start..(start + block).min(max)).to_vec();
        page.resize(block, 0);
        pool.fill(p, Bytes::from(page))?;
    }
    let pool_h = target.register_memory(Memory::Paged(pool));
    let addr = target.listen("127.0.0.1:0".parse()?, None).await?;
    let init = Agent::new("bench-initiator", Backend::Tcp)?;
    let md = init.fetch_metadata(&addr.to_string()).await?;
    let remote = init.load_remote(md)?;
    let mut plain = TcpStream::connect(&plain_addr).await?;
    plain.set_nodelay(true)?;

    let mut rows: Vec<(u64, [f64; 3])> = Vec::new();
    for &mib in &args.sizes_mib {
        let size = (mib << 20) as usize;
        let n_blocks = size.div_ceil(block);
        let size = n_blocks * block;
        if size > pages * block {
            bail!("size {mib} MiB exceeds the generated data");
        }
        let host_descs: Vec<Descriptor> = (0..n_blocks)
            .map(|i| Descriptor {
                region: host.id,
                offset: (i * block) as u64,
                len: block as u64,
            })
            .collect();
        let pool_descs: Vec<Descriptor> = (0..n_blocks)
            .map(|i| Descriptor {
                region: pool_h.id,
                offset: (i * block) as u64,
                len: block as u64,
            })
            .collect();
        let mut buf = vec![0u8; size];
        let mut samples: [Vec<f64>; 3] = Default::default();
        // Interleave the methods so machine noise hits all of them alike; one warm-up round.
        for it in 0..=args.iters {
            for (m, sample) in samples.iter_mut().enumerate() {
                let t0 = Instant::now();
                match m {
                    0 => {
                        plain.write_all(&(size as u64).to_le_bytes()).await?;
                        plain.read_exact(&mut buf).await?;
                    }
                    _ => {
                        let descs = if m == 1 { &host_descs } else { &pool_descs };
                        let out = init
                            .read(&remote, descs, std::mem::take(&mut buf))?
                            .wait()
                            .await?;
                        buf = out.data;
                    }
                }
                let el = t0.elapsed();
                if buf[..64] != data[..64]
                    || buf[size - block..size - block + 64] != data[size - block..size - block + 64]
                {
                    bail!("{} delivered wrong bytes", METHODS[m]);
                }
                if it > 0 {
                    sample.push(gbps(size, el));
                }
            }
            eprintln!("  {mib} MiB: round {it}/{}", args.iters);
        }
        let med = [
            median(samples[0].clone()),
            median(samples[1].clone()),
            median(samples[2].clone()),
        ];
        eprintln!(
            "{mib} MiB: plain {:.2} GB/s, agent-host {:.2} GB/s, agent-kv-pool {:.2} GB/s",
            med[0], med[1], med[2]
        );
        rows.push((mib, med));
    }

    println!(
        "block {} KiB, {} iterations (median), loopback TCP, one connection per method",
        args.block_kib, args.iters
    );
    println!("| size | method | GB/s | % of plain copy |");
    println!("|---:|---|---:|---:|");
    for (mib, med) in &rows {
        for (m, name) in METHODS.iter().enumerate() {
            println!(
                "| {mib} MiB | {name} | {:.2} | {:.0}% |",
                med[m],
                100.0 * med[m] / med[0]
            );
        }
    }
    write_svg(&args.svg, &rows, args.block_kib)
        .with_context(|| format!("writing {}", args.svg.display()))?;
    eprintln!("wrote {}", args.svg.display());
    Ok(())
}

fn write_svg(path: &PathBuf, rows: &[(u64, [f64; 3])], block_kib: u64) -> anyhow::Result<()> {
    let colors = ["#888888", "#2b7bb9", "#e07b39"];
    let (w, h, left, top, bottom) = (760.0, 360.0, 60.0, 50.0, 60.0);
    let max = rows
        .iter()
        .flat_map(|r| r.1)
        .fold(0.0f64, f64::max)
        .max(0.1)
        * 1.1;
    let group_w = (w - left - 20.0) / rows.len().max(1) as f64;
    let bar_w = group_w / 4.0;
    let plot_h = h - top - bottom;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14">KV transfer agent vs plain loopback TCP copy (GB/s, median; {block_kib} KiB blocks)</text>"#,
        w / 2.0
    );
    let _ = writeln!(
        s,
        r#"<line x1="{left}" y1="{top}" x2="{left}" y2="{}" stroke="black"/>"#,
        h - bottom
    );
    for i in 0..=4 {
        let v = max * i as f64 / 4.0;
        let y = h - bottom - plot_h * i as f64 / 4.0;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{v:.1}</text><line x1="{left}" y1="{y}" x2="{}" y2="{y}" stroke="lightgray"/>"#,
            left - 5.0,
            y + 4.0,
            w - 20.0
        );
    }
    for (g, (mib, med)) in rows.iter().enumerate() {
        let gx = left + g as f64 * group_w + bar_w / 2.0;
        for (m, v) in med.iter().enumerate() {
            let bh = plot_h * v / max;
            let x = gx + m as f64 * bar_w;
            let y = h - bottom - bh;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{bh:.1}" fill="{}"/><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{v:.2}</text>"#,
                bar_w - 4.0,
                colors[m],
                x + (bar_w - 4.0) / 2.0,
                y - 3.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{mib} MiB</text>"#,
            gx + 1.5 * bar_w,
            h - bottom + 18.0
        );
    }
    for (m, name) in METHODS.iter().enumerate() {
        let x = left + 10.0 + m as f64 * 200.0;
        let _ = writeln!(
            s,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{name}</text>"#,
            h - 25.0,
            colors[m],
            x + 16.0,
            h - 15.0
        );
    }
    s.push_str("</svg>\n");
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, s)?;
    Ok(())
}
