//! `kvroute-sidecar`: parses flags, starts the HTTP server, stops gracefully on SIGINT/SIGTERM.

use anyhow::Context;
use clap::Parser;
use kvroute_sidecar::config::{Args, Config};
use kvroute_sidecar::server::{serve, App};
use tokio::net::TcpListener;

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
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
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received, shutting down"),
        _ = term => tracing::info!("SIGTERM received, shutting down"),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let cfg = Config::from_args(&args).context("invalid configuration")?;
    let listen = cfg.listen;
    for e in &cfg.engines {
        tracing::info!(name = %e.name, instance_id = e.instance_id, dp_rank = ?e.dp_rank, url = %e.base_url, "local engine");
    }
    let app = App::new(cfg).context("starting the sidecar")?;
    if app.router.allowlist.is_empty() {
        tracing::info!("SSRF allowlist is empty: disaggregated requests will be refused (set --pool-endpoints or --pool-file)");
    }
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    tracing::info!(%listen, "kvroute-sidecar listening");
    serve(listener, app, shutdown_signal()).await?;
    tracing::info!("kvroute-sidecar stopped");
    Ok(())
}
