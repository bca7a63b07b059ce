//! `/v1/chat/completions` and `/v1/completions` on the simulated engine: parse the body
//! (shared `kvroute_proto::openai`), tokenize it exactly like the EPP (`PromptRenderer`),
//! submit it, and answer with one JSON body or an SSE stream shaped like vLLM's / OpenAI's.
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
use crate::sim::{EngineError, EngineOutput, EngineRequest, FinishReason};

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
    };
    if parsed.stream {
        stream_response(state, reply, rx, tracker)
    } else {
        full_response(state, reply, rx, tracker).await
    }
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
                return super::respond::json_response(
                    StatusCode::OK,
                    &reply.full(text, finish_reason, usage),
                );
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
