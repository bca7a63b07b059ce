//! The worker's OpenAI-compatible HTTP API (hyper 1, HTTP/1.1): routing, request ids, the
//! worker-id header, graceful shutdown.
//!
//! - [`respond`]: response bodies, OpenAI-shaped errors, size-limited body reading;
//! - [`generate`]: `/v1/chat/completions` and `/v1/completions` on the [`SimEngine`], JSON or
//!   SSE.
//!
//! Every response, errors included, carries `x-kvroute-worker-id` (the instance id, decimal)
//! and `x-request-id` (the client's, or a fresh uuid).

pub mod generate;
pub mod respond;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use kvroute_proto::openai::ApiKind;
use kvroute_proto::prompt::{PromptError, PromptRenderer};
use serde_json::json;
use tokio::net::TcpListener;

use crate::disagg::Disagg;
use crate::metrics::Metrics;
use crate::sim::SimEngine;
use respond::{error_response, json_response, method_not_allowed, RespBody};

pub const WORKER_ID_HEADER: &str = "x-kvroute-worker-id";
pub use kvroute_proto::request_id::HEADER as REQUEST_ID_HEADER;
/// The dp rank the EPP picked (Dynamo's header).
pub const DP_RANK_HEADER: &str = "x-dynamo-dp-rank";

/// The simulated engine's output text, cycled token by token.
pub const FILLER_TEXT: &str = " The quick brown fox jumps over the lazy dog.";

/// The filler token ids for [`crate::sim::SimConfig::filler_tokens`].
pub fn filler_tokens(renderer: &PromptRenderer) -> Result<Vec<u32>, PromptError> {
    renderer.encode(FILLER_TEXT, false)
}

/// Settings of the HTTP layer.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// The model name clients must send (`model`); others get 404.
    pub served_model: String,
    pub instance_id: u64,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// `max_tokens` when the request gives none.
    pub default_max_tokens: u32,
    /// How long in-flight requests may run after shutdown begins.
    pub shutdown_grace: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            served_model: "Qwen/Qwen3-0.6B".into(),
            instance_id: 1,
            max_body_bytes: 16 << 20,
            default_max_tokens: 128,
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// Everything a request handler needs; shared by all connections.
#[derive(Debug)]
pub struct AppState {
    pub cfg: HttpConfig,
    pub engine: SimEngine,
    pub renderer: Arc<PromptRenderer>,
    pub metrics: Arc<Metrics>,
    /// The disaggregated prefill/decode layer (prefill and decode roles).
    pub disagg: Option<Arc<Disagg>>,
    worker_id_header: HeaderValue,
    /// Decoded text of the filler tokens, so streaming does not detokenize per token.
    token_text: HashMap<u32, String>,
    created_unix: u64,
    shutting_down: AtomicBool,
}

impl AppState {
    pub fn new(
        cfg: HttpConfig,
        engine: SimEngine,
        renderer: Arc<PromptRenderer>,
        metrics: Arc<Metrics>,
    ) -> AppState {
        let token_text = engine
            .config()
            .filler_tokens
            .iter()
            .filter_map(|&id| renderer.decode_with(&[id], true).ok().map(|t| (id, t)))
            .collect();
        AppState {
            worker_id_header: HeaderValue::from(cfg.instance_id),
            cfg,
            engine,
            renderer,
            metrics,
            disagg: None,
            token_text,
            created_unix: unix_now(),
            shutting_down: AtomicBool::new(false),
        }
    }

    /// Enables disaggregated prefill/decode legs (`kv_transfer_params`).
    pub fn with_disagg(mut self, disagg: Arc<Disagg>) -> AppState {
        self.disagg = Some(disagg);
        self
    }

    /// New requests get 503 and `/health` fails from now on.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Release);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    /// The text of one generated token (skipping special tokens, as vLLM's output does).
    pub fn token_text(&self, id: u32) -> String {
        match self.token_text.get(&id) {
            Some(t) => t.clone(),
            None => self.renderer.decode_with(&[id], true).unwrap_or_default(),
        }
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Serves HTTP on `listener` until `shutdown` resolves, then stops accepting, lets in-flight
/// requests finish for up to `shutdown_grace` and returns.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let builder = hyper::server::conn::http1::Builder::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // SSE tokens must leave as soon as they are written.
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(error = %e, "set_nodelay failed");
                }
                let st = state.clone();
                let svc = hyper::service::service_fn(move |req| {
                    let st = st.clone();
                    async move { Ok::<_, Infallible>(handle(st, req).await) }
                });
                let conn = builder.serve_connection(TokioIo::new(stream), svc);
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
            _ = &mut shutdown => break,
        }
    }
    state.begin_shutdown();
    drop(listener);
    tracing::info!(
        connections = graceful.count(),
        "HTTP server draining connections"
    );
    if tokio::time::timeout(state.cfg.shutdown_grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?state.cfg.shutdown_grace, "HTTP connections still open after the grace period");
    }
    Ok(())
}

/// Routes one request and stamps the worker id and request id on the response.
pub async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Response<RespBody> {
    let arrived = Instant::now();
    let rid = kvroute_proto::request_id::from_or_new(req.headers());
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let mut resp = match path.as_str() {
        "/health" => get_only(&method, || health(&state)),
        "/metrics" => get_only(&method, || metrics(&state)),
        "/v1/models" => get_only(&method, || models(&state)),
        p => match ApiKind::from_path(p) {
            Some(kind @ (ApiKind::ChatCompletions | ApiKind::Completions)) => {
                if method == Method::POST {
                    let id = rid.to_str().unwrap_or("unknown").to_string();
                    generate::handle(state.clone(), kind, req, id, arrived).await
                } else {
                    method_not_allowed(&method, "POST")
                }
            }
            Some(ApiKind::Responses) => error_response(
                StatusCode::NOT_FOUND,
                "/v1/responses is not served by the simulated worker; use /v1/chat/completions",
                "not_found_error",
                None,
            ),
            None => error_response(
                StatusCode::NOT_FOUND,
                &format!("no route for {path}"),
                "not_found_error",
                None,
            ),
        },
    };
    let headers = resp.headers_mut();
    headers.insert(WORKER_ID_HEADER, state.worker_id_header.clone());
    headers.insert(REQUEST_ID_HEADER, rid);
    tracing::debug!(%method, %path, status = resp.status().as_u16(), elapsed = ?arrived.elapsed(), "request");
    resp
}

fn get_only(method: &Method, f: impl FnOnce() -> Response<RespBody>) -> Response<RespBody> {
    if method == Method::GET {
        f()
    } else {
        method_not_allowed(method, "GET")
    }
}

fn health(state: &AppState) -> Response<RespBody> {
    if state.is_shutting_down() {
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "worker is shutting down",
            "service_unavailable",
            None,
        )
    } else {
        respond::full(StatusCode::OK, "text/plain; charset=utf-8", "")
    }
}

fn metrics(state: &AppState) -> Response<RespBody> {
    state.metrics.refresh(&state.engine.stats());
    if let Some(d) = &state.disagg {
        d.refresh_metrics();
    }
    match state.metrics.encode() {
        Ok(text) => respond::full(StatusCode::OK, state.metrics.content_type(), text),
        Err(e) => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            &e.to_string(),
            "internal_error",
            None,
        ),
    }
}

fn models(state: &AppState) -> Response<RespBody> {
    let cfg = state.engine.config();
    let model = &state.cfg.served_model;
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{
                "id": model,
                "object": "model",
                "created": state.created_unix,
                "owned_by": "kvroute",
                "root": model,
                "parent": null,
                "max_model_len": cfg.kv_capacity_blocks * u64::from(cfg.block_size),
            }]
        }),
    )
}
