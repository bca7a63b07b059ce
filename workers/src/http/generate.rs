//! `/v1/chat/completions` and `/v1/completions` on the simulated engine: parse the body
//! (shared `kvroute_proto::openai`), tokenize it exactly like the EPP (`PromptRenderer`),
//! submit it, and answer with one JSON body or an SSE stream shaped like vLLM's / OpenAI's.
//!
//! Disaggregation: a body with vLLM's `kv_transfer_params` is a prefill leg
//! (`do_remote_decode`: compute, pin the KV blocks, answer with the params for the decode leg)
//! or a decode leg (`do_remote_prefill`: pull the blocks through the KV agent before the
//! request is queued, so the TTFT includes the transfer); see [`crate::disagg`].
//!
//! Streams are produced as the engine emits tokens. When the client goes away hyper drops the
//! response body (streaming) or the handler future (non-streaming); either drops the engine's
//! receiver, which cancels the request in the engine, and counts a cancellation.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use kvroute_proto::openai::{parse_request, ApiKind, ParsedRequest};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::respond::{bad_request, error_response, read_body, RespBody};
use super::{unix_now, AppState, DP_RANK_HEADER};
use crate::disagg::{Disagg, DisaggError, KvTransferParams};
use crate::sim::{EngineError, EngineOutput, EngineRequest, FinishReason, PrefixHold};

/// Handles a POST to a generation endpoint.
pub async fn handle(
    state: Arc<AppState>,
    kind: ApiKind,
    req: Request<Incoming>,
    request_id: String,
    arrived: Instant,
) -> Response<RespBody> {
    if state.is_shutting_down() {
        return unavailable("worker is shutting down");
    }
    let dp_rank = dp_rank(req.headers());
    let body = match read_body(req, state.cfg.max_body_bytes).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let parsed = match parse_request(kind, &body) {
        Ok(p) => p,
        Err(e) => {
            let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::BAD_REQUEST);
            return super::respond::json_response(status, &e.openai_error_json());
        }
    };
    if parsed.model != state.cfg.served_model {
        return error_response(
            StatusCode::NOT_FOUND,
            &format!("The model `{}` does not exist.", parsed.model),
            "not_found_error",
            Some("model"),
        );
    }

    // Disaggregation legs (vLLM NixlConnector `kv_transfer_params`).
    let leg = match Leg::of(&state, &parsed) {
        Ok(l) => l,
        Err(resp) => return *resp,
    };

    // Templating and BPE of a long prompt take milliseconds: keep them off the I/O threads.
    let renderer = state.renderer.clone();
    let tokenized =
        tokio::task::spawn_blocking(move || renderer.token_ids(&parsed).map(|t| (parsed, t))).await;
    let (parsed, prompt_tokens) = match tokenized {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => {
            let status =
                StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return error_response(status, &e.to_string(), "invalid_request_error", None);
        }
        Err(e) => {
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                &format!("tokenization task failed: {e}"),
                "internal_error",
                None,
            )
        }
    };

    // Disaggregated legs run on a rank chosen now, so the KV blocks they pin or install and
    // the request are on the same rank.
    let mut dp_rank = dp_rank;
    let mut hold = None;
    let mut kv_headers: Vec<(&'static str, String)> = Vec::new();
    let mut prefill = None;
    if let Leg::Prefill(d) | Leg::Decode(d, _) = &leg {
        let rank = match state.engine.pick_rank(dp_rank) {
            Ok(r) => r,
            Err(e) => return bad_request(&e.to_string(), None),
        };
        dp_rank = Some(rank);
        match &leg {
            Leg::Decode(_, params) => {
                let pulled = d
                    .pull(
                        params,
                        &prompt_tokens,
                        parsed.lora_name.as_deref(),
                        parsed.cache_salt.as_deref(),
                        rank,
                    )
                    .await;
                match pulled {
                    Ok(p) => {
                        kv_headers.push((KV_BLOCKS_HEADER, p.blocks.to_string()));
                        kv_headers.push((KV_BYTES_HEADER, p.bytes.to_string()));
                        kv_headers.push((KV_CHECKSUM_HEADER, p.checksum.clone()));
                        kv_headers.push((KV_TRANSFER_US_HEADER, p.elapsed.as_micros().to_string()));
                        if let Some(source) = &params.remote_engine_id {
                            kv_headers.push((KV_SOURCE_HEADER, source.clone()));
                        }
                        hold = p.hold;
                    }
                    Err(e) => {
                        tracing::warn!(request_id, error = %e, "decode leg: KV pull failed");
                        return error_response(
                            e.http_status(),
                            &e.to_string(),
                            "kv_transfer_error",
                            Some("kv_transfer_params"),
                        );
                    }
                }
            }
            _ => {
                prefill = Some(PrefillCtx {
                    disagg: d.clone(),
                    tokens: prompt_tokens.clone(),
                    lora_name: parsed.lora_name.clone(),
                    cache_salt: parsed.cache_salt.clone(),
                    dp_rank: rank,
                    request_id: request_id.clone(),
                });
            }
        }
    }

    let engine_req = EngineRequest {
        request_id: request_id.clone(),
        prompt_tokens,
        max_tokens: parsed.max_tokens.unwrap_or(state.cfg.default_max_tokens),
        lora_name: parsed.lora_name.clone(),
        cache_salt: parsed.cache_salt.clone(),
        dp_rank,
    };
    let rx = match state.engine.submit(engine_req) {
        Ok(rx) => rx,
        Err(EngineError::ShuttingDown) => return unavailable("the engine is shutting down"),
        Err(e) => return bad_request(&e.to_string(), None),
    };
    tracing::debug!(
        request_id,
        stream = parsed.stream,
        ?dp_rank,
        "request submitted"
    );

    let reply = Reply::new(&state, kind, &parsed, &request_id);
    let tracker = Tracker {
        state: state.clone(),
        arrived,
        done: false,
        _hold: hold,
    };
    let mut resp = if parsed.stream {
        stream_response(state, reply, rx, tracker)
    } else {
        full_response(state, reply, rx, tracker, prefill).await
    };
    for (name, value) in kv_headers {
        if let Ok(v) = HeaderValue::from_str(&value) {
            resp.headers_mut().insert(name, v);
        }
    }
    resp
}

/// Blocks the decode leg installed (response header).
pub const KV_BLOCKS_HEADER: &str = "x-kvroute-kv-blocks";
/// KV bytes the decode leg pulled.
pub const KV_BYTES_HEADER: &str = "x-kvroute-kv-transfer-bytes";
/// xxh3-64 (hex) of the pulled bytes; equals the prefill's `kv_checksum`.
pub const KV_CHECKSUM_HEADER: &str = "x-kvroute-kv-checksum";
/// Wall time of the pull, in microseconds (included in the TTFT).
pub const KV_TRANSFER_US_HEADER: &str = "x-kvroute-kv-transfer-us";
/// The prefill engine the blocks came from (its `remote_engine_id`: `<worker name>-<uuid>`), so an
/// operator can see which prefill worker served a disaggregated request.
pub const KV_SOURCE_HEADER: &str = "x-kvroute-kv-source";

/// Which disaggregation leg a request is.
enum Leg {
    Local,
    /// `do_remote_decode: true`: compute, pin the blocks, answer with `kv_transfer_params`.
    Prefill(Arc<Disagg>),
    /// `do_remote_prefill: true`: pull the blocks, then decode.
    Decode(Arc<Disagg>, KvTransferParams),
}

impl Leg {
    /// The leg of a request; `Err` is the (boxed: it is large) response refusing it.
    fn of(state: &AppState, parsed: &ParsedRequest) -> Result<Leg, Box<Response<RespBody>>> {
        let params = KvTransferParams::from_body(&parsed.body)
            .map_err(|m| Box::new(bad_request(&m, Some("kv_transfer_params"))))?;
        let Some(params) = params else {
            return Ok(Leg::Local);
        };
        let Some(d) = state.disagg.clone() else {
            // Like vLLM without a KV connector: the params are ignored.
            tracing::debug!("kv_transfer_params ignored: this worker has no KV transfer layer");
            return Ok(Leg::Local);
        };
        if params.do_remote_decode {
            if parsed.stream {
                return Err(Box::new(bad_request(
                    "a prefill leg (do_remote_decode) must use stream=false",
                    Some("stream"),
                )));
            }
            if d.advertised().is_none() {
                let e = DisaggError::NotPrefill(d.role());
                return Err(Box::new(error_response(
                    e.http_status(),
                    &e.to_string(),
                    "invalid_request_error",
                    Some("kv_transfer_params"),
                )));
            }
            Ok(Leg::Prefill(d))
        } else if params.do_remote_prefill {
            Ok(Leg::Decode(d, params))
        } else {
            Ok(Leg::Local)
        }
    }
}

/// What the prefill leg needs once the engine is done.
struct PrefillCtx {
    disagg: Arc<Disagg>,
    tokens: Vec<u32>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    dp_rank: u32,
    request_id: String,
}

/// `x-dynamo-dp-rank`, when present and a valid number.
fn dp_rank(headers: &HeaderMap) -> Option<u32> {
    headers
        .get(DP_RANK_HEADER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn unavailable(message: &str) -> Response<RespBody> {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        message,
        "service_unavailable",
        None,
    )
}

/// Records TTFT and completion; counts a cancellation if dropped before the request ended.
struct Tracker {
    state: Arc<AppState>,
    arrived: Instant,
    done: bool,
    /// KV blocks a decode leg installed: referenced until the request ends.
    _hold: Option<PrefixHold>,
}

impl Tracker {
    fn observe(&mut self, out: &EngineOutput) {
        match out {
            EngineOutput::FirstToken { .. } => {
                self.state
                    .metrics
                    .observe_ttft(self.arrived.elapsed().as_secs_f64());
            }
            EngineOutput::Token { .. } => {}
            EngineOutput::Finished {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                self.state.metrics.request_finished(
                    *finish_reason,
                    *prompt_tokens,
                    *completion_tokens,
                );
                self.done = true;
            }
        }
    }

    /// The engine closed the channel without finishing (it is shutting down): not a
    /// client cancellation.
    fn aborted(&mut self) {
        self.done = true;
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if !self.done {
            self.state.metrics.request_cancelled();
            tracing::debug!("client went away; request cancelled");
        }
    }
}

/// The fixed parts of every response object of one request.
struct Reply {
    chat: bool,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl Reply {
    fn new(state: &AppState, kind: ApiKind, parsed: &ParsedRequest, request_id: &str) -> Reply {
        let chat = kind == ApiKind::ChatCompletions;
        Reply {
            chat,
            id: format!("{}-{request_id}", if chat { "chatcmpl" } else { "cmpl" }),
            created: unix_now(),
            model: state.cfg.served_model.clone(),
            include_usage: parsed.include_usage,
        }
    }

    fn usage(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Value {
        json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        })
    }

    fn object(&self, streaming: bool) -> &'static str {
        match (self.chat, streaming) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    /// One streamed chunk with a single choice.
    fn chunk(&self, choice: Value) -> Value {
        let mut c = json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if self.include_usage {
            // OpenAI: with include_usage every chunk has "usage": null but the last.
            c["usage"] = Value::Null;
        }
        c
    }

    fn delta_chunk(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        if self.chat {
            self.chunk(json!({
                "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason,
            }))
        } else {
            let text = delta.get("content").cloned().unwrap_or(json!(""));
            self.chunk(json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason,
            }))
        }
    }

    fn usage_chunk(&self, usage: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        })
    }

    fn full(&self, text: String, finish_reason: FinishReason, usage: Value) -> Value {
        let choice = if self.chat {
            json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": null,
                "finish_reason": finish_reason.as_str(),
            })
        } else {
            json!({
                "index": 0, "text": text, "logprobs": null,
                "finish_reason": finish_reason.as_str(),
            })
        };
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        })
    }
}

async fn full_response(
    state: Arc<AppState>,
    reply: Reply,
    mut rx: UnboundedReceiver<EngineOutput>,
    mut tracker: Tracker,
    prefill: Option<PrefillCtx>,
) -> Response<RespBody> {
    let mut tokens = Vec::new();
    while let Some(out) = rx.recv().await {
        tracker.observe(&out);
        match out {
            EngineOutput::FirstToken { token_id, .. } | EngineOutput::Token { token_id } => {
                tokens.push(token_id)
            }
            EngineOutput::Finished {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => {
                let text = state
                    .renderer
                    .decode_with(&tokens, true)
                    .unwrap_or_default();
                let usage = Reply::usage(prompt_tokens, completion_tokens, cached_tokens);
                let mut body = reply.full(text, finish_reason, usage);
                if let Some(p) = prefill {
                    match p.disagg.publish_prefill(
                        &p.request_id,
                        &p.tokens,
                        p.lora_name.as_deref(),
                        p.cache_salt.as_deref(),
                        p.dp_rank,
                    ) {
                        Ok(params) => {
                            body["kv_transfer_params"] =
                                serde_json::to_value(params).unwrap_or(Value::Null);
                        }
                        Err(e) => {
                            tracing::warn!(request_id = p.request_id, error = %e, "prefill leg: could not publish KV blocks");
                            return error_response(
                                e.http_status(),
                                &e.to_string(),
                                "kv_transfer_error",
                                None,
                            );
                        }
                    }
                }
                return super::respond::json_response(StatusCode::OK, &body);
            }
        }
    }
    tracker.aborted();
    unavailable("the engine stopped before the request finished")
}

fn sse_event(value: &Value) -> String {
    format!("data: {value}\n\n")
}

const SSE_DONE: &str = "data: [DONE]\n\n";

/// State of one SSE stream: everything lives here so dropping the body drops the receiver.
struct SseState {
    state: Arc<AppState>,
    reply: Reply,
    rx: UnboundedReceiver<EngineOutput>,
    tracker: Tracker,
    ended: bool,
}

impl SseState {
    /// The SSE text for the next engine output, or `None` when the stream is over.
    async fn next_frame(&mut self) -> Option<String> {
        if self.ended {
            return None;
        }
        let Some(out) = self.rx.recv().await else {
            self.ended = true;
            self.tracker.aborted();
            let err = json!({"error": {
                "message": "the engine stopped before the request finished",
                "type": "service_unavailable", "param": null, "code": 503,
            }});
            return Some(format!("{}{SSE_DONE}", sse_event(&err)));
        };
        self.tracker.observe(&out);
        let r = &self.reply;
        Some(match out {
            EngineOutput::FirstToken { token_id, .. } => {
                let text = self.state.token_text(token_id);
                if r.chat {
                    // vLLM's first chunk carries the role, the next ones the content.
                    let role = r.delta_chunk(json!({"role": "assistant", "content": ""}), None);
                    let content = r.delta_chunk(json!({"content": text}), None);
                    format!("{}{}", sse_event(&role), sse_event(&content))
                } else {
                    sse_event(&r.delta_chunk(json!({"content": text}), None))
                }
            }
            EngineOutput::Token { token_id } => {
                let text = self.state.token_text(token_id);
                sse_event(&r.delta_chunk(json!({"content": text}), None))
            }
            EngineOutput::Finished {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => {
                self.ended = true;
                let delta = if r.chat {
                    json!({})
                } else {
                    json!({"content": ""})
                };
                let mut out = sse_event(&r.delta_chunk(delta, Some(finish_reason.as_str())));
                if r.include_usage {
                    let usage = Reply::usage(prompt_tokens, completion_tokens, cached_tokens);
                    out.push_str(&sse_event(&r.usage_chunk(usage)));
                }
                out.push_str(SSE_DONE);
                out
            }
        })
    }
}

fn stream_response(
    state: Arc<AppState>,
    reply: Reply,
    rx: UnboundedReceiver<EngineOutput>,
    tracker: Tracker,
) -> Response<RespBody> {
    let sse = SseState {
        state,
        reply,
        rx,
        tracker,
        ended: false,
    };
    let frames = futures::stream::unfold(sse, |mut sse| async move {
        let text = sse.next_frame().await?;
        Some((
            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(text))),
            sse,
        ))
    });
    let mut resp = Response::new(StreamBody::new(frames).boxed_unsync());
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}
