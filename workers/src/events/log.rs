//! The worker's KV event log: per dp rank an append-only sequence of events with ids from 1, a
//! bounded replay history, the live block set (to build snapshots) and a broadcast to live
//! subscribers, plus a random non-zero epoch per process start.
//!
//! [`EventLog::subscribe`] implements the cursor semantics of `proto/kvroute.proto`
//! (`SubscribeRequest`): the snapshot or replay and the live subscription are taken under the
//! same lock that [`EventLog::publish`] holds, so the subscriber sees every event exactly once.
//! Publishing never blocks: a subscriber that falls more than its buffer behind gets
//! `Lagged` from its receiver and must resubscribe with its cursor.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kvroute_proto::events::{KvCacheEvent, KvEventData, StoredBlock};
use parking_lot::Mutex;
use tokio::sync::broadcast;

/// Sizes of the replay history and of each live subscriber's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventLogConfig {
    /// Events kept for cursor replay (per dp rank).
    pub history: usize,
    /// Events a live subscriber may fall behind before its stream is ended.
    pub subscriber_buffer: usize,
}

impl Default for EventLogConfig {
    fn default() -> Self {
        EventLogConfig {
            history: 10_000,
            subscriber_buffer: 8_192,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubscribeError {
    #[error("dp rank {dp_rank} does not exist (this worker has {dp_size} dp ranks)")]
    BadDpRank { dp_rank: u32, dp_size: u32 },
    #[error("epoch {requested} is not this worker's epoch {current} (the worker restarted): drop what you know of it and resubscribe from cursor 0 with epoch 0")]
    EpochMismatch { requested: u64, current: u64 },
    #[error("cursor {cursor} is ahead of the stream head {head} in epoch {epoch}: drop what you know of this worker and resubscribe from cursor 0")]
    CursorAhead { cursor: u64, head: u64, epoch: u64 },
}

/// A consistent view of all live blocks, as `Stored` events (event id 0) ordered parents first.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Head event id the snapshot reflects.
    pub cursor: u64,
    pub events: Vec<KvCacheEvent>,
}

/// What a new subscriber gets: a snapshot or the missing events, then the live receiver, which
/// starts exactly after `cursor`.
#[derive(Debug)]
pub struct Subscription {
    pub snapshot: Option<Snapshot>,
    /// Events after the requested cursor (empty with a snapshot).
    pub replay: Vec<Arc<KvCacheEvent>>,
    /// The id of the last event delivered by `snapshot` / `replay`.
    pub cursor: u64,
    pub live: broadcast::Receiver<Arc<KvCacheEvent>>,
}

/// A live block, enough to re-announce it in a snapshot.
#[derive(Debug, Clone)]
struct LiveBlock {
    parent: Option<u64>,
    tokens_hash: u64,
    tokens: Vec<u32>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
}

#[derive(Debug)]
struct RankLog {
    head: u64,
    history: VecDeque<Arc<KvCacheEvent>>,
    live: HashMap<u64, LiveBlock>,
    tx: broadcast::Sender<Arc<KvCacheEvent>>,
}

#[derive(Debug)]
struct Inner {
    worker_id: u64,
    epoch: u64,
    cfg: EventLogConfig,
    ranks: Vec<Mutex<RankLog>>,
}

/// The shared event log of one worker (all dp ranks). Cheap to clone.
#[derive(Debug, Clone)]
pub struct EventLog {
    inner: Arc<Inner>,
}

impl EventLog {
    /// A new log with a fresh random non-zero epoch. `dp_size` is clamped to at least 1.
    pub fn new(worker_id: u64, dp_size: u32, cfg: EventLogConfig) -> EventLog {
        let epoch = loop {
            let e: u64 = rand::random();
            if e != 0 {
                break e;
            }
        };
        Self::with_epoch(worker_id, dp_size, cfg, epoch)
    }

    /// A log with a given epoch (tests; a restored process). Epoch 0 is replaced by 1.
    pub fn with_epoch(worker_id: u64, dp_size: u32, cfg: EventLogConfig, epoch: u64) -> EventLog {
        let cfg = EventLogConfig {
            history: cfg.history,
            subscriber_buffer: cfg.subscriber_buffer.max(1),
        };
        let ranks = (0..dp_size.max(1))
            .map(|_| {
                Mutex::new(RankLog {
                    head: 0,
                    history: VecDeque::with_capacity(cfg.history.min(1 << 16)),
                    live: HashMap::new(),
                    tx: broadcast::channel(cfg.subscriber_buffer).0,
                })
            })
            .collect();
        EventLog {
            inner: Arc::new(Inner {
                worker_id,
                epoch: epoch.max(1),
                cfg,
                ranks,
            }),
        }
    }

    pub fn worker_id(&self) -> u64 {
        self.inner.worker_id
    }

    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    pub fn dp_size(&self) -> u32 {
        self.inner.ranks.len() as u32
    }

    pub fn config(&self) -> EventLogConfig {
        self.inner.cfg
    }

    fn rank(&self, dp_rank: u32) -> Result<&Mutex<RankLog>, SubscribeError> {
        self.inner
            .ranks
            .get(dp_rank as usize)
            .ok_or(SubscribeError::BadDpRank {
                dp_rank,
                dp_size: self.dp_size(),
            })
    }

    /// Appends events of one rank in order and returns the new head id. Unknown ranks are
    /// logged and ignored (the engine only publishes for its own ranks).
    pub fn publish(&self, dp_rank: u32, events: impl IntoIterator<Item = KvEventData>) -> u64 {
        let Ok(rank) = self.rank(dp_rank) else {
            tracing::error!(dp_rank, "KV event for an unknown dp rank dropped");
            return 0;
        };
        let mut log = rank.lock();
        for data in events {
            log.head += 1;
            let ev = Arc::new(KvCacheEvent {
                event_id: log.head,
                data,
                dp_rank,
            });
            log.apply(&ev.data);
            if self.inner.cfg.history > 0 {
                if log.history.len() >= self.inner.cfg.history {
                    log.history.pop_front();
                }
                log.history.push_back(ev.clone());
            }
            // No receivers is fine; a full buffer overwrites and lags the slow receiver.
            let _ = log.tx.send(ev);
        }
        log.head
    }

    /// Id of the last event of a rank (0 before the first).
    pub fn head(&self, dp_rank: u32) -> Option<u64> {
        self.rank(dp_rank).ok().map(|r| r.lock().head)
    }

    /// Engine hashes of the blocks the log's events say are live.
    pub fn live_blocks(&self, dp_rank: u32) -> Vec<u64> {
        self.rank(dp_rank)
            .map(|r| r.lock().live.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Subscribes to a rank from a cursor (semantics in `proto/kvroute.proto`). Cursor 0 always
    /// gets a snapshot: a snapshot replaces everything the subscriber knows, so the epoch it
    /// names does not matter there.
    pub fn subscribe(
        &self,
        dp_rank: u32,
        from_cursor: u64,
        epoch: u64,
    ) -> Result<Subscription, SubscribeError> {
        let rank = self.rank(dp_rank)?;
        let current = self.inner.epoch;
        if from_cursor != 0 && epoch != 0 && epoch != current {
            return Err(SubscribeError::EpochMismatch {
                requested: epoch,
                current,
            });
        }
        let log = rank.lock();
        if from_cursor > log.head {
            // A cursor from another epoch is indistinguishable from one ahead: same remedy.
            return Err(SubscribeError::CursorAhead {
                cursor: from_cursor,
                head: log.head,
                epoch: current,
            });
        }
        let live = log.tx.subscribe();
        // Events after `from_cursor` are all in the history iff the oldest kept id is at most
        // from_cursor + 1.
        let oldest = log.head + 1 - log.history.len() as u64;
        if from_cursor != 0 && from_cursor + 1 >= oldest {
            let skip = (from_cursor + 1 - oldest) as usize;
            let replay = log.history.iter().skip(skip).cloned().collect();
            return Ok(Subscription {
                snapshot: None,
                replay,
                cursor: log.head,
                live,
            });
        }
        let snapshot = log.snapshot(dp_rank);
        Ok(Subscription {
            snapshot: Some(snapshot),
            replay: Vec::new(),
            cursor: log.head,
            live,
        })
    }
}

impl RankLog {
    fn apply(&mut self, data: &KvEventData) {
        match data {
            KvEventData::Stored {
                parent_hash,
                blocks,
                token_ids,
                block_size,
                lora_name,
                cache_salt,
            } => {
                let bs = *block_size as usize;
                let mut parent = *parent_hash;
                for (i, b) in blocks.iter().enumerate() {
                    let tokens = token_ids
                        .get(i * bs..(i + 1) * bs)
                        .map(<[u32]>::to_vec)
                        .unwrap_or_default();
                    self.live.insert(
                        b.block_hash,
                        LiveBlock {
                            parent,
                            tokens_hash: b.tokens_hash,
                            tokens,
                            lora_name: lora_name.clone(),
                            cache_salt: cache_salt.clone(),
                        },
                    );
                    parent = Some(b.block_hash);
                }
            }
            KvEventData::Removed { block_hashes } => {
                for h in block_hashes {
                    self.live.remove(h);
                }
            }
            KvEventData::Cleared => self.live.clear(),
        }
    }

    /// Every live block as `Stored` events, parents before children: each event is a chain
    /// (a block and its first child, recursively); other children start later events.
    fn snapshot(&self, dp_rank: u32) -> Snapshot {
        let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut roots = Vec::new();
        for (&h, b) in &self.live {
            match b.parent.filter(|p| self.live.contains_key(p)) {
                Some(p) => children.entry(p).or_default().push(h),
                None => roots.push(h),
            }
        }
        // Deterministic output order (hash maps iterate randomly).
        roots.sort_unstable();
        for c in children.values_mut() {
            c.sort_unstable();
        }
        let mut events = Vec::new();
        let mut stack: Vec<u64> = roots.into_iter().rev().collect();
        while let Some(start) = stack.pop() {
            let Some(first) = self.live.get(&start) else {
                continue;
            };
            let mut blocks = Vec::new();
            let mut token_ids = Vec::new();
            let mut cur = start;
            let block_size = first.tokens.len() as u32;
            while let Some(b) = self.live.get(&cur) {
                if b.tokens.len() as u32 != block_size {
                    // A differently sized block cannot share the event; it starts its own.
                    stack.push(cur);
                    break;
                }
                blocks.push(StoredBlock {
                    block_hash: cur,
                    tokens_hash: b.tokens_hash,
                });
                token_ids.extend_from_slice(&b.tokens);
                match children.get(&cur).map(Vec::as_slice) {
                    Some([next, rest @ ..]) => {
                        stack.extend(rest.iter().rev());
                        cur = *next;
                    }
                    _ => break,
                }
            }
            events.push(KvCacheEvent {
                event_id: 0,
                dp_rank,
                data: KvEventData::Stored {
                    parent_hash: first.parent,
                    blocks,
                    token_ids,
                    block_size,
                    lora_name: first.lora_name.clone(),
                    cache_salt: first.cache_salt.clone(),
                },
            });
        }
        Snapshot {
            cursor: self.head,
            events,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn stored(parent: Option<u64>, hashes: &[u64]) -> KvEventData {
        KvEventData::Stored {
            parent_hash: parent,
            blocks: hashes
                .iter()
                .map(|&h| StoredBlock {
                    block_hash: h,
                    tokens_hash: h + 1000,
                })
                .collect(),
            token_ids: hashes.iter().flat_map(|&h| [h as u32, h as u32]).collect(),
            block_size: 2,
            lora_name: None,
            cache_salt: None,
        }
    }

    fn cfg(history: usize) -> EventLogConfig {
        EventLogConfig {
            history,
            subscriber_buffer: 64,
        }
    }

    /// Applies a snapshot and checks parents come before children.
    fn apply_snapshot(s: &Snapshot) -> HashSet<u64> {
        let mut live = HashSet::new();
        for ev in &s.events {
            assert_eq!(ev.event_id, 0);
            let KvEventData::Stored {
                parent_hash,
                blocks,
                token_ids,
                block_size,
                ..
            } = &ev.data
            else {
                panic!("snapshot holds only Stored events")
            };
            assert_eq!(token_ids.len(), blocks.len() * *block_size as usize);
            if let Some(p) = parent_hash {
                assert!(live.contains(p), "parent {p} before child");
            }
            for b in blocks {
                assert!(live.insert(b.block_hash));
            }
        }
        live
    }

    #[test]
    fn ids_epoch_and_live_set() {
        let log = EventLog::new(7, 2, cfg(10));
        assert_ne!(log.epoch(), 0);
        assert_eq!(
            log.publish(0, [stored(None, &[1, 2]), stored(Some(2), &[3])]),
            2
        );
        assert_eq!(
            log.publish(1, [stored(None, &[9])]),
            1,
            "ranks count separately"
        );
        assert_eq!(
            log.publish(
                0,
                [KvEventData::Removed {
                    block_hashes: vec![3]
                }]
            ),
            3
        );
        let mut live = log.live_blocks(0);
        live.sort();
        assert_eq!(live, vec![1, 2]);
        log.publish(0, [KvEventData::Cleared]);
        assert!(log.live_blocks(0).is_empty());
        assert_eq!(log.head(5), None);
    }

    #[test]
    fn snapshot_orders_parents_first() {
        let log = EventLog::new(1, 1, cfg(10));
        // A tree: 1 → 2 → {3, 4 → 5}; plus root 10; then 2's subtree grows a branch.
        log.publish(
            0,
            [
                stored(None, &[1, 2, 3]),
                stored(Some(2), &[4, 5]),
                stored(None, &[10]),
                stored(Some(1), &[6]),
            ],
        );
        let sub = log.subscribe(0, 0, 0).unwrap();
        let snap = sub.snapshot.expect("cursor 0 gets a snapshot");
        assert_eq!(snap.cursor, 4);
        assert_eq!(sub.cursor, 4);
        let live = apply_snapshot(&snap);
        assert_eq!(live, HashSet::from([1, 2, 3, 4, 5, 6, 10]));
        assert!(snap.events.len() <= 4, "chains are coalesced");
    }

    #[test]
    fn cursor_semantics() {
        let log = EventLog::with_epoch(1, 1, cfg(3), 42);
        for i in 1..=5u64 {
            log.publish(0, [stored(None, &[i])]);
        }
        // History holds ids 3, 4, 5.
        let sub = log.subscribe(0, 2, 42).unwrap();
        assert!(sub.snapshot.is_none());
        assert_eq!(
            sub.replay.iter().map(|e| e.event_id).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        let sub = log.subscribe(0, 4, 0).unwrap();
        assert_eq!(
            sub.replay.iter().map(|e| e.event_id).collect::<Vec<_>>(),
            vec![5]
        );
        let sub = log.subscribe(0, 5, 42).unwrap();
        assert!(sub.snapshot.is_none() && sub.replay.is_empty());
        // Below the window → snapshot.
        let sub = log.subscribe(0, 1, 42).unwrap();
        assert_eq!(sub.snapshot.map(|s| s.cursor), Some(5));
        assert!(matches!(
            log.subscribe(0, 6, 42),
            Err(SubscribeError::CursorAhead {
                cursor: 6,
                head: 5,
                ..
            })
        ));
        assert!(matches!(
            log.subscribe(0, 3, 41),
            Err(SubscribeError::EpochMismatch { .. })
        ));
        assert!(
            log.subscribe(0, 0, 41).is_ok(),
            "cursor 0 ignores the epoch"
        );
        assert!(matches!(
            log.subscribe(1, 0, 0),
            Err(SubscribeError::BadDpRank { .. })
        ));
    }

    #[tokio::test]
    async fn live_follows_without_gap_and_lag_is_reported() {
        let log = EventLog::new(1, 1, cfg(100));
        log.publish(0, [stored(None, &[1])]);
        let mut sub = log.subscribe(0, 0, 0).unwrap();
        log.publish(0, [stored(Some(1), &[2])]);
        let ev = sub.live.recv().await.unwrap();
        assert_eq!(ev.event_id, sub.cursor + 1);
        // Overflow the 64-event buffer.
        for i in 0..100 {
            log.publish(0, [stored(None, &[100 + i])]);
        }
        assert!(matches!(
            sub.live.recv().await,
            Err(broadcast::error::RecvError::Lagged(_))
        ));
    }
}
