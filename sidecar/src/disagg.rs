//! The disaggregated flow: a prefill leg on the remote prefill worker, a decode leg on the
//! local engine, the decode stream returned to the client.
//!
//! - **nixlv2** (vLLM NixlConnector, llm-d's default; routing-and-disagg.md §6.2, §8): the
//!   prefill leg gets the original body with `kv_transfer_params {do_remote_decode: true, …}`,
//!   `stream: false`, no `stream_options`, `max_tokens = max_completion_tokens = 1`; the decode
//!   leg gets the original body plus the `kv_transfer_params` the prefill response returned,
//!   verbatim. Prefill 5xx (or unreachable, or no `kv_transfer_params`) → with
//!   `--fallback-local-prefill` the local engine serves the original body; 4xx → the prefill
//!   error is returned as is.
//! - **sglang** (bootstrap, §6.3): the same body plus `bootstrap_host`, `bootstrap_port`,
//!   `bootstrap_room` goes to both legs concurrently; the decode stream is returned; a prefill
//!   leg that fails aborts the decode leg (before headers: its error is returned; mid-stream:
//!   an SSE error event ends the stream). No local fallback: the decode engine is already
//!   waiting for KV from that prefill worker.
//!
//! `usage.prompt_tokens_details.cached_tokens` is rewritten with the prefill worker's value
//! (see [`crate::usage`] for why that is the truthful one).

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, BodyStream, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use kvroute_proto::openai::{parse_request, ApiKind};
use serde_json::{json, Map, Value};
use tokio::sync::watch;

use crate::config::KvConnector;
use crate::respond::{error_response, full, full_body, Body, BoxError};
use crate::routing::{PrefillTarget, Route};
use crate::server::{json_content_type, passthrough, set_dp_rank, App};
use crate::upstream::{self, upstream_headers, TrackedBody, UpstreamError};
use crate::usage::{cached_tokens, rewrite_json_body, SseUsageRewriter};

const MODE: &str = "disaggregated";

/// vLLM NixlConnector's prefill-leg request parameters.
pub fn prefill_kv_transfer_params() -> Value {
    json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
}

/// The prefill-leg body (nixlv2): one token, no streaming, our `kv_transfer_params`.
pub fn prefill_body(original: &Map<String, Value>) -> Map<String, Value> {
    let mut b = original.clone();
    b.insert("kv_transfer_params".into(), prefill_kv_transfer_params());
    b.insert("stream".into(), Value::Bool(false));
    b.remove("stream_options");
    b.insert("max_tokens".into(), Value::from(1));
    b.insert("max_completion_tokens".into(), Value::from(1));
    b
}

/// The decode-leg body (nixlv2): the original with the prefill's `kv_transfer_params`.
pub fn decode_body(original: &Map<String, Value>, params: &Value) -> Map<String, Value> {
    let mut b = original.clone();
    b.insert("kv_transfer_params".into(), params.clone());
    b
}

/// The body both SGLang legs get.
pub fn bootstrap_body(
    original: &Map<String, Value>,
    host: &str,
    port: u16,
    room: u64,
) -> Map<String, Value> {
    let mut b = original.clone();
    b.insert("bootstrap_host".into(), Value::from(host));
    b.insert("bootstrap_port".into(), Value::from(port));
    b.insert("bootstrap_room".into(), Value::from(room));
    b
}

/// A random room in `[0, i64::MAX]` (SGLang router: `rand u64 & i64::MAX`).
pub fn bootstrap_room() -> u64 {
    rand::random::<u64>() & (i64::MAX as u64)
}

/// Entry point for a request whose route has a prefill target.
pub async fn handle(
    app: &Arc<App>,
    route: &Route,
    kind: ApiKind,
    req: Request<Incoming>,
    rid: HeaderValue,
    arrived: Instant,
) -> Response<Body> {
    let Some(target) = route.prefill.clone() else {
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "no prefill target",
            "internal_error",
        );
    };
    if kind == ApiKind::Responses {
        return error_response(
            StatusCode::NOT_IMPLEMENTED,
            "disaggregated serving of /v1/responses is not supported by kvroute-sidecar; use /v1/chat/completions or /v1/completions",
            "invalid_request_error",
        );
    }
    let (parts, body) = req.into_parts();
    let bytes = match Limited::new(body, app.cfg.max_body_bytes).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            let too_big = e
                .downcast_ref::<http_body_util::LengthLimitError>()
                .is_some();
            return if too_big {
                error_response(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!(
                        "request body is larger than {} bytes",
                        app.cfg.max_body_bytes
                    ),
                    "invalid_request_error",
                )
            } else {
                error_response(
                    StatusCode::BAD_REQUEST,
                    &format!("reading the request body: {e}"),
                    "invalid_request_error",
                )
            };
        }
    };
    // Validate like the engines would, so a bad body is a 400 here and not two engine errors.
    let parsed = match parse_request(kind, &bytes) {
        Ok(p) => p,
        Err(e) => {
            let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::BAD_REQUEST);
            return full(
                status,
                "application/json",
                e.openai_error_json().to_string(),
            );
        }
    };
    let Value::Object(original) = parsed.body else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "request body must be a JSON object",
            "invalid_request_error",
        );
    };
    let mut headers = upstream_headers(&parts.headers, &rid);
    json_content_type(&mut headers);
    let path = kind.path();
    let leg = Leg {
        app,
        route,
        headers,
        path,
        arrived,
    };
    match app.cfg.kv_connector {
        KvConnector::Nixlv2 => leg.nixl(&target, original).await,
        KvConnector::Sglang => leg.sglang(&target, original).await,
    }
}

/// What one request's legs share.
struct Leg<'a> {
    app: &'a Arc<App>,
    route: &'a Route,
    headers: HeaderMap,
    path: &'static str,
    arrived: Instant,
}

/// How the prefill leg ended when it did not produce usable `kv_transfer_params`.
enum PrefillFailure {
    /// Unreachable, broken, timed out, or a 2xx without `kv_transfer_params`: fallback-able.
    Unavailable(Response<Body>, &'static str),
    /// A 5xx: fallback-able; passed through otherwise.
    Server(Response<Body>),
    /// A 4xx: the client's problem, returned as is.
    Client(Response<Body>),
}

impl Leg<'_> {
    fn prefill_headers(&self, target: &PrefillTarget) -> HeaderMap {
        let mut h = self.headers.clone();
        set_dp_rank(&mut h, target.dp_rank);
        h
    }

    fn decode_headers(&self) -> HeaderMap {
        let mut h = self.headers.clone();
        set_dp_rank(&mut h, self.route.dp_rank);
        h
    }

    async fn nixl(&self, target: &PrefillTarget, original: Map<String, Value>) -> Response<Body> {
        let app = self.app;
        let started = Instant::now();
        let outcome = self.prefill_nixl(target, &original).await;
        let prefill_elapsed = started.elapsed();
        app.metrics.observe_prefill(prefill_elapsed.as_secs_f64());
        let (body, cached) = match outcome {
            Ok((params, cached)) => (decode_body(&original, &params), cached),
            Err(PrefillFailure::Client(resp)) => return resp,
            Err(PrefillFailure::Server(resp) | PrefillFailure::Unavailable(resp, _))
                if !app.cfg.fallback_local_prefill =>
            {
                return resp
            }
            Err(PrefillFailure::Server(_)) => {
                app.metrics.prefill_fallback("status_5xx");
                tracing::warn!(prefill = %target.base_url, "prefill worker answered 5xx; prefilling locally");
                (original, None)
            }
            Err(PrefillFailure::Unavailable(_, why)) => {
                app.metrics.prefill_fallback(why);
                tracing::warn!(prefill = %target.base_url, why, "prefill leg failed; prefilling locally");
                (original, None)
            }
        };
        let cell = Arc::new(OnceLock::new());
        if let Some(c) = cached {
            let _ = cell.set(c);
        }
        let sent = Instant::now();
        let resp = self.send_decode(Value::Object(body)).await;
        match resp {
            Ok(r) => {
                let got = Instant::now();
                let out = self.decode_response(r, cell, None).await;
                // Everything but the two upstream waits: body read, parsing, rewriting.
                let own = (sent - self.arrived).saturating_sub(prefill_elapsed) + got.elapsed();
                app.metrics.observe_overhead(own.as_secs_f64());
                out
            }
            Err(e) => {
                app.metrics.upstream_error("decode", e.kind());
                e.response(&format!("decode engine {}", self.route.engine.name))
            }
        }
    }

    async fn send_decode(&self, body: Value) -> Result<Response<Incoming>, UpstreamError> {
        let url = format!("{}{}", self.route.engine.base_url, self.path);
        upstream::send(
            &self.app.client,
            Method::POST,
            url,
            self.decode_headers(),
            full_body(body.to_string()),
        )
        .await
    }

    /// Runs the nixlv2 prefill leg: `kv_transfer_params` and the prefill's cached tokens.
    async fn prefill_nixl(
        &self,
        target: &PrefillTarget,
        original: &Map<String, Value>,
    ) -> Result<(Value, Option<u64>), PrefillFailure> {
        let app = self.app;
        let url = format!("{}{}", target.base_url, self.path);
        let body = Value::Object(prefill_body(original)).to_string();
        let call = async {
            let r = upstream::send(
                &app.client,
                Method::POST,
                url.clone(),
                self.prefill_headers(target),
                full_body(body),
            )
            .await?;
            let status = r.status();
            let headers = r.headers().clone();
            let bytes = r
                .into_body()
                .collect()
                .await
                .map_err(|e| UpstreamError::BadUrl {
                    url: url.clone(),
                    why: format!("reading the prefill response: {e}"),
                })?;
            Ok::<_, UpstreamError>((status, headers, bytes.to_bytes()))
        };
        let (status, headers, bytes) =
            match tokio::time::timeout(app.cfg.prefill_timeout, call).await {
                Err(_) => {
                    let e = UpstreamError::Timeout {
                        url,
                        after: app.cfg.prefill_timeout,
                    };
                    app.metrics.upstream_error("prefill", e.kind());
                    return Err(PrefillFailure::Unavailable(
                        e.response("prefill worker"),
                        "timeout",
                    ));
                }
                Ok(Err(e)) => {
                    app.metrics.upstream_error("prefill", e.kind());
                    tracing::warn!(error = %e, "prefill leg failed");
                    return Err(PrefillFailure::Unavailable(
                        e.response("prefill worker"),
                        e.kind(),
                    ));
                }
                Ok(Ok(x)) => x,
            };
        let rebuilt = || {
            let mut resp = Response::new(full_body(bytes.clone()));
            *resp.status_mut() = status;
            if let Some(ct) = headers.get(CONTENT_TYPE) {
                resp.headers_mut().insert(CONTENT_TYPE, ct.clone());
            }
            resp
        };
        if status.is_server_error() {
            app.metrics.upstream_error("prefill", "status_5xx");
            return Err(PrefillFailure::Server(rebuilt()));
        }
        if !status.is_success() {
            app.metrics.upstream_error("prefill", "status_4xx");
            return Err(PrefillFailure::Client(rebuilt()));
        }
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        match v.get("kv_transfer_params") {
            Some(p @ Value::Object(_)) => Ok((p.clone(), cached_tokens(&v))),
            _ => {
                app.metrics.upstream_error("prefill", "protocol");
                Err(PrefillFailure::Unavailable(
                    error_response(
                        StatusCode::BAD_GATEWAY,
                        &format!("prefill worker {} answered without kv_transfer_params (is it running as a prefill worker with a KV connector?)", target.base_url),
                        "upstream_error",
                    ),
                    "protocol",
                ))
            }
        }
    }

    /// Passes the decode response back: errors as they are, JSON with `cached_tokens`
    /// rewritten, SSE through the event rewriter (and, in bootstrap mode, ended early if the
    /// prefill leg fails).
    async fn decode_response(
        &self,
        r: Response<Incoming>,
        cached: Arc<OnceLock<u64>>,
        prefill_failed: Option<watch::Receiver<PrefillState>>,
    ) -> Response<Body> {
        let app = self.app;
        if !r.status().is_success() {
            let kind = if r.status().is_server_error() {
                "status_5xx"
            } else {
                "status_4xx"
            };
            app.metrics.upstream_error("decode", kind);
            return passthrough(r, None);
        }
        let is_sse = r
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let (parts, body) = r.into_parts();
        let body: Body = if is_sse {
            sse_body(body, cached, prefill_failed)
        } else {
            let bytes = match body.collect().await {
                Ok(c) => c.to_bytes(),
                Err(e) => {
                    app.metrics.upstream_error("decode", "io");
                    return error_response(
                        StatusCode::BAD_GATEWAY,
                        &format!("reading the decode response: {e}"),
                        "upstream_error",
                    );
                }
            };
            let bytes = match cached.get() {
                Some(&c) => rewrite_json_body(bytes, c),
                None => bytes,
            };
            full_body(bytes)
        };
        let mut resp =
            Response::new(TrackedBody::new(body, app.metrics.clone(), MODE).boxed_unsync());
        *resp.status_mut() = parts.status;
        let mut headers = upstream::downstream_headers(&parts.headers);
        // The body length may have changed with the rewrite.
        headers.remove(http::header::CONTENT_LENGTH);
        *resp.headers_mut() = headers;
        resp
    }

    async fn sglang(&self, target: &PrefillTarget, original: Map<String, Value>) -> Response<Body> {
        let app = self.app;
        let port = target
            .bootstrap_port
            .unwrap_or(app.cfg.sglang_bootstrap_port);
        let body = Value::Object(bootstrap_body(
            &original,
            &target.host,
            port,
            bootstrap_room(),
        ))
        .to_string();
        let (tx, rx) = watch::channel(PrefillState::Running);
        let cached = Arc::new(OnceLock::new());
        let prefill = {
            let app = app.clone();
            let url = format!("{}{}", target.base_url, self.path);
            let headers = self.prefill_headers(target);
            let body = body.clone();
            let cached = cached.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let state = run_bootstrap_prefill(&app, url, headers, body, &cached).await;
                app.metrics.observe_prefill(started.elapsed().as_secs_f64());
                let _ = tx.send(state);
            })
        };
        // Dropping this aborts the prefill leg when the client goes away.
        let guard = AbortOnDrop(Some(prefill));
        let decode = self.send_decode_raw(body);
        tokio::pin!(decode);
        let mut watch_rx = rx.clone();
        let decoded = loop {
            tokio::select! {
                r = &mut decode => break r,
                changed = watch_rx.changed() => {
                    if changed.is_err() {
                        // The prefill task ended without a verdict (it cannot, but then just
                        // wait for decode).
                        break (&mut decode).await;
                    }
                    let state = watch_rx.borrow().clone();
                    if let PrefillState::Failed(f) = state {
                        // Returning drops the pending decode leg: a failed prefill aborts it.
                        app.metrics.upstream_error("decode", "aborted");
                        return f.response();
                    }
                }
            }
        };
        match decoded {
            Ok(r) => {
                let mut resp = self.decode_response(r, cached, Some(rx)).await;
                // Keep the prefill leg alive as long as the response body is.
                let body = std::mem::replace(resp.body_mut(), crate::respond::empty_body());
                *resp.body_mut() = GuardedBody { inner: body, guard }.boxed_unsync();
                resp
            }
            Err(e) => {
                app.metrics.upstream_error("decode", e.kind());
                e.response(&format!("decode engine {}", self.route.engine.name))
            }
        }
    }

    async fn send_decode_raw(&self, body: String) -> Result<Response<Incoming>, UpstreamError> {
        let url = format!("{}{}", self.route.engine.base_url, self.path);
        upstream::send(
            &self.app.client,
            Method::POST,
            url,
            self.decode_headers(),
            full_body(body),
        )
        .await
    }
}

/// Progress of an SGLang prefill leg, watched by the decode leg.
#[derive(Debug, Clone)]
pub enum PrefillState {
    Running,
    Done,
    Failed(PrefillError),
}

/// A failed bootstrap prefill leg, kept cloneable for the watch channel.
#[derive(Debug, Clone)]
pub struct PrefillError {
    status: StatusCode,
    body: Bytes,
}

impl PrefillError {
    fn response(&self) -> Response<Body> {
        full(self.status, "application/json", self.body.clone())
    }

    fn sse_event(&self) -> Bytes {
        let message = format!(
            "prefill leg failed with status {}: {}",
            self.status.as_u16(),
            String::from_utf8_lossy(&self.body)
        );
        let err = json!({"error": {"message": message, "type": "upstream_error", "param": null, "code": self.status.as_u16()}});
        Bytes::from(format!("data: {err}\n\ndata: [DONE]\n\n"))
    }
}

async fn run_bootstrap_prefill(
    app: &App,
    url: String,
    headers: HeaderMap,
    body: String,
    cached: &OnceLock<u64>,
) -> PrefillState {
    let call = async {
        let r = upstream::send(
            &app.client,
            Method::POST,
            url.clone(),
            headers,
            full_body(body),
        )
        .await?;
        let status = r.status();
        let bytes = r
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        Ok::<_, UpstreamError>((status, bytes))
    };
    match tokio::time::timeout(app.cfg.prefill_timeout, call).await {
        Err(_) => {
            app.metrics.upstream_error("prefill", "timeout");
            PrefillState::Failed(PrefillError {
                status: StatusCode::GATEWAY_TIMEOUT,
                body: Bytes::from(kvroute_proto::openai::openai_error_body(
                    504,
                    "prefill leg timed out",
                    "upstream_error",
                    None,
                )),
            })
        }
        Ok(Err(e)) => {
            app.metrics.upstream_error("prefill", e.kind());
            PrefillState::Failed(PrefillError {
                status: e.status(),
                body: Bytes::from(kvroute_proto::openai::openai_error_body(
                    e.status().as_u16(),
                    &format!("prefill worker: {e}"),
                    "upstream_error",
                    None,
                )),
            })
        }
        Ok(Ok((status, bytes))) if !status.is_success() => {
            let kind = if status.is_server_error() {
                "status_5xx"
            } else {
                "status_4xx"
            };
            app.metrics.upstream_error("prefill", kind);
            PrefillState::Failed(PrefillError {
                status,
                body: bytes,
            })
        }
        Ok(Ok((_, bytes))) => {
            if let Some(c) = serde_json::from_slice::<Value>(&bytes)
                .ok()
                .as_ref()
                .and_then(cached_tokens)
            {
                let _ = cached.set(c);
            }
            PrefillState::Done
        }
    }
}

/// Aborts the bootstrap prefill task when dropped, unless disarmed.
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.abort();
        }
    }
}

/// The decode body of a bootstrap request, holding the prefill task: if the client goes away
/// mid-stream the prefill leg is aborted with it; if the stream ends normally the prefill leg
/// is left to finish on its own (it is done or about to be: the decode could not run without
/// its KV, and cutting it off would make the prefill engine log an abort).
struct GuardedBody {
    inner: Body,
    guard: AbortOnDrop,
}

impl http_body::Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, std::task::Poll::Ready(None)) {
            // Detach instead of aborting.
            self.guard.0.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The decode SSE stream with usage rewriting, ended with an error event if the (bootstrap)
/// prefill leg fails mid-stream.
fn sse_body(
    body: Incoming,
    cached: Arc<OnceLock<u64>>,
    prefill: Option<watch::Receiver<PrefillState>>,
) -> Body {
    struct St {
        frames: BodyStream<Incoming>,
        rewriter: SseUsageRewriter,
        prefill: Option<watch::Receiver<PrefillState>>,
        done: bool,
    }
    let st = St {
        frames: BodyStream::new(body),
        rewriter: SseUsageRewriter::new(cached),
        prefill,
        done: false,
    };
    let stream = futures::stream::unfold(st, |mut st| async move {
        use futures::StreamExt;
        loop {
            if st.done {
                return None;
            }
            let next = match st.prefill.as_mut() {
                Some(rx) => {
                    tokio::select! {
                        f = st.frames.next() => f,
                        changed = rx.changed() => {
                            if changed.is_err() {
                                st.prefill = None;
                                continue;
                            }
                            let state = rx.borrow().clone();
                            if let PrefillState::Failed(e) = state {
                                // Dropping the frames (below, with `st`) drops the decode leg.
                                st.done = true;
                                tracing::warn!(status = %e.status, "prefill leg failed mid-stream; decode aborted");
                                return Some((Ok(Frame::data(e.sse_event())), st));
                            }
                            continue;
                        }
                    }
                }
                None => st.frames.next().await,
            };
            match next {
                None => {
                    st.done = true;
                    let rest = st.rewriter.finish();
                    if rest.is_empty() {
                        return None;
                    }
                    return Some((Ok(Frame::data(rest)), st));
                }
                Some(Err(e)) => {
                    st.done = true;
                    return Some((Err(BoxError::from(e)), st));
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let out = st.rewriter.push(data);
                        if !out.is_empty() {
                            return Some((Ok(Frame::data(out)), st));
                        }
                    }
                    Err(other) => return Some((Ok(other), st)),
                },
            }
        }
    });
    StreamBody::new(stream).boxed_unsync()
}
