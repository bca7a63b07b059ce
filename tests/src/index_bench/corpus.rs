//! The index replay corpus: one deterministic file of KV events and lookups that drives every
//! indexer backend, and its generator from a Mooncake trace through simulated engines.
//!
//! # Generation
//! Each trace request (`hash_ids`, 512 tokens per id) becomes tokens: every id expands to a fixed
//! pseudo-random 512-token chunk derived from the id alone (the vLLM `timed_trace` / aiperf
//! approach: equal ids give equal tokens), truncated to `input_length`. Requests are replayed in
//! timestamp order through N workers, each a `kvroute_worker::sim::block_manager::BlockManager`
//! (prefix caching, refcounts, LRU eviction) at the engine block size:
//! - the request's lookup (its full blocks' local hashes) is recorded at its arrival;
//! - it is routed by a seeded rule, Dynamo's default KV-aware cost: blocks left to prefill after
//!   the worker's cached prefix plus the worker's blocks in use by running requests; the lowest
//!   cost wins, ties broken by a seeded RNG;
//! - its prompt is allocated on that worker (`start_sequence`), the block manager's events
//!   (evictions, then stores) recorded at the arrival time;
//! - at its completion (arrival + `output_length` x `decode_ms_per_token`) its output tokens are
//!   appended (decode blocks are stored like vLLM's) and the sequence is freed; if the worker is
//!   out of blocks at an arrival, its oldest running sequences are freed early (preemption).
//!
//! # File format (`KVRCORP1`, little-endian)
//! magic, u32 version, u32 block_size, u32 workers, u64 capacity_blocks, u64 seed,
//! u64 decode_us_per_token, u64 name length + UTF-8 trace name, u64 op count, then per op:
//! u8 kind, u64 deadline_ns, u64 worker_id, u32 dp_rank and the kind's payload:
//! 0 lookup `u32 n, n x u64 local hash`; 1 stored `u8 has_parent, u64 parent, u32 n,
//! n x (u64 block_hash, u64 tokens_hash)`; 2 removed `u32 n, n x u64 block_hash`; 3 cleared.
//! Ops are in nondecreasing deadline order; a lookup comes before the events of its request.

use std::collections::{BinaryHeap, VecDeque};
use std::io::{BufWriter, Read, Write};
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use kvroute_proto::events::KvEventData;
use kvroute_proto::hashing::{chain_sequence_hash, local_block_hash, namespace_seed};
use kvroute_worker::sim::block_manager::{AllocError, BlockManager, Namespace};

const MAGIC: &[u8; 8] = b"KVRCORP1";
const VERSION: u32 = 1;
/// Tokens per Mooncake `hash_id`.
pub const TRACE_BLOCK_TOKENS: usize = 512;

pub type WorkerKey = (u64, u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// `hashes[start..start + len]`: the request's local block hashes.
    Lookup {
        start: usize,
        len: usize,
    },
    /// `stored[start..start + len]`: `(block_hash, tokens_hash)` pairs.
    Stored {
        parent: Option<u64>,
        start: usize,
        len: usize,
    },
    /// `hashes[start..start + len]`: engine block hashes.
    Removed {
        start: usize,
        len: usize,
    },
    Cleared,
}

#[derive(Debug, Clone, Copy)]
pub struct Op {
    pub deadline_ns: u64,
    pub worker: WorkerKey,
    pub kind: OpKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub block_size: u32,
    pub workers: u32,
    pub capacity_blocks: u64,
    pub seed: u64,
    pub decode_us_per_token: u64,
    pub trace_name: String,
}

/// Block-op totals of a corpus: the throughput unit is their sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub lookups: u64,
    pub lookup_blocks: u64,
    pub stored_events: u64,
    pub stored_blocks: u64,
    pub removed_events: u64,
    pub removed_blocks: u64,
    pub cleared_events: u64,
}

impl Totals {
    pub fn block_ops(&self) -> u64 {
        self.lookup_blocks + self.stored_blocks + self.removed_blocks
    }
}

#[derive(Debug, Default)]
pub struct Corpus {
    pub header: Option<Header>,
    pub ops: Vec<Op>,
    pub hashes: Vec<u64>,
    pub stored: Vec<(u64, u64)>,
}

impl Corpus {
    pub fn header(&self) -> Result<&Header> {
        self.header.as_ref().context("corpus has no header")
    }

    pub fn lookup(&self, start: usize, len: usize) -> &[u64] {
        &self.hashes[start..start + len]
    }

    pub fn totals(&self) -> Totals {
        let mut t = Totals::default();
        for op in &self.ops {
            match op.kind {
                OpKind::Lookup { len, .. } => {
                    t.lookups += 1;
                    t.lookup_blocks += len as u64;
                }
                OpKind::Stored { len, .. } => {
                    t.stored_events += 1;
                    t.stored_blocks += len as u64;
                }
                OpKind::Removed { len, .. } => {
                    t.removed_events += 1;
                    t.removed_blocks += len as u64;
                }
                OpKind::Cleared => t.cleared_events += 1,
            }
        }
        t
    }

    /// Span of deadlines (first to last), in ns.
    pub fn span_ns(&self) -> u64 {
        match (self.ops.first(), self.ops.last()) {
            (Some(a), Some(b)) => b.deadline_ns - a.deadline_ns,
            _ => 0,
        }
    }

    fn push_event(&mut self, deadline_ns: u64, worker: WorkerKey, event: KvEventData) {
        let kind = match event {
            KvEventData::Stored {
                parent_hash,
                blocks,
                ..
            } => {
                let start = self.stored.len();
                self.stored
                    .extend(blocks.iter().map(|b| (b.block_hash, b.tokens_hash)));
                OpKind::Stored {
                    parent: parent_hash,
                    start,
                    len: blocks.len(),
                }
            }
            KvEventData::Removed { block_hashes } => {
                let start = self.hashes.len();
                self.hashes.extend_from_slice(&block_hashes);
                OpKind::Removed {
                    start,
                    len: block_hashes.len(),
                }
            }
            KvEventData::Cleared => OpKind::Cleared,
        };
        self.ops.push(Op {
            deadline_ns,
            worker,
            kind,
        });
    }

    /// Write the corpus file.
    pub fn write(&self, path: &Path) -> Result<()> {
        let header = self.header()?;
        let file = std::fs::File::create(path)
            .with_context(|| format!("creating corpus file {}", path.display()))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(MAGIC)?;
        w.write_all(&VERSION.to_le_bytes())?;
        w.write_all(&header.block_size.to_le_bytes())?;
        w.write_all(&header.workers.to_le_bytes())?;
        w.write_all(&header.capacity_blocks.to_le_bytes())?;
        w.write_all(&header.seed.to_le_bytes())?;
        w.write_all(&header.decode_us_per_token.to_le_bytes())?;
        w.write_all(&(header.trace_name.len() as u64).to_le_bytes())?;
        w.write_all(header.trace_name.as_bytes())?;
        w.write_all(&(self.ops.len() as u64).to_le_bytes())?;
        for op in &self.ops {
            let kind: u8 = match op.kind {
                OpKind::Lookup { .. } => 0,
                OpKind::Stored { .. } => 1,
                OpKind::Removed { .. } => 2,
                OpKind::Cleared => 3,
            };
            w.write_all(&[kind])?;
            w.write_all(&op.deadline_ns.to_le_bytes())?;
            w.write_all(&op.worker.0.to_le_bytes())?;
            w.write_all(&op.worker.1.to_le_bytes())?;
            match op.kind {
                OpKind::Lookup { start, len } | OpKind::Removed { start, len } => {
                    w.write_all(&(len as u32).to_le_bytes())?;
                    for h in &self.hashes[start..start + len] {
                        w.write_all(&h.to_le_bytes())?;
                    }
                }
                OpKind::Stored { parent, start, len } => {
                    w.write_all(&[parent.is_some() as u8])?;
                    w.write_all(&parent.unwrap_or(0).to_le_bytes())?;
                    w.write_all(&(len as u32).to_le_bytes())?;
                    for (b, t) in &self.stored[start..start + len] {
                        w.write_all(&b.to_le_bytes())?;
                        w.write_all(&t.to_le_bytes())?;
                    }
                }
                OpKind::Cleared => {}
            }
        }
        w.flush()
            .with_context(|| format!("writing corpus file {}", path.display()))?;
        Ok(())
    }

    /// Read and validate a corpus file.
    pub fn read(path: &Path) -> Result<Corpus> {
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .with_context(|| {
                format!(
                    "reading corpus file {} (generate it with kv-corpus)",
                    path.display()
                )
            })?;
        let mut r = Reader {
            bytes: &bytes,
            at: 0,
        };
        ensure!(
            r.take(8)? == MAGIC,
            "{} is not a KVRCORP1 corpus",
            path.display()
        );
        let version = r.u32()?;
        ensure!(
            version == VERSION,
            "corpus version {version}, expected {VERSION}"
        );
        let block_size = r.u32()?;
        let workers = r.u32()?;
        let capacity_blocks = r.u64()?;
        let seed = r.u64()?;
        let decode_us_per_token = r.u64()?;
        let name_len = r.u64()? as usize;
        let trace_name = String::from_utf8(r.take(name_len)?.to_vec())
            .context("corpus trace name is not UTF-8")?;
        let count = r.u64()? as usize;
        let mut corpus = Corpus {
            header: Some(Header {
                block_size,
                workers,
                capacity_blocks,
                seed,
                decode_us_per_token,
                trace_name,
            }),
            ops: Vec::with_capacity(count.min(1 << 26)),
            ..Corpus::default()
        };
        let mut last = 0u64;
        for i in 0..count {
            let kind = r.u8()?;
            let deadline_ns = r.u64()?;
            ensure!(deadline_ns >= last, "op {i}: deadlines go backwards");
            last = deadline_ns;
            let worker = (r.u64()?, r.u32()?);
            let kind = match kind {
                0 | 2 => {
                    let len = r.u32()? as usize;
                    let start = corpus.hashes.len();
                    let raw = r.take(len * 8)?;
                    corpus.hashes.extend(raw.chunks_exact(8).map(le_u64));
                    if kind == 0 {
                        OpKind::Lookup { start, len }
                    } else {
                        OpKind::Removed { start, len }
                    }
                }
                1 => {
                    let has_parent = r.u8()? != 0;
                    let parent = r.u64()?;
                    let len = r.u32()? as usize;
                    let start = corpus.stored.len();
                    let raw = r.take(len * 16)?;
                    corpus.stored.extend(
                        raw.chunks_exact(16)
                            .map(|c| (le_u64(&c[..8]), le_u64(&c[8..]))),
                    );
                    OpKind::Stored {
                        parent: has_parent.then_some(parent),
                        start,
                        len,
                    }
                }
                3 => OpKind::Cleared,
                other => bail!("op {i}: unknown kind {other}"),
            };
            corpus.ops.push(Op {
                deadline_ns,
                worker,
                kind,
            });
        }
        ensure!(r.at == bytes.len(), "trailing bytes after {count} ops");
        Ok(corpus)
    }
}

fn le_u64(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(bytes);
    u64::from_le_bytes(word)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())
            .with_context(|| format!("corpus truncated at byte {}", self.at))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        let mut word = [0u8; 4];
        word.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(word))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(le_u64(self.take(8)?))
    }
}

/// One Mooncake trace row.
#[derive(Debug, Clone)]
pub struct TraceRow {
    pub timestamp_ms: u64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

/// Parse a Mooncake JSONL trace.
pub fn read_trace(path: &Path) -> Result<Vec<TraceRow>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading trace {}", path.display()))?;
    let mut rows = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), n + 1))?;
        let field = |name: &str| {
            v.get(name)
                .and_then(serde_json::Value::as_u64)
                .with_context(|| format!("{}:{}: missing integer {name}", path.display(), n + 1))
        };
        let hash_ids = v
            .get("hash_ids")
            .and_then(serde_json::Value::as_array)
            .with_context(|| format!("{}:{}: missing hash_ids", path.display(), n + 1))?
            .iter()
            .map(|id| {
                id.as_u64()
                    .with_context(|| format!("{}:{}: bad hash id", path.display(), n + 1))
            })
            .collect::<Result<Vec<u64>>>()?;
        rows.push(TraceRow {
            timestamp_ms: field("timestamp")?,
            input_length: field("input_length")? as usize,
            output_length: field("output_length")? as usize,
            hash_ids,
        });
    }
    ensure!(!rows.is_empty(), "{} has no requests", path.display());
    Ok(rows)
}

/// SplitMix64: the generator's only source of randomness, seeded from the command line.
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Token ids of trace block `id`: a fixed pseudo-random chunk of a Qwen-sized vocabulary.
fn id_tokens(id: u64, out: &mut Vec<u32>) {
    let mut rng = SplitMix(id ^ 0x6d6f_6f6e_6361_6b65);
    out.extend((0..TRACE_BLOCK_TOKENS).map(|_| (rng.next_u64() % 151_000) as u32));
}

#[derive(Debug, Clone)]
pub struct GenConfig {
    pub workers: u32,
    pub block_size: u32,
    pub capacity_blocks: u64,
    pub seed: u64,
    pub decode_us_per_token: u64,
    /// Only the first `limit` requests (all when `None`).
    pub limit: Option<usize>,
}

/// Statistics of a generation, for the log.
#[derive(Debug, Default, Clone, Copy)]
pub struct GenStats {
    pub requests: usize,
    pub preempted: usize,
    pub skipped: usize,
    pub decode_skipped: usize,
    pub lookup_blocks: u64,
    pub routed_hit_blocks: u64,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Completion {
    end_ns: std::cmp::Reverse<u64>,
    seq: u64,
    worker: usize,
    output_length: usize,
}

/// Replay `rows` through simulated workers into a corpus. Deterministic in its inputs.
pub fn generate(
    rows: &[TraceRow],
    trace_name: &str,
    cfg: &GenConfig,
    mut progress: impl FnMut(usize, usize),
) -> Result<(Corpus, GenStats)> {
    ensure!(cfg.workers > 0, "need at least one worker");
    ensure!(cfg.block_size > 0, "block size must be positive");
    let bs = cfg.block_size as usize;
    let ns = Namespace::default();
    let seed = namespace_seed(None, None);
    let mut managers: Vec<BlockManager> = (0..cfg.workers)
        .map(|_| BlockManager::new(cfg.capacity_blocks, cfg.block_size))
        .collect();
    let mut running: Vec<VecDeque<u64>> = vec![VecDeque::new(); cfg.workers as usize];
    let mut completions: BinaryHeap<Completion> = BinaryHeap::new();
    let mut rng = SplitMix(cfg.seed);
    let mut corpus = Corpus {
        header: Some(Header {
            block_size: cfg.block_size,
            workers: cfg.workers,
            capacity_blocks: cfg.capacity_blocks,
            seed: cfg.seed,
            decode_us_per_token: cfg.decode_us_per_token,
            trace_name: trace_name.to_string(),
        }),
        ..Corpus::default()
    };
    let mut stats = GenStats::default();
    let rows = &rows[..cfg.limit.unwrap_or(rows.len()).min(rows.len())];
    let mut tokens: Vec<u32> = Vec::new();
    let mut chunk = Vec::with_capacity(TRACE_BLOCK_TOKENS);
    let mut locals: Vec<u64> = Vec::new();
    let mut seqs: Vec<u64> = Vec::new();
    let key = |w: usize| (w as u64, 0u32);

    let complete = |c: Completion,
                    managers: &mut [BlockManager],
                    running: &mut [VecDeque<u64>],
                    corpus: &mut Corpus,
                    stats: &mut GenStats| {
        let bm = &mut managers[c.worker];
        if !bm.has_sequence(c.seq) {
            return; // preempted earlier
        }
        let mut out_rng = SplitMix(c.seq.wrapping_mul(0x2545_f491_4f6c_dd1d));
        let output: Vec<u32> = (0..c.output_length)
            .map(|_| (out_rng.next_u64() % 151_000) as u32)
            .collect();
        if bm.append(c.seq, &output).is_err() {
            stats.decode_skipped += 1;
        }
        bm.free(c.seq);
        running[c.worker].retain(|s| *s != c.seq);
        for event in bm.drain_events() {
            corpus.push_event(c.end_ns.0, key(c.worker), event);
        }
    };

    for (i, row) in rows.iter().enumerate() {
        if i % 500 == 0 {
            progress(i, rows.len());
        }
        let now = row.timestamp_ms * 1_000_000;
        while completions.peek().is_some_and(|c| c.end_ns.0 <= now) {
            if let Some(c) = completions.pop() {
                complete(c, &mut managers, &mut running, &mut corpus, &mut stats);
            }
        }
        tokens.clear();
        for &id in &row.hash_ids {
            chunk.clear();
            id_tokens(id, &mut chunk);
            tokens.extend_from_slice(&chunk);
        }
        tokens.truncate(row.input_length);
        locals.clear();
        seqs.clear();
        for block in tokens.chunks_exact(bs) {
            let local = local_block_hash(block, seed);
            let seq = seqs
                .last()
                .map_or(local, |p| chain_sequence_hash(*p, local));
            locals.push(local);
            seqs.push(seq);
        }
        // KV-aware routing by a seeded rule, Dynamo's default cost: blocks to prefill after
        // the cached prefix plus blocks in use by running requests; seeded tie-break.
        let depths: Vec<usize> = managers
            .iter()
            .map(|bm| seqs.iter().take_while(|h| bm.is_cached(**h)).count())
            .collect();
        let costs: Vec<u64> = managers
            .iter()
            .zip(&depths)
            .map(|(bm, &depth)| {
                (seqs.len() - depth) as u64 + (bm.capacity() - bm.available_blocks())
            })
            .collect();
        let cheapest = costs.iter().copied().min().unwrap_or(0);
        let tied: Vec<usize> = (0..costs.len()).filter(|w| costs[*w] == cheapest).collect();
        let worker = tied[(rng.next_u64() % tied.len() as u64) as usize];
        stats.requests += 1;
        stats.lookup_blocks += locals.len() as u64;
        stats.routed_hit_blocks += depths[worker] as u64;
        let start = corpus.hashes.len();
        corpus.hashes.extend_from_slice(&locals);
        corpus.ops.push(Op {
            deadline_ns: now,
            worker: key(worker),
            kind: OpKind::Lookup {
                start,
                len: locals.len(),
            },
        });

        let seq_id = i as u64 + 1;
        let bm = &mut managers[worker];
        let matched = bm.match_prefix(&ns, &tokens);
        let started = loop {
            match bm.start_sequence(seq_id, ns.clone(), &tokens, matched, tokens.len()) {
                Ok(_) => break true,
                Err(AllocError::OutOfBlocks { .. }) => match running[worker].pop_front() {
                    Some(victim) => {
                        bm.free(victim);
                        stats.preempted += 1;
                    }
                    None => break false,
                },
                Err(e) => return Err(e).context(format!("request {i}")),
            }
        };
        for event in bm.drain_events() {
            corpus.push_event(now, key(worker), event);
        }
        if !started {
            stats.skipped += 1;
            continue;
        }
        running[worker].push_back(seq_id);
        completions.push(Completion {
            end_ns: std::cmp::Reverse(
                now + row.output_length as u64 * cfg.decode_us_per_token * 1000,
            ),
            seq: seq_id,
            worker,
            output_length: row.output_length,
        });
    }
    while let Some(c) = completions.pop() {
        complete(c, &mut managers, &mut running, &mut corpus, &mut stats);
    }
    progress(rows.len(), rows.len());
    Ok((corpus, stats))
}
