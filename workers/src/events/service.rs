//! The `kvroute.v1.WorkerControl` gRPC service of a simulated worker: the KV event stream
//! (cursor semantics of `proto/kvroute.proto`, implemented by [`EventLog::subscribe`]), load
//! reports from [`SimEngine::stats`] and the worker's metadata.
//!
//! Each subscription runs a small task that forwards the snapshot or replay and then live events
//! into a bounded channel drained by tonic. A slow client only fills its own channel; once it is
//! more than the log's subscriber buffer behind, its stream ends with `ABORTED` naming the cursor
//! to resume from, and the engine is never blocked.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use futures::Stream;
use kvroute_proto::events::{KvCacheEvent, StorageTier};
use kvroute_proto::metadata::WorkerMetadata;
use kvroute_proto::pb::{
    self,
    worker_control_server::{WorkerControl, WorkerControlServer},
};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::log::{EventLog, SubscribeError, Subscription};
use crate::sim::SimEngine;

/// Most events per streamed batch (replays and live bursts are split).
const MAX_BATCH_EVENTS: usize = 512;
/// Batches buffered per subscriber between its forwarding task and tonic.
const STREAM_CHANNEL: usize = 16;

/// `WorkerControl` backed by a [`SimEngine`].
#[derive(Debug, Clone)]
pub struct WorkerControlService {
    engine: SimEngine,
    log: EventLog,
    metadata: pb::WorkerMetadata,
}

impl WorkerControlService {
    pub fn new(engine: SimEngine, metadata: WorkerMetadata) -> Self {
        WorkerControlService {
            log: engine.event_log(),
            metadata: metadata.to_pb(),
            engine,
        }
    }
}

/// The tonic server for the main binary. Snapshots can be large: clients should raise their
/// `max_decoding_message_size` (a 16k-block cache of 64-token blocks is a few MB).
pub fn service(
    engine: SimEngine,
    metadata: WorkerMetadata,
) -> WorkerControlServer<WorkerControlService> {
    WorkerControlServer::new(WorkerControlService::new(engine, metadata))
        .max_encoding_message_size(usize::MAX)
}

fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn subscribe_status(e: SubscribeError) -> Status {
    match e {
        SubscribeError::BadDpRank { .. } => Status::invalid_argument(e.to_string()),
        SubscribeError::EpochMismatch { .. } | SubscribeError::CursorAhead { .. } => {
            Status::out_of_range(e.to_string())
        }
    }
}

/// Identity stamped on every batch of one subscription.
#[derive(Debug, Clone, Copy)]
struct StreamId {
    worker_id: u64,
    dp_rank: u32,
    epoch: u64,
}

impl StreamId {
    fn batch(&self, snapshot: bool, cursor: u64, events: &[Arc<KvCacheEvent>]) -> pb::KvEventBatch {
        pb::KvEventBatch {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
            epoch: self.epoch,
            snapshot,
            cursor,
            events: events
                .iter()
                .map(|e| e.to_pb(StorageTier::Device))
                .collect(),
            sent_at_unix_micros: unix_micros(),
        }
    }
}

/// Forwards one subscription to a client until it leaves, lags or the worker stops.
async fn forward(
    id: StreamId,
    sub: Subscription,
    tx: mpsc::Sender<Result<pb::KvEventBatch, Status>>,
) {
    let Subscription {
        snapshot,
        replay,
        mut cursor,
        mut live,
    } = sub;
    if let Some(snap) = snapshot {
        let batch = pb::KvEventBatch {
            events: snap
                .events
                .iter()
                .map(|e| e.to_pb(StorageTier::Device))
                .collect(),
            ..id.batch(true, snap.cursor, &[])
        };
        if tx.send(Ok(batch)).await.is_err() {
            return;
        }
    }
    for chunk in replay.chunks(MAX_BATCH_EVENTS) {
        let last = chunk.last().map_or(cursor, |e| e.event_id);
        if tx.send(Ok(id.batch(false, last, chunk))).await.is_err() {
            return;
        }
    }
    let mut pending: Vec<Arc<KvCacheEvent>> = Vec::with_capacity(MAX_BATCH_EVENTS);
    loop {
        let first = tokio::select! {
            r = live.recv() => r,
            _ = tx.closed() => return,
        };
        let ended = match first {
            Ok(ev) => {
                pending.push(ev);
                // Coalesce whatever else is already queued.
                let mut ended = None;
                while pending.len() < MAX_BATCH_EVENTS {
                    match live.try_recv() {
                        Ok(ev) => pending.push(ev),
                        Err(broadcast::error::TryRecvError::Empty) => break,
                        Err(broadcast::error::TryRecvError::Lagged(n)) => {
                            ended = Some(broadcast::error::RecvError::Lagged(n));
                            break;
                        }
                        Err(broadcast::error::TryRecvError::Closed) => {
                            ended = Some(broadcast::error::RecvError::Closed);
                            break;
                        }
                    }
                }
                ended
            }
            Err(e) => Some(e),
        };
        if !pending.is_empty() {
            let last = pending.last().map_or(cursor, |e| e.event_id);
            if tx.send(Ok(id.batch(false, last, &pending))).await.is_err() {
                return;
            }
            cursor = last;
            pending.clear();
        }
        match ended {
            None => {}
            Some(broadcast::error::RecvError::Lagged(n)) => {
                tracing::warn!(
                    dp_rank = id.dp_rank,
                    cursor,
                    skipped = n,
                    "KV event subscriber fell behind; ending its stream"
                );
                let _ = tx
                    .send(Err(Status::aborted(format!(
                        "subscriber fell more than the buffer behind the KV event stream; \
                         resubscribe with from_cursor={cursor} epoch={}",
                        id.epoch
                    ))))
                    .await;
                return;
            }
            Some(broadcast::error::RecvError::Closed) => {
                let _ = tx
                    .send(Err(Status::unavailable("worker is shutting down")))
                    .await;
                return;
            }
        }
    }
}

#[tonic::async_trait]
impl WorkerControl for WorkerControlService {
    type SubscribeKvEventsStream =
        Pin<Box<dyn Stream<Item = Result<pb::KvEventBatch, Status>> + Send + 'static>>;

    async fn subscribe_kv_events(
        &self,
        request: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        let req = request.into_inner();
        let sub = self
            .log
            .subscribe(req.dp_rank, req.from_cursor, req.epoch)
            .map_err(subscribe_status)?;
        tracing::debug!(
            dp_rank = req.dp_rank,
            from_cursor = req.from_cursor,
            snapshot = sub.snapshot.is_some(),
            replay = sub.replay.len(),
            "KV event subscriber joined"
        );
        let id = StreamId {
            worker_id: self.log.worker_id(),
            dp_rank: req.dp_rank,
            epoch: self.log.epoch(),
        };
        let (tx, rx) = mpsc::channel(STREAM_CHANNEL);
        tokio::spawn(forward(id, sub, tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_load(
        &self,
        _request: Request<pb::GetLoadRequest>,
    ) -> Result<Response<pb::LoadReport>, Status> {
        let cfg = self.engine.config();
        let ranks = self
            .engine
            .stats()
            .into_iter()
            .map(|s| pb::RankLoad {
                dp_rank: s.dp_rank,
                kv_used_blocks: s.kv_used_blocks,
                kv_total_blocks: s.kv_total_blocks,
                waiting_requests: s.waiting,
                running_requests: s.running,
                active_prefill_tokens: s.active_prefill_tokens,
                max_num_batched_tokens: cfg.max_num_batched_tokens,
            })
            .collect();
        Ok(Response::new(pb::LoadReport {
            worker_id: cfg.worker_id,
            ranks,
        }))
    }

    async fn get_metadata(
        &self,
        _request: Request<pb::GetMetadataRequest>,
    ) -> Result<Response<pb::WorkerMetadata>, Status> {
        Ok(Response::new(self.metadata.clone()))
    }
}
