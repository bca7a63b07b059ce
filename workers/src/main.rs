//! `kvroute-worker`: runs an engine shim (today the simulated engine) behind the OpenAI HTTP
//! API and the `WorkerControl` gRPC service (KV events, load, metadata).
//!
//! Every flag has a `KVROUTE_*` environment fallback and a default that works on one machine.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::Parser;
use kvroute_proto::metadata::{Enforcement, WorkerMetadata, WorkerRole};
use kvroute_proto::prompt::PromptRenderer;
use kvroute_proto::worker_id::instance_id_for_pod;
use kvroute_worker::disagg::{Disagg, DisaggConfig};
use kvroute_worker::http::{self, AppState, HttpConfig};
use kvroute_worker::metrics::Metrics;
use kvroute_worker::sim::{SimConfig, SimEngine};
use kvroute_worker::transfer::Backend;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    name = "kvroute-worker",
    version,
    about = "kvroute worker shim (OpenAI HTTP API + WorkerControl gRPC)"
)]
struct Args {
    /// Engine to run; only `sim` (the simulated engine) exists today.
    #[arg(long, env = "KVROUTE_ENGINE", default_value = "sim")]
    engine: String,
    /// OpenAI HTTP API address.
    #[arg(long, env = "KVROUTE_LISTEN", default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// WorkerControl gRPC address.
    #[arg(long, env = "KVROUTE_GRPC_LISTEN", default_value = "127.0.0.1:9500")]
    grpc_listen: SocketAddr,
    /// host:port others reach the HTTP API at (default: the listen address; an unspecified IP
    /// is replaced by $POD_IP or 127.0.0.1).
    #[arg(long, env = "KVROUTE_ADVERTISE_ADDR")]
    advertise_addr: Option<String>,
    /// Served model name; requests for other models get 404.
    #[arg(long, env = "KVROUTE_MODEL", default_value = "Qwen/Qwen3-0.6B")]
    model: String,
    /// Dir with tokenizer.json + tokenizer_config.json (default: ./.cache/models/qwen3, then
    /// the source checkout's .cache/models/qwen3).
    #[arg(long, env = "KVROUTE_MODEL_DIR")]
    model_dir: Option<PathBuf>,
    /// Worker name (the pod name on Kubernetes; default $POD_NAME, then $HOSTNAME).
    #[arg(long, env = "KVROUTE_WORKER_NAME")]
    name: Option<String>,
    /// Instance id (default: Dynamo's hash of --name).
    #[arg(long, env = "KVROUTE_INSTANCE_ID")]
    instance_id: Option<u64>,
    /// Tokens per KV block.
    #[arg(long, env = "KVROUTE_BLOCK_SIZE", default_value_t = 16)]
    block_size: u32,
    /// KV cache capacity per dp rank, in blocks.
    #[arg(long, env = "KVROUTE_KV_BLOCKS", default_value_t = 16384)]
    kv_blocks: u64,
    #[arg(long, env = "KVROUTE_MAX_NUM_SEQS", default_value_t = 256)]
    max_num_seqs: usize,
    #[arg(long, env = "KVROUTE_MAX_NUM_BATCHED_TOKENS", default_value_t = 8192)]
    max_num_batched_tokens: u32,
    /// Divides every simulated duration (2.0 = twice as fast as the modelled GPU).
    #[arg(long, env = "KVROUTE_SPEEDUP", default_value_t = 1.0)]
    speedup: f64,
    #[arg(long, env = "KVROUTE_DP_SIZE", default_value_t = 1)]
    dp_size: u32,
    /// aggregated | prefill | decode
    #[arg(long, env = "KVROUTE_ROLE", default_value = "aggregated")]
    role: WorkerRole,
    /// Larger request bodies get 413.
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES", default_value_t = 16 << 20)]
    max_body_bytes: usize,
    /// `max_tokens` for requests that give none.
    #[arg(long, env = "KVROUTE_DEFAULT_MAX_TOKENS", default_value_t = 128)]
    default_max_tokens: u32,
    /// Seconds in-flight requests may run after SIGINT/SIGTERM.
    #[arg(long, env = "KVROUTE_SHUTDOWN_GRACE_SECS", default_value_t = 10)]
    shutdown_grace_secs: u64,
    /// Where a prefill worker's KV transfer agent listens (port 0 = a free port; the bound
    /// host:port is advertised in `kv_transfer_params`).
    #[arg(
        long,
        env = "KVROUTE_KV_TRANSFER_LISTEN",
        default_value = "127.0.0.1:0"
    )]
    kv_transfer_listen: SocketAddr,
    /// Host advertised as `remote_host` (default: the bound IP; $POD_IP for 0.0.0.0).
    #[arg(long, env = "KVROUTE_KV_TRANSFER_ADVERTISE_HOST")]
    kv_transfer_advertise_host: Option<String>,
    /// KV bytes per token held by the simulated engine for transfer (layers * 2 * kv_heads *
    /// head_dim * dtype bytes; Qwen3-0.6B bf16 is 114688).
    #[arg(long, env = "KVROUTE_KV_BYTES_PER_TOKEN", default_value_t = 4096)]
    kv_bytes_per_token: u64,
    /// Blocks a prefill worker can hold pinned for transfer (default: --kv-blocks).
    #[arg(long, env = "KVROUTE_KV_TRANSFER_POOL_BLOCKS")]
    kv_transfer_pool_blocks: Option<usize>,
    /// Seconds a prefill worker keeps unpulled blocks pinned (vLLM's
    /// VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
    #[arg(long, env = "KVROUTE_KV_PIN_TIMEOUT_SECS", default_value_t = 60)]
    kv_pin_timeout_secs: u64,
    /// Bound on one KV pull, in seconds.
    #[arg(long, env = "KVROUTE_KV_TRANSFER_TIMEOUT_SECS", default_value_t = 30)]
    kv_transfer_timeout_secs: u64,
    /// tcp | cuda (cuda needs a CUDA driver; without one the worker logs an error and uses tcp).
    #[arg(long, env = "KVROUTE_KV_TRANSFER_BACKEND", default_value = "tcp", value_parser = parse_backend)]
    kv_transfer_backend: Backend,
    /// One file per topology domain (file name = domain, content = value); ignored if absent.
    #[arg(
        long,
        env = "KVROUTE_TOPOLOGY_DIR",
        default_value = "/etc/kvroute/topology"
    )]
    topology_dir: PathBuf,
    /// DOMAIN=VALUE, repeatable; overrides --topology-dir.
    #[arg(long = "topology-domain", env = "KVROUTE_TOPOLOGY_DOMAINS", value_delimiter = ',', value_parser = parse_domain)]
    topology_domains: Vec<(String, String)>,
    /// The topology domain that constrains who may pull this worker's KV blocks.
    #[arg(long, env = "KVROUTE_KV_TRANSFER_DOMAIN")]
    kv_transfer_domain: Option<String>,
    /// required | preferred
    #[arg(
        long,
        env = "KVROUTE_KV_TRANSFER_ENFORCEMENT",
        default_value = "required"
    )]
    kv_transfer_enforcement: Enforcement,
    /// In [0, 1]; used with `preferred` enforcement.
    #[arg(
        long,
        env = "KVROUTE_KV_TRANSFER_PREFERRED_WEIGHT",
        default_value_t = 1.0
    )]
    kv_transfer_preferred_weight: f32,
}

fn parse_backend(s: &str) -> Result<Backend, String> {
    match s.to_ascii_lowercase().as_str() {
        "tcp" => Ok(Backend::Tcp),
        "cuda" => Ok(Backend::Cuda),
        other => Err(format!(
            "unknown KV transfer backend {other:?} (tcp | cuda)"
        )),
    }
}

fn parse_domain(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
        _ => Err(format!("expected DOMAIN=VALUE, got {s:?}")),
    }
}

/// Reads `dir/<domain>` files (Kubernetes downward-API style; hidden entries such as `..data`
/// are skipped). A missing dir means no topology.
fn load_topology_dir(dir: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| format!("reading topology dir {}", dir.display())),
    };
    for entry in entries {
        let entry = entry.with_context(|| format!("reading topology dir {}", dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with('.') || !path.is_file() {
            continue;
        }
        let value = std::fs::read_to_string(&path)
            .with_context(|| format!("reading topology file {}", path.display()))?;
        let value = value.trim();
        if !value.is_empty() {
            out.insert(name, value.to_string());
        }
    }
    Ok(out)
}

fn resolve_model_dir(flag: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let candidates: Vec<PathBuf> = match flag {
        Some(d) => vec![d],
        None => vec![
            PathBuf::from(".cache/models/qwen3"),
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/models/qwen3"),
        ],
    };
    candidates
        .iter()
        .find(|d| d.join("tokenizer.json").is_file())
        .cloned()
        .ok_or_else(|| {
            anyhow!(
                "no tokenizer.json in {}: pass --model-dir (or KVROUTE_MODEL_DIR), or run `./dev setup`",
                candidates
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" or ")
            )
        })
}

fn advertised(addr: SocketAddr) -> String {
    if addr.ip().is_unspecified() {
        let host = std::env::var("POD_IP").unwrap_or_else(|_| "127.0.0.1".into());
        format!("{host}:{}", addr.port())
    } else {
        addr.to_string()
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received, shutting down"),
        _ = term => tracing::info!("SIGTERM received, shutting down"),
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One readable line (with its causes) instead of anyhow's Debug + backtrace.
            eprintln!("kvroute-worker: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    if args.engine != "sim" {
        bail!(
            "engine {:?} is not supported yet: the only engine is `sim`",
            args.engine
        );
    }

    let name = args
        .name
        .clone()
        .or_else(|| std::env::var("POD_NAME").ok())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|n| !n.trim().is_empty())
        .unwrap_or_else(|| "kvroute-worker".into());
    let instance_id = args
        .instance_id
        .unwrap_or_else(|| instance_id_for_pod(&name));

    let mut topology_domains = load_topology_dir(&args.topology_dir)?;
    topology_domains.extend(args.topology_domains.iter().cloned());
    let mut metadata = WorkerMetadata {
        instance_id,
        name: name.clone(),
        model: args.model.clone(),
        role: args.role,
        block_size: args.block_size,
        kv_capacity_blocks: args.kv_blocks,
        dp_size: args.dp_size,
        topology_domains,
        kv_transfer_domain: args.kv_transfer_domain.clone(),
        kv_transfer_enforcement: args.kv_transfer_enforcement,
        kv_transfer_preferred_weight: args.kv_transfer_preferred_weight,
        http_endpoint: String::new(),
        max_num_batched_tokens: args.max_num_batched_tokens,
    };
    metadata.validate().map_err(|e| anyhow!("{e}"))?;

    let model_dir = resolve_model_dir(args.model_dir.clone())?;
    let renderer = Arc::new(
        PromptRenderer::from_dir(&model_dir)
            .with_context(|| format!("loading the tokenizer from {}", model_dir.display()))?,
    );
    let filler_tokens = http::filler_tokens(&renderer).context("encoding the filler text")?;

    let http_listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding the HTTP listener on {}", args.listen))?;
    let grpc_listener = TcpListener::bind(args.grpc_listen)
        .await
        .with_context(|| format!("binding the gRPC listener on {}", args.grpc_listen))?;
    let http_addr = http_listener.local_addr()?;
    let grpc_addr = grpc_listener.local_addr()?;
    metadata.http_endpoint = args
        .advertise_addr
        .clone()
        .unwrap_or_else(|| advertised(http_addr));

    let engine = SimEngine::start(SimConfig {
        block_size: args.block_size,
        kv_capacity_blocks: args.kv_blocks,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        speedup: args.speedup,
        dp_size: args.dp_size,
        worker_id: instance_id,
        filler_tokens,
    });
    let metrics = Arc::new(Metrics::new(&args.model, args.block_size, args.kv_blocks)?);
    let disagg = if args.role == WorkerRole::Aggregated {
        None
    } else {
        let advertise_host = args.kv_transfer_advertise_host.clone().or_else(|| {
            args.kv_transfer_listen
                .ip()
                .is_unspecified()
                .then(|| std::env::var("POD_IP").ok())
                .flatten()
        });
        let d = Disagg::start(
            DisaggConfig {
                role: args.role,
                engine_id: format!("{name}-{}", uuid::Uuid::new_v4().simple()),
                block_size: args.block_size,
                kv_bytes_per_token: args.kv_bytes_per_token,
                pool_blocks: args
                    .kv_transfer_pool_blocks
                    .unwrap_or(args.kv_blocks as usize),
                pin_timeout: Duration::from_secs(args.kv_pin_timeout_secs),
                transfer_timeout: Duration::from_secs(args.kv_transfer_timeout_secs),
                backend: args.kv_transfer_backend,
                listen: args.kv_transfer_listen,
                advertise_host,
            },
            engine.clone(),
            metrics.registry(),
        )
        .await
        .context("starting the KV transfer agent")?;
        if let Some((host, port)) = d.advertised() {
            tracing::info!(kv_transfer = %format!("{host}:{port}"), "KV transfer agent advertised");
        }
        Some(d)
    };
    let mut app = AppState::new(
        HttpConfig {
            served_model: args.model.clone(),
            instance_id,
            max_body_bytes: args.max_body_bytes,
            default_max_tokens: args.default_max_tokens,
            shutdown_grace: Duration::from_secs(args.shutdown_grace_secs),
        },
        engine.clone(),
        renderer,
        metrics,
    );
    if let Some(d) = disagg {
        app = app.with_disagg(d);
    }
    let state = Arc::new(app);

    let token = CancellationToken::new();
    tokio::spawn({
        let token = token.clone();
        async move {
            shutdown_signal().await;
            token.cancel();
        }
    });

    tracing::info!(
        name,
        instance_id,
        http = %http_addr,
        grpc = %grpc_addr,
        model = args.model,
        model_dir = %model_dir.display(),
        role = %args.role,
        "kvroute-worker serving"
    );
    let mut http_task = tokio::spawn(http::serve(
        http_listener,
        state.clone(),
        token.clone().cancelled_owned(),
    ));
    let mut grpc_task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(kvroute_worker::events::service(engine.clone(), metadata))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(grpc_listener),
                token.clone().cancelled_owned(),
            ),
    );

    // Either server failing takes the other down too.
    let (http_res, grpc_res) = tokio::select! {
        r = &mut http_task => { token.cancel(); (r, grpc_task.await) }
        r = &mut grpc_task => { token.cancel(); (http_task.await, r) }
    };
    engine.shutdown();
    http_res
        .context("HTTP server task")?
        .context("HTTP server")?;
    grpc_res
        .context("gRPC server task")?
        .context("gRPC server")?;
    tracing::info!("kvroute-worker stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_domains_and_reads_topology_files() {
        assert_eq!(
            parse_domain("zone=us-east-1a"),
            Ok(("zone".into(), "us-east-1a".into()))
        );
        assert!(parse_domain("zone").is_err());
        assert!(parse_domain("=x").is_err());

        let dir = std::env::temp_dir().join(format!("kvroute-topo-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("..data")).unwrap();
        std::fs::write(dir.join("zone"), "us-east-1a\n").unwrap();
        std::fs::write(dir.join("rack"), "r7").unwrap();
        std::fs::write(dir.join(".hidden"), "x").unwrap();
        let got = load_topology_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            got,
            BTreeMap::from([
                ("rack".to_string(), "r7".to_string()),
                ("zone".to_string(), "us-east-1a".to_string())
            ])
        );
        assert!(load_topology_dir(Path::new("/nonexistent/topology"))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn cli_defaults_and_errors() {
        let a = Args::try_parse_from(["kvroute-worker"]).unwrap();
        assert_eq!(a.listen.to_string(), "127.0.0.1:8000");
        assert_eq!(a.block_size, 16);
        assert_eq!(a.role, WorkerRole::Aggregated);
        let a = Args::try_parse_from([
            "kvroute-worker",
            "--topology-domain",
            "zone=a",
            "--topology-domain",
            "rack=b",
            "--role",
            "prefill",
        ])
        .unwrap();
        assert_eq!(a.topology_domains.len(), 2);
        assert_eq!(a.role, WorkerRole::Prefill);
        assert!(Args::try_parse_from(["kvroute-worker", "--role", "middle"]).is_err());
    }
}
