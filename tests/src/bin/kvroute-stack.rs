//! `kvroute-stack`: runs the local gateway stack (`./dev up`): N simulated workers, the EPP and
//! Envoy, all on this machine. Prints the gateway URL; Ctrl-C stops everything it started.

use std::path::PathBuf;

use clap::Parser;
use kvroute_tests::harness::envoy::BodyMode;
use kvroute_tests::harness::stack::{Stack, StackOptions};

#[derive(Parser, Debug)]
#[command(
    name = "kvroute-stack",
    about = "Run Envoy + kvroute-epp + simulated workers locally"
)]
struct Args {
    /// Aggregated simulated workers [default: 4, or 0 with --prefill/--decode].
    #[arg(long, env = "KVROUTE_WORKERS_N")]
    workers: Option<usize>,
    /// Disaggregated serving: prefill workers...
    #[arg(long, default_value_t = 0)]
    prefill: usize,
    /// ...and decode workers, each behind a kvroute-sidecar.
    #[arg(long, default_value_t = 0)]
    decode: usize,
    /// Topology zones assigned round-robin per role (e.g. a,b); enables KV transfer domains.
    #[arg(long, value_delimiter = ',')]
    zones: Vec<String>,
    /// KV transfer enforcement when zones are set: required or preferred.
    #[arg(long, default_value = "required", value_parser = ["required", "preferred"])]
    kv_transfer: String,
    /// Preferred weight in [0, 1] (with --kv-transfer preferred).
    #[arg(long, default_value_t = 0.5)]
    kv_transfer_weight: f32,
    /// Gateway (Envoy) port.
    #[arg(long, env = "KVROUTE_GATEWAY_PORT", default_value_t = 10000)]
    port: u16,
    /// EPP ports: ext_proc, health, metrics.
    #[arg(long, default_value_t = 9002)]
    epp_port: u16,
    #[arg(long, default_value_t = 9003)]
    epp_health_port: u16,
    #[arg(long, default_value_t = 9090)]
    epp_metrics_port: u16,
    /// Selection policy: kv, round-robin, random, least-loaded, approx-prefix.
    #[arg(long, env = "KVROUTE_POLICY", default_value = "kv")]
    policy: String,
    /// ext_proc request body mode.
    #[arg(long, default_value = "full-duplex", value_parser = ["full-duplex", "buffered"])]
    body_mode: String,
    /// Simulated time divisor of the workers (1 = real-time mocker timings).
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// KV capacity per worker, in blocks.
    #[arg(long, default_value_t = 16384)]
    kv_blocks: u64,
    /// Where process logs go.
    #[arg(long, default_value = ".cache/stack")]
    log_dir: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let args = Args::parse();
    let opts = StackOptions {
        workers: args
            .workers
            .unwrap_or(if args.prefill + args.decode > 0 { 0 } else { 4 }),
        prefill_workers: args.prefill,
        decode_workers: args.decode,
        zones: args.zones.clone(),
        kv_transfer: (args.kv_transfer.clone(), args.kv_transfer_weight),
        gateway_port: Some(args.port),
        policy: args.policy.clone(),
        body_mode: if args.body_mode == "buffered" {
            BodyMode::Buffered
        } else {
            BodyMode::FullDuplexStreamed
        },
        speedup: args.speedup,
        kv_blocks: args.kv_blocks,
        log_dir: args.log_dir.clone(),
        epp_ports: Some((args.epp_port, args.epp_health_port, args.epp_metrics_port)),
        ..StackOptions::default()
    };
    eprintln!(
        "starting {} aggregated, {} prefill and {} decode workers, the EPP ({}) and Envoy ...",
        opts.workers, opts.prefill_workers, opts.decode_workers, args.policy
    );
    let stack = Stack::start(opts).await?;
    println!();
    println!("  gateway      {}", stack.gateway_url);
    println!(
        "  EPP metrics  http://127.0.0.1:{}/metrics",
        stack.epp_metrics_port
    );
    for w in &stack.workers {
        let zone = w
            .zone
            .as_deref()
            .map(|z| format!(", zone {z}"))
            .unwrap_or_default();
        match &w.sidecar {
            Some((addr, _)) => println!(
                "  {:<11}  {}  http://{}  via sidecar http://{addr}  (id {}{zone})",
                w.role, w.name, w.http, w.instance_id
            ),
            None => println!(
                "  {:<11}  {}  http://{}  (id {}{zone})",
                w.role, w.name, w.http, w.instance_id
            ),
        }
    }
    println!("  logs         {}", args.log_dir.display());
    println!();
    println!(
        "  try: curl -s {}/v1/chat/completions -H 'content-type: application/json' \\",
        stack.gateway_url
    );
    println!("         -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}]}}'", stack.opts.model);
    println!();
    println!("Ctrl-C stops everything.");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
    eprintln!("stopping ...");
    drop(stack);
    Ok(())
}
