//! The sidecar's HTTP server (hyper 1, HTTP/1.1): routes, the aggregated pass-through proxy,
//! `/health`, `/v1/models`, `/metrics`, request ids and graceful shutdown.
//!
//! Aggregated requests are proxied without reading their bodies: the client's request body is
//! handed to the engine as it arrives and the engine's response body (SSE or JSON) is handed
//! back frame by frame. When the client goes away hyper drops the response body (or the
//! handler future, before headers); that drops the upstream request and its connection, and
//! the engine cancels the generation when its connection closes.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use kvroute_proto::hints;
use kvroute_proto::openai::ApiKind;
use tokio::net::TcpListener;

use crate::allowlist::Allowlist;
use crate::config::{Config, ConfigError};
use crate::metrics::{Metrics, MetricsError};
use crate::respond::{empty_body, error_response, full, Body};
use crate::routing::{Route, Router};
use crate::upstream::{
    self, downstream_headers, new_client, upstream_headers, HttpClient, TrackedBody, REQUEST_ID,
};

/// Why the server could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Metrics(#[from] MetricsError),
}

/// Everything a request handler needs; shared by all connections.
#[derive(Debug)]
pub struct App {
    pub cfg: Config,
    pub router: Router,
    pub client: HttpClient,
    pub metrics: Arc<Metrics>,
    shutting_down: AtomicBool,
}

impl App {
    pub fn new(cfg: Config) -> Result<Arc<App>, ServerError> {
        let allowlist = Arc::new(Allowlist::new(
            cfg.pool_endpoints.clone(),
            cfg.pool_file.clone(),
        )?);
        Ok(Arc::new(App {
            router: Router::new(&cfg, allowlist),
            client: new_client(cfg.connect_timeout),
            metrics: Arc::new(Metrics::new()?),
            shutting_down: AtomicBool::new(false),
            cfg,
        }))
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }
}

/// Serves on `listener` until `shutdown` resolves, then stops accepting and lets in-flight
/// requests finish for up to the configured grace period.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    if app.cfg.pool_file.is_some() {
        tokio::spawn(app.router.allowlist.clone().watch(Duration::from_secs(2)));
    }
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
                // SSE events must leave as soon as they arrive from the engine.
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(error = %e, "set_nodelay failed");
                }
                let app = app.clone();
                let svc = hyper::service::service_fn(move |req| {
                    let app = app.clone();
                    async move { Ok::<_, Infallible>(handle(app, req).await) }
                });
                let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), svc));
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
            _ = &mut shutdown => break,
        }
    }
    app.shutting_down.store(true, Ordering::Release);
    drop(listener);
    tracing::info!(connections = graceful.count(), "draining connections");
    if tokio::time::timeout(app.cfg.shutdown_grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?app.cfg.shutdown_grace, "connections still open after the grace period");
    }
    Ok(())
}

/// Routes one request; every response carries the request id.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Response<Body> {
    let arrived = Instant::now();
    let rid = kvroute_proto::request_id::from_or_new(req.headers());
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let mut resp = match (path.as_str(), &method) {
        ("/health", &Method::GET) => health(&app).await,
        ("/metrics", &Method::GET) => metrics(&app),
        ("/v1/models", &Method::GET) => models(&app, req, &rid).await,
        ("/health" | "/metrics" | "/v1/models", _) => method_not_allowed("GET"),
        (p, m) => match ApiKind::from_path(p) {
            Some(kind) if m == Method::POST => {
                generate(app.clone(), kind, req, rid.clone(), arrived).await
            }
            Some(_) => method_not_allowed("POST"),
            None => error_response(
                StatusCode::NOT_FOUND,
                &format!("no route for {path}"),
                "not_found_error",
            ),
        },
    };
    resp.headers_mut().entry(REQUEST_ID).or_insert(rid);
    tracing::debug!(%method, %path, status = resp.status().as_u16(), elapsed = ?arrived.elapsed(), "request");
    resp
}

fn method_not_allowed(allow: &'static str) -> Response<Body> {
    let mut r = error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        &format!("method not allowed; use {allow}"),
        "invalid_request_error",
    );
    r.headers_mut()
        .insert(http::header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// 200 when the sidecar runs and at least one local engine answers its `/health` with 200.
async fn health(app: &App) -> Response<Body> {
    if app.is_shutting_down() {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "sidecar is shutting down",
            "service_unavailable",
        );
    }
    let checks = app.router.engines().iter().map(|e| {
        let url = format!("{}/health", e.base_url);
        let client = app.client.clone();
        async move {
            let call = upstream::send(&client, Method::GET, url, Default::default(), empty_body());
            matches!(tokio::time::timeout(Duration::from_secs(2), call).await, Ok(Ok(r)) if r.status() == StatusCode::OK)
        }
    });
    let results = futures::future::join_all(checks).await;
    let healthy = results.iter().filter(|ok| **ok).count();
    if healthy > 0 {
        full(
            StatusCode::OK,
            "text/plain; charset=utf-8",
            format!("ok: {healthy}/{} local engines healthy\n", results.len()),
        )
    } else {
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "no local engine is healthy",
            "service_unavailable",
        )
    }
}

fn metrics(app: &App) -> Response<Body> {
    match app.metrics.encode() {
        Ok(text) => full(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            text,
        ),
        Err(e) => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            &e.to_string(),
            "internal_error",
        ),
    }
}

/// `/v1/models` of the hinted engine, or of the first local engine without a hint.
async fn models(app: &App, req: Request<Incoming>, rid: &HeaderValue) -> Response<Body> {
    let engine = match app.router.route(req.headers()) {
        Ok(r) => r.engine,
        Err(_) => match app.router.engines().first() {
            Some(e) => e.clone(),
            None => {
                return error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no local engine",
                    "service_unavailable",
                )
            }
        },
    };
    let headers = upstream_headers(req.headers(), rid);
    match upstream::send(
        &app.client,
        Method::GET,
        format!("{}/v1/models", engine.base_url),
        headers,
        empty_body(),
    )
    .await
    {
        Ok(r) => passthrough(r, None),
        Err(e) => {
            app.metrics.upstream_error("engine", e.kind());
            e.response(&format!("engine {}", engine.name))
        }
    }
}

/// Turns an upstream response into ours; the body streams through untouched, wrapped so a
/// client that goes away is noticed.
pub fn passthrough(
    r: Response<Incoming>,
    tracked: Option<(&Arc<Metrics>, &'static str)>,
) -> Response<Body> {
    let (parts, body) = r.into_parts();
    let body = body.map_err(Into::into).boxed_unsync();
    let body = match tracked {
        Some((m, mode)) => TrackedBody::new(body, m.clone(), mode).boxed_unsync(),
        None => body,
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = parts.status;
    *resp.headers_mut() = downstream_headers(&parts.headers);
    resp
}

async fn generate(
    app: Arc<App>,
    kind: ApiKind,
    req: Request<Incoming>,
    rid: HeaderValue,
    arrived: Instant,
) -> Response<Body> {
    if app.is_shutting_down() {
        app.metrics.request("none", 503);
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "sidecar is shutting down",
            "service_unavailable",
        );
    }
    let route = match app.router.route(req.headers()) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "request not routable");
            app.metrics.request("none", e.status().as_u16());
            return error_response(e.status(), &e.to_string(), e.error_type());
        }
    };
    let mode = route.mode();
    let resp = if route.prefill.is_some() {
        crate::disagg::handle(&app, &route, kind, req, rid, arrived).await
    } else {
        aggregated(&app, &route, req, rid, arrived).await
    };
    app.metrics.request(mode, resp.status().as_u16());
    resp
}

/// Sets the dp rank header for an engine that serves several ranks itself. The value is the
/// sidecar's own (parsed and re-serialised), not the client's header passed through.
pub fn set_dp_rank(headers: &mut http::HeaderMap, rank: Option<u32>) {
    if let Some(r) = rank {
        headers.insert(hints::DP_RANK, HeaderValue::from(r));
    }
}

async fn aggregated(
    app: &Arc<App>,
    route: &Route,
    req: Request<Incoming>,
    rid: HeaderValue,
    arrived: Instant,
) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let mut headers = upstream_headers(&parts.headers, &rid);
    set_dp_rank(&mut headers, route.dp_rank);
    let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let url = format!("{}{}", route.engine.base_url, pq);
    let sent = Instant::now();
    match upstream::send(
        &app.client,
        parts.method,
        url,
        headers,
        body.map_err(Into::into).boxed_unsync(),
    )
    .await
    {
        Ok(r) => {
            let got = Instant::now();
            let resp = passthrough(r, Some((&app.metrics, "aggregated")));
            app.metrics
                .observe_overhead((sent - arrived + got.elapsed()).as_secs_f64());
            if !resp.status().is_success() {
                let kind = if resp.status().is_server_error() {
                    "status_5xx"
                } else {
                    "status_4xx"
                };
                app.metrics.upstream_error("engine", kind);
            }
            resp
        }
        Err(e) => {
            tracing::warn!(engine = %route.engine.name, error = %e, "engine call failed");
            app.metrics.upstream_error("engine", e.kind());
            e.response(&format!(
                "engine {} ({})",
                route.engine.name, route.engine.instance_id
            ))
        }
    }
}

/// Marks a JSON content type on upstream request headers whose body the sidecar rewrote.
pub fn json_content_type(headers: &mut http::HeaderMap) {
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
}
