//! The sidecar's own Prometheus metrics (`kvroute_sidecar_*`): requests by routing mode and
//! status, prefill-leg latency, upstream errors by leg and kind, client cancellations, and the
//! time the sidecar itself adds to a request (its overhead histogram).

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

/// Why a metrics operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("metrics registry: {0}")]
    Prometheus(#[from] prometheus::Error),
    #[error("metrics text is not UTF-8: {0}")]
    Utf8(#[from] std::string::FromUtf8Error),
}

/// Overhead buckets: the sidecar should add tens to hundreds of microseconds.
const OVERHEAD_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
];
const PREFILL_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    upstream_errors: IntCounterVec,
    prefill_fallbacks: IntCounterVec,
    prefill_seconds: Histogram,
    overhead_seconds: Histogram,
    pub inflight: IntGauge,
    pub client_cancellations: IntCounterVec,
}

impl Metrics {
    pub fn new() -> Result<Metrics, MetricsError> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("kvroute_sidecar_requests_total", "Requests answered, by routing mode (aggregated, disaggregated, none) and HTTP status"),
            &["mode", "status"],
        )?;
        let upstream_errors = IntCounterVec::new(
            Opts::new("kvroute_sidecar_upstream_errors_total", "Failed upstream calls, by leg (engine, prefill, decode) and kind (connect, io, status_4xx, status_5xx, protocol, timeout)"),
            &["leg", "kind"],
        )?;
        let prefill_fallbacks = IntCounterVec::new(
            Opts::new("kvroute_sidecar_prefill_fallbacks_total", "Disaggregated requests prefilled on the local decode engine because the prefill leg failed"),
            &["reason"],
        )?;
        let prefill_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvroute_sidecar_prefill_leg_seconds",
                "Duration of the remote prefill leg (request sent to JSON response read)",
            )
            .buckets(PREFILL_BUCKETS.to_vec()),
        )?;
        let overhead_seconds = Histogram::with_opts(
            HistogramOpts::new("kvroute_sidecar_overhead_seconds", "Time the sidecar adds before response headers: its own work before sending upstream plus after the upstream headers arrived")
                .buckets(OVERHEAD_BUCKETS.to_vec()),
        )?;
        let inflight = IntGauge::new(
            "kvroute_sidecar_inflight_requests",
            "Requests in flight through the sidecar",
        )?;
        let client_cancellations = IntCounterVec::new(
            Opts::new("kvroute_sidecar_client_cancellations_total", "Responses the client stopped reading before they ended (the upstream request was dropped)"),
            &["mode"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(upstream_errors.clone()))?;
        registry.register(Box::new(prefill_fallbacks.clone()))?;
        registry.register(Box::new(prefill_seconds.clone()))?;
        registry.register(Box::new(overhead_seconds.clone()))?;
        registry.register(Box::new(inflight.clone()))?;
        registry.register(Box::new(client_cancellations.clone()))?;
        Ok(Metrics {
            registry,
            requests,
            upstream_errors,
            prefill_fallbacks,
            prefill_seconds,
            overhead_seconds,
            inflight,
            client_cancellations,
        })
    }

    pub fn request(&self, mode: &str, status: u16) {
        self.requests
            .with_label_values(&[mode, &status.to_string()])
            .inc();
    }

    pub fn upstream_error(&self, leg: &str, kind: &str) {
        self.upstream_errors.with_label_values(&[leg, kind]).inc();
    }

    pub fn prefill_fallback(&self, reason: &str) {
        self.prefill_fallbacks.with_label_values(&[reason]).inc();
    }

    pub fn observe_prefill(&self, secs: f64) {
        self.prefill_seconds.observe(secs);
    }

    pub fn observe_overhead(&self, secs: f64) {
        self.overhead_seconds.observe(secs);
    }

    pub fn encode(&self) -> Result<String, MetricsError> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        Ok(String::from_utf8(buf)?)
    }
}
