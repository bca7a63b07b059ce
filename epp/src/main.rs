//! `kvroute-epp`: the endpoint picker binary. Wires discovery → ingest → pool/index/ledger →
//! picker → ext_proc server, plus gRPC health and Prometheus metrics.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use kvroute_epp::discovery::{self, WorkerEndpoint};
use kvroute_epp::extproc::{ExtProcConfig, ExtProcService};
use kvroute_epp::health;
use kvroute_epp::index::KvIndex;
use kvroute_epp::ingest::{self, IngestConfig, Sinks};
use kvroute_epp::load::LoadLedger;
use kvroute_epp::metrics::{self, EppMetrics};
use kvroute_epp::picker::{Picker, PickerConfig};
use kvroute_epp::policy::{BusyThresholds, CostParams, PolicyKind};
use kvroute_epp::pool::WorkerPool;
use kvroute_proto::prompt::PromptRenderer;

#[derive(Parser, Debug)]
#[command(
    name = "kvroute-epp",
    version,
    about = "KV-aware endpoint picker for the Gateway API Inference Extension"
)]
struct Args {
    /// ext_proc gRPC listen address.
    #[arg(long, env = "KVROUTE_EPP_GRPC_ADDR", default_value = "0.0.0.0:9002")]
    grpc_addr: SocketAddr,
    /// grpc.health.v1 listen address.
    #[arg(long, env = "KVROUTE_EPP_HEALTH_ADDR", default_value = "0.0.0.0:9003")]
    health_addr: SocketAddr,
    /// Prometheus /metrics listen address.
    #[arg(long, env = "KVROUTE_EPP_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    metrics_addr: SocketAddr,
    /// Served model name (requests for other names get 404).
    #[arg(long, env = "KVROUTE_MODEL", default_value = "Qwen/Qwen3-0.6B")]
    model: String,
    /// LoRA adapter names also served (repeatable).
    #[arg(long = "lora", env = "KVROUTE_LORA_ADAPTERS", value_delimiter = ',')]
    lora_adapters: Vec<String>,
    /// Directory with tokenizer.json and tokenizer_config.json (the engine's, for identical token ids).
    #[arg(long, env = "KVROUTE_MODEL_DIR", default_value = ".cache/models/qwen3")]
    model_dir: PathBuf,
    /// KV block size in tokens; must equal the engines'.
    #[arg(long, env = "KVROUTE_BLOCK_SIZE", default_value_t = 16)]
    block_size: u32,
    /// Worker list file (JSON), re-read when it changes.
    #[arg(long, env = "KVROUTE_WORKERS_FILE")]
    workers_file: Option<PathBuf>,
    /// A worker: name=NAME,grpc=HOST:PORT[,http=HOST:PORT] (repeatable).
    #[arg(long = "worker", env = "KVROUTE_WORKERS", value_delimiter = ';')]
    workers: Vec<String>,
    /// Selection policy.
    #[arg(long, env = "KVROUTE_POLICY", value_enum, default_value_t = PolicyKind::Kv)]
    policy: PolicyKind,
    /// Credit per overlapping block (Dynamo overlap_score_credit), 0..=1.
    #[arg(long, env = "KVROUTE_OVERLAP_SCORE_CREDIT", default_value_t = 1.0)]
    overlap_score_credit: f64,
    /// Weight of prefill work in the cost (Dynamo prefill_load_scale).
    #[arg(long, env = "KVROUTE_PREFILL_LOAD_SCALE", default_value_t = 1.0)]
    prefill_load_scale: f64,
    /// Softmax temperature over costs; 0 = always the cheapest.
    #[arg(long, env = "KVROUTE_ROUTER_TEMPERATURE", default_value_t = 0.0)]
    router_temperature: f64,
    /// Shrinks the overlap credit of workers with a prefill backlog (0 = off).
    #[arg(long, env = "KVROUTE_OVERLAP_CREDIT_DECAY", default_value_t = 0.0)]
    overlap_score_credit_decay: f64,
    /// A rank is busy above this fraction of its KV blocks in use by active requests.
    #[arg(long, env = "KVROUTE_ACTIVE_DECODE_BLOCKS_THRESHOLD")]
    active_decode_blocks_threshold: Option<f64>,
    /// A rank is busy above this many active prefill tokens.
    #[arg(long, env = "KVROUTE_ACTIVE_PREFILL_TOKENS_THRESHOLD")]
    active_prefill_tokens_threshold: Option<u64>,
    /// Request bodies above this many bytes get 413.
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES", default_value_t = 16 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Next-best endpoints after the pick in the envoy.lb fallback list.
    #[arg(long, env = "KVROUTE_FALLBACKS", default_value_t = 2)]
    fallbacks: usize,
    /// Also put the fallback list in the x-gateway-destination-endpoint header.
    #[arg(long, env = "KVROUTE_HEADER_FALLBACKS")]
    header_fallbacks: bool,
    /// Honour the conformance test header test-epp-endpoint-selection.
    #[arg(long, env = "KVROUTE_TEST_EPP_HEADER")]
    test_epp_header: bool,
    /// How long a pick's blocks count as held by the chosen worker until its KV events arrive (0 = off).
    #[arg(long, env = "KVROUTE_SPECULATIVE_TTL_MS", default_value_t = 2000)]
    speculative_ttl_ms: u64,
    /// Conditional disaggregation: prefill on the decode worker when it would compute fewer
    /// uncached prompt tokens than this (0 = always use a prefill worker when there is one).
    #[arg(long, env = "KVROUTE_DISAGG_MIN_UNCACHED_TOKENS", default_value_t = 0)]
    disagg_min_uncached_tokens: u64,
    /// How often to poll each worker's load report.
    #[arg(long, env = "KVROUTE_LOAD_POLL_MS", default_value_t = 100)]
    load_poll_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,h2=warn,tower=warn".into()),
        )
        .init();
    let args = Args::parse();
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.overlap_score_credit),
        "--overlap-score-credit must be in [0, 1], got {}",
        args.overlap_score_credit
    );
    anyhow::ensure!(
        args.router_temperature >= 0.0,
        "--router-temperature must be >= 0"
    );
    anyhow::ensure!(args.block_size > 0, "--block-size must be positive");

    let renderer = Arc::new(PromptRenderer::from_dir(&args.model_dir).with_context(|| {
        format!(
            "loading the tokenizer and chat template from {}",
            args.model_dir.display()
        )
    })?);
    let workers_rx = match (&args.workers_file, args.workers.is_empty()) {
        (Some(path), _) => discovery::watch_file(path.clone(), Duration::from_millis(500)),
        (None, false) => {
            let list: Vec<WorkerEndpoint> = args
                .workers
                .iter()
                .map(|s| discovery::parse_worker_flag(s))
                .collect::<Result<_, _>>()?;
            discovery::static_workers(list)
        }
        (None, true) => {
            anyhow::bail!("no workers: pass --workers-file FILE or --worker name=..,grpc=..")
        }
    };

    let metrics = Arc::new(EppMetrics::new().context("registering metrics")?);
    let pool = Arc::new(WorkerPool::new());
    let index = Arc::new(KvIndex::new());
    let ledger = Arc::new(LoadLedger::new());
    let sinks = Sinks {
        pool: pool.clone(),
        index: index.clone(),
        ledger: ledger.clone(),
        metrics: metrics.clone(),
    };
    let ingest_cfg = IngestConfig {
        block_size: args.block_size,
        load_poll_interval: Duration::from_millis(args.load_poll_ms.max(10)),
        ..IngestConfig::default()
    };
    tokio::spawn(ingest::run(workers_rx, sinks, ingest_cfg));

    let picker = Arc::new(Picker::new(
        PickerConfig {
            model: args.model.clone(),
            lora_adapters: args.lora_adapters.clone(),
            block_size: args.block_size,
            max_body_bytes: args.max_body_bytes,
            policy: args.policy,
            cost: CostParams {
                overlap_score_credit: args.overlap_score_credit,
                prefill_load_scale: args.prefill_load_scale,
                temperature: args.router_temperature,
                overlap_score_credit_decay: args.overlap_score_credit_decay,
            },
            busy: BusyThresholds {
                active_decode_blocks_frac: args.active_decode_blocks_threshold,
                active_prefill_tokens: args.active_prefill_tokens_threshold,
            },
            fallbacks: args.fallbacks,
            speculative_ttl: Duration::from_millis(args.speculative_ttl_ms),
            disagg_min_uncached_tokens: args.disagg_min_uncached_tokens,
        },
        renderer,
        pool.clone(),
        index,
        ledger,
        metrics.clone(),
    ));

    let (reporter, health_service) = tonic_health::server::health_reporter();
    tokio::spawn(health::track_readiness(reporter, pool));
    let health_addr = args.health_addr;
    let health_server = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(health_service)
            .serve(health_addr)
            .await
    });
    let m = metrics.clone();
    let metrics_addr = args.metrics_addr;
    let metrics_server =
        tokio::spawn(async move { metrics::serve(metrics_addr, move || m.render()).await });

    let service = ExtProcService::new(
        picker,
        ExtProcConfig {
            header_fallbacks: args.header_fallbacks,
            test_epp_header: args.test_epp_header,
        },
    );
    tracing::info!(
        grpc = %args.grpc_addr, health = %args.health_addr, metrics = %args.metrics_addr,
        policy = %args.policy, model = %args.model, "kvroute-epp starting"
    );
    let grpc = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(service.into_server())
        .serve_with_shutdown(args.grpc_addr, shutdown_signal());
    tokio::select! {
        r = grpc => r.context("ext_proc server")?,
        r = health_server => r.context("health task")?.context("health server")?,
        r = metrics_server => r.context("metrics task")?.with_context(|| format!("metrics server on {metrics_addr}"))?,
    }
    tracing::info!("kvroute-epp stopped");
    Ok(())
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot listen for SIGTERM: {e}");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
}
