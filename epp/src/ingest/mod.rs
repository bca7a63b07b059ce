//! Keeps the pool, the KV index and the load ledger in step with the workers discovery lists.
//!
//! Per worker: connect to its `WorkerControl` service, fetch and validate its metadata, then per
//! dp rank hold a `SubscribeKvEvents` stream with a cursor. A snapshot batch replaces the rank's
//! blocks; live events must arrive with consecutive ids — a gap resubscribes from the cursor (the
//! worker replays the missing events), `OUT_OF_RANGE` (worker restarted, or we fell out of its
//! history) clears the rank and resubscribes from 0, and an event the index rejects also forces
//! a fresh snapshot rather than leaving a corrupted view. A rank is routable only while its
//! stream is live. Load reports are polled alongside. A worker discovery drops is cancelled and
//! its blocks, load and pool entry are dropped.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute_proto::events::{KvCacheEvent, KvEventData, StoredBlock};
use kvroute_proto::hashing::{local_block_hash, namespace_seed};
use kvroute_proto::metadata::WorkerMetadata;
use kvroute_proto::pb::worker_control_client::WorkerControlClient;
use kvroute_proto::pb::{GetLoadRequest, GetMetadataRequest, KvEventBatch, SubscribeRequest};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};

use crate::discovery::{WorkerEndpoint, WorkerList};
use crate::index::KvIndex;
use crate::load::{LoadLedger, ReportedLoad, WorkerKey};
use crate::metrics::EppMetrics;
use crate::pool::{WorkerEntry, WorkerPool};

#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// The router's block size; a worker with another one is refused (its overlap would be wrong).
    pub block_size: u32,
    pub load_poll_interval: Duration,
    pub connect_timeout: Duration,
    pub max_backoff: Duration,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            block_size: 16,
            load_poll_interval: Duration::from_millis(100),
            connect_timeout: Duration::from_secs(2),
            max_backoff: Duration::from_secs(5),
        }
    }
}

/// Everything the ingest tasks write to.
#[derive(Clone)]
pub struct Sinks {
    pub pool: Arc<WorkerPool>,
    pub index: Arc<KvIndex>,
    pub ledger: Arc<LoadLedger>,
    pub metrics: Arc<EppMetrics>,
}

/// A worker's ingest task, and the instance id it registered (once known).
type RunningWorker = (WorkerEndpoint, JoinHandle<()>, watch::Receiver<Option<u64>>);

/// Follows the discovery channel forever: starts a task per new worker, stops removed ones.
pub async fn run(mut workers: watch::Receiver<WorkerList>, sinks: Sinks, cfg: IngestConfig) {
    let mut running: HashMap<String, RunningWorker> = HashMap::new();
    loop {
        let list = workers.borrow_and_update().clone();
        if let Some(list) = list {
            let wanted: HashMap<&str, &WorkerEndpoint> =
                list.iter().map(|w| (w.name.as_str(), w)).collect();
            let stale: Vec<String> = running
                .iter()
                .filter(|(name, (ep, _, _))| wanted.get(name.as_str()) != Some(&ep))
                .map(|(name, _)| name.clone())
                .collect();
            for name in stale {
                if let Some((_, task, id)) = running.remove(&name) {
                    task.abort();
                    let worker_id = *id.borrow();
                    if let Some(worker_id) = worker_id {
                        drop_worker(&sinks, worker_id);
                    }
                    tracing::info!(worker = %name, "worker left discovery; dropped");
                }
            }
            let mut first_contacts = Vec::new();
            let new_workers: Vec<WorkerEndpoint> = list
                .iter()
                .filter(|w| !running.contains_key(&w.name))
                .cloned()
                .collect();
            for ep in &new_workers {
                let (id_tx, id_rx) = watch::channel(None);
                let (tried_tx, tried_rx) = tokio::sync::oneshot::channel();
                let task = tokio::spawn(worker_task(
                    ep.clone(),
                    sinks.clone(),
                    cfg.clone(),
                    id_tx,
                    tried_tx,
                ));
                running.insert(ep.name.clone(), (ep.clone(), task, id_rx));
                first_contacts.push(tried_rx);
            }
            if !sinks.pool.is_synced() {
                // Ready once every worker of the first list was contacted once (success or not),
                // so a dead worker cannot keep the EPP unready forever.
                for rx in first_contacts {
                    let _ = rx.await;
                }
                sinks.pool.set_synced();
                tracing::info!(workers = list.len(), "discovery synced");
            }
            update_gauges(&sinks);
        }
        if workers.changed().await.is_err() {
            return;
        }
    }
}

fn drop_worker(sinks: &Sinks, worker_id: u64) {
    sinks.pool.remove(worker_id);
    sinks.index.remove_worker(worker_id);
    sinks.ledger.forget_worker(worker_id);
    update_gauges(sinks);
}

pub fn update_gauges(sinks: &Sinks) {
    sinks
        .metrics
        .ready_pods
        .set(sinks.pool.ready_count() as i64);
    let stats = sinks.index.stats();
    sinks.metrics.index_blocks.set(stats.blocks as i64);
    sinks.metrics.index_workers.set(stats.workers as i64);
}

async fn connect(
    ep: &WorkerEndpoint,
    cfg: &IngestConfig,
) -> Result<WorkerControlClient<Channel>, String> {
    let endpoint = Endpoint::from_shared(format!("http://{}", ep.grpc))
        .map_err(|e| format!("bad grpc address {:?}: {e}", ep.grpc))?
        .connect_timeout(cfg.connect_timeout)
        .tcp_nodelay(true);
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("connecting to {}: {e}", ep.grpc))?;
    Ok(WorkerControlClient::new(channel))
}

async fn fetch_metadata(
    client: &mut WorkerControlClient<Channel>,
    cfg: &IngestConfig,
) -> Result<WorkerMetadata, String> {
    let md = client
        .get_metadata(GetMetadataRequest {})
        .await
        .map_err(|s| format!("GetMetadata: {}", s.message()))?
        .into_inner();
    let md = WorkerMetadata::from_pb(&md).map_err(|e| format!("invalid metadata: {e}"))?;
    if md.block_size != cfg.block_size {
        return Err(format!(
            "worker block size {} differs from the router's {} (start the EPP with --block-size {}); refusing it, since overlaps would be wrong",
            md.block_size, cfg.block_size, md.block_size
        ));
    }
    Ok(md)
}

async fn worker_task(
    ep: WorkerEndpoint,
    sinks: Sinks,
    cfg: IngestConfig,
    id_tx: watch::Sender<Option<u64>>,
    tried: tokio::sync::oneshot::Sender<()>,
) {
    let mut tried = Some(tried);
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = async {
            let mut client = connect(&ep, &cfg).await?;
            let md = fetch_metadata(&mut client, &cfg).await?;
            Ok::<_, String>((client, md))
        }
        .await;
        let (client, md) = match attempt {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(worker = %ep.name, "{e}; retrying in {backoff:?}");
                if let Some(t) = tried.take() {
                    let _ = t.send(());
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(cfg.max_backoff);
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        let destination = ep.http.clone().unwrap_or_else(|| md.http_endpoint.clone());
        let worker_id = md.instance_id;
        if let Some(prev) = *id_tx.borrow() {
            if prev != worker_id {
                drop_worker(&sinks, prev);
            }
        }
        id_tx.send_replace(Some(worker_id));
        let entry = Arc::new(WorkerEntry::new(ep.name.clone(), md.clone(), destination));
        sinks.pool.upsert(entry.clone());
        tracing::info!(worker = %ep.name, worker_id, dp_size = md.dp_size, role = %md.role, "worker registered");

        let mut ranks: Vec<JoinHandle<()>> = (0..md.dp_size)
            .map(|rank| {
                tokio::spawn(subscribe_rank(
                    client.clone(),
                    entry.clone(),
                    rank,
                    sinks.clone(),
                    cfg.clone(),
                ))
            })
            .collect();
        // The first contact counts once the first rank synced or failed; good enough for readiness.
        if let Some(t) = tried.take() {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
            while !entry.ready() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let _ = t.send(());
        }
        poll_load(client, entry.clone(), sinks.clone(), cfg.clone()).await;
        // Load polling only returns when the worker stopped answering: restart from metadata,
        // which also catches a restarted worker with changed metadata.
        for r in ranks.drain(..) {
            r.abort();
        }
        for rank in 0..md.dp_size {
            entry.set_rank_synced(rank, false);
        }
        update_gauges(&sinks);
        tokio::time::sleep(backoff).await;
    }
}

/// Polls `GetLoad` until the worker fails several times in a row.
async fn poll_load(
    mut client: WorkerControlClient<Channel>,
    entry: Arc<WorkerEntry>,
    sinks: Sinks,
    cfg: IngestConfig,
) {
    let mut failures = 0;
    let mut tick = tokio::time::interval(cfg.load_poll_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match client.get_load(GetLoadRequest {}).await {
            Ok(report) => {
                failures = 0;
                for r in report.into_inner().ranks {
                    sinks.ledger.set_reported(
                        (entry.id(), r.dp_rank),
                        ReportedLoad {
                            kv_used_blocks: r.kv_used_blocks,
                            kv_total_blocks: r.kv_total_blocks,
                            waiting_requests: r.waiting_requests,
                            running_requests: r.running_requests,
                            active_prefill_tokens: r.active_prefill_tokens,
                            max_num_batched_tokens: r.max_num_batched_tokens,
                        },
                    );
                }
            }
            Err(s) => {
                failures += 1;
                tracing::debug!(worker = %entry.name, "GetLoad: {}", s.message());
                if failures >= 3 {
                    tracing::warn!(worker = %entry.name, "worker stopped answering; marking it unready");
                    return;
                }
            }
        }
    }
}

/// What to do after a stream ends.
enum Resume {
    /// Resubscribe from the cursor (network error, gap).
    FromCursor,
    /// Forget the rank and start from a snapshot.
    Fresh(&'static str),
}

async fn subscribe_rank(
    mut client: WorkerControlClient<Channel>,
    entry: Arc<WorkerEntry>,
    rank: u32,
    sinks: Sinks,
    cfg: IngestConfig,
) {
    let key: WorkerKey = (entry.id(), rank);
    let seed_cache = SeedCache::default();
    let (mut cursor, mut epoch) = (0u64, 0u64);
    let mut backoff = Duration::from_millis(50);
    loop {
        let req = SubscribeRequest {
            dp_rank: rank,
            from_cursor: cursor,
            epoch,
        };
        let resume = match client.subscribe_kv_events(req).await {
            Ok(resp) => {
                let mut stream = resp.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(batch)) => {
                            match apply_batch(
                                &batch,
                                key,
                                &entry,
                                &sinks,
                                &seed_cache,
                                cfg.block_size,
                                &mut cursor,
                            ) {
                                Ok(()) => {
                                    epoch = batch.epoch;
                                    backoff = Duration::from_millis(50);
                                }
                                Err(r) => break r,
                            }
                        }
                        Ok(None) => break Resume::FromCursor,
                        Err(s) if s.code() == tonic::Code::OutOfRange => {
                            break Resume::Fresh("out_of_range")
                        }
                        Err(s) => {
                            tracing::debug!(worker = %entry.name, rank, "event stream: {}", s.message());
                            break Resume::FromCursor;
                        }
                    }
                }
            }
            Err(s) if s.code() == tonic::Code::OutOfRange => Resume::Fresh("out_of_range"),
            Err(s) => {
                tracing::debug!(worker = %entry.name, rank, "subscribe: {}", s.message());
                entry.set_rank_synced(rank, false);
                update_gauges(&sinks);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(cfg.max_backoff);
                Resume::FromCursor
            }
        };
        if let Resume::Fresh(reason) = resume {
            tracing::info!(worker = %entry.name, rank, reason, "resynchronizing from a snapshot");
            sinks.metrics.resyncs.with_label_values(&[reason]).inc();
            sinks.index.clear_worker_rank(key);
            entry.set_rank_synced(rank, false);
            update_gauges(&sinks);
            cursor = 0;
            epoch = 0;
        }
    }
}

fn apply_batch(
    batch: &KvEventBatch,
    key: WorkerKey,
    entry: &WorkerEntry,
    sinks: &Sinks,
    seeds: &SeedCache,
    block_size: u32,
    cursor: &mut u64,
) -> Result<(), Resume> {
    if batch.snapshot {
        sinks.index.clear_worker_rank(key);
    }
    for ev in &batch.events {
        if !batch.snapshot {
            if ev.event_id <= *cursor {
                continue; // already applied (a replay overlapping what we had)
            }
            if ev.event_id != *cursor + 1 {
                sinks.metrics.resyncs.with_label_values(&["gap"]).inc();
                tracing::info!(worker = %entry.name, rank = key.1, have = *cursor, got = ev.event_id, "event gap; replaying");
                return Err(Resume::FromCursor);
            }
        }
        let (event, _tier) = match KvCacheEvent::from_pb(ev, key.1) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(worker = %entry.name, "undecodable event {}: {e}", ev.event_id);
                return Err(Resume::Fresh("bad_event"));
            }
        };
        let data = with_router_hashes(event.data, block_size, seeds);
        if let Err(e) = sinks.index.apply(key, &data) {
            tracing::warn!(worker = %entry.name, "index rejected event {}: {e}", ev.event_id);
            return Err(Resume::Fresh("index_rejected"));
        }
        sinks.metrics.events_applied.inc();
        if !batch.snapshot {
            *cursor = ev.event_id;
        }
    }
    if batch.snapshot {
        *cursor = batch.cursor;
        entry.set_rank_synced(key.1, true);
        update_gauges(sinks);
    }
    if batch.sent_at_unix_micros > 0 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        let lag = now.saturating_sub(batch.sent_at_unix_micros) as f64 / 1e6;
        sinks.metrics.event_lag.observe(lag);
    }
    Ok(())
}

/// Namespace seeds by (lora, salt); a tiny cache since the same few recur.
type Namespace = (Option<String>, Option<String>);

#[derive(Default)]
struct SeedCache(parking_lot::Mutex<HashMap<Namespace, u64>>);

impl SeedCache {
    fn seed(&self, lora: Option<&str>, salt: Option<&str>) -> u64 {
        if lora.is_none() && salt.is_none() {
            return kvroute_proto::hashing::XXH3_SEED;
        }
        let key = (lora.map(str::to_string), salt.map(str::to_string));
        *self
            .0
            .lock()
            .entry(key)
            .or_insert_with(|| namespace_seed(lora, salt))
    }
}

/// The router's own key for every stored block: recomputed from the token ids (DESIGN contract 4,
/// dual keys), so an engine's hash scheme never has to match ours.
fn with_router_hashes(data: KvEventData, block_size: u32, seeds: &SeedCache) -> KvEventData {
    match data {
        KvEventData::Stored {
            parent_hash,
            blocks,
            token_ids,
            block_size: ev_bs,
            lora_name,
            cache_salt,
        } if !token_ids.is_empty() && ev_bs == block_size => {
            let seed = seeds.seed(lora_name.as_deref(), cache_salt.as_deref());
            let blocks = blocks
                .iter()
                .zip(token_ids.chunks_exact(block_size as usize))
                .map(|(b, toks)| StoredBlock {
                    block_hash: b.block_hash,
                    tokens_hash: local_block_hash(toks, seed),
                })
                .collect();
            KvEventData::Stored {
                parent_hash,
                blocks,
                token_ids,
                block_size: ev_bs,
                lora_name,
                cache_salt,
            }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_hashes_are_recomputed_from_tokens() {
        let seeds = SeedCache::default();
        let data = KvEventData::Stored {
            parent_hash: None,
            blocks: vec![StoredBlock {
                block_hash: 99,
                tokens_hash: 0,
            }],
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            lora_name: None,
            cache_salt: Some("tenant-a".into()),
        };
        match with_router_hashes(data, 4, &seeds) {
            KvEventData::Stored { blocks, .. } => {
                assert_eq!(blocks[0].block_hash, 99, "engine key kept");
                assert_eq!(
                    blocks[0].tokens_hash,
                    local_block_hash(&[1, 2, 3, 4], namespace_seed(None, Some("tenant-a")))
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
