//! Router-side load accounting per (worker, dp rank).
//!
//! A request is *booked* on the worker it was sent to at pick time (its uncached prefill tokens
//! and its KV blocks), its prefill tokens are dropped when the first response byte arrives, and
//! the whole booking is released when the response ends, the client aborts or the ext_proc
//! stream resets. Bookings are the only load signal fast enough to stop a burst converging on
//! one worker (a polled metric is always stale, GAIE pain point "Stale load"), so the cost
//! function reads bookings only, as Dynamo's router does. The workers' own reports feed the busy
//! thresholds (where staleness errs on the safe side) and reconcile the books: a booking older
//! than a report saying the rank runs and queues nothing has leaked, and is dropped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use parking_lot::Mutex;

/// A worker's dp rank: the unit that holds a KV cache.
pub type WorkerKey = (u64, u32);

/// What a worker last reported about itself.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReportedLoad {
    pub kv_used_blocks: u64,
    pub kv_total_blocks: u64,
    pub waiting_requests: u32,
    pub running_requests: u32,
    pub active_prefill_tokens: u64,
    pub max_num_batched_tokens: u32,
}

/// The load the selector sees for one (worker, dp rank): this router's bookings, plus the
/// rank's last fresh report (zero when none).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadView {
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u64,
    pub reported: ReportedLoad,
}

#[derive(Default)]
struct RankCounters {
    prefill_tokens: AtomicU64,
    decode_blocks: AtomicU64,
    requests: AtomicU64,
    reported: Mutex<Option<(ReportedLoad, Instant)>>,
}

#[derive(Debug, Clone)]
struct Booking {
    key: WorkerKey,
    prefill_tokens: u64,
    decode_blocks: u64,
    prefill_done: bool,
    booked_at: Instant,
}

/// Reports older than this are ignored (the worker is probably gone or partitioned).
const REPORT_TTL: Duration = Duration::from_secs(5);
/// A booking this much older than an idle report is a leak, not a request in flight
/// (covers the poll interval and request hand-off to the engine).
const LEAK_GRACE: Duration = Duration::from_secs(2);

#[derive(Default)]
pub struct LoadLedger {
    ranks: DashMap<WorkerKey, Arc<RankCounters>>,
    bookings: DashMap<String, Booking>,
}

impl LoadLedger {
    pub fn new() -> Self {
        Self::default()
    }

    fn counters(&self, key: WorkerKey) -> Arc<RankCounters> {
        self.ranks.entry(key).or_default().clone()
    }

    /// Books a request. A second booking under the same id replaces the first.
    pub fn book(&self, request_id: &str, key: WorkerKey, prefill_tokens: u64, decode_blocks: u64) {
        self.release(request_id);
        let c = self.counters(key);
        c.prefill_tokens
            .fetch_add(prefill_tokens, Ordering::Relaxed);
        c.decode_blocks.fetch_add(decode_blocks, Ordering::Relaxed);
        c.requests.fetch_add(1, Ordering::Relaxed);
        self.bookings.insert(
            request_id.to_string(),
            Booking {
                key,
                prefill_tokens,
                decode_blocks,
                prefill_done: false,
                booked_at: Instant::now(),
            },
        );
    }

    /// The first response byte arrived: the prefill is over.
    pub fn mark_prefill_done(&self, request_id: &str) {
        if let Some(mut b) = self.bookings.get_mut(request_id) {
            if !b.prefill_done {
                b.prefill_done = true;
                let c = self.counters(b.key);
                sub(&c.prefill_tokens, b.prefill_tokens);
            }
        }
    }

    /// Releases a booking; returns whether one existed (idempotent).
    pub fn release(&self, request_id: &str) -> bool {
        let Some((_, b)) = self.bookings.remove(request_id) else {
            return false;
        };
        let c = self.counters(b.key);
        if !b.prefill_done {
            sub(&c.prefill_tokens, b.prefill_tokens);
        }
        sub(&c.decode_blocks, b.decode_blocks);
        sub(&c.requests, 1);
        true
    }

    /// Moves a booking to the worker that really served it (the gateway's served-endpoint report).
    pub fn move_booking(&self, request_id: &str, to: WorkerKey) -> bool {
        let Some(b) = self.bookings.get(request_id).map(|b| b.clone()) else {
            return false;
        };
        if b.key == to {
            return false;
        }
        self.release(request_id);
        self.book(request_id, to, b.prefill_tokens, b.decode_blocks);
        if b.prefill_done {
            self.mark_prefill_done(request_id);
        }
        true
    }

    pub fn booked_worker(&self, request_id: &str) -> Option<WorkerKey> {
        self.bookings.get(request_id).map(|b| b.key)
    }

    pub fn active_bookings(&self) -> usize {
        self.bookings.len()
    }

    /// Records a worker's report; if it says the rank is idle, releases bookings on it that
    /// are clearly older than the report (returns how many).
    pub fn set_reported(&self, key: WorkerKey, load: ReportedLoad) -> usize {
        let now = Instant::now();
        *self.counters(key).reported.lock() = Some((load, now));
        if load.running_requests > 0 || load.waiting_requests > 0 {
            return 0;
        }
        let leaked: Vec<String> = self
            .bookings
            .iter()
            .filter(|b| b.key == key && now.duration_since(b.booked_at) > LEAK_GRACE)
            .map(|b| b.key().clone())
            .collect();
        for id in &leaked {
            tracing::debug!(request_id = %id, worker = key.0, "releasing a booking the worker does not know");
            self.release(id);
        }
        leaked.len()
    }

    /// Forgets a worker's counters and reports (its bookings release normally when their streams end).
    pub fn forget_worker(&self, worker_id: u64) {
        self.ranks.retain(|k, _| k.0 != worker_id);
    }

    pub fn view(&self, key: WorkerKey) -> LoadView {
        let Some(c) = self.ranks.get(&key).map(|c| c.clone()) else {
            return LoadView::default();
        };
        let reported = match *c.reported.lock() {
            Some((r, at)) if at.elapsed() < REPORT_TTL => r,
            // Capacity does not go stale.
            Some((r, _)) => ReportedLoad {
                kv_total_blocks: r.kv_total_blocks,
                max_num_batched_tokens: r.max_num_batched_tokens,
                ..ReportedLoad::default()
            },
            None => ReportedLoad::default(),
        };
        LoadView {
            active_prefill_tokens: c.prefill_tokens.load(Ordering::Relaxed),
            active_decode_blocks: c.decode_blocks.load(Ordering::Relaxed),
            active_requests: c.requests.load(Ordering::Relaxed),
            reported,
        }
    }
}

fn sub(a: &AtomicU64, n: u64) {
    // Saturating: a release racing a forget_worker must not wrap to u64::MAX.
    let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn book_prefill_done_release() {
        let l = LoadLedger::new();
        l.book("r1", (1, 0), 100, 7);
        l.book("r2", (1, 0), 50, 3);
        assert_eq!(l.view((1, 0)).active_prefill_tokens, 150);
        assert_eq!(l.view((1, 0)).active_decode_blocks, 10);
        assert_eq!(l.view((1, 0)).active_requests, 2);
        l.mark_prefill_done("r1");
        l.mark_prefill_done("r1");
        assert_eq!(l.view((1, 0)).active_prefill_tokens, 50);
        assert!(l.release("r1"));
        assert!(!l.release("r1"), "release is idempotent");
        let v = l.view((1, 0));
        assert_eq!(
            (
                v.active_prefill_tokens,
                v.active_decode_blocks,
                v.active_requests
            ),
            (50, 3, 1)
        );
        l.release("r2");
        assert_eq!(l.view((1, 0)), LoadView::default());
        assert_eq!(l.active_bookings(), 0);
    }

    #[test]
    fn move_to_served_worker() {
        let l = LoadLedger::new();
        l.book("r", (1, 0), 10, 2);
        assert!(l.move_booking("r", (2, 0)));
        assert_eq!(l.view((1, 0)).active_requests, 0);
        assert_eq!(l.view((2, 0)).active_decode_blocks, 2);
        assert_eq!(l.booked_worker("r"), Some((2, 0)));
        assert!(!l.move_booking("r", (2, 0)));
    }

    #[test]
    fn reports_are_kept_apart_and_reconcile_leaks() {
        let l = LoadLedger::new();
        l.book("r", (1, 0), 10, 2);
        let busy = ReportedLoad {
            kv_used_blocks: 40,
            kv_total_blocks: 100,
            running_requests: 3,
            waiting_requests: 2,
            active_prefill_tokens: 5,
            max_num_batched_tokens: 8192,
        };
        assert_eq!(l.set_reported((1, 0), busy), 0);
        let v = l.view((1, 0));
        assert_eq!(
            (
                v.active_prefill_tokens,
                v.active_decode_blocks,
                v.active_requests
            ),
            (10, 2, 1)
        );
        assert_eq!(v.reported, busy);
        // An idle report does not touch a fresh booking (it may not have reached the engine yet)...
        let idle = ReportedLoad {
            kv_total_blocks: 100,
            ..ReportedLoad::default()
        };
        assert_eq!(l.set_reported((1, 0), idle), 0);
        assert_eq!(l.view((1, 0)).active_requests, 1);
        // ...but releases one older than the grace period.
        if let Some(mut b) = l.bookings.get_mut("r") {
            b.booked_at = Instant::now() - LEAK_GRACE - Duration::from_millis(1);
        }
        assert_eq!(l.set_reported((1, 0), idle), 1);
        assert_eq!(l.view((1, 0)).active_requests, 0);
        l.book("s", (1, 0), 1, 1);
        l.forget_worker(1);
        assert_eq!(l.view((1, 0)), LoadView::default());
        assert!(
            l.release("s"),
            "bookings outlive forgotten counters without underflow"
        );
        assert_eq!(l.view((1, 0)).active_requests, 0);
    }
}
