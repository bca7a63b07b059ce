//! Response building blocks (full and streamed bodies, OpenAI-shaped errors) and reading a
//! request body under a size limit: the declared Content-Length is checked before reading, and
//! chunked bodies are cut off as soon as they pass the limit.

use std::convert::Infallible;

use bytes::Bytes;
use http::header::{ALLOW, CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use kvroute_proto::openai::openai_error_body;

/// The body of every response: a full buffer or an SSE stream.
pub type RespBody = UnsyncBoxBody<Bytes, Infallible>;

/// A response with a complete body.
pub fn full(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<RespBody> {
    let mut resp = Response::new(Full::new(body.into()).boxed_unsync());
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

pub fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<RespBody> {
    full(status, "application/json", value.to_string())
}

/// `{"error":{"message","type","param","code"}}` with `status`.
pub fn error_response(
    status: StatusCode,
    message: &str,
    err_type: &str,
    param: Option<&str>,
) -> Response<RespBody> {
    full(
        status,
        "application/json",
        openai_error_body(status.as_u16(), message, err_type, param),
    )
}

/// 400 with OpenAI's `invalid_request_error` type.
pub fn bad_request(message: &str, param: Option<&str>) -> Response<RespBody> {
    error_response(
        StatusCode::BAD_REQUEST,
        message,
        "invalid_request_error",
        param,
    )
}

/// 405 with an `Allow` header.
pub fn method_not_allowed(method: &Method, allow: &'static str) -> Response<RespBody> {
    let mut resp = error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        &format!("method {method} is not allowed here; use {allow}"),
        "invalid_request_error",
        None,
    );
    resp.headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    resp
}

fn too_large(limit: usize) -> Response<RespBody> {
    error_response(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!("request body is larger than the limit of {limit} bytes"),
        "invalid_request_error",
        None,
    )
}

/// Reads the whole body, or answers 413 when it is (or declares to be) over `limit`.
pub async fn read_body(req: Request<Incoming>, limit: usize) -> Result<Bytes, Response<RespBody>> {
    if let Some(len) = req.headers().get(CONTENT_LENGTH) {
        match len.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()) {
            Some(n) if n > limit as u64 => return Err(too_large(limit)),
            Some(_) => {}
            None => return Err(bad_request("invalid Content-Length header", None)),
        }
    }
    match Limited::new(req.into_body(), limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large(limit)),
        Err(e) => Err(bad_request(
            &format!("could not read the request body: {e}"),
            None,
        )),
    }
}
