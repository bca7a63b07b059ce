//! The EPP's Prometheus metrics: GAIE's names where GAIE has one (so existing dashboards work),
//! `kvroute_epp_*` for what only a KV-event router can report (hit rate at pick time, index size,
//! event lag, resyncs). Served as text on `/metrics`.

use std::net::SocketAddr;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

pub struct EppMetrics {
    pub registry: Registry,
    pub scheduler_e2e: Histogram,
    pub ready_pods: IntGauge,
    pub request_total: IntCounterVec,
    pub request_error_total: IntCounterVec,
    pub running_requests: IntGaugeVec,
    pub input_tokens: HistogramVec,
    pub kv_hit_rate: Histogram,
    pub tokenize_seconds: Histogram,
    pub index_blocks: IntGauge,
    pub index_workers: IntGauge,
    pub events_applied: IntCounter,
    pub event_lag: Histogram,
    pub resyncs: IntCounterVec,
    pub picks: IntCounterVec,
}

fn buckets_seconds() -> Vec<f64> {
    vec![
        0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256,
        0.512, 1.0,
    ]
}

impl EppMetrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let scheduler_e2e = Histogram::with_opts(
            HistogramOpts::new(
                "inference_extension_scheduler_e2e_duration_seconds",
                "Time from the end of the request body to the routing decision (parse, tokenize, score).",
            )
            .buckets(buckets_seconds()),
        )?;
        let ready_pods = IntGauge::new(
            "inference_pool_ready_pods",
            "Workers with a synced KV event stream.",
        )?;
        let request_total = IntCounterVec::new(
            Opts::new("inference_objective_request_total", "Requests routed."),
            &["model_name", "target_model_name"],
        )?;
        let request_error_total = IntCounterVec::new(
            Opts::new(
                "inference_objective_request_error_total",
                "Requests answered with an error status by the EPP.",
            ),
            &["model_name", "target_model_name", "error_code"],
        )?;
        let running_requests = IntGaugeVec::new(
            Opts::new(
                "inference_objective_running_requests",
                "Requests routed and not yet finished.",
            ),
            &["model_name"],
        )?;
        let input_tokens = HistogramVec::new(
            HistogramOpts::new(
                "inference_objective_input_tokens",
                "Prompt tokens per routed request.",
            )
            .buckets(prometheus::exponential_buckets(16.0, 2.0, 14)?),
            &["model_name", "target_model_name"],
        )?;
        let kv_hit_rate = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_epp_kv_hit_rate",
                "Matched blocks on the chosen worker / request blocks, at pick time.",
            )
            .buckets(vec![
                0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0,
            ]),
        )?;
        let tokenize_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_epp_tokenize_duration_seconds",
                "Chat template + tokenization time.",
            )
            .buckets(buckets_seconds()),
        )?;
        let index_blocks =
            IntGauge::new("kvroute_epp_index_blocks", "Blocks held in the KV index.")?;
        let index_workers =
            IntGauge::new("kvroute_epp_index_workers", "Worker ranks in the KV index.")?;
        let events_applied = IntCounter::new(
            "kvroute_epp_kv_events_applied_total",
            "KV events applied to the index.",
        )?;
        let event_lag = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_epp_kv_event_lag_seconds",
                "Publisher send time to index apply time, per event batch.",
            )
            .buckets(buckets_seconds()),
        )?;
        let resyncs = IntCounterVec::new(
            Opts::new(
                "kvroute_epp_kv_resyncs_total",
                "Event stream resynchronizations by reason.",
            ),
            &["reason"],
        )?;
        let picks = IntCounterVec::new(
            Opts::new("kvroute_epp_picks_total", "Routing decisions per worker."),
            &["worker"],
        )?;
        for c in [
            Box::new(scheduler_e2e.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(ready_pods.clone()),
            Box::new(request_total.clone()),
            Box::new(request_error_total.clone()),
            Box::new(running_requests.clone()),
            Box::new(input_tokens.clone()),
            Box::new(kv_hit_rate.clone()),
            Box::new(tokenize_seconds.clone()),
            Box::new(index_blocks.clone()),
            Box::new(index_workers.clone()),
            Box::new(events_applied.clone()),
            Box::new(event_lag.clone()),
            Box::new(resyncs.clone()),
            Box::new(picks.clone()),
        ] {
            registry.register(c)?;
        }
        Ok(EppMetrics {
            registry,
            scheduler_e2e,
            ready_pods,
            request_total,
            request_error_total,
            running_requests,
            input_tokens,
            kv_hit_rate,
            tokenize_seconds,
            index_blocks,
            index_workers,
            events_applied,
            event_lag,
            resyncs,
            picks,
        })
    }

    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::warn!("encoding metrics: {e}");
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

/// Serves `GET /metrics` (anything else: 404) until the process exits.
pub async fn serve(
    addr: SocketAddr,
    render: impl Fn() -> String + Send + Sync + 'static,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let render = std::sync::Arc::new(render);
    loop {
        let (mut sock, _) = listener.accept().await?;
        let render = render.clone();
        tokio::spawn(async move {
            // A scrape is one small request; read the head and answer, no keep-alive needed.
            let mut buf = vec![0u8; 4096];
            let n = match sock.read(&mut buf).await {
                Ok(n) => n,
                Err(_) => return,
            };
            let head = String::from_utf8_lossy(&buf[..n]);
            let first = head.lines().next().unwrap_or_default();
            let (status, body) = if first.starts_with("GET /metrics") {
                ("200 OK", render())
            } else {
                ("404 Not Found", "not found: try GET /metrics\n".to_string())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        });
    }
}
