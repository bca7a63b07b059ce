//! Rewrites `usage.prompt_tokens_details.cached_tokens` of a disaggregated response so the
//! client sees what was really reused.
//!
//! **What is truthful.** `cached_tokens` tells a client how many prompt tokens were served from
//! a KV cache instead of being computed for this request (OpenAI bills them at a discount). In
//! the disaggregated flow the prompt is computed on the prefill worker; the decode worker
//! receives the KV blocks by transfer and — like vLLM with the NixlConnector — counts them as
//! externally cached, so its own number says "almost everything was cached" even for a brand
//! new prompt. The number that answers the client's question is the prefill worker's: its
//! prefix-cache hits, i.e. the tokens that were not recomputed anywhere. So the decode
//! response's value is replaced by the prefill leg's (llm-d does the same). When the prefill
//! leg did not report one, or when the request fell back to a local prefill, the decode engine
//! computed the prompt itself and its own value is already truthful and is left alone.
//!
//! Streams are rewritten event by event: complete SSE events are forwarded as soon as they
//! arrive (unchanged bytes unless they carry `prompt_tokens_details`); only an incomplete
//! trailing event is held until its end arrives.

use std::sync::{Arc, OnceLock};

use bytes::{Bytes, BytesMut};
use serde_json::Value;

const MARKER: &[u8] = b"prompt_tokens_details";

/// `usage.prompt_tokens_details.cached_tokens` of a response object.
pub fn cached_tokens(v: &Value) -> Option<u64> {
    v.get("usage")?
        .get("prompt_tokens_details")?
        .get("cached_tokens")?
        .as_u64()
}

/// Sets `usage.prompt_tokens_details.cached_tokens` when the object has a usage object.
/// Returns whether it changed anything.
pub fn set_cached_tokens(v: &mut Value, cached: u64) -> bool {
    let Some(usage) = v.get_mut("usage").and_then(Value::as_object_mut) else {
        return false;
    };
    let details = usage
        .entry("prompt_tokens_details")
        .or_insert_with(|| Value::Object(Default::default()));
    if !details.is_object() {
        *details = Value::Object(Default::default());
    }
    match details.as_object_mut() {
        Some(d) => {
            d.insert("cached_tokens".into(), Value::from(cached));
            true
        }
        None => false,
    }
}

/// Rewrites a complete JSON response body; bodies that are not JSON objects with a usage are
/// returned unchanged.
pub fn rewrite_json_body(body: Bytes, cached: u64) -> Bytes {
    if !contains(&body, b"\"usage\"") {
        return body;
    }
    match serde_json::from_slice::<Value>(&body) {
        Ok(mut v) => {
            if set_cached_tokens(&mut v, cached) {
                Bytes::from(v.to_string())
            } else {
                body
            }
        }
        Err(_) => body,
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The end of the last complete SSE event in `buf` (after its blank line), if any.
fn last_event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf
        .windows(4)
        .rposition(|w| w == b"\r\n\r\n")
        .map(|i| i + 4);
    lf.max(crlf)
}

/// Rewrites the usage events of one SSE stream.
#[derive(Debug)]
pub struct SseUsageRewriter {
    pending: BytesMut,
    /// The prefill worker's value; set later in SGLang bootstrap mode, where the prefill leg
    /// runs concurrently with the decode stream (its usage event comes last, after prefill).
    cached: Arc<OnceLock<u64>>,
}

impl SseUsageRewriter {
    pub fn new(cached: Arc<OnceLock<u64>>) -> SseUsageRewriter {
        SseUsageRewriter {
            pending: BytesMut::new(),
            cached,
        }
    }

    /// Feeds one upstream chunk; returns what can be sent to the client now.
    pub fn push(&mut self, chunk: Bytes) -> Bytes {
        // Fast path: whole events, nothing held back, nothing to rewrite → the same bytes.
        if self.pending.is_empty()
            && (chunk.ends_with(b"\n\n") || chunk.ends_with(b"\r\n\r\n"))
            && !contains(&chunk, MARKER)
        {
            return chunk;
        }
        self.pending.extend_from_slice(&chunk);
        let Some(end) = last_event_end(&self.pending) else {
            return Bytes::new();
        };
        let complete = self.pending.split_to(end).freeze();
        self.rewrite_events(complete)
    }

    /// Whatever is left when the upstream stream ends (an unterminated last event).
    pub fn finish(&mut self) -> Bytes {
        let rest = self.pending.split().freeze();
        self.rewrite_events(rest)
    }

    fn rewrite_events(&self, complete: Bytes) -> Bytes {
        let Some(&cached) = self.cached.get() else {
            return complete;
        };
        if !contains(&complete, MARKER) {
            return complete;
        }
        let mut out = BytesMut::with_capacity(complete.len() + 8);
        for line in complete.split_inclusive(|&b| b == b'\n') {
            let rewritten = line
                .strip_prefix(b"data:")
                .filter(|_| contains(line, MARKER))
                .and_then(|payload| {
                    let text = std::str::from_utf8(payload).ok()?.trim();
                    let mut v: Value = serde_json::from_str(text).ok()?;
                    if !set_cached_tokens(&mut v, cached) {
                        return None;
                    }
                    let eol: &[u8] = if line.ends_with(b"\r\n") {
                        b"\r\n"
                    } else if line.ends_with(b"\n") {
                        b"\n"
                    } else {
                        b""
                    };
                    let mut l = format!("data: {v}").into_bytes();
                    l.extend_from_slice(eol);
                    Some(l)
                });
            match rewritten {
                Some(l) => out.extend_from_slice(&l),
                None => out.extend_from_slice(line),
            }
        }
        out.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixed(n: u64) -> Arc<OnceLock<u64>> {
        let c = Arc::new(OnceLock::new());
        let _ = c.set(n);
        c
    }

    #[test]
    fn rewrites_json_usage() {
        let body = Bytes::from(
            json!({"id":"x","usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":9}}}).to_string(),
        );
        let out: Value = serde_json::from_slice(&rewrite_json_body(body, 3)).unwrap();
        assert_eq!(cached_tokens(&out), Some(3));
        let no_usage = Bytes::from_static(b"{\"id\":1}");
        assert_eq!(rewrite_json_body(no_usage.clone(), 3), no_usage);
    }

    #[test]
    fn sse_passes_other_events_untouched_and_rewrites_split_usage_event() {
        let mut r = SseUsageRewriter::new(fixed(4));
        let ev = Bytes::from_static(b"data: {\"choices\":[]}\n\n");
        assert_eq!(r.push(ev.clone()), ev);
        let usage = format!(
            "data: {}\n\ndata: [DONE]\n\n",
            json!({"choices":[],"usage":{"prompt_tokens":20,"prompt_tokens_details":{"cached_tokens":16}}})
        );
        let (a, b) = usage.as_bytes().split_at(30);
        assert!(r.push(Bytes::copy_from_slice(a)).is_empty());
        let out = r.push(Bytes::copy_from_slice(b));
        let text = std::str::from_utf8(&out).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        let first = text.lines().next().unwrap().strip_prefix("data: ").unwrap();
        let v: Value = serde_json::from_str(first).unwrap();
        assert_eq!(cached_tokens(&v), Some(4));
        assert_eq!(v["usage"]["prompt_tokens"], 20);
        assert!(r.finish().is_empty());
    }

    #[test]
    fn sse_without_value_is_unchanged() {
        let mut r = SseUsageRewriter::new(Arc::new(OnceLock::new()));
        let ev = Bytes::from_static(
            b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":1}}}\n\n",
        );
        assert_eq!(r.push(ev.clone()), ev);
    }
}
