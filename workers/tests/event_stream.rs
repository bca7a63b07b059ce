//! The `WorkerControl` service over a real tonic server on 127.0.0.1:0: snapshot + live with no
//! gap or duplicate while events race the subscription, cursor replay, OUT_OF_RANGE cursors,
//! snapshots below the history window, lagging subscribers, load and metadata.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_proto::events::{KvCacheEvent, KvEventData, StoredBlock};
use kvroute_proto::metadata::{Enforcement, WorkerMetadata, WorkerRole};
use kvroute_proto::pb::{
    self, worker_control_client::WorkerControlClient, GetLoadRequest, GetMetadataRequest,
    SubscribeRequest,
};
use kvroute_worker::events::{service, EventLogConfig};
use kvroute_worker::sim::{EngineRequest, SimConfig, SimEngine};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Channel;
use tonic::Streaming;

fn cfg(kv_capacity_blocks: u64, speedup: f64) -> SimConfig {
    SimConfig {
        block_size: 4,
        kv_capacity_blocks,
        max_num_seqs: 64,
        max_num_batched_tokens: 512,
        speedup,
        dp_size: 1,
        worker_id: 99,
        filler_tokens: vec![5, 6, 7],
    }
}

fn metadata() -> WorkerMetadata {
    WorkerMetadata {
        instance_id: 99,
        name: "sim-0".into(),
        model: "Qwen/Qwen3-0.6B".into(),
        role: WorkerRole::Aggregated,
        block_size: 4,
        kv_capacity_blocks: 64,
        dp_size: 1,
        topology_domains: BTreeMap::new(),
        kv_transfer_domain: None,
        kv_transfer_enforcement: Enforcement::Required,
        kv_transfer_preferred_weight: 0.0,
        http_endpoint: "127.0.0.1:8000".into(),
        max_num_batched_tokens: 512,
    }
}

async fn serve(engine: SimEngine) -> WorkerControlClient<Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service(engine, metadata()))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    WorkerControlClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(64 << 20)
}

async fn subscribe(
    client: &mut WorkerControlClient<Channel>,
    from_cursor: u64,
    epoch: u64,
) -> Result<Streaming<pb::KvEventBatch>, tonic::Status> {
    client
        .subscribe_kv_events(SubscribeRequest {
            dp_rank: 0,
            from_cursor,
            epoch,
        })
        .await
        .map(|r| r.into_inner())
}

/// A subscriber's view of the worker, checking every batch it applies.
#[derive(Debug, Default)]
struct Mirror {
    live: HashSet<u64>,
    cursor: u64,
    snapshots: usize,
    events: Vec<KvCacheEvent>,
}

impl Mirror {
    fn apply(&mut self, b: &pb::KvEventBatch, epoch: u64) {
        assert_eq!(b.worker_id, 99);
        assert_eq!(b.epoch, epoch);
        assert!(b.sent_at_unix_micros > 0);
        if b.snapshot {
            self.snapshots += 1;
            self.live.clear();
            for ev in &b.events {
                assert_eq!(ev.event_id, 0, "event ids are 0 inside a snapshot");
                let (ev, _) = KvCacheEvent::from_pb(ev, 0).unwrap();
                assert!(
                    matches!(ev.data, KvEventData::Stored { .. }),
                    "snapshots hold Stored events only"
                );
                self.apply_data(&ev.data);
            }
            self.cursor = b.cursor;
            return;
        }
        for ev in &b.events {
            assert_eq!(
                ev.event_id,
                self.cursor + 1,
                "no gap, no duplicate (cursor {})",
                self.cursor
            );
            let (ev, _) = KvCacheEvent::from_pb(ev, 0).unwrap();
            self.apply_data(&ev.data);
            self.cursor = ev.event_id;
            self.events.push(ev);
        }
        assert_eq!(b.cursor, self.cursor, "batch cursor = its last event id");
    }

    fn apply_data(&mut self, data: &KvEventData) {
        match data {
            KvEventData::Stored {
                parent_hash,
                blocks,
                ..
            } => {
                if let Some(p) = parent_hash {
                    assert!(self.live.contains(p), "parent {p} known before its child");
                }
                for b in blocks {
                    assert!(self.live.insert(b.block_hash), "block stored twice");
                }
            }
            KvEventData::Removed { block_hashes } => {
                for h in block_hashes {
                    assert!(self.live.remove(h), "removed an unknown block {h}");
                }
            }
            KvEventData::Cleared => self.live.clear(),
        }
    }
}

/// Synthetic chains for tests that drive the log directly: `Stored` of two blocks under a root
/// `n`, or the removal of an earlier chain.
fn chain(n: u64) -> KvEventData {
    KvEventData::Stored {
        parent_hash: None,
        blocks: vec![
            StoredBlock {
                block_hash: n * 10,
                tokens_hash: n,
            },
            StoredBlock {
                block_hash: n * 10 + 1,
                tokens_hash: n + 1,
            },
        ],
        token_ids: (0..8).map(|i| n as u32 * 8 + i).collect(),
        block_size: 4,
        lora_name: None,
        cache_salt: None,
    }
}

fn unchain(n: u64) -> KvEventData {
    KvEventData::Removed {
        block_hashes: vec![n * 10 + 1, n * 10],
    }
}

async fn next(stream: &mut Streaming<pb::KvEventBatch>) -> pb::KvEventBatch {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("a batch arrives")
        .expect("stream healthy")
        .expect("stream open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_then_live_while_events_race() {
    // A tiny cache under constant load: stores and evictions race every subscription.
    let engine = SimEngine::start(cfg(48, 2000.0));
    let log = engine.event_log();
    let epoch = log.epoch();
    let mut client = serve(engine.clone()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for w in 0..6u32 {
        let (engine, stop) = (engine.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                // Prefixes shared across workers, private tails, varied lengths.
                let mut p: Vec<u32> = (0..(4 * (i % 5) + 4)).map(|t| (i % 3) * 1000 + t).collect();
                p.extend((0..(i % 11 + 1)).map(|t| 100_000 + w * 10_000 + i * 16 + t));
                let req = EngineRequest {
                    request_id: format!("w{w}-{i}"),
                    prompt_tokens: p,
                    max_tokens: 1 + i % 9,
                    ..Default::default()
                };
                let mut rx = engine.submit(req).unwrap();
                while rx.recv().await.is_some() {}
                i += 1;
            }
        }));
    }

    let (target_tx, target_rx) = tokio::sync::watch::channel(None::<u64>);
    let mut subscribers = Vec::new();
    for round in 0..6 {
        tokio::time::sleep(Duration::from_millis(15 + round * 7)).await;
        let mut stream = subscribe(&mut client, 0, 0).await.unwrap();
        let mut target = target_rx.clone();
        subscribers.push(tokio::spawn(async move {
            let mut m = Mirror::default();
            loop {
                if let Some(h) = *target.borrow() {
                    if m.cursor >= h {
                        return m;
                    }
                }
                tokio::select! {
                    b = next(&mut stream) => m.apply(&b, epoch),
                    _ = target.changed() => {}
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    let head = log.head(0).unwrap();
    assert!(head > 100, "the load produced events: {head}");
    target_tx.send(Some(head)).unwrap();
    let expected: HashSet<u64> = log.live_blocks(0).into_iter().collect();
    assert_eq!(expected.len() as u64, engine.stats()[0].kv_cached_blocks);
    for s in subscribers {
        let m = s.await.unwrap();
        assert_eq!(m.snapshots, 1);
        assert_eq!(m.cursor, head);
        assert_eq!(
            m.live, expected,
            "snapshot + live rebuilds the cache exactly"
        );
    }
}

#[tokio::test]
async fn cursor_in_history_ahead_and_below_window() {
    let engine = SimEngine::start_with_log(
        cfg(64, 100.0),
        EventLogConfig {
            history: 100,
            subscriber_buffer: 1024,
        },
    );
    let log = engine.event_log();
    let epoch = log.epoch();
    let mut client = serve(engine.clone()).await;
    let mut published = Vec::new();
    for n in 1..=30u64 {
        let data = if n % 3 == 0 { unchain(n - 1) } else { chain(n) };
        published.push(data.clone());
        log.publish(0, [data]);
    }

    // From 20 (inside the history): exactly 21..=30, then live.
    let mut s = subscribe(&mut client, 20, epoch).await.unwrap();
    let b = next(&mut s).await;
    assert!(!b.snapshot);
    let ids: Vec<u64> = b.events.iter().map(|e| e.event_id).collect();
    assert_eq!(ids, (21..=30).collect::<Vec<_>>());
    for ev in &b.events {
        let (ev, _) = KvCacheEvent::from_pb(ev, 0).unwrap();
        assert_eq!(ev.data, published[ev.event_id as usize - 1]);
    }
    log.publish(0, [chain(31), chain(32)]);
    let mut got = Vec::new();
    while got.len() < 2 {
        got.extend(next(&mut s).await.events.iter().map(|e| e.event_id));
    }
    assert_eq!(got, vec![31, 32]);

    // At the head: nothing to replay, live only.
    let mut s = subscribe(&mut client, 32, 0).await.unwrap();
    log.publish(0, [chain(33)]);
    let b = next(&mut s).await;
    assert!(!b.snapshot);
    assert_eq!(b.events.len(), 1);
    assert_eq!(b.events[0].event_id, 33);

    // Ahead of the head, or another epoch: OUT_OF_RANGE with the remedy in the message.
    let err = subscribe(&mut client, 34, epoch).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::OutOfRange);
    assert!(
        err.message().contains("resubscribe from cursor 0"),
        "{}",
        err.message()
    );
    let err = subscribe(&mut client, 10, epoch ^ 1).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::OutOfRange);
    let err = client
        .subscribe_kv_events(SubscribeRequest {
            dp_rank: 3,
            from_cursor: 0,
            epoch: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    // Push event 20 out of the 100-event window: cursor 20 now gets a snapshot.
    for n in 34..=150u64 {
        log.publish(0, [if n % 4 == 0 { unchain(n - 1) } else { chain(n) }]);
    }
    let mut s = subscribe(&mut client, 20, epoch).await.unwrap();
    let b = next(&mut s).await;
    assert!(b.snapshot, "a cursor below the window gets a snapshot");
    assert_eq!(b.cursor, 150);
    let mut m = Mirror::default();
    m.apply(&b, epoch);
    let expected: HashSet<u64> = log.live_blocks(0).into_iter().collect();
    assert_eq!(m.live, expected);
    // The oldest cursor still inside the window replays.
    let mut s = subscribe(&mut client, 50, epoch).await.unwrap();
    let b = next(&mut s).await;
    assert!(!b.snapshot);
    assert_eq!(b.events.first().map(|e| e.event_id), Some(51));
    assert_eq!(b.cursor, 150);
}

#[tokio::test]
async fn lagging_subscriber_is_cut_off_and_resumes() {
    let engine = SimEngine::start_with_log(
        cfg(64, 100.0),
        EventLogConfig {
            history: 10_000,
            subscriber_buffer: 4,
        },
    );
    let log = engine.event_log();
    let epoch = log.epoch();
    let mut client = serve(engine.clone()).await;
    log.publish(0, [chain(1)]);
    let mut s = subscribe(&mut client, 0, 0).await.unwrap();
    let mut m = Mirror::default();
    m.apply(&next(&mut s).await, epoch);
    // A burst far beyond the 4-event buffer; publishing never waits for the subscriber.
    let start = Instant::now();
    for n in 2..2000u64 {
        log.publish(0, [chain(n)]);
    }
    assert!(start.elapsed() < Duration::from_secs(1));
    let status = loop {
        match tokio::time::timeout(Duration::from_secs(10), s.message())
            .await
            .expect("stream progresses")
        {
            Ok(Some(b)) => m.apply(&b, epoch),
            Ok(None) => panic!("stream ended without telling the subscriber why"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), tonic::Code::Aborted);
    let resume = format!("from_cursor={}", m.cursor);
    assert!(status.message().contains(&resume), "{}", status.message());
    // Resume from the cursor: the rest arrives by replay, without a snapshot.
    let mut s = subscribe(&mut client, m.cursor, epoch).await.unwrap();
    while m.cursor < 1999 {
        m.apply(&next(&mut s).await, epoch);
    }
    assert_eq!(m.snapshots, 1);
    let expected: HashSet<u64> = log.live_blocks(0).into_iter().collect();
    assert_eq!(m.live, expected);
}

#[tokio::test]
async fn load_and_metadata() {
    let engine = SimEngine::start(cfg(64, 10.0));
    let mut client = serve(engine.clone()).await;
    let md = client
        .get_metadata(GetMetadataRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(WorkerMetadata::from_pb(&md).unwrap(), metadata());
    let mut rx = engine
        .submit(EngineRequest {
            request_id: "x".into(),
            prompt_tokens: (0..40).collect(),
            max_tokens: 100_000,
            ..Default::default()
        })
        .unwrap();
    rx.recv().await.unwrap();
    let load = client
        .get_load(GetLoadRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(load.worker_id, 99);
    assert_eq!(load.ranks.len(), 1);
    let r = &load.ranks[0];
    assert_eq!(r.running_requests, 1);
    assert_eq!(r.waiting_requests, 0);
    assert_eq!(r.kv_total_blocks, 64);
    assert!(r.kv_used_blocks >= 10, "{r:?}");
    assert_eq!(r.max_num_batched_tokens, 512);
}
