//! gRPC health (`grpc.health.v1`) on its own port: `liveness` always serves; `""`,
//! `readiness`, `envoy.service.ext_proc.v3.ExternalProcessor` and `inference-extension` serve
//! only once discovery has synced (gaie-epp-protocol.md §7). Unknown names get NOT_FOUND
//! (tonic-health's SERVICE_UNKNOWN equivalent).

use std::sync::Arc;
use std::time::Duration;

use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::pool::WorkerPool;

pub const READY_SERVICES: &[&str] = &[
    "",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
    "inference-extension",
];

/// Flips readiness as the pool's sync state changes (checked every 100 ms).
pub async fn track_readiness(reporter: HealthReporter, pool: Arc<WorkerPool>) {
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let mut last = None;
    loop {
        let ready = pool.is_synced();
        if last != Some(ready) {
            let status = if ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            for s in READY_SERVICES {
                reporter.set_service_status(*s, status).await;
            }
            tracing::info!(ready, "health status");
            last = Some(ready);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
