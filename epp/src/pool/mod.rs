//! The set of workers the EPP may route to: their metadata, where the gateway should send their
//! requests, and whether their KV state is synced. Reads happen on every pick, so the list is an
//! immutable snapshot swapped on change (readers never wait for the ingest tasks).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use kvroute_proto::metadata::{WorkerMetadata, WorkerRole};
use parking_lot::RwLock;

/// One discovered worker.
#[derive(Debug)]
pub struct WorkerEntry {
    pub name: String,
    pub metadata: WorkerMetadata,
    /// host:port for `x-gateway-destination-endpoint`.
    pub destination: String,
    /// Bit i set = dp rank i has applied a snapshot and is streaming.
    synced_ranks: AtomicU32,
}

impl WorkerEntry {
    pub fn new(name: String, metadata: WorkerMetadata, destination: String) -> Self {
        WorkerEntry {
            name,
            metadata,
            destination,
            synced_ranks: AtomicU32::new(0),
        }
    }

    pub fn id(&self) -> u64 {
        self.metadata.instance_id
    }

    pub fn set_rank_synced(&self, rank: u32, synced: bool) {
        let bit = 1u32 << rank.min(31);
        if synced {
            self.synced_ranks.fetch_or(bit, Ordering::Relaxed);
        } else {
            self.synced_ranks.fetch_and(!bit, Ordering::Relaxed);
        }
    }

    pub fn rank_synced(&self, rank: u32) -> bool {
        self.synced_ranks.load(Ordering::Relaxed) & (1u32 << rank.min(31)) != 0
    }

    /// Routable: every dp rank has a live event stream.
    pub fn ready(&self) -> bool {
        (0..self.metadata.dp_size.min(32)).all(|r| self.rank_synced(r))
    }

    pub fn serves(&self, model: &str) -> bool {
        self.metadata.model == model
    }

    pub fn role(&self) -> WorkerRole {
        self.metadata.role
    }
}

#[derive(Default)]
pub struct WorkerPool {
    workers: RwLock<Arc<Vec<Arc<WorkerEntry>>>>,
    synced: AtomicBool,
}

impl WorkerPool {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn snapshot(&self) -> Arc<Vec<Arc<WorkerEntry>>> {
        self.workers.read().clone()
    }

    /// Adds or replaces (same instance id) a worker.
    pub fn upsert(&self, entry: Arc<WorkerEntry>) {
        let mut w = self.workers.write();
        let mut next: Vec<Arc<WorkerEntry>> =
            w.iter().filter(|e| e.id() != entry.id()).cloned().collect();
        next.push(entry);
        *w = Arc::new(next);
    }

    pub fn remove(&self, worker_id: u64) -> Option<Arc<WorkerEntry>> {
        let mut w = self.workers.write();
        let gone = w.iter().find(|e| e.id() == worker_id).cloned();
        if gone.is_some() {
            *w = Arc::new(w.iter().filter(|e| e.id() != worker_id).cloned().collect());
        }
        gone
    }

    pub fn get(&self, worker_id: u64) -> Option<Arc<WorkerEntry>> {
        self.snapshot()
            .iter()
            .find(|e| e.id() == worker_id)
            .cloned()
    }

    /// The worker whose destination is `endpoint` (`ip:port`, or a bare IP matching any port).
    pub fn by_destination(&self, endpoint: &str) -> Option<Arc<WorkerEntry>> {
        self.snapshot()
            .iter()
            .find(|e| endpoint_matches(endpoint, &e.destination))
            .cloned()
    }

    pub fn ready_count(&self) -> usize {
        self.snapshot().iter().filter(|e| e.ready()).count()
    }

    /// Discovery has delivered its first list and every listed worker has been tried once.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Relaxed)
    }

    pub fn set_synced(&self) {
        self.synced.store(true, Ordering::Relaxed);
    }
}

/// Does a subset-hint / selection token (`ip`, `ip:port`, `[v6]`, `[v6]:port`) match a destination?
pub fn endpoint_matches(token: &str, destination: &str) -> bool {
    let token = token.trim();
    if token.is_empty() {
        return false;
    }
    if token == destination {
        return true;
    }
    let dest_host = destination
        .rsplit_once(':')
        .map(|(h, _)| h)
        .unwrap_or(destination)
        .trim_start_matches('[')
        .trim_end_matches(']');
    // A token with a port must match exactly (done above); a bare host matches any port.
    let bare = token.trim_start_matches('[').trim_end_matches(']');
    let has_port = if token.starts_with('[') {
        token.contains("]:")
    } else {
        token.matches(':').count() == 1
    };
    !has_port && bare == dest_host
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_matching() {
        assert!(endpoint_matches("10.0.0.1:8000", "10.0.0.1:8000"));
        assert!(endpoint_matches("10.0.0.1", "10.0.0.1:8000"));
        assert!(!endpoint_matches("10.0.0.1:8001", "10.0.0.1:8000"));
        assert!(!endpoint_matches("10.0.0.2", "10.0.0.1:8000"));
        assert!(endpoint_matches("[::1]", "[::1]:8000"));
        assert!(endpoint_matches("[::1]:8000", "[::1]:8000"));
        assert!(endpoint_matches("::1", "[::1]:8000"));
        assert!(!endpoint_matches("", "10.0.0.1:8000"));
    }
}
